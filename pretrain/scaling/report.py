"""The fit command: scaling laws over finished runs, written as tables (Markdown, CSV), figures
(PNG) and TensorBoard.

Runs of a sweep that differ only in axis values (e.g. the learning rate) form a cell; every fit
uses each cell's best run, and the learning-rate curves show whether that best lies inside the
axis's grid. Per group, over those best runs:
- one-variable power laws L = E + A x^-alpha: L(N), N = parameters (per size the run with the
  most tokens), L(D), D = tokens (per token budget the largest model; only when a group has
  three or more budgets), L(C), C = training FLOPs (the compute frontier: each run with a lower
  loss than every run with less compute). Values within ~2% count as one point;
- at equal compute (`analysis`): IsoFLOP parabolas per compute budget, N*(C) and D*(C), the
  joint law L(N, D), and against the group's baseline the compute-equivalent gain and the
  differences of the exponents.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.fileio import markdown_table
from pretrain.scaling.allocation import GAIN_SEARCH_DECADES, N_SEARCH_DECADES
from pretrain.scaling.analysis import (EXPONENTS, LAWS, Comparison, FamilyAnalysis, Law, Point,
                                       analyse_family, compare, too_few_message)
from pretrain.scaling.fit import MIN_POINTS, FitResult, TooFewPoints, fit_power_law, rate_difference
from pretrain.scaling.joint import percentile_interval
from pretrain.scaling.registry import Registry, find_run_dirs, load_registry
from pretrain.training.summary import RunRecord

METRICS = ("best_val_loss", "final_val_loss", "final_train_loss")
"""RunRecord fields that can be fitted; any numeric key of summary.json can be, too."""
PARAM_COUNTS = ("non_embedding", "total")
SEED_AXIS = "seed"
"""The sweep axis whose runs a cell averages (see `best_of_cells`)."""
BASELINE_FAMILY = {"gpt_rec": "gpt", "nrgpt": "gpt", "ebt": "transformer_pp"}
"""The papers' comparisons: NRGPT and GPT_Rec against GPT, EBT against Transformer++."""


@dataclass
class LawFit:
    """One law fitted for one group, or the reason it was not."""

    group: str
    law: Law
    points: list[Point]
    """The runs the law was fitted to (see the module docstring)."""
    full: FitResult | None = None
    """L = E + A x^-alpha."""
    loglog: FitResult | None = None
    """L = A x^-slope (E = 0): the straight line in log-log axes the EBT paper compares."""
    rate: tuple[float, tuple[float, float]] | None = None
    """Relative difference of the log-log slope to the baseline group's, with its interval."""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AxisCurve:
    """The metric against one axis (e.g. the learning rate) within one sweep cell."""

    group: str
    cell: str
    key: str
    """The axis, e.g. `optimizer.lr`."""
    values: list[tuple[Any, float]]
    """(axis value, metric) of the cell's runs, by axis value."""
    grid: list[Any]
    """Every value of the axis in the group (the grid the best is judged against)."""

    @property
    def best(self) -> Any:
        return min(self.values, key=lambda v: v[1])[0]

    @property
    def at_edge(self) -> bool:
        """The best value is the smallest or largest of the grid: the optimum may lie beyond."""
        return len(self.grid) > 1 and self.best in (self.grid[0], self.grid[-1])


# ----------------------------------------------------------------------------- points

