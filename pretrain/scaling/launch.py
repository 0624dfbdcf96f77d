"""Launching a sweep: its unfinished runs one after another on this machine, or a Slurm job
array over `launch/slurm.sbatch`. Both go through the project's launchers, so a sweep run is
an ordinary training run (resumed from its run directory if it was interrupted)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.cli import Stopped
from pretrain.scaling.sweep import RunSpec, Sweep, check_runs, expand, is_finished, write_run_configs

class SweepFailed(RuntimeError):
    """Some run of a sweep did not finish."""


REQUEUE_EXIT_CODE = 75
"""The trainer's exit code after a preemption signal: the run saved a checkpoint to resume from."""


def plan(sweep: Sweep, datasets: str = "peek", slurm: bool = False,
         runs: list[RunSpec] | None = None) -> list[tuple[RunSpec, Path]]:
    """Expand the sweep (`datasets`: see `sweep.DATASETS`), or take `runs` of it (an
    experiment's own selection), check the runs as the trainer will at launch (`slurm`: in a
    job array, else here), write every run's config and print the plan; return (run, config
    path) for every run, finished or not."""
    runs = expand(sweep, datasets) if runs is None else runs
    check_runs(sweep, runs, slurm)
    planned = list(zip(runs, write_run_configs(sweep, runs)))
    n_done = sum(is_finished(sweep, r) for r in runs)
    print(f"sweep {sweep.name}: {len(runs)} runs, {n_done} finished, {len(runs) - n_done} to "
          f"run; configs in {sweep.directory / 'configs'}")
    for run in runs:
        state = "done" if is_finished(sweep, run) else "todo"
        compute = f" C={run.flops_per_token * run.max_tokens:.3g}" if run.flops_per_token else ""
        print(f"  {state}  {run.run_name:<48} N={run.non_embedding_params:<10,d} "
              f"tokens={run.max_tokens:,d}{compute}")
    return planned


def unfinished(sweep: Sweep, planned: list[tuple[RunSpec, Path]]) -> list[tuple[RunSpec, Path]]:
    return [(run, path) for run, path in planned if not is_finished(sweep, run)]


class Trainers:
    """The sweep's running trainer processes. Once stopped, it starts no more, and a stop
    signal that reached the sweep alone (`kill PID`) is passed on to the running ones, so that
    they save a checkpoint, as they do when a scheduler or Ctrl-C signals every process."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.stopped = False

    def run(self, command: list[str], **popen_args) -> int | None:
        """The trainer's exit code, or None when the sweep was stopped before it started."""
        with self.lock:  # a stop either precedes this start or reaches this trainer
            if self.stopped:
                return None
            trainer = subprocess.Popen(command, **popen_args)
            self.running.add(trainer)
        try:
            return trainer.wait()
        finally:
            with self.lock:
                self.running.discard(trainer)

    def stop(self, signum: int | None = None) -> None:
        """Start no more trainers; pass `signum` on to the running ones."""
        with self.lock:
            self.stopped = True
            if signum:
                for trainer in self.running:
                    trainer.send_signal(signum)


