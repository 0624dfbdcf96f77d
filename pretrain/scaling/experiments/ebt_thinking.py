"""EBT "thinking" (EBT paper): a tiny S2 model trained on GPT-2-tokenized Shakespeare, then
evaluated with more inference (descent) steps than most training batches used (2 or 3), and with
best-of-N: N seeded initial candidates per position, keeping the lowest final energy.

The paper's claim at scale: more steps give lower energy and lower loss, and best-of-N helps
further. Here every number is on the same fixed val windows.
"""
from __future__ import annotations

import math
from itertools import islice

import torch

from pretrain.fileio import markdown_table
from pretrain.scaling.experiments.common import (train_and_evaluate,
                                                 trained_model, write_results)
from pretrain.scaling.plots import pyplot

SWEEP = "configs/scaling/ebt_thinking.yaml"
MAX_STEPS = 6
BEST_OF = (1, 2, 4)
EVAL_BATCHES = 12
EVAL_MICRO_BATCH = 4
"""Sequences per think call: a candidate is B x T x 50304 floats per sample, times best-of."""


def thinking_curves(model, data_dir: str) -> dict:
    """Val loss and mean energy after 1..MAX_STEPS steps, and at the trained number of steps
    for each best-of-N, averaged over fixed val windows."""
    from data_pipeline.loader import build_loader

    loader = build_loader(data_dir, "val", micro_batch_size=EVAL_MICRO_BATCH, seed=0,
                          shuffle=True, num_workers=0)
    batches = list(islice(loader, EVAL_BATCHES))
    train_steps = model.config.n_steps
    loss = torch.zeros(MAX_STEPS, dtype=torch.float64)
    energy = torch.zeros(MAX_STEPS + 1, dtype=torch.float64)
    best_loss = torch.zeros(len(BEST_OF), dtype=torch.float64)
    best_energy = torch.zeros(len(BEST_OF), dtype=torch.float64)
    for inputs, targets in batches:
        out = model.think(inputs, steps=MAX_STEPS, targets=targets)
        loss += out.loss_per_step.detach().double()
        energy += out.energies.detach().double().mean(dim=(1, 2))
        for i, n in enumerate(BEST_OF):
            out = model.think(inputs, steps=train_steps, best_of=n, targets=targets)
            best_loss[i] += out.loss_per_step[-1].detach().double()
            best_energy[i] += out.energies[-1].detach().double().mean()
    n = len(batches)
    return {"loss_per_step": (loss / n).tolist(), "energy_per_step": (energy / n).tolist(),
            "best_of_loss": (best_loss / n).tolist(), "best_of_energy": (best_energy / n).tolist(),
            "train_steps": train_steps, "train_min_steps": model.config.min_steps,
            "tokens": n * EVAL_MICRO_BATCH * inputs.size(1)}


def main(overrides: list[str] = ()) -> int:
    sweep, runs = train_and_evaluate(
        SWEEP, "ebt_thinking",
        lambda run, run_dir: thinking_curves(trained_model(run_dir), run.config["data"]["path"]),
        overrides)
    (run,) = runs
    record, curves = run.record, run.evaluation
    train_steps = curves["train_steps"]
    steps_rows = [{"steps": k + 1, "best_of": 1, "val_loss": loss, "ppl": math.exp(loss),
                   "final_energy": curves["energy_per_step"][k + 1]}
                  for k, loss in enumerate(curves["loss_per_step"])]
    best_rows = [{"steps": train_steps, "best_of": n, "val_loss": loss, "ppl": math.exp(loss),
                  "final_energy": energy}
                 for n, loss, energy in zip(BEST_OF, curves["best_of_loss"],
                                            curves["best_of_energy"])]
    fmt = {"val_loss": ".4f", "ppl": ".1f", "final_energy": ".4g"}
    markdown = (f"Run {record.run_name}: {record.params:,d} parameters, "
                f"{record.tokens_seen:,d} training tokens, best val loss during training "
                f"{record.best_val_loss:.4f}. Evaluated on {curves['tokens']:,d} val tokens; "
                f"mean energy of the initial candidates {curves['energy_per_step'][0]:.4g}.\n\n"
                + markdown_table(steps_rows, fmt) + "\n" + markdown_table(best_rows, fmt))
    figure = _figure(steps_rows, best_rows, (curves["train_min_steps"], train_steps))
    write_results(sweep, "ebt_thinking", markdown, steps_rows + best_rows, figure)
    return 0


def _figure(steps_rows, best_rows, trained_steps: tuple[int, int]):
    plt = pyplot()
    # One loss scale for both panels: on an axis of its own, with an offset, a best-of-N
    # difference of 0.0003 nats fills the panel and reads like a trend.
    fig, (ax_steps, ax_best) = plt.subplots(1, 2, figsize=(8.4, 3.4), sharey=True)
    steps = [r["steps"] for r in steps_rows]
    ax_steps.plot(steps, [r["val_loss"] for r in steps_rows], "o-", label="val loss")
    ax_steps.axvspan(*trained_steps, color="0.88", label="steps used in training")
    ax_energy = ax_steps.twinx()
    ax_energy.plot(steps, [r["final_energy"] for r in steps_rows], "s--", color="C1",
                   label="energy after step")
    ax_energy.set_ylabel("mean energy", color="C1")
    ax_steps.set_xlabel("inference (descent) steps")
    ax_steps.set_ylabel("val loss")
    ax_steps.legend(fontsize=8, loc="upper right")
    ax_best.plot([r["best_of"] for r in best_rows], [r["val_loss"] for r in best_rows], "o-")
    ax_best.set_xscale("log", base=2)
    ax_best.set_xlabel(f"best of N candidates ({trained_steps[1]} steps)")
    ax_best.ticklabel_format(axis="y", useOffset=False)
    for ax in (ax_steps, ax_best):
        ax.grid(True, alpha=0.3)
    fig.suptitle("EBT S2 (tiny): thinking longer and best-of-N", fontsize=10)
    fig.tight_layout()
    return fig