def metric_value(record: RunRecord, metric: str) -> float | None:
    """The metric of a run: a RunRecord field, or a (dotted) key of summary.json's extra keys;
    None when the run does not have it as a number."""
    if metric in METRICS:
        return getattr(record, metric)
    value: Any = record.extra
    for part in metric.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def collect_points(registry: Registry, metric: str, *, higher_is_better: bool = False,
                   params: str = "non_embedding") -> tuple[dict[str, list[Point]], list[str]]:
    """Group -> points of every usable run, and one line per run skipped (and why). With
    `higher_is_better` the point's loss is 1 - metric (an error rate)."""
    if params not in PARAM_COUNTS:
        raise ValueError(f"unknown parameter count {params!r}; choose {' or '.join(PARAM_COUNTS)}")
    groups: dict[str, list[Point]] = {}
    skipped = []
    for run_dir, record in registry.records:
        if record.length_changes:  # its schedule was planned for another length than it ran
            changes = ", ".join(change.describe() for change in record.length_changes)
            skipped.append(f"length changed on resuming ({changes}) in {run_dir}: not a run planned "
                           f"at {record.steps} steps, skipped")
            continue
        value = metric_value(record, metric)
        if value is None or not math.isfinite(value):
            skipped.append(f"no finite {metric} in {run_dir}, skipped")
            continue
        if higher_is_better:
            if not 0 < value < 1:
                skipped.append(f"{metric}={value} in {run_dir} is not in (0, 1), skipped")
                continue
            value = 1.0 - value
        n = record.non_embedding_params if params == "non_embedding" else record.params
        x = {"N": float(n), "D": float(record.tokens_seen), "C": float(record.train_flops)}
        if min(x.values()) <= 0 or value <= 0:
            skipped.append(f"non-positive params/tokens/FLOPs/{metric} in {run_dir}, skipped")
            continue
        cell = registry.cells.get(run_dir, {})
        flops_per_token = record.extra.get("flops_per_token", x["C"] / x["D"])
        groups.setdefault(registry.group_of(run_dir, record), []).append(Point(
            record.run_name, x, value, cell.get("cell", record.run_name),
            cell.get("flops_budget"), cell.get("axes", {}), float(flops_per_token)))
    return groups, skipped


def best_of_cells(points: list[Point]) -> list[Point]:
    """Each cell's best variant, in the order of the cells' first runs. A variant is the runs
    that differ only in their seed (the `seed` axis; a run without it counts as one seed):
    its loss is their mean, so that extra seeds measure the noise instead of picking the
    luckiest run."""
    variants: dict[tuple, list[Point]] = {}
    for p in points:
        others = tuple(sorted((k, v) for k, v in p.axes.items() if k != SEED_AXIS))
        variants.setdefault((p.cell, others), []).append(p)
    best: dict[str, Point] = {}
    for (cell, _), runs in variants.items():
        point = runs[0]
        if len(runs) > 1:
            losses = tuple(r.loss for r in runs)
            point = dataclasses.replace(point, loss=sum(losses) / len(losses), seed_losses=losses)
        if cell not in best or point.loss < best[cell].loss:
            best[cell] = point
    return list(best.values())


def axis_curves(groups: dict[str, list[Point]]) -> list[AxisCurve]:
    """For every group, cell and axis: the metric against that axis's values, the other axes
    held at the cell's best run's values."""
    curves = []
    for group, points in sorted(groups.items()):
        keys = sorted({k for p in points for k in p.axes} - {SEED_AXIS})
        for key in keys:
            grid = sorted({p.axes[key] for p in points if key in p.axes})
            for cell_best in best_of_cells(points):
                others = {k: v for k, v in cell_best.axes.items() if k != key}
                values = sorted((p.axes[key], p.loss) for p in points if p.cell == cell_best.cell
                                and {k: v for k, v in p.axes.items() if k != key} == others)
                if len(values) > 1:
                    curves.append(AxisCurve(group, cell_best.cell, key, values, grid))
    return curves


# ----------------------------------------------------------------------------- 1-d laws

def _key(value: float) -> float:
    return round(math.log10(value), 2)


def select_points(points: list[Point], law: Law) -> list[Point]:
    """The runs that enter `law`, sorted by x (see the module docstring)."""
    if law.symbol == "C":
        frontier, best = [], math.inf
        for p in sorted(points, key=lambda p: (p.x["C"], p.loss)):
            if p.loss < best:
                frontier.append(p)
                best = p.loss
        return frontier
    # N: per size the longest-trained run; D: per budget the largest model.
    other = "D" if law.symbol == "N" else "N"
    chosen: dict[float, Point] = {}
    for p in points:
        k = _key(p.x[law.symbol])
        if k not in chosen or (p.x[other], -p.loss) > (chosen[k].x[other], -chosen[k].loss):
            chosen[k] = p
    return sorted(chosen.values(), key=lambda p: p.x[law.symbol])


EXACT_RESIDUAL = 1e-4
"""A fit whose relative RMS residual is below this passes through its points (the exponent is
searched on a grid, so a fit of three parameters to three points is exact to about 1e-6)."""


