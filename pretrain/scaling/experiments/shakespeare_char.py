"""Character-level Shakespeare (NRGPT paper): GPT, GPT_Rec and NRGPT at three widths. Reports
the best val loss against parameters and the generalization gap: val minus train loss of the
final model, both measured the same way here (the same number of windows of each split, in
eval mode), so the gap is not blurred by the trainer's last-batch train loss.

The data are the first 150 scenes of the bundled plays (about 1M characters, the size of the
paper's tiny-shakespeare), 10% of scenes held out for validation.
"""
from __future__ import annotations

from data_pipeline.prepare import ensure_prepared
from pretrain.config import load_config
from pretrain.fileio import markdown_table
from pretrain.scaling.experiments.common import (mean_loss,
                                                 train_and_evaluate, trained_model,
                                                 write_results)
from pretrain.scaling.plots import pyplot
from pretrain.scaling.sweep import load_sweep

SWEEP = "configs/scaling/shakespeare_char.yaml"
SCENES = 150
VAL_FRACTION = 0.1
LOSS_BATCHES = 80
"""Micro-batches of each split for the final train and val losses (80 x 8 x 128 characters)."""


def main(overrides: list[str] = ()) -> int:
    data = load_config(load_sweep(SWEEP, overrides).base_config).data
    ensure_prepared(data.path, "shakespeare", seq_len=data.seq_len, tokenizer="char",
                    val_fraction=VAL_FRACTION, max_docs=SCENES)

    def final_losses(run, run_dir):
        model = trained_model(run_dir)
        return {split: mean_loss(model, data.path, split, LOSS_BATCHES, data.micro_batch_size)
                for split in ("train", "val")}

    sweep, runs = train_and_evaluate(SWEEP, "char_losses", final_losses, overrides)
    rows = [{"model": r.spec.group, "width": r.spec.config["model"]["overrides"]["n_embd"],
             "params": r.record.params, "non_embedding": r.record.non_embedding_params,
             "best_val": r.record.best_val_loss, "final_train": r.evaluation["train"],
             "final_val": r.evaluation["val"],
             "gap": r.evaluation["val"] - r.evaluation["train"], "wall_s": r.record.wall_time_s}
            for r in runs]
    rows.sort(key=lambda r: (r["model"], r["params"]))
    formats = {"params": ",d", "non_embedding": ",d", "wall_s": ".0f"}
    formats.update({c: ".3f" for c in ("best_val", "final_train", "final_val", "gap")})
    markdown = markdown_table(rows, formats)
    write_results(sweep, "shakespeare_char", markdown, rows, _figure(rows))
    return 0


def _figure(rows):
    plt = pyplot()
    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for i, model in enumerate(sorted({r["model"] for r in rows})):
        mine = [r for r in rows if r["model"] == model]
        params = [r["params"] for r in mine]
        ax_loss.plot(params, [r["best_val"] for r in mine], "o-", color=f"C{i}", label=model)
        ax_gap.plot(params, [r["gap"] for r in mine], "o-", color=f"C{i}", label=model)
    for ax, title in ((ax_loss, "best val loss"), (ax_gap, "val - train loss (final)")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_gap.axhline(0, color="0.5", lw=0.8)
    fig.suptitle("Character-level Shakespeare", fontsize=10)
    fig.tight_layout()
    return fig
