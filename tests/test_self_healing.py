"""A job that heals itself, on 2 processes of one host under launch/torchrun.sh: a rank killed
with SIGKILL is restarted in place and the run ends with the uninterrupted run's losses; the
restarts, used up, end the job in one line; a rank stuck in a data read is ended by its watchdog
with its threads' stacks, and restarted; a slow rank is named. (The same restart on the Slurm
cluster: tests/test_cluster.py.)"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainer_runs as runs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

N_STEPS = 16
RUN = ["train.max_steps=16", "checkpoint.interval=4", "data.num_workers=2"]
"""Every run here: 16 steps, a checkpoint every 4, the loader's default workers."""


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted 2-process run: its per-step losses, and its output (a clean run)."""
    name = "healing-reference"
    done = subprocess.run(runs.train_command([f"run_name={name}", *RUN]), env=runs.child_env(), cwd=runs.REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return runs.scalars(name, "train/loss"), done.stdout + done.stderr


def launch(name: str, *overrides: str, restarts: int, log: Path) -> subprocess.Popen:
    """launch/torchrun.sh with 2 processes on this host, its output (both streams) into `log`."""
    env = runs.child_env(NPROC_PER_NODE="2", RESTARTS=str(restarts), PYTHON=sys.executable, GRACE_SECONDS="5")
    return subprocess.Popen(["bash", "launch/torchrun.sh", str(runs.base_config_file()), f"run_name={name}", *RUN,
                             *overrides], env=env, cwd=runs.REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            preexec_fn=runs.lower_priority, start_new_session=True)


def rank_pid(launcher: subprocess.Popen, rank: int, other_than: int = 0) -> int | None:
    """The pid of the trainer process of `rank` under `launcher` (not its data workers)."""
    for pid in runs.process_tree(launcher.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            comm = Path(f"/proc/{pid}/comm").read_bytes()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # (the trainer's resource tracker and loader workers inherit its environment)
        trainer = b"pretrain.train" in command and b"pt_data_worker" not in comm
        if f"RANK={rank}".encode() in environ and trainer and pid != other_than:
            return pid
    return None


def finish(launcher: subprocess.Popen, log: Path) -> str:
    try:
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            for pid in runs.process_tree(launcher.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        launcher.wait()
        runs.remove_leaked_shared_memory()
    return log.read_text()


def assert_same_losses(name: str, reference) -> None:
    losses, expected = runs.scalars(name, "train/loss"), reference[0]
    assert sorted(losses) == sorted(expected) == list(range(1, N_STEPS + 1))
    for step in expected:
        assert losses[step] == expected[step], f"step {step}: {losses[step]!r} != {expected[step]!r}"


def hold_at(step: int, hold: Path) -> list[str]:
    hold.touch()
    return [f"fault.step_stall_file={hold}", f"fault.step_stall_from={step}"]


def test_a_rank_killed_mid_run_is_restarted_in_place_and_the_run_ends_as_if_uninterrupted(reference, tmp_path):
    name, log, hold = "healed-kill", tmp_path / "job.log", tmp_path / "hold"
    launcher = launch(name, *hold_at(10, hold), restarts=2, log=log)
    checkpoint = runs.run_dir(name) / "ckpt" / "step_00000008" / "complete.json"
    runs.wait_for(checkpoint.exists, "the step-8 checkpoint", launcher)
    victim = rank_pid(launcher, 1)
    os.kill(victim, signal.SIGKILL)  # during step 9, or held before step 10
    hold.unlink()
    out = finish(launcher, log)
    assert launcher.returncode == 0, out[-3000:]
    restarts = [line for line in out.splitlines() if "restarting" in line]
    assert restarts == [f"torchrun: rank 1 (pid {victim}) on {socket.gethostname()} died of SIGKILL; restarting "
                        "this node's ranks from the newest complete checkpoint (restart 1 of 2)"], out[-3000:]
    assert "resuming at step 8" in out and "Traceback" not in out
    assert_same_losses(name, reference)


def test_restarts_used_up_end_the_job_in_one_line(tmp_path):
    name, log, hold = "healed-twice", tmp_path / "job.log", tmp_path / "hold"
    launcher = launch(name, *hold_at(6, hold), restarts=1, log=log)
    checkpoint = runs.run_dir(name) / "ckpt" / "step_00000004" / "complete.json"
    runs.wait_for(checkpoint.exists, "the step-4 checkpoint", launcher)
    first = rank_pid(launcher, 1)
    os.kill(first, signal.SIGKILL)
    runs.wait_for(lambda: "restart 1 of 1" in log.read_text() and rank_pid(launcher, 1, other_than=first),
                  "the restarted rank 1", launcher)
    second = rank_pid(launcher, 1, other_than=first)
    os.kill(second, signal.SIGKILL)
    out = finish(launcher, log)
    assert launcher.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last == (f"error: torchrun: rank 1 (pid {second}) on {socket.gethostname()} died of SIGKILL, and the 1 "
                    "in-job restart(s) allowed (--max-restarts) are used up: the job ends with exit code 1"), \
        out[-3000:]
    assert out.count("restarting this node's ranks") == 1


def test_a_rank_stuck_in_a_read_is_ended_by_its_watchdog_with_its_stacks_and_restarted(reference, tmp_path):
    name, log = "healed-hang", tmp_path / "job.log"
    launcher = launch(name, "fault.hang_read_rank=1", "fault.hang_read_step=10", "train.hang_min_s=3",
                      "train.hang_factor=5", restarts=1, log=log)
    started = time.monotonic()
    out = finish(launcher, log)
    assert launcher.returncode == 0, out[-3000:]
    assert time.monotonic() - started < 200
    # rank 1's own account: every thread's stack, the blocked read on top of the main thread's
    assert "rank 1: watchdog: the stack of each thread" in out
    assert "in stuck_network_read" in out and "in read" in out and "in train_step" in out
    hung = next(line for line in out.splitlines() if line.startswith("error: rank 1 on"))
    assert f"error: rank 1 on {socket.gethostname()} hung: no step completed in" in hung
    assert "last seen reading its data" in hung and "exit code 124" in hung
    assert "rank 0: watchdog" not in out, "the rank waiting for the stuck one reported too"
    restarts = [line for line in out.splitlines() if "restarting" in line]
    assert len(restarts) == 1, out[-3000:]
    assert restarts[0].startswith("torchrun: rank 1 (pid ") and restarts[0].endswith("(restart 1 of 1)")
    assert "hung: its watchdog ended it" in restarts[0]
    assert "resuming at step 8" in out
    assert_same_losses(name, reference)


def test_a_slow_rank_is_named_and_a_clean_run_names_none(reference):
    name = "lagging"
    # one micro-batch per step: no gradient reduction before the step's all-reduce, where the
    # fast rank would already wait for the slow one
    command = runs.train_command([f"run_name={name}", *RUN, "train.global_batch_size=4", "fault.slow_rank=1",
                                  "fault.slow_rank_s=0.2"])
    done = subprocess.run(command, env=runs.child_env(), cwd=runs.REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "is a straggler" in line]
    # once per run of slow intervals: on a busy host the ratio may dip below the factor in between
    assert warnings and all(line.startswith(f"warning: rank 1 on {socket.gethostname()} is a straggler")
                            for line in warnings), warnings
    ratios, slowest = runs.scalars(name, "train/straggler_ratio"), runs.scalars(name, "train/slowest_rank_ms")
    assert sorted(ratios) == sorted(slowest) == list(range(1, N_STEPS + 1))
    assert all(ms > 200 for ms in slowest.values())
    assert sorted(ratios.values())[N_STEPS // 2] > 1.5

    assert "is a straggler" not in reference[1]
    assert runs.scalars("healing-reference", "train/straggler_ratio")