def fit_groups(groups: dict[str, list[Point]], *, baselines: dict[str, str],
               n_bootstrap: int = 1000, seed: int = 0) -> list[LawFit]:
    """Every law for every group, then each group's rate relative to its baseline."""
    fits: list[LawFit] = []
    for group_index, group in enumerate(sorted(groups)):
        # Each group gets its own resampling stream, so the slope comparison pairs
        # independent bootstrap draws.
        group_seed = seed + 1000 * group_index
        for law in LAWS:
            points = select_points(groups[group], law)
            fit = LawFit(group, law, points)
            fits.append(fit)
            if law.symbol == "D" and len(points) < MIN_POINTS:
                fit.notes.append("token budget not varied (fewer than 3 budgets)")
                continue
            x = [p.x[law.symbol] for p in points]
            y = [p.loss for p in points]
            try:
                fit.full = fit_power_law(x, y, n_bootstrap=n_bootstrap, seed=group_seed)
                fit.loglog = fit_power_law(x, y, irreducible=False, n_bootstrap=n_bootstrap,
                                           seed=group_seed)
            except TooFewPoints as err:
                fit.notes.append(f"too few points for L({law.symbol}): {err}")
                continue
            if fit.full.at_bound:
                fit.notes.append("exponent at the search bound: the data do not pin it")
            if fit.full.E_clamped:
                fit.notes.append(f"E clamped at 0 (the points call for a negative E): relative RMS "
                                 f"residual {fit.full.residual:.2%}")
            if fit.full.n_points == MIN_POINTS:
                how = ("E free: exact fit" if fit.full.residual < EXACT_RESIDUAL else
                       "E clamped" if fit.full.E_clamped else f"relative RMS residual {fit.full.residual:.2%}")
                fit.notes.append(f"3 points: no bootstrap interval ({how})")
    fitted = {(f.group, f.law.symbol): f for f in fits if f.loglog is not None}
    for fit in fits:
        base = fitted.get((baselines.get(fit.group), fit.law.symbol))
        if fit.loglog is not None and base is not None:
            fit.rate = rate_difference(fit.loglog, base.loglog)
    return fits


# ----------------------------------------------------------------------------- analysis

def resolve_baselines(groups: dict[str, list[Point]], families: dict[str, str],
                      baseline: str) -> tuple[dict[str, str], list[str]]:
    """Group -> the group it is compared to, and notes. `baseline` "auto": by the runs' model
    family (BASELINE_FAMILY; a baseline family's group is its own baseline), else one group
    for all."""
    if baseline != "auto":
        if baseline not in groups:
            return {}, [f"baseline group {baseline!r} not among the runs: no comparison"]
        return {g: baseline for g in groups}, []
    by_family: dict[str, str] = {}
    for group in sorted(groups):  # a group named like its family wins over other labels
        if group == families[group] or families[group] not in by_family:
            by_family[families[group]] = group
    resolved, notes = {}, []
    for group in sorted(groups):
        wanted = BASELINE_FAMILY.get(families[group], families[group])
        if wanted in by_family:
            resolved[group] = by_family[wanted]
        else:
            notes.append(f"{group}: no {wanted} runs to compare with")
    return resolved, notes


@dataclass
class Analysis:
    """Everything the fit command computed."""

    metric: str
    groups: dict[str, list[Point]]
    """Every usable run, by group."""
    cells: dict[str, list[Point]]
    """Each cell's best run, by group: what the laws are fitted to."""
    laws: list[LawFit]
    curves: list[AxisCurve]
    families: dict[str, FamilyAnalysis]
    baselines: dict[str, str]
    comparisons: list[Comparison]
    notes: list[str]


