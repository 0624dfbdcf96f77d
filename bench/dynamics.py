"""The cost of `eval.dynamics`: an evaluation's model work with the descent probe on its first
micro-batch, against the same evaluation without it, per family and shape. Target: at most 1.10.

    python -m bench.dynamics [--rounds 3] [--threads 1]

The evaluation here is what `pretrain.training.evaluation.evaluate` runs per batch: the eval forward with
targets, and for EBT also the thinking curve (`think` with targets at eval.think_steps); the
text sample is left out, so the ratio is an upper bound of the trainer's. Shapes: the tiny
configs' (GPT-2 vocabulary), the character-level Shakespeare experiment's (width 64), and the
OpenWebText configs' depth and vocabulary at a CPU-sized width. Time is process CPU time, the
minimum over interleaved rounds (bench.models' convention)."""
from __future__ import annotations

import time

import torch

from common.cli import ArgumentParser, run_command
from common.fileio import markdown_table
from pretrain.models import build, resolve
from pretrain.training.evaluation import DescentProbe

SHAPES = {
    # name: (flavor, overrides, micro-batch, seq_len, eval batches, think steps)
    "nrgpt tiny": ("nrgpt-tiny", {"vocab_size": 50304}, 4, 64, 8, 0),
    "gpt_rec tiny": ("gpt_rec-tiny", {"vocab_size": 50304}, 4, 64, 8, 0),
    "ebt tiny": ("ebt-tiny", {"vocab_size": 50304}, 4, 64, 8, 4),
    "nrgpt char w64": ("nrgpt-mini", {"vocab_size": 128, "n_steps": 4}, 8, 128, 16, 0),
    "nrgpt owt-depth D=128": ("nrgpt-ff2w-90m", {"n_embd": 128, "n_head": 2, "block_size": 256}, 2, 256, 25, 0),
    "gpt_rec owt-depth D=128": ("gpt_rec-85m", {"n_embd": 128, "n_head": 2, "block_size": 256}, 2, 256, 25, 0),
}


def evaluation(model, batches: list[torch.Tensor], think_steps: int, probed: bool) -> None:
    """One evaluation's model calls, the first batch probed when `probed`."""
    probe = DescentProbe(model, batches[0].size(1), len(batches)) if probed else None
    for i, idx in enumerate(batches):
        targets = idx.roll(-1, 1)
        if probe is not None and i == 0 and think_steps == 0:
            probe.forward(model, idx, targets)
        else:
            model(idx, targets)
        if think_steps:
            thought = model.think(idx, steps=think_steps, targets=targets)
            if probe is not None and i == 0:
                probe.think(thought, targets)
    if probe is not None:
        probe.scalars()


def measure(name: str, rounds: int) -> dict:
    flavor, overrides, batch, seq_len, n_batches, think_steps = SHAPES[name]
    torch.manual_seed(0)
    model = build(resolve(flavor, overrides)).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=generator)
               for _ in range(n_batches)]
    best = {False: float("inf"), True: float("inf")}
    with torch.no_grad():
        evaluation(model, batches[:1], think_steps, True)  # warm-up
        for _ in range(rounds):
            for probed in (False, True):
                start = time.process_time()
                evaluation(model, batches, think_steps, probed)
                best[probed] = min(best[probed], time.process_time() - start)
    stride = DescentProbe(model, seq_len, n_batches).positions.step if think_steps == 0 else None
    return {"shape": name, "batches": f"{n_batches} x {batch} x {seq_len}", "readout stride": stride or "-",
            "eval s": best[False], "with probe s": best[True], "ratio": best[True] / best[False]}


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    parser = ArgumentParser(prog="python -m bench.dynamics", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # the probe reduces
    try:
        rows = [measure(name, args.rounds) for name in args.shapes.split(",")]
    finally:
        dist.destroy_process_group()
    print(markdown_table(rows, {"eval s": ".3f", "with probe s": ".3f", "ratio": ".3f"}))
    return 0


if __name__ == "__main__":
    run_command(main)
