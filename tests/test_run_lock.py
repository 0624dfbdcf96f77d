"""One trainer per run directory: a second trainer (or launch check) on a live run stops before
any work with one line naming the holder; the lock dies with its holder, so a requeue after
kill -9 resumes as before."""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainer_runs as runs
from conftest import run_at_once
from pretrain.config import ConfigError
from pretrain.training.runlock import CHECK_WAIT_S, RunLock, hold_run, lock_file, lock_whole_file

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


def test_a_rerun_right_after_kill_9_resumes_though_the_data_workers_live_on(tmp_path):
    """kill -9 of a launcher and its ranks leaves their DataLoader workers alive for a while (they
    notice a dead parent within seconds): the lock died with rank 0 all the same, so the same
    command run at once resumes. The workers are kept stopped (SIGSTOP) through the rerun, the
    longest they could linger; an flock would still be theirs."""
    name = "killed-then-rerun"  # (test_train_preemption's "killed" may share this process's workspace)
    command = runs.train_command([f"run_name={name}", "train.max_steps=100000", "checkpoint.interval=2",
                                  "data.num_workers=2"])
    command[command.index("torch.distributed.run")] = "pretrain.torchrun"
    log = tmp_path / "killed.log"
    launcher = subprocess.Popen(command, env=runs.child_env(), cwd=runs.REPO, stdout=subprocess.DEVNULL,
                                stderr=log.open("w"), preexec_fn=runs.lower_priority)
    data_workers = []
    try:
        runs.wait_for(lambda: (runs.run_dir(name) / "ckpt" / "step_00000004" / "complete.json").exists(),
                      "the second checkpoint", launcher)
        # the loader forks its workers anew at each epoch: wait until this one's are there
        runs.wait_for(lambda: any(b"pt_data_worker" in _command_name(pid) for pid in runs.process_tree(launcher.pid)),
                      "the DataLoader workers", launcher)
        tree = runs.process_tree(launcher.pid)
        data_workers = [pid for pid in tree if b"pt_data_worker" in _command_name(pid)]
        for pid in data_workers:
            os.kill(pid, signal.SIGSTOP)
        for pid in tree:
            if pid not in data_workers:
                os.kill(pid, signal.SIGKILL)
        launcher.wait()

        latest = int((runs.run_dir(name) / "ckpt" / "latest").read_text().strip().rsplit("_", 1)[1])
        rerun = subprocess.run([*command[:-1], f"train.max_steps={latest + 2}"], env=runs.child_env(),
                               cwd=runs.REPO, capture_output=True, text=True, timeout=300)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert f"resuming at step {latest}" in rerun.stderr + rerun.stdout
    finally:
        for pid in runs.process_tree(launcher.pid) + data_workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
        runs.remove_leaked_shared_memory()


def _command_name(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "comm").read_bytes()
    except OSError:
        return b""


def test_a_lock_kept_by_another_process_than_the_trainer_it_names_says_so(tmp_path):
    """The lock file names a trainer of this host that has ended, while another process holds the
    lock: the line names that process, not the dead trainer as if it were running."""
    run_dir = tmp_path / "run"
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from pretrain.training.runlock import RunLock; lock = RunLock(Path(sys.argv[1])); lock.acquire(); "
         "print('held', flush=True); time.sleep(600)", str(run_dir)],
        env=runs.child_env(), cwd=runs.REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        dead_pid = _a_dead_pid()  # a pid of this host that no longer runs
        lock_file(run_dir).write_text(f"host {socket.gethostname()}, pid {dead_pid}, started {started}\n")
        with pytest.raises(ConfigError) as refused:
            RunLock(run_dir).acquire()
        line = str(refused.value)
        assert f"is in use by pid {holder.pid} (" in line and "pretrain.training.runlock" in line, line
        assert f"not by the trainer the lock file names (host {socket.gethostname()}, pid {dead_pid}" in line, line
        assert "which has ended" in line, line
    finally:
        holder.kill()
        holder.wait()


def _a_dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


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

    # a check in another process (record locks are per process), holding on longer than any does
    check = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; from pretrain.training.runlock import lock_whole_file; "
         "fd = os.open(sys.argv[1], os.O_RDONLY); lock_whole_file(fd, fcntl.F_RDLCK); print('held', flush=True); "
         "time.sleep(0.5)", str(lock_file(run_dir))],
        env=runs.child_env(), cwd=runs.REPO, stdout=subprocess.PIPE, text=True)
    assert check.stdout.readline().strip() == "held"
    trainer = RunLock(run_dir)
    started = time.monotonic()
    assert trainer.acquire() and 0.4 < time.monotonic() - started < CHECK_WAIT_S
    check.wait()
    trainer.release()
