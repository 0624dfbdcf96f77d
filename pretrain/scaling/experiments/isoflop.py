"""IsoFLOP study (Chinchilla's approach 2) of GPT, NRGPT, EBT and Transformer++ on
character-level Shakespeare, then the fits of `python -m pretrain.scaling fit` over its runs:
the IsoFLOP parabolas, N*(C) ~ C^a and D*(C) ~ C^b with bootstrap intervals, the loss
against compute, parameters and tokens, and each family against its baseline.

The sweep (configs/scaling/isoflop.yaml) names the families, a ladder of sizes, the compute
budgets and a starting grid of learning rates. Three phases, each through the sweep runner
(`parallel_runs` at a time; a rerun skips finished runs and resumes an interrupted one):

1. Learning rates: every size of every family at its smallest budget with each rate of the
   grid; where the best rate is the grid's smallest or largest, the grid is widened by a
   factor 2 on that side and the new rate run, until the best is inside (at most
   MAX_WIDENINGS times). Each size then trains at its own best rate at every budget.
2. Budgets: budget i runs the sizes i .. i + WINDOW - 1 of the ladder (the optimum moves up
   the ladder as C grows, so each budget's sizes sit around its own).
3. Noise: each budget's best size trains again with the seeds EXTRA_SEEDS; the fits average
   a cell's seeds and take their spread into the intervals.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math

from pathlib import Path

import yaml

from common.fileio import atomic_write_text, read_json
from data_pipeline.prepare import ensure_prepared
from pretrain.config import load_config, to_dict
from pretrain.scaling import launch, report
from pretrain.scaling.registry import SUMMARY_FILE, SWEEP_FILE
from pretrain.scaling.sweep import RunSpec, Sweep, expand, load_sweep
from pretrain.training.metrics import flatten

SWEEP = "configs/scaling/isoflop.yaml"
RUN_TABLE = Path("docs/isoflop_runs.csv")
"""The committed copy of the study's per-run table (the experiment writes SWEEP_DIR/results/)."""
LR_AXIS = "optimizer.lr"
WINDOW = 5
"""Sizes per budget."""
MAX_WIDENINGS = 3
"""Widenings of a size's learning-rate grid before the study gives up on that size."""
EXTRA_SEEDS = (1, 2)
"""Seeds of the repeated runs at each budget's best size (the base config's seed is the first)."""
METRIC = "final_val_loss"


def main(overrides: list[str] = ()) -> int:
    sweep = load_sweep(SWEEP, overrides)
    # the dataset once, before the runs are planned (each run's plan checks it)
    data = load_config(sweep.base_config, [f"{k}={json.dumps(v)}" for k, v in sweep.overrides.items()]).data
    ensure_prepared(data.path, data.source, seq_len=data.seq_len, tokenizer=data.tokenizer,
                    val_fraction=data.val_fraction)
    windows = {group: size_windows(sweep, group) for group in sweep.families}
    rates, rate_runs = tune_learning_rates(sweep, windows)
    budget_runs = [one_run(sweep, group, size, budget, {LR_AXIS: rates[group, size]})
                   for group, by_budget in windows.items() for budget, sizes in by_budget.items()
                   for size in sizes]
    losses = train(sweep, budget_runs)
    seed_runs = []
    for group, by_budget in windows.items():
        for budget in by_budget:
            best = min((run for run in budget_runs if run.group == group and run.flops_budget == budget),
                       key=lambda run: losses[run.run_name])
            seed_runs += [one_run(sweep, group, best.size, budget, {**best.axes, "seed": seed})
                          for seed in EXTRA_SEEDS]
    train(sweep, seed_runs)
    # The study's runs only: the sweep's directory may hold runs of an earlier design.
    names = sorted({run.run_name for run in rate_runs + budget_runs + seed_runs})
    write_run_table(sweep, names, sweep.directory / "results" / RUN_TABLE.name)
    return report.fit_command(report.FitOptions(dirs=[str(sweep.directory / name) for name in names],
                                                metric=METRIC, out=str(sweep.directory / "fit")))


def write_run_table(sweep: Sweep, names: list[str], path: Path) -> None:
    """One row per finished run of `names`: family, size, seed, budget, tokens, FLOPs, the
    final val loss, wall time, and the overrides of the base config that make the run, so that
    `python -m pretrain.train --config BASE OVERRIDES` re-runs it from its row alone."""
    base = flatten(to_dict(load_config(sweep.base_config)))
    cells = read_json(sweep.directory / SWEEP_FILE)["runs"]
    rows = []
    for name in names:
        cell, summary = cells[name], sweep.directory / name / SUMMARY_FILE
        if not summary.is_file():
            continue
        record = read_json(summary)
        config = flatten(yaml.safe_load((sweep.directory / "configs" / f"{name}.yaml").read_text()))
        overrides = [f"{key}={json.dumps(value)}" for key, value in config.items()
                     if base.get(key) != value and key not in ("run_name", "output_root")]
        rows.append({"run": name, "family": cell["group"], "size": cell["size"], "seed": config["seed"],
                     "budget_flops": cell["flops_budget"], "non_embedding_params": record["non_embedding_params"],
                     "tokens": record["tokens_seen"], "flops": record["train_flops"],
                     "final_val_loss": record[METRIC], "wall_s": round(record["wall_time_s"], 1),
                     "overrides": " ".join(overrides)})
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, report.to_csv(rows))
    print(f"wrote {path} ({len(rows)} runs)")


