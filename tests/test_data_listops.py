"""ListOps: the generator's arithmetic and format, the held-out triples, the prepared dataset."""
import re

import pytest

from data_pipeline import listops
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare
from data_pipeline.tokenizer import decode

SIZES = {"train": 3000, "val": 300, "test": 300}


def evaluate(text: str) -> int:
    """Independent evaluator: repeatedly apply the innermost list, written out by hand."""
    ops = {"add_10": lambda a: sum(a) % 10, "max_10": max,
           "median_10": lambda a: sorted(a)[len(a) // 2] if len(a) % 2 else sum(sorted(a)) // 2}
    innermost = re.compile(r"(add_10|max_10|median_10) \( ([0-9 ]+) \)")
    while not text.isdigit():
        text = innermost.sub(lambda m: str(ops[m[1]](list(map(int, m[2].split())))), text, 1)
    return int(text)


def triples_in(text: str) -> set[tuple[int, ...]]:
    found = re.findall(r"\( (\d) (\d) (\d) \)", text)
    return {tuple(map(int, t)) for t in found}


@pytest.fixture(scope="module")
def generated():
    return listops.generate(SIZES)


def test_examples_reduce_correctly_in_the_documented_format(generated):
    texts, _ = generated
    assert listops.example_text(("add_10", [0, ("median_10", [1, 7, 1]), 2]))[0] == (
        "add_10 ( 0 median_10 ( 1 7 1 ) 2 ) = add_10 ( 0 1 2 ) = 3")
    for text in texts["train"][:500] + texts["test"][:100]:
        problem, reduced, answer = text.split(" = ")
        assert evaluate(problem) == evaluate(reduced) == int(answer)
        assert "( " in problem and problem.count("(") >= 2  # depth 2: a nested list
        args = re.findall(r"\( ([^()]*?) \)", problem)
        assert all(2 <= len(a.split()) <= 3 for a in args)
        assert set(text.split()) <= set(listops.VOCAB)
    assert len(listops.VOCAB) == 20


def test_heldout_triples_never_in_training_and_in_every_test_example(generated):
    texts, heldout = generated
    heldout = set(map(tuple, heldout))
    assert len(heldout) == listops.HELDOUT_TRIPLES
    for text in texts["train"] + texts["val"]:
        assert not triples_in(text) & heldout
    for text in texts["test"]:
        assert triples_in(text) & heldout
    assert not set(texts["val"]) & set(texts["train"])
    assert {len(v) for v in texts.values()} == {3000, 300}
    assert listops.generate(SIZES) == generated  # a pure function of the seed


def test_prepared_listops_dataset_and_test_examples(tmp_path):
    out = str(tmp_path / "listops")
    manifest = prepare("listops", out, seq_len=64, max_docs=2000)
    assert (manifest["tokenizer"], manifest["vocab_size"]) == ("listops", 20)
    assert manifest["vocab"][manifest["eot_id"]] == "<eos>"
    assert manifest["vocab"][manifest["equals_id"]] == "="
    assert manifest["splits"]["train"]["docs"] == 2000
    assert set(manifest["splits"]) == {"train", "val", "test"}
    examples = listops.listops_test_examples(out)
    assert len(examples) == listops.DEFAULT_SIZES["test"]
    lines = open(f"{out}/examples/test.txt").read().splitlines()
    for (prompt, answer), line in zip(examples[:50], lines):
        assert prompt[-1] == manifest["equals_id"] and manifest["equals_id"] not in prompt[:-1]
        assert answer[-1] == manifest["eot_id"]
        assert decode(manifest, prompt + answer) == line + " <eos>"
    # Packed windows: examples follow each other, each closed by <eos>.
    inputs, _ = next(iter(build_loader(out, "train", micro_batch_size=2, seed=0)))
    text = decode(manifest, inputs[0])
    for example in text.split(" <eos> ")[1:-1]:
        problem, _, answer = example.rpartition(" = ")
        assert evaluate(problem.split(" = ")[0]) == int(answer)
