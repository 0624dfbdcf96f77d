"""Command line of pretrain.scaling (see the package docstring)."""
from __future__ import annotations

import importlib
import sys

from common.cli import ArgumentParser, run_command
from pretrain.scaling import launch, report
from pretrain.scaling.experiments import EXPERIMENTS
from pretrain.scaling.registry import load_registry
from pretrain.scaling.sweep import load_sweep

OVERRIDES_HELP = ("key.sub=value overrides of the sweep: a sweep key (e.g. flops=[1.0e11,3.0e11], "
                  "slurm.time=4:00:00) or a trainer key for every run (e.g. "
                  "train.global_batch_size=16)")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m pretrain.scaling", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    p_run = sub.add_parser("run", help="run a sweep's unfinished runs (or write a Slurm job array)")
    p_run.add_argument("sweep", help="sweep YAML, e.g. configs/scaling/shakespeare_char.yaml")
    p_run.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    p_run.add_argument("--slurm", action="store_true",
                       help="write a Slurm job array for the unfinished runs instead of running")
    p_run.add_argument("--dry-run", action="store_true", help="write configs, print the plan")

    p_list = sub.add_parser("list", help="list finished and unfinished runs")
    p_list.add_argument("dirs", nargs="+", help="run directories or directories holding runs")

    p_fit = sub.add_parser("fit", help="fit scaling laws over finished runs")
    p_fit.add_argument("dirs", nargs="+", help="run directories or directories holding runs")
    p_fit.add_argument("--out", default=None,
                       help="output directory (fits.md, fits.csv, *.png, tb/); default DIR/fit "
                            "for one sweep directory DIR, else checkpoints/scaling/fit")
    p_fit.add_argument("--metric", default="best_val_loss",
                       help="what the laws fit: best_val_loss, final_val_loss, final_train_loss "
                            "or any numeric key of summary.json (dotted for nested keys)")
    p_fit.add_argument("--higher-is-better", action="store_true",
                       help="the metric is an accuracy-like score in (0, 1): fit 1 - metric")
    p_fit.add_argument("--baseline", default="auto",
                       help="group every other group is compared to; auto: gpt for gpt_rec and "
                            "nrgpt, transformer_pp for ebt (by the runs' model family)")
    p_fit.add_argument("--params", default="non_embedding", choices=report.PARAM_COUNTS,
                       help="the N of the laws: non-embedding or all parameters")
    p_fit.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    p_fit.add_argument("--seed", type=int, default=0, help="bootstrap seed")

    p_exp = sub.add_parser("experiment", help="train and evaluate one of the papers' small "
                                              "experiments (see pretrain/scaling/experiments)")
    p_exp.add_argument("name", choices=EXPERIMENTS)
    p_exp.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)

    # Overrides may come before or after the options (argparse takes positionals in one run).
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if rest:
        args.overrides = args.overrides + rest
    try:
        command = {"run": _run, "list": _list, "fit": _fit, "experiment": _experiment}
        return command[args.command](args)
    except (ValueError, launch.SweepFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    sweep = load_sweep(args.sweep, args.overrides)
    # A local launch prepares what the configs can prepare; a job array needs every dataset
    # in place (one preparation, not one per task); a dry run only looks.
    datasets = "peek" if args.dry_run else "check" if args.slurm else "prepare"
    planned = launch.plan(sweep, datasets, slurm=args.slurm)
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


def _list(args) -> int:
    report.print_registry(load_registry(args.dirs))
    return 0


def _fit(args) -> int:
    return report.fit_command(report.FitOptions(
        dirs=args.dirs, out=args.out, metric=args.metric, higher_is_better=args.higher_is_better,
        baseline=args.baseline, params=args.params, n_bootstrap=args.bootstrap, seed=args.seed))


def _experiment(args) -> int:
    module = importlib.import_module(f"pretrain.scaling.experiments.{args.name}")
    return module.main(args.overrides)


if __name__ == "__main__":
    run_command(main)
