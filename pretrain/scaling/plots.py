"""Figures (PNG) and TensorBoard output of the fit command.

TensorBoard's scalar charts plot against a step and smooth by default, which suits training
curves, not laws: the laws go to TensorBoard as the figures themselves (titled by their axes)
and as one HParams session per fitted point, whose dashboard plots the metric against N, D or C
with those names on its axes (see `write_tensorboard`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pretrain.scaling.analysis import LAWS
from pretrain.training.metrics import pyplot

_CURVE_POINTS = 64


def _colors(analysis) -> dict[str, str]:
    return {g: f"C{i}" for i, g in enumerate(sorted(analysis.groups))}


def _log_axes(ax, xlabel: str, ylabel: str = "loss", log_y: bool = True) -> None:
    import matplotlib.ticker

    ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
        for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            set_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def laws_figure(analysis):
    """Log-log loss against each fitted one-variable law's x, every group in one panel per law."""
    plt = pyplot()
    laws = [law for law in LAWS if any(f.law == law and f.full is not None
                                       for f in analysis.laws)] or [LAWS[0]]
    fig, axes = plt.subplots(1, len(laws), figsize=(4.2 * len(laws), 3.6), squeeze=False)
    colors = _colors(analysis)
    for ax, law in zip(axes[0], laws):
        for group, points in sorted(analysis.cells.items()):
            xs = [p.x[law.symbol] for p in points]
            ax.scatter(xs, [p.loss for p in points], s=14, color=colors[group], alpha=0.35)
            fit = next(f for f in analysis.laws if f.group == group and f.law == law)
            label = group if fit.full is None else f"{group}: alpha={fit.full.law.alpha:.3g}" + (
                f" (E clamped at 0, residual {fit.full.residual:.1%})" if fit.full.E_clamped else "")
            ax.scatter([p.x[law.symbol] for p in fit.points], [p.loss for p in fit.points],
                       s=22, color=colors[group], label=label)
            if fit.full is not None:
                grid = np.geomspace(min(xs), max(xs), _CURVE_POINTS)
                ax.plot(grid, fit.full.law(grid), color=colors[group], lw=1.2)
        _log_axes(ax, law.label)
        ax.set_title(f"L({law.symbol})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _frontier_curve(family, extend: float = 1.5):
    """(C grid, L*(C)) of a family's joint law over its compute range, a little beyond."""
    lo, hi = family.c_range
    grid = np.geomspace(lo / extend, hi * extend, _CURVE_POINTS)
    return grid, family.allocation(grid)[2]


def compute_figure(analysis):
    """Loss against training compute per group (each cell's best run), with the joint law's
    compute-optimal frontier and the IsoFLOP optima."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.0, 3.8))
    colors = _colors(analysis)
    for group, points in sorted(analysis.cells.items()):
        family = analysis.families[group]
        ax.scatter([p.x["C"] for p in points], [p.loss for p in points], s=16, alpha=0.5,
                   color=colors[group], label=group)
        if family.joint is not None:
            grid, loss = _frontier_curve(family)
            ax.plot(grid, loss, color=colors[group], lw=1.4)
        optima = [f for f in family.isoflop if f.inside]
        if optima:
            ax.scatter([f.budget for f in optima], [f.loss_opt for f in optima], marker="*",
                       s=90, color=colors[group], edgecolor="k", lw=0.5)
    _log_axes(ax, "training FLOPs C")
    ax.set_title("loss vs compute: runs, joint-law frontier (line), IsoFLOP optima (stars)",
                 fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def isoflop_figure(analysis):
    """Per group: loss against N at each compute budget with its parabola and optimum; then,
    for the groups with a law through their optima, N*(C) and D*(C) with the laws' exponents
    and intervals."""
    plt = pyplot()
    groups = [g for g, f in sorted(analysis.families.items()) if f.isoflop]
    with_law = [g for g in groups if analysis.families[g].n_opt_law]
    panels = len(groups) + (2 if with_law else 0)
    fig, axes = plt.subplots(1, panels, figsize=(3.8 * panels, 3.5), squeeze=False)
    cmap = plt.get_cmap("viridis")
    budgets = sorted({f.budget for g in groups for f in analysis.families[g].isoflop})
    shade = {b: cmap(i / max(1, len(budgets) - 1) * 0.85) for i, b in enumerate(budgets)}
    for ax, group in zip(axes[0], groups):
        family = analysis.families[group]
        for fit in family.isoflop:
            runs = sorted((p for p in family.points if p.budget == fit.budget),
                          key=lambda p: p.x["N"])
            n = [p.x["N"] for p in runs]
            ax.scatter(n, [p.loss for p in runs], s=16, color=shade[fit.budget],
                       label=f"C={fit.budget:.2g}")
            grid = np.geomspace(min(n) / 1.5, max(n) * 1.5, _CURVE_POINTS)
            ax.plot(grid, fit(grid), color=shade[fit.budget], lw=1.0)
            if fit.inside:
                ax.scatter([fit.n_opt], [fit.loss_opt], marker="*", s=80,
                           color=shade[fit.budget], edgecolor="k", lw=0.5)
        _log_axes(ax, "parameters N", log_y=False)
        ax.set_title(f"{group}: IsoFLOP curves", fontsize=9)
        ax.legend(fontsize=6)
    colors = _colors(analysis)
    for ax, (symbol, law_of, exponent) in zip(axes[0][len(groups):], (("N", "n_opt_law", "a"),
                                                                     ("D", "d_opt_law", "b"))):
        for group in with_law:
            family = analysis.families[group]
            optima = [f for f in family.isoflop if f.inside]
            c = np.array([f.budget for f in optima])
            values = [f.n_opt for f in optima] if symbol == "N" else c / family.flops([f.n_opt for f in optima])
            law = getattr(family, law_of)
            lo, hi = family.optimum_ci.get(exponent, (math.nan, math.nan))
            ax.scatter(c, values, marker="*", s=60, color=colors[group])
            grid = np.geomspace(c.min() / 1.5, c.max() * 1.5, _CURVE_POINTS)
            ax.plot(grid, law(grid), color=colors[group], lw=1.0,
                    label=f"{group}: {exponent}={law.exponent:.2f} [{lo:.2f}, {hi:.2f}]")
        _log_axes(ax, "training FLOPs C", f"compute-optimal {symbol}*")
        ax.set_title(f"{symbol}*(C) ~ C^{exponent} (95% interval)", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def gain_figure(analysis):
    """Compute-equivalent gain against compute, with its interval, per comparison."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    colors = _colors(analysis)
    for comp in analysis.comparisons:
        color = colors[comp.group]
        ax.plot(comp.budgets, comp.gain, "o-", color=color,
                label=f"{comp.group} vs {comp.baseline}")
        ax.fill_between(comp.budgets, *comp.gain_ci, color=color, alpha=0.2)
    ax.axhline(1.0, color="0.4", lw=0.8, ls="--")
    _log_axes(ax, "training FLOPs C", "compute-equivalent gain (x)")
    ax.set_title(f"compute the baseline needs for the same loss, over C "
                 f"({analysis.comparisons[0].ci_level:.0%} band)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def axes_figure(analysis):
    """Per group: the metric against each axis (e.g. learning rate) within each cell; a cell
    whose best value is on the grid's edge is drawn dashed."""
    plt = pyplot()
    groups = sorted({c.group for c in analysis.curves})
    fig, axes = plt.subplots(1, len(groups), figsize=(3.8 * len(groups), 3.5), squeeze=False)
    for ax, group in zip(axes[0], groups):
        curves = [c for c in analysis.curves if c.group == group]
        numeric = all(isinstance(v, (int, float)) and v > 0 for c in curves for v, _ in c.values)
        for i, curve in enumerate(curves):
            xs = [v if numeric else str(v) for v, _ in curve.values]
            ax.plot(xs, [m for _, m in curve.values], "o" + ("--" if curve.at_edge else "-"),
                    color=f"C{i % 10}", lw=1.0, ms=3,
                    label=curve.cell.rsplit("-", 2)[-2] + "-" + curve.cell.rsplit("-", 1)[-1])
        if numeric:
            ax.set_xscale("log")
        edge = sum(c.at_edge for c in curves)
        ax.set_title(f"{group}: {curves[0].key} ({edge}/{len(curves)} best on an edge)",
                     fontsize=8)
        ax.set_xlabel(curves[0].key)
        ax.set_ylabel(analysis.metric)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    return fig


def make_figures(analysis) -> dict:
    """File stem -> figure, for what the analysis has."""
    figures = {"scaling": laws_figure(analysis), "compute": compute_figure(analysis)}
    if any(f.isoflop for f in analysis.families.values()):
        figures["isoflop"] = isoflop_figure(analysis)
    if analysis.comparisons:
        figures["gain"] = gain_figure(analysis)
    if analysis.curves:
        figures["axes"] = axes_figure(analysis)
    return figures


def close(figures: dict) -> None:
    plt = pyplot()
    for figure in figures.values():
        plt.close(figure)


def write_tensorboard(tb_dir: Path, analysis, figures: dict, table_md: str) -> None:
    """What a researcher opening `tensorboard --logdir tb` should see, with axes that say what
    they are and nothing smoothed: the figures, one TensorBoard run `figures` whose cards (the
    landing page) are each one panel, about the card's width (a whole figure of several panels
    shrinks to an illegible strip), titled by what the figure plots against what; the tables
    (Text); and every fitted point as an HParams session (`points/<run>`): its group, size,
    budget and axis values, N, D and C with their log10, and the metric (`point/<metric>`), so
    the HParams dashboard plots the metric against N or C per point with the axes named."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    writer = SummaryWriter(str(tb_dir / "figures"))
    for i, (name, figure) in enumerate(figures.items(), 1):
        for j, (title, panel) in enumerate(panels(figure), 1):
            writer.add_image(f"{i} {FIGURE_TITLES.get(name, name)}/{i}.{j} {title}", panel, dataformats="HWC")
    writer.add_text("fits", table_md)
    writer.close()
    tag = f"point/{analysis.metric}"
    for group, points in sorted(analysis.cells.items()):
        for p in points:
            values = {"group": group, **{law.label: p.x[law.symbol] for law in LAWS},
                      **{f"log10 {law.label}": math.log10(p.x[law.symbol]) for law in LAWS},
                      **{key: value for key, value in p.axes.items() if isinstance(value, (int, float, str))}}
            if p.budget is not None:
                values["compute budget C"] = p.budget
            if p.seed_losses:
                values["seeds"] = len(p.seed_losses)
            writer = SummaryWriter(str(tb_dir / "points" / p.run_name))
            for summary in hparams(values, {tag: p.loss}):
                writer.file_writer.add_summary(summary)
            writer.add_scalar(tag, p.loss, 0)
            writer.close()


def panels(figure, pad_px: int = 6) -> list[tuple[str, np.ndarray]]:
    """(title, RGB image) of each panel of `figure` as drawn at its dpi: the panel with its
    labels, ticks and legend."""
    figure.canvas.draw()
    image = np.asarray(figure.canvas.buffer_rgba())[..., :3]
    height, width = image.shape[:2]
    renderer = figure.canvas.get_renderer()
    out = []
    for ax in figure.axes:
        box = ax.get_tightbbox(renderer)
        top, bottom = max(0, int(height - box.y1) - pad_px), min(height, int(height - box.y0) + pad_px)
        left, right = max(0, int(box.x0) - pad_px), min(width, int(box.x1) + pad_px)
        out.append((ax.get_title() or f"panel {len(out) + 1}", image[top:bottom, left:right].copy()))
    return out


FIGURE_TITLES = {
    "compute": "loss vs training FLOPs C: every cell, each family's frontier and IsoFLOP optima",
    "isoflop": "IsoFLOP: loss vs parameters N at each budget C, and N*(C), D*(C)",
    "scaling": "loss vs N, C and D: one-variable power laws",
    "gain": "compute-equivalent gain vs C against the baseline",
    "axes": "loss vs learning rate within each cell",
}
"""Figure file stem -> the title of its TensorBoard image (what it plots against what)."""
