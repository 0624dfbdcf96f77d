"""ListOps (NRGPT paper): accuracy on the held-out test set versus parameter count for NRGPT
(ff1, ff2w) and GPT_Rec with one head and five recurrent steps, at widths 8 to 64.

Accuracy is greedy generation after the first `=`: the prompt is the expression up to and
including its first `=`, preceded by `<eos>` (in the packed training stream every example
follows an `<eos>`); the model generates the reduction chain and the result. An example counts
as solved when the whole generated answer matches ("exact"); "result" only checks the digit
generated right before the first `<eos>`. Every test example contains an argument triple that
never occurs in training.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from data_pipeline.listops import listops_test_examples
from data_pipeline.loader import read_manifest
from pretrain.scaling.experiments.common import (cached, markdown_table, train_sweep,
                                                 trained_model, write_results)
from pretrain.scaling.report import pyplot

SWEEP = "configs/scaling/listops.yaml"
PAPER_TRANSITION = (2.3e4, 3.0e4)
"""Parameter range past which the paper reports high accuracy for all three models."""
GENERATION_BATCH = 500


@torch.no_grad()
def greedy_accuracy(model, examples: list[tuple[list[int], list[int]]], eos_id: int) -> dict:
    """Exact-answer and result accuracy of greedy generation (see the module docstring)."""
    by_length = defaultdict(list)  # equal prompt lengths batch without padding
    for prompt, answer in examples:
        by_length[len(prompt)].append((prompt, answer))
    exact = result = 0
    for group in by_length.values():
        for start in range(0, len(group), GENERATION_BATCH):
            chunk = group[start:start + GENERATION_BATCH]
            idx = torch.tensor([[eos_id] + prompt for prompt, _ in chunk])
            new_tokens = max(len(answer) for _, answer in chunk)
            generated = model.generate(idx, new_tokens, top_k=1)[:, idx.size(1):].tolist()
            for row, (_, answer) in zip(generated, chunk):
                exact += row[:len(answer)] == answer
                end = row.index(eos_id) if eos_id in row else None
                result += end is not None and end > 0 and row[end - 1] == answer[-2]
    return {"exact": exact / len(examples), "result": result / len(examples),
            "examples": len(examples)}


def main() -> int:
    sweep, runs = train_sweep(SWEEP)
    rows = []
    for run, record, run_dir in runs:
        data_dir = run.config["data"]["path"]
        manifest = read_manifest(data_dir)
        scores = cached(run_dir, "listops_test", lambda: greedy_accuracy(
            trained_model(run_dir), listops_test_examples(data_dir, "test"), manifest["eot_id"]))
        rows.append({"model": run.group, "width": run.config["model"]["overrides"]["n_embd"],
                     "params": record.params, "val_loss": record.best_val_loss,
                     "test_exact": scores["exact"], "test_result": scores["result"],
                     "train_tokens": record.tokens_seen, "wall_s": record.wall_time_s})
    rows.sort(key=lambda r: (r["model"], r["params"]))
    markdown = markdown_table(rows, {"val_loss": ".3f", "test_exact": ".3f",
                                     "test_result": ".3f", "wall_s": ".0f", "params": ",d",
                                     "train_tokens": ",d"})
    write_results(sweep, "listops", markdown, rows, _figure(rows))
    return 0


def _figure(rows):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    ax.axvspan(*PAPER_TRANSITION, color="0.85", label="paper's transition")
    for i, model in enumerate(sorted({r["model"] for r in rows})):
        mine = [r for r in rows if r["model"] == model]
        ax.plot([r["params"] for r in mine], [r["test_exact"] for r in mine], "o-", color=f"C{i}",
                label=f"{model} (exact)")
        ax.plot([r["params"] for r in mine], [r["test_result"] for r in mine], "x--",
                color=f"C{i}", alpha=0.6, label=f"{model} (result)")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("parameters")
    ax.set_ylabel("held-out test accuracy")
    ax.set_title("ListOps: greedy generation after the first '='")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
