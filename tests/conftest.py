"""Shared fixtures.

Data: a few hundred real documents (speeches from the bundled Shakespeare plays plus a handful
of awkward strings) and a small GPT-2 dataset prepared from them once per session, with tiny
shards so that packing crosses many shard and work-chunk boundaries.
"""
import json
import multiprocessing

import pytest

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
