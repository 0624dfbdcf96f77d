"""Character-level Shakespeare (NRGPT paper): GPT, GPT_Rec and NRGPT at three widths. Reports
the best val loss against parameters and the generalization gap: val minus train loss of the
final model, both measured the same way here (the same number of windows of each split, in
eval mode), so the gap is not blurred by the trainer's last-batch train loss.

The data are the first 150 scenes of the bundled plays (about 1M characters, the size of the
paper's tiny-shakespeare), 10% of scenes held out for validation.
"""
from __future__ import annotations

from pathlib import Path

from common.fileio import markdown_table
from data_pipeline.prepare import ensure_prepared
from pretrain.config import load_config
from pretrain.scaling.experiments.common import (mean_loss, scalar_curve, train_and_evaluate,
                                                 trained_model, write_results)
from pretrain.scaling.plots import pyplot
from pretrain.scaling.sweep import Sweep, load_sweep

SWEEP = "configs/scaling/shakespeare_char.yaml"
SCENES = 150
VAL_FRACTION = 0.1
LOSS_BATCHES = 80
"""Micro-batches of each split for the final train and val losses (80 x 8 x 128 characters)."""


def main(overrides: list[str] = ()) -> int:
    sweep, rows = char_sweep(SWEEP, SCENES, list(overrides))
    write_char_results(sweep.directory, "shakespeare_char", rows)
    return 0


def char_sweep(path: str, scenes: int, overrides: list[str]) -> tuple[Sweep, list[dict]]:
    """Train the sweep at `path` on the first `scenes` scenes (10% of them held out) and return
    one row per run: sizes, losses, the generalization gap and the val curve's turn."""
    data = load_config(load_sweep(path, overrides).base_config).data
    data_path = data.path
    if scenes != SCENES:  # the base config's dataset is the 150-scene one
        data_path = f"{data.path.rsplit('-', 1)[0]}-{scenes}scenes"
        overrides = overrides + [f"data.path={data_path}"]
    manifest = ensure_prepared(data_path, "shakespeare", seq_len=data.seq_len, tokenizer="char",
                               val_fraction=VAL_FRACTION, max_docs=scenes)

    def final_losses(run, run_dir):
        model = trained_model(run_dir)
        return {split: mean_loss(model, data_path, split, LOSS_BATCHES, data.micro_batch_size)
                for split in ("train", "val")}

    sweep, runs = train_and_evaluate(path, "char_losses", final_losses, overrides)
    rows = []
    for r in runs:
        curve = scalar_curve(r.directory, "eval/loss")
        best_step, best_val = min(curve, key=lambda point: point[1])
        rows.append({"model": r.spec.group, "width": r.spec.config["model"]["overrides"]["n_embd"],
                     "scenes": scenes, "train_chars": manifest["splits"]["train"]["tokens"],
                     "params": r.record.params, "non_embedding": r.record.non_embedding_params,
                     "best_val": best_val, "best_step": best_step, "last_val": curve[-1][1],
                     "rise": curve[-1][1] - best_val, "final_train": r.evaluation["train"],
                     "final_val": r.evaluation["val"],
                     "gap": r.evaluation["val"] - r.evaluation["train"],
                     "wall_s": r.record.wall_time_s, "curve": curve})
    rows.sort(key=lambda r: (r["scenes"], r["model"], r["params"]))
    return sweep, rows


def write_char_results(directory: Path, name: str, rows: list[dict]) -> None:
    """The table (without the curves), the CSV and the figure of `char_sweep`'s rows."""
    table = [{k: v for k, v in row.items() if k != "curve"} for row in rows]
    formats = {"params": ",d", "non_embedding": ",d", "train_chars": ",d", "wall_s": ".0f"}
    formats.update({c: ".3f" for c in ("best_val", "last_val", "rise", "final_train",
                                       "final_val", "gap")})
    write_results(directory, name, markdown_table(table, formats), table, _figure(rows))


def _figure(rows):
    """Val loss against step for every run (one panel per dataset size) and the final gap
    against parameters."""
    plt = pyplot()
    scene_counts = sorted({r["scenes"] for r in rows})
    models = sorted({r["model"] for r in rows})
    widths = sorted({r["width"] for r in rows})
    fig, axes = plt.subplots(1, len(scene_counts) + 1, figsize=(4.2 * (len(scene_counts) + 1), 3.4))
    for ax, scenes in zip(axes, scene_counts):
        for r in (r for r in rows if r["scenes"] == scenes):
            steps, losses = zip(*r["curve"])
            ax.plot(steps, losses, color=f"C{models.index(r['model'])}",
                    ls=("-", "--", ":", "-.")[widths.index(r["width"]) % 4],
                    label=f"{r['model']} w{r['width']}")
        ax.set_xlabel("step")
        chars = next(r["train_chars"] for r in rows if r["scenes"] == scenes)
        ax.set_title(f"val loss, {scenes} scenes ({chars:,} train characters)", fontsize=9)
    ax_gap = axes[-1]
    for i, model in enumerate(models):
        for scenes, marker in zip(scene_counts, "os^"):
            mine = [r for r in rows if r["model"] == model and r["scenes"] == scenes]
            ax_gap.plot([r["params"] for r in mine], [r["gap"] for r in mine], marker + "-",
                        color=f"C{i}", label=f"{model}, {scenes} scenes")
    ax_gap.set_xscale("log")
    ax_gap.set_xlabel("parameters")
    ax_gap.set_title("val - train loss (final)", fontsize=9)
    ax_gap.axhline(0, color="0.5", lw=0.8)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Character-level Shakespeare", fontsize=10)
    fig.tight_layout()
    return fig