def analyse(registry: Registry, options: FitOptions) -> Analysis:
    """Collect, fit and compare; a ValueError (one line) when nothing can be fitted."""
    if not registry.records:
        raise ValueError(f"no finished runs (summary.json) under {' '.join(options.dirs)}")
    groups, notes = collect_points(registry, options.metric,
                                   higher_is_better=options.higher_is_better,
                                   params=options.params)
    if not groups:
        raise ValueError(f"no run has a usable {options.metric}")
    families = {registry.group_of(d, r): r.family for d, r in registry.records}
    baselines, baseline_notes = resolve_baselines(groups, families, options.baseline)
    cells = {g: best_of_cells(points) for g, points in groups.items()}
    laws = fit_groups(cells, baselines=baselines, n_bootstrap=options.n_bootstrap,
                      seed=options.seed)
    analyses = {}
    for index, group in enumerate(sorted(cells)):
        analyses[group] = analyse_family(group, cells[group], n_bootstrap=options.n_bootstrap,
                                          seed=options.seed + 1000 * index + 1)
    message = too_few_message(list(analyses.values()), any(f.full for f in laws))
    if message:
        raise ValueError(message)
    comparisons = [compare(analyses[g], analyses[b]) for g, b in sorted(baselines.items())
                   if g != b and analyses[g].joint and analyses[b].joint]
    return Analysis(options.metric, groups, cells, laws, axis_curves(groups), analyses,
                    baselines, comparisons, notes + baseline_notes)


# ----------------------------------------------------------------------------- tables

CSV_COLUMNS = ["group", "law", "points", "E", "E_lo", "E_hi", "A", "A_lo", "A_hi", "alpha",
               "alpha_lo", "alpha_hi", "slope", "slope_lo", "slope_hi", "slope_vs_baseline",
               "slope_vs_baseline_lo", "slope_vs_baseline_hi", "notes"]


def table_rows(fits: list[LawFit]) -> list[dict[str, object]]:
    rows = []
    for fit in fits:
        row: dict[str, object] = {"group": fit.group, "law": f"L({fit.law.symbol})",
                                  "points": len(fit.points), "notes": "; ".join(fit.notes)}
        if fit.full is not None:
            for name in ("E", "A", "alpha"):
                row[name] = getattr(fit.full.law, name)
                row[f"{name}_lo"], row[f"{name}_hi"] = fit.full.ci[name]
            row["slope"] = fit.loglog.law.alpha
            row["slope_lo"], row["slope_hi"] = fit.loglog.ci["alpha"]
        if fit.rate is not None:
            row["slope_vs_baseline"] = fit.rate[0]
            row["slope_vs_baseline_lo"], row["slope_vs_baseline_hi"] = fit.rate[1]
        rows.append(row)
    return rows


def joint_rows(analysis: Analysis) -> list[dict[str, object]]:
    """One row per family with a joint law: parameters, intervals and the allocation."""
    rows = []
    for group, family in sorted(analysis.families.items()):
        if family.joint is None:
            continue
        fit = family.joint
        row: dict[str, object] = {"group": group, "runs": fit.n_points}
        for name in ("E", "A", "alpha", "B", "beta"):
            row[name] = getattr(fit.law, name)
            row[f"{name}_lo"], row[f"{name}_hi"] = fit.ci(name)
        row["flops_per_token_exponent"] = family.flops.exponent
        a, b = family.allocation_exponents()
        samples = [family.allocation_exponents(law) for law in fit.samples]
        row["n_opt_exponent"], row["d_opt_exponent"] = a, b
        for i, name in enumerate(("n_opt_exponent", "d_opt_exponent")):
            row[f"{name}_lo"], row[f"{name}_hi"] = percentile_interval(
                [s[i] for s in samples], fit.ci_level)
        rows.append(row)
    return rows


def isoflop_rows(analysis: Analysis) -> list[dict[str, object]]:
    rows = []
    for group, family in sorted(analysis.families.items()):
        for fit in family.isoflop:
            d_opt = fit.budget / float(family.flops(fit.n_opt)) if fit.inside else math.nan
            rows.append({"group": group, "budget": fit.budget, "runs": fit.n_points,
                         "n_opt": fit.n_opt, "d_opt": d_opt, "loss_opt": fit.loss_opt,
                         "inside": fit.inside, "curvature": fit.coef[0]})
    return rows


