"""`python -m pretrain.models [--vocab N]`

Print the registered flavors with their sizes and FLOPs per token, each at the vocabulary its row
names: the flavor's own, or with --vocab the embedding rows the trainer gives a dataset of N
token ids (padded up to a multiple of 64: GPT-2's 50257 -> 50304)."""
from __future__ import annotations

import argparse
import dataclasses

import torch

from common.cli import ArgumentParser, run_command
from pretrain.models import FLAVORS, build, padded_vocab


def flavor_rows(dataset_vocab: int | None = None) -> list[tuple[str, str, int, int, int, int, float]]:
    """(flavor, family, context length, vocabulary, parameters, non-embedding parameters,
    training FLOPs per token at that context length) for every registered flavor, built on the
    meta device: at the flavor's registered vocabulary, or at the trainer's for a dataset of
    `dataset_vocab` token ids."""
    rows = []
    for name in sorted(FLAVORS):
        config = FLAVORS[name]
        if dataset_vocab is not None:
            config = dataclasses.replace(config, vocab_size=padded_vocab(dataset_vocab))
        with torch.device("meta"):
            model = build(config)
        rows.append((name, type(model).__name__, config.block_size, config.vocab_size, model.num_params(),
                     model.num_params(non_embedding=True), model.flops_per_token(config.block_size)))
    return rows


def count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _vocabulary(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of token ids, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m pretrain.models", description=__doc__.split("\n\n")[1])
    parser.add_argument("--vocab", type=_vocabulary, metavar="N",
                        help="count at a dataset vocabulary of N token ids, as the trainer does (e.g. 50257 "
                             "for GPT-2's BPE: 50304 embedding rows); default: each flavor's own vocabulary")
    args = parser.parse_args(argv)
    header = ("flavor", "family", "context", "vocab", "params", "non-embedding", "train FLOPs/token")
    table = [header] + [(name, family, str(context), str(vocab), count(total), count(non_embed), f"{flops:.3e}")
                        for name, family, context, vocab, total, non_embed, flops in flavor_rows(args.vocab)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    run_command(main)