def run_locally(sweep: Sweep, planned: list[tuple[RunSpec, Path]]) -> int:
    """Train the unfinished runs in order, `parallel_runs` at a time; returns 0 when all
    finished, the requeue code when one was interrupted or the sweep was stopped by SIGTERM or
    SIGUSR1 (nothing new is started after it; the running runs save a checkpoint), 1 when some
    failed."""
    todo = unfinished(sweep, planned)
    trainers = Trainers()

    def train(i: int, run: RunSpec, config_path: Path) -> int:
        rc = train_run(sweep, run, config_path, f"[{i}/{len(todo)}]", trainers)
        if rc == REQUEUE_EXIT_CODE:  # an interrupted run stops the sweep: start nothing new
            trainers.stop()
        return rc

    with ThreadPoolExecutor(sweep.parallel_runs) as pool:
        try:
            futures = [(run, pool.submit(train, i, run, path))
                       for i, (run, path) in enumerate(todo, 1)]
            codes = [(run, future.result()) for run, future in futures]
        except Stopped as stop:  # the pool's end waits for the running trainers to save
            trainers.stop(stop.signum)
            print(f"stopped by {signal.Signals(stop.signum).name}: the running runs save a checkpoint; "
                  "rerun the sweep to resume them", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # Ctrl-C reached the trainers too: they save
            trainers.stop()
            raise
    if trainers.stopped:
        return REQUEUE_EXIT_CODE
    failed = [f"{run.run_name} (exit code {rc})" for run, rc in codes if rc != 0]
    if failed:
        print("failed runs (rerun the sweep to resume them):\n  " + "\n  ".join(failed),
              file=sys.stderr)
        return 1
    return 0


def train_run(sweep: Sweep, run: RunSpec, config_path: Path, progress: str, trainers: Trainers) -> int:
    """Train (or resume) one run in a child process; its exit code, 1 if it exited 0 without
    writing summary.json, the requeue code if the sweep was stopped before it started."""
    if trainers.stopped:  # not announced as starting (`trainers.run` settles a stop racing the start)
        return REQUEUE_EXIT_CODE
    env = {**os.environ, "NPROC_PER_NODE": str(sweep.nproc_per_node), "PYTHON": sys.executable}
    if sweep.threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(sweep.threads_per_process)
    resuming = (sweep.directory / run.run_name).exists()
    log = None
    if sweep.parallel_runs > 1:  # interleaved output of several runs would be unreadable
        log = sweep.directory / "logs" / f"{run.run_name}.log"
        log.parent.mkdir(exist_ok=True)
    print(f"{progress} {'resuming' if resuming else 'starting'} {run.run_name}".lstrip()
          + (f" (output: {log})" if log else ""), flush=True)
    if log is None:
        rc = trainers.run(_command(sweep, config_path), env=env)
    else:
        with log.open("a") as out:
            rc = trainers.run(_command(sweep, config_path), env=env, stdout=out, stderr=subprocess.STDOUT)
    if rc is None:
        return REQUEUE_EXIT_CODE
    if log is not None and rc not in (0, REQUEUE_EXIT_CODE):
        print(f"{run.run_name} failed (exit code {rc}); last line of {log}: {_last_line(log)}", flush=True)
    if rc == REQUEUE_EXIT_CODE:
        print(f"{run.run_name} was interrupted and checkpointed; rerun the sweep to resume it")
    return rc or int(not is_finished(sweep, run))


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(empty)"


def _command(sweep: Sweep, config_path: Path) -> list[str]:
    if sweep.nproc_per_node == 1:
        # One process needs no torchrun (the trainer defaults the rendezvous variables), which
        # saves a Python start and a torch import per run: seconds each on a CPU sweep.
        return [sys.executable, "-m", "pretrain.train", "--config", str(config_path)]
    return ["bash", "launch/torchrun.sh", str(config_path)]


def write_slurm_array(sweep: Sweep, config_paths: list[Path]) -> Path | None:
    """Write SWEEP_DIR/slurm_runs.txt (one config per line, the list format of
    launch/slurm.sbatch) and SWEEP_DIR/submit.sh (the sbatch call); None when nothing is left."""
    if not config_paths:
        return None
    runs_file = sweep.directory / "slurm_runs.txt"
    runs_file.write_text("".join(f"{p}\n" for p in config_paths))
    spec = sweep.slurm
    array = f"0-{len(config_paths) - 1}" + (f"%{spec.max_parallel}" if spec.max_parallel else "")
    # the options README's launch/slurm.sbatch lines take, each only where the sweep sets it
    command = ["sbatch", f"--array={array}", f"--job-name={sweep.name}", f"--nodes={spec.nodes}",
               *([f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []),
               *([f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else []),
               *([f"--export=ALL,PROCS_PER_NODE={spec.procs_per_node}"] if spec.procs_per_node else []),
               f"--time={spec.time}", *spec.extra_args, "launch/slurm.sbatch", str(runs_file)]
    script = sweep.directory / "submit.sh"
    script.write_text("#!/usr/bin/env bash\n# Run from the repository root.\nset -euo pipefail\n"
                      + " ".join(command) + "\n")
    script.chmod(0o755)
    return script