def optimum_row(family: FamilyAnalysis) -> dict[str, float]:
    """The exponents of N*(C) and D*(C) and the tokens per parameter at the optimum (at the
    geometric mean of the budgets), with their intervals."""
    budgets = [f.budget for f in family.isoflop if f.inside]
    centre = math.exp(sum(map(math.log, budgets)) / len(budgets))
    row = {"a": family.n_opt_law.exponent, "b": family.d_opt_law.exponent, "centre": centre,
           "tokens_per_param": float(family.d_opt_law(centre) / family.n_opt_law(centre)),
           "noise_sd": family.noise_sd}
    for name, (lo, hi) in family.optimum_ci.items():
        row[f"{name}_lo"], row[f"{name}_hi"] = lo, hi
    return row


def gain_rows(analysis: Analysis) -> list[dict[str, object]]:
    rows = []
    for comp in analysis.comparisons:
        for c, g, lo, hi in zip(comp.budgets, comp.gain, *comp.gain_ci):
            rows.append({"group": comp.group, "baseline": comp.baseline, "budget": float(c),
                         "gain": float(g), "gain_lo": float(lo), "gain_hi": float(hi)})
    return rows


def to_csv(rows: list[dict[str, object]], columns: list[str] | None = None) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns or (list(rows[0]) if rows else []), restval="",
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _number(value: float, spec: str) -> str:
    """`value` formatted by `spec`, or `-` for NaN (no value)."""
    return "-" if math.isnan(value) else f"{value:{spec}}"


def _fmt(row: dict[str, object], name: str, percent: bool = False, spec: str = ".4g") -> str:
    """`value [lo, hi]`, the interval left out when it is NaN; `-` when there is no value."""
    value = row.get(name, "")
    if value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    scale, spec = (100.0, "+.1f") if percent else (1.0, spec)
    text = f"{value * scale:{spec}}" + ("%" if percent else "")
    lo, hi = row.get(f"{name}_lo", math.nan), row.get(f"{name}_hi", math.nan)
    if not (math.isnan(lo) or math.isnan(hi)):
        spec = ".1f" if percent else ".3g"
        text += f" [{lo * scale:{spec}}, {hi * scale:{spec}}]"
    return text


