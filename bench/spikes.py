"""Loss spikes of a deep NRGPT, with and without the spike guard (`train.skip_spikes`).

The tiny NRGPT config widened to D = 64 with 12 descent steps (2 heads) at lr 3e-3 spikes in
fp32 and diverges in bf16. Each run trains it for `--steps` steps on the bundled Shakespeare
corpus, in fp32 and bf16, with the guard off and on (statistics over `--window` updates: the
default window of 100 could not act before the bf16 divergence starts), and reports the largest
gradient norm, the final train and val loss and the skipped updates.

    python -m bench.spikes [--steps 300] [--window 20] [--seeds 1]

Prints a table; docs/benchmarks.md records it."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from common.cli import ArgumentParser, run_command

REPO = Path(__file__).resolve().parent.parent


def train(root: Path, name: str, precision: str, guard: str, seed: int, steps: int, window: int) -> dict:
    from pretrain.scaling.experiments.common import scalar_curve

    overrides = [f"output_root={root}", f"run_name={name}", "data.source=shakespeare",
                 f"data.path={root / 'shakespeare-gpt2-64'}",
                 "model.overrides.n_embd=64", "model.overrides.n_steps=12", "optimizer.lr=3e-3",
                 f"train.max_steps={steps}", f"train.precision={precision}", f"train.skip_spikes={guard}",
                 f"train.spike_window={window}", f"seed={seed}", "train.log_interval=1",
                 f"eval.interval={steps}", "eval.sample_tokens=0", "checkpoint.interval=0"]
    result = subprocess.run([sys.executable, "-m", "pretrain.train", "--config", "configs/tiny/nrgpt.yaml",
                             *overrides], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    run = root / name
    norms = [value for _, value in scalar_curve(run, "train/grad_norm")]
    losses = dict(scalar_curve(run, "train/loss"))
    summary = json.loads((run / "summary.json").read_text())
    return {"max_grad_norm": max(norms), "spikes_over_100": sum(n > 100 for n in norms),
            "final_train_loss": losses.get(steps, math.nan), "val_loss": summary["final_val_loss"],
            "spike_skips": summary["spike_skips"], "skipped_steps": summary["skipped_steps"]}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m bench.spikes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=20, help="train.spike_window of the guarded runs")
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"{'precision':<9} {'guard':<5} {'seed':>4} {'max gnorm':>10} {'gnorm>100':>9} {'train loss':>10} "
          f"{'val loss':>9} {'spike skips':>11} {'non-finite':>10}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "bf16"):
            for guard in ("off", "on"):
                for seed in range(1, args.seeds + 1):
                    r = train(Path(tmp), f"{precision}-{guard}-{seed}", precision, guard, seed, args.steps,
                              args.window)
                    print(f"{precision:<9} {guard:<5} {seed:>4} {r['max_grad_norm']:>10.4g} {r['spikes_over_100']:>9} "
                          f"{r['final_train_loss']:>10.4f} {r['val_loss']:>9.4f} {r['spike_skips']:>11} "
                          f"{r['skipped_steps']:>10}", flush=True)
    return 0


if __name__ == "__main__":
    run_command(main)
