"""A two-point sweep of tiny real runs, end to end: launch through the project's torchrun
launcher, skip finished runs, resume an unfinished one, list, fit (too few points: a one-line
error, nothing written); a sweep stopped by SIGTERM."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

import trainer_runs as runs
from pretrain.scaling.__main__ import main
from pretrain.scaling.launch import REQUEUE_EXIT_CODE
from pretrain.scaling.registry import load_registry

STEPS, BATCH, SEQ_LEN = 6, 8, 32


@pytest.fixture(scope="module")
def char_dataset(tmp_path_factory, corpus_jsonl):
    """Character-level dataset of the shared test corpus: a small vocabulary keeps runs fast."""
    from data_pipeline.prepare import prepare

    out = str(tmp_path_factory.mktemp("datasets") / "char")
    prepare(f"jsonl:{corpus_jsonl}", out, seq_len=SEQ_LEN, val_fraction=0.1, tokenizer="char",
            num_proc=1)
    return out


def write_sweep(tmp_path, dataset: str, steps: int) -> tuple:
    """(sweep file, sweep directory) of two tiny GPTs trained `steps` steps each."""
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "model": {"flavor": "gpt-tiny"},
        "data": {"path": dataset, "seq_len": SEQ_LEN, "micro_batch_size": BATCH,
                 "num_workers": 0},
        "train": {"global_batch_size": BATCH, "log_interval": 2},
        "zero": {"stage": 0},
        "checkpoint": {"interval": 0},
        "eval": {"interval": 0, "batches": 2, "sample_tokens": 0}}))
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({
        "name": "two", "base_config": str(base), "output_root": str(tmp_path / "runs"),
        "families": {"gpt": {"flavor": "gpt-tiny"}},
        "sizes": {"w16": {"n_embd": 16}, "w32": {"n_embd": 32}},
        "tokens": {"fixed": [steps * BATCH * SEQ_LEN]}, "threads_per_process": 1}))
    return sweep_file, tmp_path / "runs" / "two"


def test_two_point_sweep_end_to_end(tmp_path, char_dataset, capsys):
    sweep_file, sweep_dir = write_sweep(tmp_path, char_dataset, STEPS)

    assert main(["run", str(sweep_file)]) == 0
    registry = load_registry([sweep_dir])
    assert not registry.missing and not registry.invalid
    records = {r.run_name: r for _, r in registry.records}
    assert sorted(records) == ["two-gpt-w16-t1.54k", "two-gpt-w32-t1.54k"]
    for record in records.values():
        assert record.steps == STEPS and record.tokens_seen == STEPS * BATCH * SEQ_LEN
        assert record.train_flops == pytest.approx(
            record.extra["flops_per_token"] * record.tokens_seen)
        assert record.best_val_loss is not None
    small, large = records["two-gpt-w16-t1.54k"], records["two-gpt-w32-t1.54k"]
    assert 2.5 < large.non_embedding_params / small.non_embedding_params < 4.5

    # Finished runs are skipped; a run whose summary is gone is run again and resumes from its
    # final checkpoint instead of training anew.
    (sweep_dir / small.run_name / "summary.json").unlink()
    capsys.readouterr()
    assert main(["run", str(sweep_file)]) == 0
    out = capsys.readouterr().out
    assert "1 finished, 1 to run" in out and f"resuming {small.run_name}" in out
    resumed = json.loads((sweep_dir / small.run_name / "summary.json").read_text())
    assert resumed["steps"] == STEPS and resumed["final_train_loss"] == small.final_train_loss

    assert main(["list", str(sweep_dir)]) == 0
    assert small.run_name in capsys.readouterr().out
    capsys.readouterr()
    assert main(["fit", str(sweep_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too few runs for any law (the most in one group: 2" in err
    assert "need runs at 3 or more distinct sizes" in err
    assert not (sweep_dir / "fit").exists()


def test_a_sweep_stopped_by_sigterm_has_its_running_run_checkpoint_and_starts_no_other(tmp_path, char_dataset):
    """`kill PID` of a local sweep reaches the sweep alone: it passes the signal on to the
    running trainer, which saves a checkpoint, starts no further run and exits with the requeue
    code. (Before, the sweep died at once and left its trainer running to the end unwatched.)"""
    sweep_file, sweep_dir = write_sweep(tmp_path, char_dataset, 100_000)
    log = tmp_path / "sweep.out"
    with log.open("w") as out:
        sweep = subprocess.Popen([sys.executable, "-m", "pretrain.scaling", "run", str(sweep_file)],
                                 cwd=runs.REPO, stdout=out, stderr=subprocess.STDOUT, env=runs.child_env(),
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "step 4/" not in log.read_text():  # the first run is in its training loop
            assert sweep.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=120) == REQUEUE_EXIT_CODE, log.read_text()[-3000:]
    finally:  # whatever failed, no trainer of the sweep is left running (the group outlives it)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sweep.pid, signal.SIGKILL)
    output = log.read_text()
    assert "stopped by SIGTERM: the running runs save a checkpoint; rerun the sweep to resume them" in output
    assert "on SIGTERM: checkpoint saved, exit code 75" in output and "Traceback" not in output
    assert list(sweep_dir.glob("two-gpt-w16-*/ckpt/step_*/complete.json"))
    assert not list(sweep_dir.glob("two-gpt-w32-*"))  # the second run never started