def to_markdown(analysis: Analysis, ci_level: float = 0.95) -> str:
    """Every table of the analysis, with a line saying what each holds."""
    out = []
    if analysis.curves:
        out.append("### Axes (e.g. learning rate) within each cell\n")
        out.append(markdown_table([{
            "group": c.group, "cell": c.cell, "axis": c.key,
            "values: metric": ", ".join(f"{v:g}: {m:.4f}" if isinstance(v, float) else f"{v}: {m:.4f}"
                                        for v, m in c.values),
            "best": c.best, "on the grid's edge": "yes" if c.at_edge else "no"} for c in analysis.curves]))
        edge = sum(c.at_edge for c in analysis.curves)
        out.append(f"\n{edge} of {len(analysis.curves)} cells have their best value on the "
                   "edge of the grid: there the optimum may lie outside it.\n")

    out.append("### One-variable power laws\n")
    law_rows = []
    for row in table_rows(analysis.laws):
        base = analysis.baselines.get(row["group"])
        rate = "baseline" if base == row["group"] and "slope" in row else \
            _fmt(row, "slope_vs_baseline", True) + (f" ({base})" if "slope_vs_baseline" in row
                                                     else "")
        law_rows.append({"group": row["group"], "law": row["law"], "points": row["points"],
                         "E": _fmt(row, "E"), "A": _fmt(row, "A"), "alpha": _fmt(row, "alpha"),
                         "log-log slope": _fmt(row, "slope"), "slope vs baseline": rate,
                         "notes": row["notes"]})
    if law_rows:
        out.append(markdown_table(law_rows))
    out.append(f"\nL = E + A x^-alpha; the log-log slope is the exponent of L = A x^-slope; "
               "slope vs baseline = (slope - slope_base) / slope_base.\n")

    rows = isoflop_rows(analysis)
    if rows:
        out.append("### IsoFLOP parabolas (approach 2)\n")
        out.append(markdown_table([{
            "group": r["group"], "C": f"{r['budget']:.3g}", "runs": r["runs"], "N*": _fmt(r, "n_opt"),
            "D*": _fmt(r, "d_opt"), "L*": _fmt(r, "loss_opt", spec=".4f"),
            "N* inside the sizes": "yes" if r["inside"] else "no"} for r in rows]))
        out.append("\nN* and L* are the parabola's vertex (outside the sizes an extrapolation; '-' "
                   "where the parabola opens downward); D* only for a vertex inside the sizes.")
        fits = [(g, f) for g, f in sorted(analysis.families.items()) if f.n_opt_law]
        for group, family in fits:
            row = optimum_row(family)
            out.append(f"\n{group}: N*(C) = {family.n_opt_law.scale:.3g} C^a, a = {_fmt(row, 'a', spec='.3f')}; "
                       f"D*(C) = {family.d_opt_law.scale:.3g} C^b, b = {_fmt(row, 'b', spec='.3f')}; "
                       f"D*/N* = {_fmt(row, 'tokens_per_param', spec='.3g')} tokens per parameter at "
                       f"C = {row['centre']:.3g} (through {family.n_opt_law.n_points} budgets' optima; "
                       f"{ci_level:.0%} intervals: the losses redrawn with a run noise of "
                       f"{family.noise_sd:.3g}).")
        out.append("")

    rows = joint_rows(analysis)
    if rows:
        out.append("### Joint law L(N, D) = E + A / N^alpha + B / D^beta (approach 3)\n")
        out.append(markdown_table([{
            "group": r["group"], "runs": r["runs"], **{k: _fmt(r, k) for k in ("E", "A", "alpha", "B", "beta")},
            "FLOPs/token ~ N^k": f"{r['flops_per_token_exponent']:.3f}", "N* ~ C^a": _fmt(r, "n_opt_exponent"),
            "D* ~ C^b": _fmt(r, "d_opt_exponent")} for r in rows]))
        out.append("\nHuber loss on log L, variable projection over (alpha, beta); N* and D* "
                   "minimise L(N, C / flops_per_token(N)) with each family's own FLOPs per "
                   "token (a power of N through its runs), exponents over its compute range.\n")

    if analysis.comparisons:
        out.append("### Compute-equivalent gain against the baseline\n")
        gains = [{"group": r["group"], "baseline": r["baseline"], "C": f"{r['budget']:.3g}",
                  "gain": _fmt(r, "gain")} for r in gain_rows(analysis)]
        if gains:
            out.append(markdown_table(gains))
        out.append("\nGain = the compute the baseline needs to reach the family's compute-"
                   "optimal loss at C, over C (> 1: the family needs less compute); from the "
                   "joint laws' frontiers. '-': the family's law has no frontier at C, or the "
                   f"baseline does not reach that loss within {10 ** GAIN_SEARCH_DECADES:.0f}x the "
                   "compute. A law has no frontier where its compute-optimal size lies "
                   f"{N_SEARCH_DECADES:.0f} or more decades outside the fitted sizes, as when an "
                   "exponent sits at its search bound.\n")
        exponent_rows = []
        for comp in analysis.comparisons:
            for name in EXPONENTS:
                value, delta, (lo, hi) = comp.exponents[name]
                interval = "" if math.isnan(lo) else f" [{lo:+.3g}, {hi:+.3g}]"
                exponent_rows.append({"group": comp.group, "baseline": comp.baseline, "exponent": name,
                                      "group's value": _number(value, ".4g"),
                                      "minus baseline's": _number(delta, "+.4g") + interval})
        out.append(markdown_table(exponent_rows))
        out.append("\nalpha, beta: the joint law's exponents; compute_slope: the mean log-log "
                   "slope of its frontier L*(C) over both families' compute range (the "
                   "scaling rate in compute); '-' where a law has no frontier at an end of "
                   "that range, the interval then over the bootstrap laws that have one.\n")

    notes = analysis.notes + [f"{g}: {n}" for g, f in sorted(analysis.families.items())
                              for n in f.notes]
    if notes:
        out.append("### Notes\n")
        out += [f"- {n}" for n in notes]
        out.append("")
    out.append(f"Brackets: {ci_level:.0%} bootstrap intervals (runs resampled with replacement; "
               "paired resamples of two independently resampled families for differences).")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- outputs

FIGURE_DPI = 90


