"""One trainer per run directory: a second trainer (or launch check) on a live run stops before
any work with one line naming the holder; the lock dies with its holder, so a requeue after
kill -9 resumes as before."""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

import trainer_runs as runs
from conftest import run_at_once
from pretrain.training.runlock import CHECK_WAIT_S, RunLock, hold_run, lock_file

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


def test_a_live_run_is_held_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    name = "held"
    log = tmp_path / "holder.log"
    # the holder trains far beyond the test, saving a checkpoint every 2 steps
    holder = subprocess.Popen(
        runs.train_command([f"run_name={name}", "train.max_steps=100000", "checkpoint.interval=2",
                            "data.num_workers=0"], nproc=1),
        env=runs.child_env(), cwd=runs.REPO, stdout=subprocess.DEVNULL, stderr=log.open("w"),
        preexec_fn=runs.lower_priority)
    try:
        runs.wait_for(lambda: (runs.run_dir(name) / "ckpt" / "latest").exists(), "the holder's first checkpoint",
                      holder)
        holder_says = f"host {socket.gethostname()}, pid {holder.pid}"

        # a second job on the same run, as torchrun starts it: both ranks stop, exit 2
        launch = runs.train_command([f"run_name={name}", "train.max_steps=100000"])
        launch[launch.index("torch.distributed.run")] = "pretrain.torchrun"  # exits with the trainer's code
        second = subprocess.run(launch,
                                env=runs.child_env(), cwd=runs.REPO, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        line = one_error_line(second.stderr)
        assert "is in use by another trainer" in line and holder_says in line and "started" in line, line

        # the launcher's check says the same, in one process
        check = runs.train_here(["--check", f"run_name={name}"])
        assert check.returncode == 2 and holder_says in one_error_line(check.stderr)
        # except on the nodes after the first of a multi-node launch, where the holder can be the
        # job's own rank 0 (started before this node's check): node 0's check asks
        assert runs.train_here(["--check", "--node-rank", "1", f"run_name={name}"]).returncode == 0
        # and resume=restart does not move a live run aside
        restart = runs.train_here([f"run_name={name}", "resume=restart"])
        assert restart.returncode == 2 and holder_says in one_error_line(restart.stderr)
        assert runs.run_dir(name).is_dir() and not list(runs.run_dir(name).parent.glob(f"{name}.replaced-*"))
        assert holder.poll() is None, "the holder was disturbed"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()

    # a requeue after kill -9 finds the lock free and resumes from the holder's checkpoint
    latest = int((runs.run_dir(name) / "ckpt" / "latest").read_text().strip().rsplit("_", 1)[1])
    resumed = runs.train_here([f"run_name={name}", f"train.max_steps={latest + 2}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at step {latest}" in resumed.stderr + resumed.stdout


def test_the_checks_of_a_jobs_nodes_never_fail_each_other(tmp_path):
    """Each node of a multi-node launch runs its check at about the same instant (a requeue
    starts them together): checks take the lock shared, so they never find each other holding
    it, and a trainer starting while checks hold it waits for them."""
    run_dir = tmp_path / "run"
    lock_file(run_dir).touch()  # a run that had a trainer once: the checks do take the lock

    def checks():
        for _ in range(300):
            hold_run(run_dir, rank=0, checking_only=True)
        return "ok"

    assert run_at_once(checks, processes=3) == ["ok"] * 3

    check = os.open(lock_file(run_dir), os.O_RDONLY)
    fcntl.flock(check, fcntl.LOCK_SH)  # a check, holding on for longer than any does
    trainer = RunLock(run_dir)

    def let_go():
        time.sleep(0.5)
        os.close(check)
    threading.Thread(target=let_go).start()
    started = time.monotonic()
    assert trainer.acquire() and 0.4 < time.monotonic() - started < CHECK_WAIT_S
    trainer.release()
