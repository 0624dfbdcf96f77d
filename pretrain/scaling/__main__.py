"""Command line of pretrain.scaling (see the package docstring)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pretrain.scaling import report, sweep as sweeps
from pretrain.scaling.registry import load_registry

REQUEUE_EXIT_CODE = 75
"""The trainer's exit code after a preemption signal: stop the sweep, the run resumes later."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.scaling", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_run = sub.add_parser("run", help="run a sweep's unfinished runs one after another")
    p_run.add_argument("sweep", help="sweep YAML, e.g. configs/scaling/tiny.yaml")
    p_run.add_argument("--slurm", action="store_true",
                       help="write a Slurm job array for the unfinished runs instead of running")
    p_run.add_argument("--dry-run", action="store_true", help="write configs, print the plan")

    p_list = sub.add_parser("list", help="list finished and unfinished runs")
    p_list.add_argument("dirs", nargs="+", help="run directories or directories holding runs")

    p_fit = sub.add_parser("fit", help="fit scaling laws over finished runs")
    p_fit.add_argument("dirs", nargs="+", help="run directories or directories holding runs")
    p_fit.add_argument("--out", default="checkpoints/scaling/fit",
                       help="output directory (fits.md, fits.csv, scaling.png, tb/)")
    p_fit.add_argument("--metric", default="best_val_loss", choices=report.METRICS)
    p_fit.add_argument("--baseline", default="gpt",
                       help="group whose log-log slope the others are compared to")
    p_fit.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    p_fit.add_argument("--seed", type=int, default=0, help="bootstrap seed")

    args = parser.parse_args(argv)
    try:
        return {"run": _run, "list": _list, "fit": _fit}[args.command](args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    sweep = sweeps.load_sweep(args.sweep)
    runs = sweeps.expand(sweep)
    config_paths = sweeps.write_run_configs(sweep, runs)
    todo = [(r, p) for r, p in zip(runs, config_paths) if not sweeps.is_finished(sweep, r)]
    print(f"sweep {sweep.name}: {len(runs)} runs, {len(runs) - len(todo)} finished, "
          f"{len(todo)} to run; configs in {sweep.directory / 'configs'}")
    for run in runs:
        state = "done" if sweeps.is_finished(sweep, run) else "todo"
        print(f"  {state}  {run.run_name:<48} N={run.non_embedding_params:<10,d} "
              f"tokens={run.max_tokens:,d}")
    if args.slurm:
        script = write_slurm_array(sweep, [p for _, p in todo])
        print(f"job array written: submit with\n  bash {script}" if script else "nothing to submit")
        return 0
    if args.dry_run:
        return 0
    failed = []
    for i, (run, path) in enumerate(todo, 1):
        resuming = (sweep.directory / run.run_name).exists()
        print(f"[{i}/{len(todo)}] {'resuming' if resuming else 'starting'} {run.run_name}",
              flush=True)
        rc = subprocess.run(launch_command(sweep, path), env=_launch_env(sweep)).returncode
        if rc == REQUEUE_EXIT_CODE:
            print(f"{run.run_name} was interrupted and checkpointed; rerun the sweep to resume")
            return rc
        if rc != 0 or not sweeps.is_finished(sweep, run):
            failed.append(f"{run.run_name} (exit code {rc})")
    if failed:
        print("failed runs (rerun the sweep to resume them):\n  " + "\n  ".join(failed),
              file=sys.stderr)
        return 1
    print(f"all runs finished; fit with: python -m pretrain.scaling fit {sweep.directory}")
    return 0


def launch_command(sweep: sweeps.Sweep, config_path: Path) -> list[str]:
    """The trainer under the project's torchrun launcher (one process per slot)."""
    return ["bash", "launch/torchrun.sh", str(config_path)]


def _launch_env(sweep: sweeps.Sweep) -> dict[str, str]:
    return {**os.environ, "NPROC_PER_NODE": str(sweep.nproc_per_node), "PYTHON": sys.executable}


def write_slurm_array(sweep: sweeps.Sweep, config_paths: list[Path]) -> Path | None:
    """Write SWEEP_DIR/slurm_runs.txt (one config per line, for launch/slurm.sbatch) and
    SWEEP_DIR/submit.sh (the sbatch call); None when every run is finished."""
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


def _print_registry(registry) -> None:
    print(f"{'run':<48} {'group':<14} {'N':>11} {'tokens':>12} {'FLOPs':>10} "
          f"{'train':>7} {'best val':>8}")
    for run_dir, r in registry.records:
        best = f"{r.best_val_loss:8.4f}" if r.best_val_loss is not None else f"{'-':>8}"
        print(f"{r.run_name:<48} {registry.group_of(run_dir, r):<14} "
              f"{r.non_embedding_params:>11,d} {r.tokens_seen:>12,d} {r.train_flops:>10.3g} "
              f"{r.final_train_loss:>7.4f} {best}")
    for line in registry.problems():
        print(line)


def _list(args) -> int:
    _print_registry(load_registry(args.dirs))
    return 0


def _fit(args) -> int:
    registry = load_registry(args.dirs)
    _print_registry(registry)
    if not registry.records:
        raise ValueError(f"no finished runs (summary.json) under {' '.join(args.dirs)}")
    groups, skipped = report.collect_points(registry, args.metric)
    for line in skipped:
        print(line)
    if not groups:
        raise ValueError(f"no run has a usable {args.metric}")
    fits = report.fit_groups(groups, baseline=args.baseline, n_bootstrap=args.bootstrap,
                             seed=args.seed)
    for fit in fits:
        for note in fit.notes:
            print(f"{fit.group} L({fit.law.symbol}): {note}")
    if args.baseline not in groups:
        print(f"baseline group {args.baseline!r} not among the runs: no slope comparison")
    header = (f"Scaling fits over {len(registry.records)} runs ({args.metric}); "
              f"{len(registry.missing) + len(registry.invalid)} listed run(s) skipped.\n\n")
    report.write_outputs(Path(args.out), groups, fits, args.baseline, header)
    print()
    print(report.to_markdown(fits, args.baseline))
    print(f"wrote {args.out}/fits.md, fits.csv, scaling.png; "
          f"tensorboard --logdir {args.out}/tb")
    return 0


if __name__ == "__main__":
    sys.exit(main())
