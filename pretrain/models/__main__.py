"""`python -m pretrain.models`: the registered flavors with their sizes and FLOPs per token."""
from __future__ import annotations

import torch

from pretrain.cli import ArgumentParser, run_command
from pretrain.models import FLAVORS, build


def flavor_rows() -> list[tuple[str, str, int, int, int, float]]:
    """(flavor, family, context length, parameters, non-embedding parameters, training FLOPs
    per token at that context length) for every registered flavor, built on the meta device."""
    rows = []
    for name in sorted(FLAVORS):
        config = FLAVORS[name]
        with torch.device("meta"):
            model = build(config)
        rows.append((name, type(model).__name__, config.block_size, model.num_params(),
                     model.num_params(non_embedding=True), model.flops_per_token(config.block_size)))
    return rows


def count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def main(argv: list[str] | None = None) -> None:
    ArgumentParser(prog="python -m pretrain.models",
                   description="Print the registered flavors with their sizes and FLOPs per token.").parse_args(argv)
    header = ("flavor", "family", "context", "params", "non-embedding", "train FLOPs/token")
    table = [header] + [(name, family, str(context), count(total), count(non_embed), f"{flops:.3e}")
                        for name, family, context, total, non_embed, flops in flavor_rows()]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    run_command(main)