def size_windows(sweep: Sweep, group: str) -> dict[float, list[str]]:
    """Budget -> the sizes of `group` it runs: WINDOW consecutive sizes of the group's ladder
    (its own `sizes`, else the sweep's), one step up per budget."""
    sizes = list(sweep.families[group].sizes or sweep.sizes)
    budgets = sorted(sweep.flops)
    if not budgets or len(sizes) != len(budgets) + WINDOW - 1:
        raise ValueError(f"sweep {sweep.name}: {group}: the study needs compute budgets (flops) and "
                         f"{WINDOW} - 1 more sizes than budgets ({WINDOW} per budget, one step up "
                         f"the ladder per budget); it has {len(budgets)} budgets and {len(sizes)} sizes")
    return {budget: sizes[i:i + WINDOW] for i, budget in enumerate(budgets)}


def tune_learning_rates(sweep: Sweep, windows: dict[str, dict[float, list[str]]]
                        ) -> tuple[dict[tuple[str, str], float], list[RunSpec]]:
    """(group, size) -> its best learning rate at the size's smallest budget, with the grid
    widened until that best is not on its edge; and the runs that found them."""
    first_budget = {}
    for group, by_budget in windows.items():
        for budget, sizes in sorted(by_budget.items(), reverse=True):
            first_budget.update({(group, size): budget for size in sizes})
    grids = {key: sorted(sweep.axes[LR_AXIS]) for key in first_budget}
    for widening in itertools.count():
        runs = {key: [one_run(sweep, *key, first_budget[key], {LR_AXIS: lr}) for lr in grid]
                for key, grid in grids.items()}
        losses = train(sweep, [run for cell in runs.values() for run in cell])
        tried = {key: {lr: losses[run.run_name] for lr, run in zip(grids[key], cell)}
                 for key, cell in runs.items()}
        wider = {key: widened(by_rate) for key, by_rate in tried.items()}
        if not any(wider.values()):
            return ({key: min(by_rate, key=by_rate.get) for key, by_rate in tried.items()},
                    [run for cell in runs.values() for run in cell])
        if widening == MAX_WIDENINGS:
            key = next(key for key, grid in wider.items() if grid)
            raise launch.SweepFailed(f"sweep {sweep.name}: {' '.join(key)}: the best learning rate "
                                     f"is still on the edge of {grids[key]}; widen the sweep's grid")
        grids = {key: wider[key] or grids[key] for key in grids}


def widened(losses: dict[float, float]) -> list[float] | None:
    """Learning rate -> loss of one size: the grid with one more rate a factor 2 beyond the
    best when the best is the smallest or largest tried (the optimum may lie beyond), else
    None."""
    grid = sorted(losses)
    best = min(grid, key=losses.get)
    if best == grid[0]:
        return [grid[0] / 2] + grid
    if best == grid[-1]:
        return grid + [grid[-1] * 2]
    return None


def one_run(sweep: Sweep, group: str, size: str, budget: float, axes: dict) -> RunSpec:
    """The run of `group` at `size` and `budget` with the axis values `axes`, as the sweep
    names and configures it."""
    spec = sweep.families[group]
    sizes = spec.sizes or sweep.sizes
    one = dataclasses.replace(sweep, families={group: dataclasses.replace(spec, sizes=None)},
                              sizes={size: sizes[size]},
                              flops=[budget], axes={k: [v] for k, v in axes.items()})
    (run,) = expand(one, "check")
    return run


def train(sweep: Sweep, runs: list[RunSpec]) -> dict[str, float]:
    """Train the unfinished ones of `runs`, cheapest first; run name -> its final val loss
    (inf for a run that diverged)."""
    planned = launch.plan(sweep, "prepare", runs=runs)
    planned.sort(key=lambda item: item[0].max_tokens * item[0].flops_per_token)
    rc = launch.run_locally(sweep, planned)
    if rc != 0:
        raise launch.SweepFailed(f"sweep {sweep.name} did not finish (exit code {rc}); rerun "
                                 "the same command to resume it")
    losses = {}
    for run in runs:
        loss = read_json(sweep.directory / run.run_name / SUMMARY_FILE)[METRIC]
        losses[run.run_name] = loss if loss is not None and math.isfinite(loss) else math.inf
    return losses
