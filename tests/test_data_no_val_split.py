"""A dataset without a val split (`prepare --val-fraction 0`) trains with eval.interval=0 and no
evaluation at all; every other way to point the trainer at unusable data is one line that says
what to set. Real runs of the trainer's command line, in this process (see `train_here`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainer_runs as runs
from data_pipeline.prepare import prepare

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def no_val(tmp_path_factory) -> Path:
    """The trainer tests' character-level Shakespeare, prepared with --val-fraction 0."""
    path = tmp_path_factory.mktemp("no-val") / "shakespeare-char-32"
    manifest = prepare("shakespeare", str(path), seq_len=32, val_fraction=0.0, tokenizer="char",
                       max_docs=80, num_proc=1, progress_bar=False)
    assert manifest["splits"]["val"]["windows"] == 0
    return path


def test_a_dataset_without_val_split_trains_without_evaluation(no_val, tmp_path):
    result = runs.train_here([f"data.path={no_val}", "eval.interval=0", "train.max_steps=4",
                              f"output_root={tmp_path}", "run_name=no-eval"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval at step" not in result.stdout + result.stderr
    summary = json.loads((tmp_path / "no-eval" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_train_loss"] > 0
    assert summary["best_val_loss"] is None and summary["final_val_loss"] is None
    # the scaling fit skips such a run in one line (nothing to fit), it does not crash on it
    fit = runs.command_here("pretrain.scaling", ["fit", str(tmp_path), "--out", str(tmp_path / "fit")])
    assert fit.returncode != 0 and "Traceback" not in fit.stderr
    assert fit.stderr.strip().splitlines()[-1] == "error: no run has a usable best_val_loss"


def test_the_launch_check_accepts_it(no_val):
    result = runs.train_here(["--check", f"data.path={no_val}", "eval.interval=0"])
    assert result.returncode == 0, result.stderr[-3000:]


def dataset_of(no_val: Path) -> dict:
    data = runs.char_dataset()  # the test config's dataset: a val split of a few windows
    manifest = json.loads((data / "manifest.json").read_text())
    return {"no_val": no_val, "data": data, "val_windows": manifest["splits"]["val"]["windows"]}


CASES = {
    "evaluating without a val split": (
        ["data.path={no_val}", "eval.interval=5"],
        "error: eval.interval=5: the dataset at {no_val} has no val split (prepared with --val-fraction "
        "0); set eval.interval=0 to train without evaluation, or prepare the dataset with a val fraction"),
    "a val split smaller than a micro-batch": (
        ["data.micro_batch_size={micro_batch}", "train.global_batch_size={micro_batch}"],
        "error: data.micro_batch_size={micro_batch}: the val split of the dataset at {data} has "
        "{val_windows} window(s), fewer than one micro-batch on each of 1 process(es); lower "
        "data.micro_batch_size, prepare the dataset with a larger --val-fraction, or with --val-fraction 0 "
        "and set eval.interval=0 to train without evaluation"),
    "a split folder as data.path": (
        ["data.path={no_val}/train"],
        "error: data.path={no_val}/train is the train split of the dataset at {no_val}; "
        "set data.path={no_val}"),
    "a file as data.path": (
        ["data.path={no_val}/manifest.json"],
        "error: data.path={no_val}/manifest.json is a file; it must be the directory of a prepared "
        "dataset (the one holding manifest.json)"),
    "no dataset at data.path": (
        ["data.path={no_val}/nothing"],
        "error: data.path={no_val}/nothing: no prepared dataset there (no such directory); prepare one "
        "with python -m data_pipeline.prepare --source SOURCE --out {no_val}/nothing, or set data.source "
        "to prepare it on first use"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unusable_data_is_one_line_saying_what_to_set(no_val, case):
    overrides, expected = CASES[case]
    where = dataset_of(no_val)
    where["micro_batch"] = where["val_windows"] + 1
    # (eval.dynamics off: on gpt it would add its own warning line)
    result = runs.train_here(["--check", "eval.dynamics=false", *(o.format(**where) for o in overrides)])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [expected.format(**where)]
