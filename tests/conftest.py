"""Shared fixtures.

Data: a few hundred real documents (speeches from the bundled Shakespeare plays plus a handful
of awkward strings) and a small GPT-2 dataset prepared from them once per session, with tiny
shards so that packing crosses many shard and work-chunk boundaries.
"""
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.s3_server import S3Server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Each pytest-xdist worker (and what it starts) gets its share of the cores: torch's OpenMP
    # threads spin while they wait, and two workers each as wide as the machine slow each other.
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

SHARED_WORK = {
    "resume matrix": {"test_export.py", "test_export_hf.py", "test_recipes.py", "test_sample.py",
                      "test_train.py", "test_train_preemption.py"},
}
"""Test files that read one piece of work made once per pytest process (`trainer_runs.resume_matrix`,
two minutes of training): `make test`'s pytest-xdist workers run each group's files in one worker."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items):
    """Units of work for `--dist loadgroup`: a test file (its module fixtures are made once), or
    the files of a `SHARED_WORK` group. Each unit runs whole, in order, in one worker."""
    group_of = {name: group for group, names in SHARED_WORK.items() for name in names}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of.get(item.path.name, item.path.name)))


AWKWARD_DOCS = [
    "A web page that mentions <|endoftext|> in its text.",
    "  leading and trailing whitespace  \n\n",
    "Unicode: caf\u00e9, na\u00efve, \u4e2d\u6587, emoji \U0001F3AD, replacement char \ufffd.",
    "tabs\tand\r\nwindows newlines",
    "x",
]


@pytest.fixture(scope="session")
def corpus_docs() -> list[str]:
    """~600 documents: one per speech of the first plays, then the awkward strings."""
    from data_pipeline.sources import parse_source

    docs: list[str] = []
    for scene in parse_source("shakespeare").documents():
        docs.extend(block for block in scene.split("\n\n") if ":\n" in block)
        if len(docs) >= 600:
            break
    return docs[:600] + AWKWARD_DOCS


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory, corpus_docs) -> str:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(corpus_docs):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
    return str(path)


TINY_SETTINGS = dict(seq_len=32, val_fraction=0.1, shard_size="8kb")
"""Settings of `tiny_dataset`: ~100 windows per shard, a ~10% val split."""


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory, corpus_jsonl) -> str:
    """GPT-2 dataset of `corpus_docs`, prepared with two tokenizer processes."""
    from data_pipeline.prepare import prepare

    out = str(tmp_path_factory.mktemp("datasets") / "tiny")
    prepare(f"jsonl:{corpus_jsonl}", out, num_proc=2, **TINY_SETTINGS)
    return out


@pytest.fixture(scope="session")
def mixture_datasets(tmp_path_factory, corpus_docs) -> list[str]:
    """Two GPT-2 datasets of different documents (the first about 2.5x the second), for
    mixtures."""
    from data_pipeline.prepare import prepare

    root = tmp_path_factory.mktemp("mixture")
    paths = []
    for name, docs in (("a", corpus_docs[:430]), ("b", corpus_docs[430:])):
        corpus = root / f"{name}.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        paths.append(str(root / name))
        prepare(f"jsonl:{corpus}", paths[-1], num_proc=1, **TINY_SETTINGS)
    return paths


@pytest.fixture(scope="session")
def two_rank_reads(tmp_path_factory, tiny_dataset, mixture_datasets) -> Path:
    """What `tests.test_data_loader.worker_main` saved on each of two ranks under torchrun (one
    launch for the single-dataset and the mixture checks)."""
    out = tmp_path_factory.mktemp("two_ranks")
    # --standalone: a rendezvous on a free local port, so concurrent launches cannot collide.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "tests.test_data_loader", tiny_dataset,
               *mixture_datasets, str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def run_at_once(work, processes: int = 3) -> list:
    """What `work()` returns in `processes` forked processes released at the same moment (an
    exception comes back as the string "error: ...")."""
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()

    def child():
        start.wait()
        try:
            results.put(work())
        except Exception as err:  # reported to the test
            results.put(f"error: {type(err).__name__}: {err}")

    children = [context.Process(target=child) for _ in range(processes)]
    for process in children:
        process.start()
    start.set()
    returned = [results.get(timeout=120) for _ in children]
    for process in children:
        process.join()
    return returned


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server (`bench.s3_server.S3Server`) for the whole session."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server, with this process's environment pointing at it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server
