"""EBT "thinking" (EBT paper): a tiny S2 model trained on character-level Shakespeare with the
released S2 recipe (2 or 3 descent steps per batch, all on one energy landscape: one shared step
embedding), then evaluated with more inference steps than training used, and with best-of-N: N
seeded initial candidates per position, keeping the lowest final energy. Each is measured without
and with the Langevin noise at evaluation (the released code adds it in validation too).

The paper's claim at scale: more steps give lower energy and lower loss, and best-of-N helps
further. Here every number is on the same fixed val windows.
"""
from __future__ import annotations

import math
from itertools import islice

import torch

from common.fileio import markdown_table
from pretrain.scaling.experiments.common import (train_and_evaluate,
                                                 trained_model, write_results)
from pretrain.scaling.plots import pyplot

SWEEP = "configs/scaling/ebt_thinking.yaml"
MAX_STEPS = 8
BEST_OF = (1, 2, 4, 8)
EVAL_BATCHES = 12
EVAL_MICRO_BATCH = 16
"""Sequences per think call: a candidate is B x T x V floats per sample, times best-of."""


def thinking_curves(model, data_dir: str) -> dict:
    """Per eval-noise setting ("off", "on"): val loss and mean energy of the final candidate
    after 1..MAX_STEPS steps (energy_per_step[0]: of the initial candidates, without noise), and
    at the trained number of steps for each best-of-N, averaged over fixed val windows."""
    from data_pipeline.loader import build_loader

    loader = build_loader(data_dir, "val", micro_batch_size=EVAL_MICRO_BATCH, seed=0,
                          shuffle=True, num_workers=0)
    batches = list(islice(loader, EVAL_BATCHES))
    train_steps = model.config.n_steps
    curves = {}
    for setting, noise in (("off", False), ("on", True)):
        loss = torch.zeros(MAX_STEPS, dtype=torch.float64)
        energy = torch.zeros(MAX_STEPS + 1, dtype=torch.float64)
        best_loss = torch.zeros(len(BEST_OF), dtype=torch.float64)
        best_energy = torch.zeros(len(BEST_OF), dtype=torch.float64)
        for inputs, targets in batches:
            energy[0] += model.think(inputs, steps=1, langevin_noise=False).energies[0].double().mean()
            # One call per step count, each ending with the energy of its final candidate: with
            # noise, the energies a longer descent reports for its middle steps are those of the
            # noised candidates. (The seeded noise makes the shorter descents prefixes of the longer.)
            for k in range(1, MAX_STEPS + 1):
                out = model.think(inputs, steps=k, targets=targets, langevin_noise=noise)
                loss[k - 1] += out.loss_per_step[-1].double()
                energy[k] += out.energies[-1].double().mean()
            for i, n in enumerate(BEST_OF):
                out = model.think(inputs, steps=train_steps, best_of=n, targets=targets, langevin_noise=noise)
                best_loss[i] += out.loss_per_step[-1].double()
                best_energy[i] += out.energies[-1].double().mean()
        n = len(batches)
        curves[setting] = {"loss_per_step": (loss / n).tolist(), "energy_per_step": (energy / n).tolist(),
                           "best_of_loss": (best_loss / n).tolist(),
                           "best_of_energy": (best_energy / n).tolist()}
    return {**curves, "train_steps": train_steps, "train_min_steps": model.config.min_steps,
            "noise_std": model.config.langevin_noise_std, "tokens": len(batches) * EVAL_MICRO_BATCH * inputs.size(1)}


def main(overrides: list[str] = ()) -> int:
    sweep, runs = train_and_evaluate(
        SWEEP, "ebt_thinking_one_landscape",
        lambda run, run_dir: thinking_curves(trained_model(run_dir), run.config["data"]["path"]),
        overrides)
    (run,) = runs
    record, curves = run.record, run.evaluation
    train_steps = curves["train_steps"]
    steps_rows, best_rows = [], []
    for setting in ("off", "on"):
        curve = curves[setting]
        steps_rows += [{"eval_noise": setting, "steps": k + 1, "best_of": 1, "val_loss": loss,
                        "ppl": math.exp(loss), "final_energy": curve["energy_per_step"][k + 1]}
                       for k, loss in enumerate(curve["loss_per_step"])]
        best_rows += [{"eval_noise": setting, "steps": train_steps, "best_of": n, "val_loss": loss,
                       "ppl": math.exp(loss), "final_energy": energy}
                      for n, loss, energy in zip(BEST_OF, curve["best_of_loss"], curve["best_of_energy"])]
    fmt = {"val_loss": ".4f", "ppl": ".1f", "final_energy": ".4g"}
    markdown = (f"Run {record.run_name}: {record.params:,d} parameters, "
                f"{record.tokens_seen:,d} training tokens, best val loss during training "
                f"{record.best_val_loss:.4f}. Evaluated on {curves['tokens']:,d} val tokens; eval noise "
                f"'on' adds Langevin noise of std {curves['noise_std']:g} before each step. Mean energy "
                f"of the initial candidates {curves['off']['energy_per_step'][0]:.4g}; final_energy "
                f"is that of the final candidate (without noise).\n\n"
                + markdown_table(steps_rows, fmt) + "\n" + markdown_table(best_rows, fmt))
    figure = _figure(steps_rows, best_rows, (curves["train_min_steps"], train_steps))
    write_results(sweep.directory, "ebt_thinking", markdown, steps_rows + best_rows, figure)
    return 0


def _figure(steps_rows, best_rows, trained_steps: tuple[int, int]):
    plt = pyplot()
    fig, (ax_steps, ax_energy, ax_best) = plt.subplots(1, 3, figsize=(11.5, 3.4))
    # The best-of-N panel on the steps panel's loss scale, without an offset: on an axis of its
    # own a difference of 0.0003 nats fills the panel and reads like a trend.
    ax_best.sharey(ax_steps)
    for color, setting in (("C0", "off"), ("C1", "on")):
        rows = [r for r in steps_rows if r["eval_noise"] == setting]
        steps = [r["steps"] for r in rows]
        ax_steps.plot(steps, [r["val_loss"] for r in rows], "o-", color=color, label=f"eval noise {setting}")
        ax_energy.plot(steps, [r["final_energy"] for r in rows], "s--", color=color,
                       label=f"eval noise {setting}")
        best = [r for r in best_rows if r["eval_noise"] == setting]
        ax_best.plot([r["best_of"] for r in best], [r["val_loss"] for r in best], "o-", color=color,
                     label=f"eval noise {setting}")
    for ax in (ax_steps, ax_energy):
        ax.axvspan(*trained_steps, color="0.88", label="steps used in training")
        ax.set_xlabel("inference (descent) steps")
    ax_steps.set_ylabel("val loss")
    ax_energy.set_ylabel("mean energy after the step")
    ax_best.set_xscale("log", base=2)
    ax_best.set_xlabel(f"best of N candidates ({trained_steps[1]} steps)")
    ax_best.set_ylabel("val loss")
    ax_best.ticklabel_format(axis="y", useOffset=False)
    for ax in (ax_steps, ax_energy, ax_best):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("EBT S2 (tiny, one energy landscape): thinking longer and best-of-N", fontsize=10)
    fig.tight_layout()
    return fig