def write_outputs(out_dir: Path, analysis: Analysis, header: str = "") -> None:
    """Write fits.md, the CSV tables, the figures and tb/ into `out_dir`, replacing a previous
    output only once everything is written."""
    from pretrain.scaling import plots

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    table_md = to_markdown(analysis)
    figures = plots.make_figures(analysis)
    # Built next to the target and renamed into place; created with the usual mode (umask)
    # like every other directory the project writes.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / "fits.md").write_text(header + table_md)
        (tmp / "fits.csv").write_text(to_csv(table_rows(analysis.laws), CSV_COLUMNS))
        for name, rows in (("isoflop", isoflop_rows(analysis)), ("joint", joint_rows(analysis)),
                           ("gains", gain_rows(analysis))):
            if rows:
                (tmp / f"{name}.csv").write_text(to_csv(rows))
        for name, figure in figures.items():
            figure.set_dpi(FIGURE_DPI)
            figure.savefig(tmp / f"{name}.png", dpi=FIGURE_DPI)
        plots.write_tensorboard(tmp / "tb", analysis, figures, table_md)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        plots.close(figures)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


# ----------------------------------------------------------------------------- the command

@dataclass
class FitOptions:
    """What `python -m pretrain.scaling fit` was asked."""

    dirs: list[str]
    """Run directories or directories holding runs."""
    out: str | None = None
    """Output directory; None: DIR/fit for one directory DIR of runs, else
    checkpoints/scaling/fit."""
    metric: str = "best_val_loss"
    """RunRecord field or (dotted) key of summary.json that the laws fit."""
    higher_is_better: bool = False
    """The metric is a score in (0, 1) such as an accuracy: the laws fit 1 - metric."""
    baseline: str = "auto"
    """Group all others are compared to, or "auto" (see `resolve_baselines`)."""
    params: str = "non_embedding"
    """The N of the laws: "non_embedding" or "total" parameters."""
    n_bootstrap: int = 500
    """Bootstrap resamples of every interval."""
    seed: int = 0
    """Seed of the bootstrap."""


def print_registry(registry: Registry) -> None:
    print(f"{'run':<48} {'group':<14} {'N':>11} {'tokens':>12} {'FLOPs':>10} "
          f"{'train':>7} {'best val':>8}")
    for run_dir, r in registry.records:
        best = f"{r.best_val_loss:8.4f}" if r.best_val_loss is not None else f"{'-':>8}"
        print(f"{r.run_name:<48} {registry.group_of(run_dir, r):<14} "
              f"{r.non_embedding_params:>11,d} {r.tokens_seen:>12,d} {r.train_flops:>10.3g} "
              f"{r.final_train_loss:>7.4f} {best}")
    for line in registry.problems():
        print(line)


def default_out(dirs: list[str]) -> Path:
    """DIR/fit for one directory holding runs (a sweep's), else checkpoints/scaling/fit."""
    if len(dirs) == 1 and find_run_dirs(Path(dirs[0])) != [Path(dirs[0])]:
        return Path(dirs[0]) / "fit"
    return Path("checkpoints/scaling/fit")


def fit_command(options: FitOptions) -> int:
    """Fit, print the tables and write the outputs; bad input is a ValueError, with nothing
    written."""
    if options.n_bootstrap < 0:
        raise ValueError("--bootstrap must be >= 0")
    registry = load_registry(options.dirs)
    print_registry(registry)
    analysis = analyse(registry, options)
    for line in analysis.notes:
        print(line)
    for fit in analysis.laws:
        for note in fit.notes:
            print(f"{fit.group} L({fit.law.symbol}): {note}")
    for group, family in sorted(analysis.families.items()):
        for note in family.notes:
            print(f"{group}: {note}")
    out = Path(options.out) if options.out else default_out(options.dirs)
    header = (f"Scaling fits over {len(registry.records)} runs ({options.metric}"
              f"{', as 1 - metric' if options.higher_is_better else ''}; N = "
              f"{options.params.replace('_', '-')} parameters); "
              f"{len(registry.missing) + len(registry.invalid)} listed run(s) skipped.\n\n")
    write_outputs(out, analysis, header)
    print()
    print(to_markdown(analysis))
    print(f"wrote {out}/fits.md, *.csv, *.png; .venv/bin/tensorboard --logdir {out}/tb")
    return 0
