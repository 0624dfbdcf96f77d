"""Fit scaling laws per group of runs and write the table (Markdown, CSV), the log-log figure
(PNG) and TensorBoard curves.

Which runs enter which law (runs whose x values agree within ~2% count as one point):
- L(N), N = non-embedding parameters: per model size, the run with the most training tokens
  (the one closest to convergence).
- L(D), D = training tokens: per token budget, the largest model; fitted only when a group
  has at least three budgets, i.e. when the sweep varies data.
- L(C), C = training FLOPs: the compute frontier, i.e. each run that reaches a lower loss than
  every run with less compute.
"""
from __future__ import annotations

import csv
import io
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrain.scaling.fit import MIN_POINTS, FitResult, TooFewPoints, fit_power_law, rate_difference
from pretrain.scaling.registry import Registry

METRICS = ("best_val_loss", "final_val_loss", "final_train_loss")
TB_STEPS_PER_DECADE = 1000
"""TensorBoard steps are integers: a point at x is logged at step round(1000 * log10 x)."""


@dataclass(frozen=True)
class Law:
    symbol: str
    """N, D or C."""
    name: str
    """Word used in tags and file names."""
    record_field: str
    """RunRecord field holding x."""
    label: str
    """Axis label."""


LAWS = (
    Law("N", "params", "non_embedding_params", "non-embedding parameters N"),
    Law("C", "flops", "train_flops", "training FLOPs C"),
    Law("D", "tokens", "tokens_seen", "training tokens D"),
)


@dataclass(frozen=True)
class Point:
    run_name: str
    x: dict[str, float]
    """Law symbol -> x value of this run."""
    loss: float


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


def collect_points(registry: Registry, metric: str) -> tuple[dict[str, list[Point]], list[str]]:
    """Group -> points of every usable run, and one line per run skipped for lack of `metric`."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    groups: dict[str, list[Point]] = {}
    skipped = []
    for run_dir, record in registry.records:
        loss = getattr(record, metric)
        if loss is None or not math.isfinite(loss):
            skipped.append(f"no finite {metric} in {run_dir}, skipped")
            continue
        x = {law.symbol: float(getattr(record, law.record_field)) for law in LAWS}
        if min(x.values()) <= 0:
            skipped.append(f"non-positive params/tokens/FLOPs in {run_dir}, skipped")
            continue
        groups.setdefault(registry.group_of(run_dir, record), []).append(
            Point(record.run_name, x, loss))
    return groups, skipped


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


def fit_groups(groups: dict[str, list[Point]], *, baseline: str = "gpt", n_bootstrap: int = 1000,
               seed: int = 0) -> list[LawFit]:
    """Every law for every group, then each group's rate relative to `baseline`."""
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
            if fit.full.n_points == MIN_POINTS:
                fit.notes.append("3 points: no bootstrap interval (E free: exact fit)")
    base = {f.law.symbol: f for f in fits if f.group == baseline and f.loglog is not None}
    for fit in fits:
        if fit.loglog is not None and fit.law.symbol in base:
            fit.rate = rate_difference(fit.loglog, base[fit.law.symbol].loglog)
    return fits


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


