"""The model card of a Hugging Face export tells what `python -m pretrain.evaluate` measured on
the exported checkpoint, and what the exported code does."""
from __future__ import annotations

import json

import trainer_runs as runs
from pretrain.downstream import harness


def test_card_shows_the_downstream_results_of_the_exported_checkpoint(tmp_path, tiny_dataset):
    """A tiny GPT-2-vocabulary nrgpt run, evaluated by the command, then exported."""
    result = runs.train_here([f"output_root={tmp_path}", "run_name=run", f"data.path={tiny_dataset}",
                              "data.source=null", "data.seq_len=32", "data.micro_batch_size=2",
                              "train.global_batch_size=2", "train.max_steps=2", "eval.interval=2", "eval.batches=1",
                              "eval.sample_tokens=0", "checkpoint.interval=2", "zero.stage=0"],
                             runs.REPO / "configs/tiny/nrgpt.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    result = runs.command_here("pretrain.evaluate", [str(run), "--tasks", "arc_easy", "--limit", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    (report_file,) = (run / "downstream").iterdir()  # where the command writes without --out
    report = json.loads(report_file.read_text())
    result = runs.command_here("pretrain.export", [str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert result.returncode == 0, result.stderr[-3000:]
    card = (tmp_path / "hf" / "README.md").read_text()

    assert "## Downstream results" in card and "step 2 " in card and "the first 2 documents of each task" in card
    shown = harness.summary_rows([harness.Row(**row) for row in report["rows"]])
    assert shown
    for row in shown:  # task, metric, value and documents scored, as the command printed them
        assert f"| {row.task} | {row.metric} | {row.value:.4f} |" in card, row
        assert f"| {row.docs} |" in card
    # the exported code decodes with a cache (tests/test_export_hf.py checks that it does)
    assert "decodes with the model's own cache" in card and "recomputes the whole context" not in card
