"""Launching a sweep: its unfinished runs one after another on this machine, or a Slurm job
array over `launch/slurm.sbatch`. Both go through the project's launchers, so a sweep run is
an ordinary training run (resumed from its run directory if it was interrupted)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pretrain.scaling.sweep import RunSpec, Sweep, expand, is_finished, write_run_configs

REQUEUE_EXIT_CODE = 75
"""The trainer's exit code after a preemption signal: the run saved a checkpoint to resume from."""


def plan(sweep: Sweep) -> list[tuple[RunSpec, Path]]:
    """Expand the sweep, write every run's config, print the plan; return the unfinished runs."""
    runs = expand(sweep)
    config_paths = write_run_configs(sweep, runs)
    todo = [(r, p) for r, p in zip(runs, config_paths) if not is_finished(sweep, r)]
    print(f"sweep {sweep.name}: {len(runs)} runs, {len(runs) - len(todo)} finished, "
          f"{len(todo)} to run; configs in {sweep.directory / 'configs'}")
    for run in runs:
        state = "done" if is_finished(sweep, run) else "todo"
        print(f"  {state}  {run.run_name:<48} N={run.non_embedding_params:<10,d} "
              f"tokens={run.max_tokens:,d}")
    return todo


def run_locally(sweep: Sweep, todo: list[tuple[RunSpec, Path]]) -> int:
    """Train the runs in order; returns 0 when all finished, the requeue code when one was
    interrupted (the rest is left for the next call), 1 when some failed."""
    failed = []
    env = {**os.environ, "NPROC_PER_NODE": str(sweep.nproc_per_node), "PYTHON": sys.executable}
    for i, (run, config_path) in enumerate(todo, 1):
        resuming = (sweep.directory / run.run_name).exists()
        print(f"[{i}/{len(todo)}] {'resuming' if resuming else 'starting'} {run.run_name}",
              flush=True)
        rc = subprocess.run(_command(sweep, config_path), env=env).returncode
        if rc == REQUEUE_EXIT_CODE:
            print(f"{run.run_name} was interrupted and checkpointed; rerun the sweep to resume it")
            return rc
        if rc != 0 or not is_finished(sweep, run):
            failed.append(f"{run.run_name} (exit code {rc})")
    if failed:
        print("failed runs (rerun the sweep to resume them):\n  " + "\n  ".join(failed),
              file=sys.stderr)
        return 1
    return 0


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
    command = ["sbatch", f"--array={array}", f"--job-name={sweep.name}", f"--nodes={spec.nodes}",
               f"--gpus-per-node={spec.gpus_per_node}", f"--time={spec.time}", *spec.extra_args,
               "launch/slurm.sbatch", str(runs_file)]
    script = sweep.directory / "submit.sh"
    script.write_text("#!/usr/bin/env bash\n# Run from the repository root.\nset -euo pipefail\n"
                      + " ".join(command) + "\n")
    script.chmod(0o755)
    return script