def to_csv(fits: list[LawFit]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, CSV_COLUMNS, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(table_rows(fits))
    return buffer.getvalue()


def _fmt(row: dict[str, object], name: str, percent: bool = False) -> str:
    """`value [lo, hi]`, the interval left out when it is NaN; `-` when there is no value."""
    value = row.get(name, "")
    if value == "":
        return "-"
    scale, spec = (100.0, "+.1f") if percent else (1.0, ".4g")
    text = f"{value * scale:{spec}}" + ("%" if percent else "")
    lo, hi = row.get(f"{name}_lo", math.nan), row.get(f"{name}_hi", math.nan)
    if not (math.isnan(lo) or math.isnan(hi)):
        spec = ".1f" if percent else ".3g"
        text += f" [{lo * scale:{spec}}, {hi * scale:{spec}}]"
    return text


def to_markdown(fits: list[LawFit], baseline: str, ci_level: float = 0.95) -> str:
    lines = [f"| group | law | points | E | A | alpha | log-log slope | slope vs {baseline} "
             "| notes |", "|" + "---|" * 9]
    for row in table_rows(fits):
        is_base = row["group"] == baseline and "slope" in row
        rate = "baseline" if is_base else _fmt(row, "slope_vs_baseline", True)
        lines.append(f"| {row['group']} | {row['law']} | {row['points']} | {_fmt(row, 'E')} | "
                     f"{_fmt(row, 'A')} | {_fmt(row, 'alpha')} | {_fmt(row, 'slope')} | "
                     f"{rate} | {row['notes']} |")
    lines.append("")
    lines.append(f"Brackets: {ci_level:.0%} bootstrap intervals (runs resampled with replacement). "
                 "L = E + A x^-alpha; the log-log slope is the exponent of L = A x^-slope; "
                 f"slope vs {baseline} = (slope - slope_{baseline}) / slope_{baseline}.")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots

def pyplot():
    """matplotlib.pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def make_figure(groups: dict[str, list[Point]], fits: list[LawFit]):
    """Log-log loss against each fitted law's x, every group in one panel per law."""
    import matplotlib.ticker

    plt = pyplot()

    laws = [law for law in LAWS if any(f.law == law and f.full is not None for f in fits)]
    laws = laws or [LAWS[0]]
    fig, axes = plt.subplots(1, len(laws), figsize=(4.2 * len(laws), 3.6), squeeze=False)
    colors = {g: f"C{i}" for i, g in enumerate(sorted(groups))}
    for ax, law in zip(axes[0], laws):
        for group, points in sorted(groups.items()):
            xs = [p.x[law.symbol] for p in points]
            ax.scatter(xs, [p.loss for p in points], s=14, color=colors[group], alpha=0.35)
            fit = next(f for f in fits if f.group == group and f.law == law)
            label = group if fit.full is None else f"{group}: alpha={fit.full.law.alpha:.3g}"
            ax.scatter([p.x[law.symbol] for p in fit.points], [p.loss for p in fit.points],
                       s=22, color=colors[group], label=label)
            if fit.full is not None:
                grid = np.geomspace(min(xs), max(xs), 64)
                ax.plot(grid, fit.full.law(grid), color=colors[group], lw=1.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            set_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
        ax.set_xlabel(law.label)
        ax.set_ylabel("loss")
        ax.set_title(f"L({law.symbol})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_tensorboard(tb_dir: Path, fits: list[LawFit], figure, table_md: str) -> None:
    """Scalars `loss_vs_<law>/<group>` (measured) and `loss_vs_<law>_fit/<group>` (fitted curve)
    at step round(1000 log10 x), a custom-scalars layout putting every group of one law in one
    chart, the log-log figure and the table."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb_dir))
    layout = {}
    for law in LAWS:
        law_fits = [f for f in fits if f.law == law and f.points]
        if not law_fits:
            continue
        tags = [rf"loss_vs_{law.name}/.*", rf"loss_vs_{law.name}_fit/.*"]
        layout[f"loss vs {law.name} (step = {TB_STEPS_PER_DECADE} log10 {law.symbol})"] = [
            "Multiline", tags]
        for fit in law_fits:
            # Ascending steps: TensorBoard drops earlier points when a tag's step goes back.
            for p in fit.points:
                writer.add_scalar(f"loss_vs_{law.name}/{fit.group}", p.loss,
                                  _tb_step(p.x[law.symbol]))
            if fit.full is not None:
                xs = [p.x[law.symbol] for p in fit.points]
                steps = range(_tb_step(min(xs)), _tb_step(max(xs)) + 1, TB_STEPS_PER_DECADE // 50)
                for step in steps:
                    x = 10 ** (step / TB_STEPS_PER_DECADE)
                    writer.add_scalar(f"loss_vs_{law.name}_fit/{fit.group}",
                                      float(fit.full.law(x)), step)
    writer.add_custom_scalars({"scaling laws": layout})
    writer.add_figure("scaling/loglog", figure, close=False)
    writer.add_text("scaling/fits", table_md)
    writer.close()


def _tb_step(x: float) -> int:
    return round(TB_STEPS_PER_DECADE * math.log10(x))


def write_outputs(out_dir: Path, groups: dict[str, list[Point]], fits: list[LawFit],
                  baseline: str, header: str = "") -> None:
    """Write fits.md, fits.csv, scaling.png and tb/ into `out_dir`, replacing a previous
    output only once everything is written."""
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    table_md = to_markdown(fits, baseline)
    figure = make_figure(groups, fits)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (tmp / "fits.md").write_text(header + table_md)
        (tmp / "fits.csv").write_text(to_csv(fits))
        figure.savefig(tmp / "scaling.png", dpi=90)
        write_tensorboard(tmp / "tb", fits, figure, table_md)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        plt.close(figure)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
