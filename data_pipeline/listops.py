"""ListOps, the algorithmic task of the NRGPT paper, as a packed language-modeling dataset.

An example is a depth-2 expression over the digits 0-9 written with its chain-of-thought
reduction, innermost lists first:

    add_10 ( 0 median_10 ( 1 7 1 ) 2 ) = add_10 ( 0 1 2 ) = 3 <eos>

Operators take 2 or 3 arguments: `add_10` is the sum mod 10, `max_10` the maximum, `median_10`
the median truncated to an integer (the mean of the middle two for two arguments, as in the
original ListOps). The top list has at least one nested list, and nested lists hold digits only.

A fixed, seeded set of digit triples (an operator's three digit arguments, wherever they appear
in the text, reductions included) never occurs in train or val; every test example contains at
least one of them, so test accuracy measures generalization to unseen argument combinations.
Val is in-distribution and shares no example text with train.

Examples are packed like documents (each followed by `<eos>`) into `seq_len + 1` windows, which is
what a causal LM trainer consumes. The val and test examples are also written one per line to
`examples/{val,test}.txt`, read back by `listops_test_examples` for greedy-generation accuracy.
"""
from __future__ import annotations

import os
import random
from typing import Iterator

import numpy as np

from data_pipeline.errors import DataError
from data_pipeline.packing import dataset_fingerprint, read_manifest, write_splits
from data_pipeline.sources import SourceStats
from data_pipeline.tokenizer import WordTokenizer, tokenizer_from_spec

OPERATORS = ("add_10", "max_10", "median_10")
DIGITS = tuple(str(d) for d in range(10))
VOCAB = ("<pad>", "<eos>", "=", "(", ")", *OPERATORS, *DIGITS, "<bos>", "<unk>")
"""20 tokens; `<pad>`, `<bos>` and `<unk>` are reserved and never generated (packing needs none)."""
EOS, EQUALS = "<eos>", "="
SPLITS = ("train", "val", "test")
DEFAULT_SIZES = {"train": 50_000, "val": 2_000, "test": 2_000}
HELDOUT_TRIPLES = 50
"""How many of the 1000 ordered digit triples are held out of training (5%)."""
SEED = 1234
"""Generator seed; the dataset is a pure function of it and the sizes."""
MAX_DRAWS_PER_EXAMPLE = 1000
"""Rejection-sampling budget per requested example before giving up."""


def apply(op: str, args: list[int]) -> int:
    """The value of one operator on digit arguments."""
    if op == "add_10":
        return sum(args) % 10
    if op == "max_10":
        return max(args)
    ordered = sorted(args)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) // 2


def _random_list(rng: random.Random, depth: int) -> tuple[str, list]:
    op = rng.choice(OPERATORS)
    n_args = rng.choice((2, 3))
    if depth == 1:
        return op, [rng.randrange(10) for _ in range(n_args)]
    nested = [rng.random() < 0.5 for _ in range(n_args)]
    if not any(nested):
        nested[rng.randrange(n_args)] = True
    return op, [_random_list(rng, 1) if n else rng.randrange(10) for n in nested]


def _render(expr) -> str:
    if isinstance(expr, int):
        return str(expr)
    op, args = expr
    return f"{op} ( {' '.join(_render(a) for a in args)} )"


def _reduce_innermost(expr):
    """Replace every list whose arguments are all digits by its value."""
    if isinstance(expr, int):
        return expr
    op, args = expr
    if all(isinstance(a, int) for a in args):
        return apply(op, args)
    return op, [_reduce_innermost(a) for a in args]


def _digit_triples(expr) -> Iterator[tuple[int, int, int]]:
    if isinstance(expr, int):
        return
    _, args = expr
    if len(args) == 3 and all(isinstance(a, int) for a in args):
        yield tuple(args)
    for a in args:
        yield from _digit_triples(a)


def example_text(expr) -> tuple[str, set[tuple[int, int, int]]]:
    """The chain-of-thought text of an expression (without <eos>) and the triples it shows."""
    steps, triples = [], set()
    while not isinstance(expr, int):
        steps.append(_render(expr))
        triples.update(_digit_triples(expr))
        expr = _reduce_innermost(expr)
    steps.append(str(expr))
    return f" {EQUALS} ".join(steps), triples


