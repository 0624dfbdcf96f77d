"""Interrupted runs on 2 processes: kill -9 mid-training and resume; an interrupted checkpoint
write is skipped; SIGUSR1 (Slurm's warning) saves and exits with the requeue code under an
srun-style launch. Each resumed run must reproduce the uninterrupted matrix run's per-step
losses exactly. A preempted compiled run leaves its compiled graphs to the requeued job."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import trainer_runs as runs
from pretrain.training.engine import COMPILE_CACHE_FILE
from pretrain.training.stopping import EXIT_PREEMPTED


@pytest.fixture(scope="module")
def matrix():
    return runs.resume_matrix()


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"run ended (code {proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.005)


def marker(name: str, step: int) -> Path:
    return runs.run_dir(name) / "ckpt" / f"step_{step:08d}" / "complete.json"


def assert_same_losses(name: str, family: str, stage: int) -> None:
    reference = runs.scalars(runs.reference_name(family, stage), "train/loss")
    losses = runs.scalars(name, "train/loss")
    assert sorted(losses) == sorted(reference)
    for step in reference:
        assert losses[step] == reference[step], f"step {step}: {losses[step]!r} != {reference[step]!r}"


def test_kill_9_during_training_then_resume(matrix, tmp_path):
    family, stage, name = "nrgpt", 2, "killed"
    command = runs.train_command(runs.run_overrides(family, stage) + [f"run_name={name}"])
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(command, env=runs.child_env(), cwd=runs.REPO, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=runs.lower_priority)
        try:
            wait_for(marker(name, runs.CKPT_INTERVAL), proc)
        finally:
            kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL
    runs.remove_leaked_shared_memory()
    assert not (runs.run_dir(name) / "summary.json").exists(), "the run finished before the kill"

    # What a kill in the middle of writing the next checkpoint leaves: files, one truncated,
    # and no completion marker.
    ckpt = runs.run_dir(name) / "ckpt"
    complete = sorted(p for p in ckpt.glob("step_*") if (p / "complete.json").exists())
    newest = complete[-1]
    assert int(newest.name[5:]) < runs.N_STEPS, "killed too late to leave any step to resume"
    broken = ckpt / f"step_{int(newest.name[5:]) + runs.CKPT_INTERVAL:08d}"
    if broken.exists():
        shutil.rmtree(broken)
    shutil.copytree(newest, broken)
    (broken / "complete.json").unlink()
    shard = broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])

    result = subprocess.run(command, env=runs.child_env(), cwd=runs.REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"skipping incomplete checkpoint {broken}" in result.stderr
    assert f"resuming at step {int(newest.name[5:])}" in result.stdout
    assert (marker(name, runs.N_STEPS)).exists() and (broken / "complete.json").exists()
    assert_same_losses(name, family, stage)


def test_a_preempted_compiled_run_leaves_its_graphs_to_the_requeued_job(tmp_path):
    """SIGTERM (as Slurm sends it to a preempted job's processes) stops a compiled run with its
    checkpoint saved, and rank 0 saves the graphs the job compiled beside it; the requeued job,
    with an empty inductor cache as on other nodes, loads them before its first step. One
    process: only rank 0 writes the file, and every rank compiles the same graphs."""
    name = "preempted-compiled"
    overrides = runs.run_overrides("gpt", 2) + [f"run_name={name}", "model.compile=inductor"]
    command = runs.train_command(overrides, nproc=1)
    with Runs(tmp_path) as started:
        proc = started.start(command, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "first-nodes"))
        wait_for(marker(name, runs.CKPT_INTERVAL), proc)
        proc.send_signal(signal.SIGTERM)
        ((code, out, err),) = started.finish([proc])
        assert code != 0 and "on SIGTERM: checkpoint saved, exit code 75" in out, err[-3000:]
        cache = runs.run_dir(name) / COMPILE_CACHE_FILE
        assert cache.stat().st_size > 0
        ((code, out, err),) = started.finish([started.start(command, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "other-nodes"))])
    assert code == 0, err[-3000:]
    assert "resuming at step" in out and f"compiled graph(s) from {cache}" in out


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in runs.process_tree(proc.pid):  # the launcher, the trainers, their loader workers
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class Runs:
    """Trainer processes writing to log files (a pipe nobody reads while the test waits for a
    checkpoint would block a chatty child), all killed with their children if the test fails
    before they exit."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs, self.logs = log_dir, [], []

    def start(self, command: list[str], **env) -> subprocess.Popen:
        n = len(self.procs)
        out, err = self.log_dir / f"{n}.out", self.log_dir / f"{n}.err"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            proc = subprocess.Popen(command, cwd=runs.REPO, stdout=stdout, stderr=stderr,
                                    preexec_fn=runs.lower_priority, env=runs.child_env(**env))
        self.procs.append(proc)
        self.logs.append((out, err))
        return proc

    def start_srun_style(self, command: list[str]) -> list[subprocess.Popen]:
        """Two trainer processes started the way `srun` starts tasks: rank from SLURM_PROCID."""
        port = str(runs.free_port())
        return [self.start(command, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                           SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port)
                for rank in (0, 1)]

    def finish(self, procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [(proc.returncode, *(path.read_text() for path in self.logs[self.procs.index(proc)]))
                for proc in procs]

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc)


@pytest.mark.parametrize("launcher", ["srun-SIGUSR1", "torchrun-SIGTERM"])
def test_preemption_signal_saves_and_exits_with_the_requeue_code(matrix, launcher, tmp_path):
    """srun-style: Slurm's SIGUSR1 reaches every process of rank 1 only (its loader worker
    too); both ranks stop after the same step and exit with the requeue code. torchrun: SIGTERM
    to torchrun, which passes it to each trainer's process group (loader workers included)."""
    family, stage, name = "gpt", 2, f"preempted-{launcher}"
    overrides = runs.run_overrides(family, stage) + [f"run_name={name}"]
    with Runs(tmp_path) as started:
        if launcher.startswith("srun"):
            procs = started.start_srun_style(runs.train_command(overrides, nproc=1))
            wait_for(marker(name, runs.CKPT_INTERVAL), procs[0])
            for pid in runs.process_tree(procs[1].pid):
                os.kill(pid, signal.SIGUSR1)
            (code0, out, err), (code1, _, _) = started.finish(procs)
            assert (code0, code1) == (EXIT_PREEMPTED, EXIT_PREEMPTED), err[-3000:]
            assert "another rank's signal" in out  # rank 0 stopped because rank 1 was told to
        else:
            proc = started.start(runs.train_command(overrides))
            wait_for(marker(name, runs.CKPT_INTERVAL), proc)
            proc.send_signal(signal.SIGTERM)
            ((code, out, err),) = started.finish([proc])
            assert code != 0 and "on SIGTERM: checkpoint saved, exit code 75" in out, err[-3000:]
        stopped = [int(line.split()[3]) for line in out.splitlines() if line.startswith("stopping at step")]
        assert len(stopped) == 1 and runs.CKPT_INTERVAL < stopped[0] < runs.N_STEPS
        assert marker(name, stopped[0]).exists() and not (runs.run_dir(name) / "summary.json").exists()

        resumed = started.finish(started.start_srun_style(runs.train_command(overrides, nproc=1)))
    assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-3000:]
    assert f"resuming at step {stopped[0]}" in resumed[0][1]
    assert_same_losses(name, family, stage)
