"""ListOps (NRGPT paper): accuracy on the held-out test set versus parameter count for NRGPT
(ff1, ff2w) and GPT_Rec with one head and five recurrent steps, at widths 8 to 64.

Accuracy is greedy generation after the first `=`: the prompt is the expression up to and
including its first `=`, preceded by `<eos>` (in the packed training stream every example
follows an `<eos>`); the model generates the reduction chain and the result. An example counts
as solved when the whole generated answer matches ("exact"); "result" only checks the digit
generated right before the first `<eos>`. Every test example contains an argument triple that
never occurs in training.

Because exact match stays at zero until a model has learned the whole chain, the answer is also
scored teacher-forced, which shows partial learning: the share of answer tokens predicted right
(argmax) when the true answer so far is given, and the mean loss on the answer tokens.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from common.fileio import markdown_table
from data_pipeline.listops import listops_test_examples
from data_pipeline.loader import read_manifest
from pretrain.models.blocks import cross_entropy
from pretrain.scaling.experiments.common import (train_and_evaluate,
                                                 trained_model, write_results)
from pretrain.scaling.plots import pyplot

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


@torch.no_grad()
def teacher_forced(model, examples: list[tuple[list[int], list[int]]], eos_id: int) -> dict:
    """Answer-token accuracy and loss with the true answer prefix given."""
    by_length = defaultdict(list)
    for prompt, answer in examples:
        by_length[(len(prompt), len(answer))].append((prompt, answer))
    correct = total = 0
    loss = 0.0
    for (prompt_len, answer_len), group in by_length.items():
        for start in range(0, len(group), GENERATION_BATCH):
            chunk = group[start:start + GENERATION_BATCH]
            seqs = torch.tensor([[eos_id] + prompt + answer for prompt, answer in chunk])
            # The logits at positions prompt_len .. end-1 predict the answer tokens.
            logits = model(seqs[:, :-1]).logits[:, prompt_len:]
            targets = seqs[:, prompt_len + 1:]
            correct += (logits.argmax(-1) == targets).sum().item()
            loss += cross_entropy(logits, targets, reduction="sum").item()
            total += targets.numel()
    return {"answer_token_acc": correct / total, "answer_loss": loss / total}


def main(overrides: list[str] = ()) -> int:
    def evaluate_run(run, run_dir):
        data_dir = run.config["data"]["path"]
        examples = listops_test_examples(data_dir, "test")
        eos_id = read_manifest(data_dir)["eot_id"]
        model = trained_model(run_dir)
        return {**greedy_accuracy(model, examples, eos_id),
                **teacher_forced(model, examples, eos_id)}

    sweep, runs = train_and_evaluate(SWEEP, "listops_test", evaluate_run, overrides)
    rows = [{"model": r.spec.group, "width": r.spec.config["model"]["overrides"]["n_embd"],
             "params": r.record.params, "val_loss": r.record.best_val_loss,
             "test_exact": r.evaluation["exact"], "test_result": r.evaluation["result"],
             "answer_token_acc": r.evaluation["answer_token_acc"],
             "answer_loss": r.evaluation["answer_loss"], "train_tokens": r.record.tokens_seen,
             "wall_s": r.record.wall_time_s} for r in runs]
    rows.sort(key=lambda r: (r["model"], r["params"]))
    markdown = markdown_table(rows, {"val_loss": ".3f", "test_exact": ".3f",
                                     "test_result": ".3f", "answer_token_acc": ".3f",
                                     "answer_loss": ".3f", "wall_s": ".0f", "params": ",d",
                                     "train_tokens": ",d"})
    write_results(sweep.directory, "listops", markdown, rows, _figure(rows))
    return 0


def _figure(rows):
    plt = pyplot()
    fig, (ax_greedy, ax_forced) = plt.subplots(1, 2, figsize=(9.0, 3.6))
    for ax in (ax_greedy, ax_forced):
        ax.axvspan(*PAPER_TRANSITION, color="0.88", label="paper's transition")
    for i, model in enumerate(sorted({r["model"] for r in rows})):
        mine = [r for r in rows if r["model"] == model]
        params = [r["params"] for r in mine]
        ax_greedy.plot(params, [r["test_exact"] for r in mine], "o-", color=f"C{i}",
                       label=f"{model}: exact")
        ax_greedy.plot(params, [r["test_result"] for r in mine], "x--", color=f"C{i}",
                       alpha=0.6, label=f"{model}: result digit")
        ax_forced.plot(params, [r["answer_token_acc"] for r in mine], "o-", color=f"C{i}",
                       label=model)
    ax_greedy.axhline(0.1, color="0.5", lw=0.8, ls=":", label="chance (result digit)")
    ax_greedy.set_ylabel("held-out test accuracy")
    ax_greedy.set_title("greedy generation after the first '='", fontsize=9)
    ax_forced.set_ylabel("answer-token accuracy")
    ax_forced.set_title("teacher-forced answer tokens", fontsize=9)
    for ax in (ax_greedy, ax_forced):
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("parameters")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("ListOps (1 head, 5 steps)", fontsize=10)
    fig.tight_layout()
    return fig
