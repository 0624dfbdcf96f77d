"""Command line of pretrain.scaling (see the package docstring)."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from pretrain.scaling import launch, report
from pretrain.scaling.experiments import EXPERIMENTS
from pretrain.scaling.registry import load_registry
from pretrain.scaling.sweep import load_sweep


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

    p_exp = sub.add_parser("experiment", help="train and evaluate one of the papers' small "
                                              "experiments (see pretrain/scaling/experiments)")
    p_exp.add_argument("name", choices=EXPERIMENTS)

    args = parser.parse_args(argv)
    try:
        command = {"run": _run, "list": _list, "fit": _fit, "experiment": _experiment}
        return command[args.command](args)
    except (ValueError, launch.SweepFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    sweep = load_sweep(args.sweep)
    planned = launch.plan(sweep)
    if args.slurm:
        script = launch.write_slurm_array(sweep, [p for _, p in launch.unfinished(sweep, planned)])
        print(f"job array written; submit with: bash {script}" if script else "nothing to submit")
        return 0
    if args.dry_run:
        return 0
    rc = launch.run_locally(sweep, planned)
    if rc == 0:
        print(f"all runs finished; fit with: python -m pretrain.scaling fit {sweep.directory}")
    return rc


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


def _experiment(args) -> int:
    module = importlib.import_module(f"pretrain.scaling.experiments.{args.name}")
    return module.main()


if __name__ == "__main__":
    sys.exit(main())
