"""bench.gpu on a CPU: the tiny mode runs the GPU benchmark's code path (worker process, the
trainer's engine and step, attention-kernel probe, EBT second-order check, reports) on tiny
flavors; the scheduler's budget and time cap are checked without a GPU too."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

import trainer_runs as runs
from bench import gpu
from pretrain.models import build, resolve

PEAK = 2.0
"""A made-up peak (TFLOP/s) so that MFU is computed on a CPU too."""


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gpu")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--out", str(out),
                           "--peak-tflops", str(PEAK)], cwd=runs.REPO, env=runs.child_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()


def test_tiny_run_measures_every_case_through_the_trainer(tiny_report):
    report, _ = tiny_report
    cases = {c["case"]: c for c in report["cases"]}
    assert set(cases) == {c.name for c in gpu.tiny_plan()}
    assert report["environment"]["torch"] and report["elapsed_s"] <= report["budget_s"]
    for case in gpu.tiny_plan():
        if case.kind != "throughput":
            continue
        r = cases[case.name]
        assert r["status"] == "ok", r
        model = build(resolve(case.flavor, {"vocab_size": 512, "block_size": case.seq_len, **case.overrides}))
        assert r["flops_per_token"] == model.flops_per_token(case.seq_len)
        assert r["params"] == model.num_params()
        assert r["tokens_per_step"] == case.micro_batch * case.seq_len and r["timed_steps"] >= 2
        assert 0 < r["step_ms_min"] <= r["step_ms_median"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_ms_median"] * 1e3)
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / (PEAK * 1e12))
        assert 0 <= r["data_wait_frac"] < 0.5  # synthetic batches are ready at once
        assert r["precision"] == "bf16" and r["peak_memory_gib"] is None  # measured on GPU only
        assert abs(r["loss_first"] - math.log(512)) < 1.0  # random tokens: about ln V at init
        assert math.isfinite(r["loss_last"])  # (EBT S1's first update sends it up, see docs)


def test_tiny_run_records_the_attention_kernels(tiny_report):
    report, _ = tiny_report
    cases = {c["case"]: c for c in report["cases"]}
    off, on = cases["gpt-tiny ac=off"]["attention_kernels"], cases["gpt-tiny ac=step"]["attention_kernels"]
    assert off == {"flash (cpu)": 2, "flash (cpu) backward": 2}  # one call per layer
    assert on == {"flash (cpu)": 4, "flash (cpu) backward": 2}  # checkpointing reruns the forward
    assert cases["nrgpt-tiny ac=off"]["attention_kernels"]["flash (cpu)"] == 3  # one per step
    assert cases["nrgpt-tiny ac=off attention=explicit"]["attention_kernels"] == {}


def test_tiny_run_checks_ebt_second_order_numerics(tiny_report):
    report, markdown = tiny_report
    check = next(c for c in report["cases"] if c["kind"] == "ebt_check")
    assert check["status"] == "ok" and check["energy_head_grad_norm"] > 0
    bf16 = check["variants"]["bf16"]  # TF32 exists on GPUs only
    assert bf16["pass"] and bf16["tolerance"] == gpu.EBT_CHECK_TOLERANCES["bf16"]
    # it really ran in lower precision, and stayed within the stated tolerance
    assert 0 < bf16["loss_rel_err"] <= bf16["tolerance"]["loss"]
    assert 0 < bf16["energy_head_grad_rel_err"] <= bf16["max_grad_rel_err"] <= bf16["tolerance"]["grads"]
    assert "second-order check**: ok" in markdown and "| bf16 |" in markdown


def test_markdown_has_one_row_per_case(tiny_report):
    report, markdown = tiny_report
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and " ok |" in line]
    assert len(rows) == sum(c["kind"] == "throughput" for c in report["cases"])
    for case in report["cases"]:
        if case["kind"] == "throughput":
            assert f"| {case['case']} | ok | 4 x 64 |" in markdown


def test_spent_budget_skips_cases_and_still_writes_reports(tmp_path, capsys):
    handlers = [signal.getsignal(signum) for signum in gpu.STOP_SIGNALS]
    assert gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--budget-s", "1"]) == 0
    assert [signal.getsignal(signum) for signum in gpu.STOP_SIGNALS] == handlers  # the caller's again
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert {c["status"] for c in report["cases"]} == {"skipped"}
    assert "skipped: run budget spent" in (tmp_path / "gpu.md").read_text()


def test_worker_past_its_deadline_is_killed_and_its_cases_reported(tmp_path):
    cases = gpu.tiny_plan()[:2]
    settings = gpu.Settings(device="cpu", vocab_size=512, warmup=1, steps=2, case_seconds=1, peak_tflops=None)
    start = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        records = list(gpu.run_group(cases, settings, deadline=start + 1.0, log=log))
    assert time.monotonic() - start < 30
    assert [(r["case"], r["status"]) for r in records if "case" in r] == [(c.name, "timeout") for c in cases]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_stops_the_worker_and_reports_the_cases_as_stopped(signum, tmp_path):
    """Ctrl-C or a scheduler's SIGTERM to the benchmark: its worker, in a session of its own that
    the signal does not reach, must not keep the device busy, and the report says what happened."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--out", str(tmp_path),
                             "--only", "transformer_pp"], cwd=runs.REPO, env=runs.child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    runs.wait_for(lambda: runs.process_tree(proc.pid)[1:], "the worker started", proc)
    worker = runs.process_tree(proc.pid)[1]
    time.sleep(1.0)  # into the worker's imports
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, out + err
    assert err.strip() == (f"error: stopped by {signal.Signals(signum).name}; {tmp_path / 'gpu.json'} and "
                           "gpu.md report the cases finished before it")
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert {(c["status"], c["error"]) for c in report["cases"]} == {
        ("stopped", f"stopped by {signal.Signals(signum).name}")}
    markdown = (tmp_path / "gpu.md").read_text()
    assert f"| transformer_pp-tiny ac=off | stopped: stopped by {signal.Signals(signum).name} |" in markdown


def test_a_worker_stopped_by_the_scheduler_reports_its_cases_as_stopped(tmp_path):
    """Under Slurm the job's SIGTERM reaches the worker too: the case it was running and the
    ones after it are reported as stopped, not as a crash."""
    cases = [c for c in gpu.tiny_plan() if c.name.startswith("gpt-tiny")]
    settings = gpu.Settings(device="cpu", vocab_size=512, warmup=1, steps=2, case_seconds=60, peak_tflops=None)
    with open(tmp_path / "log", "w") as log:
        records = gpu.run_group(cases, settings, deadline=time.monotonic() + 120, log=log)
        assert "environment" in next(records)  # the worker is set up and starts the first case,
        time.sleep(1.0)  # which builds an engine for seconds
        os.kill(runs.process_tree(os.getpid())[1], signal.SIGTERM)  # the worker, this process's only child
        rest = list(records)
    assert [(r["case"], r["status"], r["error"]) for r in rest] == [
        (cases[0].name, "stopped", "stopped by SIGTERM"), (cases[1].name, "stopped", "worker stopped by SIGTERM")]


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu"], "need a GPU"), (["--device", "cpu", "--tiny", "--only", "nothing"], "matches no case")])
def test_bad_invocations_exit_2_with_one_line(args, message, tmp_path, capsys):
    assert gpu.main(args + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