def generate(sizes: dict[str, int], seed: int = SEED) -> tuple[dict[str, list[str]], list]:
    """Example texts per split and the sorted held-out triples."""
    rng = random.Random(seed)
    all_triples = [(a, b, c) for a in range(10) for b in range(10) for c in range(10)]
    heldout = set(rng.sample(all_triples, HELDOUT_TRIPLES))
    splits: dict[str, list[str]] = {name: [] for name in SPLITS}
    train_texts: set[str] = set()
    for name in SPLITS:
        budget = MAX_DRAWS_PER_EXAMPLE * sizes[name]
        while len(splits[name]) < sizes[name]:
            budget -= 1
            if budget < 0:
                raise DataError(f"listops: could not draw {sizes[name]} {name} examples")
            text, triples = example_text(_random_list(rng, depth=2))
            # Test examples need a held-out triple; train and val must have none.
            if bool(triples & heldout) != (name == "test"):
                continue
            if name == "val" and text in train_texts:
                continue
            splits[name].append(text)
            if name == "train":
                train_texts.add(text)
    return splits, sorted(heldout)


def build_listops_dataset(staging: str, settings: dict, shard_size) -> dict:
    """Generate ListOps, write its MDS splits and example files; return the manifest."""
    sizes = dict(DEFAULT_SIZES)
    if settings["max_docs"] is not None:
        sizes["train"] = settings["max_docs"]
    texts, heldout = generate(sizes)
    tokenizer = WordTokenizer(list(VOCAB), EOS)
    empty = (np.empty(0, dtype=np.uint16), 0, 0)

    def chunks():
        for position, name in enumerate(SPLITS):
            eot = np.array([tokenizer.eot_id])
            ids = np.concatenate([piece for text in texts[name]
                                  for piece in (tokenizer.encode(text), eot)])
            parts = [empty] * len(SPLITS)
            parts[position] = (ids.astype(np.uint16), len(texts[name]),
                               sum(len(text.encode("utf-8")) for text in texts[name]))
            yield parts

    counts = write_splits(staging, chunks(), SPLITS, settings["seq_len"],
                          settings["compression"], shard_size)
    for name in ("train", "val"):
        if counts[name]["windows"] == 0:
            raise DataError(f"listops: the {name} split has no complete window of "
                            f"{settings['seq_len'] + 1} tokens; use a smaller --seq-len")
    os.makedirs(os.path.join(staging, "examples"))
    for name in ("val", "test"):
        with open(os.path.join(staging, "examples", f"{name}.txt"), "w", encoding="utf-8") as f:
            f.writelines(text + "\n" for text in texts[name])
    vocabulary = {"tokenizer": "listops", "vocab": list(VOCAB)}
    return {**settings, **vocabulary, "vocab_size": len(VOCAB), "eot_id": tokenizer.eot_id,
            "equals_id": tokenizer.index[EQUALS], "pad_id": tokenizer.index["<pad>"],
            "splits": counts, "heldout_triples": [list(t) for t in heldout], "seed": SEED,
            **vars(SourceStats()),
            "fingerprint": dataset_fingerprint(vocabulary, counts)}


def listops_test_examples(data_dir: str, split: str = "test") -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per example of a prepared ListOps split (`test` or `val`).

    The prompt runs up to and including the first `=`; the answer is everything after it through
    `<eos>` (the intermediate reduction and the result), as greedy generation should produce it.
    """
    manifest = read_manifest(data_dir)
    if manifest.get("tokenizer") != "listops":
        raise DataError(f"{data_dir} is not a ListOps dataset")
    tokenizer = tokenizer_from_spec(manifest)
    examples = []
    with open(os.path.join(data_dir, "examples", f"{split}.txt"), encoding="utf-8") as f:
        for line in f:
            ids = [*tokenizer.encode(line).tolist(), tokenizer.eot_id]
            cut = ids.index(manifest["equals_id"]) + 1
            examples.append((ids[:cut], ids[cut:]))
    return examples
