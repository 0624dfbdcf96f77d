"""Power-law fits L(x) = E + A x^-alpha with bootstrap confidence intervals (numpy only).

For a fixed exponent the model is linear in (E, A), so the fit searches the exponent on a
log-spaced grid (refined once around the best cell) and solves the weighted linear least squares
in closed form at every grid point ("variable projection"). Residuals are relative,
(L - L_hat) / L, so points at high and low loss weigh alike, close to a fit in log space.
Confidence intervals come from resampling runs with replacement (a case bootstrap).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_POINTS = 3
"""E, A and alpha need at least three distinct x values."""
ALPHA_RANGE = (1e-3, 5.0)
"""Exponents searched. A fit at either end is flagged: the data did not pin the exponent."""
_GRID = np.geomspace(*ALPHA_RANGE, 241)


class TooFewPoints(ValueError):
    """Fewer than MIN_POINTS distinct x values."""


@dataclass(frozen=True)
class PowerLaw:
    """L(x) = E + A * x**-alpha."""

    E: float
    """Irreducible loss (0 for a pure power law)."""
    A: float
    """Scale, in the units of x (so A * x**-alpha is a loss)."""
    alpha: float
    """Exponent: the scaling rate (larger = loss falls faster with x)."""

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * np.asarray(x, dtype=float) ** -self.alpha


@dataclass(frozen=True)
class FitResult:
    """A power law fitted to points, with percentile bootstrap intervals."""

    law: PowerLaw
    """The fit to all points."""
    n_points: int
    """Points fitted."""
    ci: dict[str, tuple[float, float]]
    """Parameter name (E, A, alpha) -> (low, high) interval; NaN with only MIN_POINTS points
    (a resample then needs every point once: the bootstrap has nothing to vary)."""
    ci_level: float
    """Coverage of the intervals, e.g. 0.95."""
    alpha_samples: np.ndarray
    """Bootstrap exponents (for comparing two fits' rates); empty when the CI is NaN."""
    at_bound: bool
    """True when the best exponent sits at an end of ALPHA_RANGE."""
    E_clamped: bool
    """True when the points call for a negative irreducible loss and E was pinned at 0 (fits
    with E only): the law then misses the points, however few they are (see `residual`)."""
    residual: float
    """Relative RMS residual of the fit to all points: sqrt(mean(((L - L_hat) / L)^2))."""


def fit_power_law(x, y, *, irreducible: bool = True, n_bootstrap: int = 1000,
                  ci_level: float = 0.95, seed: int = 0) -> FitResult:
    """Fit L(x) = E + A x^-alpha (E = 0 when `irreducible` is False) to positive x, y."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-d of equal length, got {x.shape} and {y.shape}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(x > 0) and np.all(y > 0)):
        raise ValueError("x and y must be finite and positive")
    n_distinct = len(np.unique(x))
    if n_distinct < MIN_POINTS:
        raise TooFewPoints(f"{n_distinct} distinct point(s), need at least {MIN_POINTS}")

    # Work with x / x_ref (geometric mean) so A stays O(loss) whatever the units of x.
    x_ref = float(np.exp(np.mean(np.log(x))))
    E, a, alpha = _fit(x / x_ref, y, irreducible)
    law = PowerLaw(E=E, A=a * x_ref**alpha, alpha=alpha)
    # E is 0 exactly only where `_solve_linear` pinned a negative E there
    quality = dict(at_bound=_at_bound(alpha), E_clamped=irreducible and E == 0.0 and a > 0,
                   residual=float(np.sqrt(np.mean(((y - law(x)) / y) ** 2))))

    names = ("E", "A", "alpha")
    if len(x) <= MIN_POINTS or n_bootstrap == 0:  # (every valid resample would be the data)
        nan = (float("nan"), float("nan"))
        return FitResult(law, len(x), {k: nan for k in names}, ci_level, np.empty(0), **quality)
    rng = np.random.default_rng(seed)
    samples = []
    while len(samples) < n_bootstrap:
        idx = rng.integers(0, len(x), len(x))
        if len(np.unique(x[idx])) < MIN_POINTS:
            continue  # a resample that cannot determine three parameters
        E_b, a_b, alpha_b = _fit(x[idx] / x_ref, y[idx], irreducible)
        samples.append((E_b, a_b * x_ref**alpha_b, alpha_b))
    samples_arr = np.array(samples)
    tail = 100 * (1 - ci_level) / 2
    lo, hi = np.percentile(samples_arr, [tail, 100 - tail], axis=0)
    ci = {k: (float(lo[i]), float(hi[i])) for i, k in enumerate(names)}
    return FitResult(law, len(x), ci, ci_level, samples_arr[:, 2], **quality)


def _at_bound(alpha: float) -> bool:
    return bool(np.isclose(alpha, ALPHA_RANGE[0]) or np.isclose(alpha, ALPHA_RANGE[1]))


def _fit(xn: np.ndarray, y: np.ndarray, irreducible: bool) -> tuple[float, float, float]:
    """(E, a, alpha) minimising the relative squared error of y ~ E + a xn^-alpha."""
    sse, E, a = _solve_linear(xn, y, _GRID, irreducible)
    best = int(np.argmin(sse))
    # Refine inside the neighbouring grid cells (the SSE is smooth in alpha).
    fine = np.linspace(_GRID[max(best - 1, 0)], _GRID[min(best + 1, len(_GRID) - 1)], 201)
    sse, E, a = _solve_linear(xn, y, fine, irreducible)
    best = int(np.argmin(sse))
    return float(E[best]), float(a[best]), float(fine[best])


def _solve_linear(xn, y, alphas, irreducible):
    """For each alpha: the weighted least-squares E >= 0 and a >= 0, and the residual sum."""
    w = 1.0 / y**2  # relative residuals
    f = xn[None, :] ** -alphas[:, None]  # [n_alpha, n_points]
    if irreducible:
        sw = w.sum()
        f_mean = (f * w).sum(1) / sw
        y_mean = (w * y).sum() / sw
        cov = ((f - f_mean[:, None]) * (y - y_mean) * w).sum(1)
        var = ((f - f_mean[:, None]) ** 2 * w).sum(1)
        a = cov / np.maximum(var, 1e-300)
        E = y_mean - a * f_mean
    else:
        a = np.zeros(len(alphas))
        E = np.full(len(alphas), -1.0)  # forces the E = 0 branch below
    # A negative irreducible loss is unphysical: refit with E pinned at 0.
    through_origin = (f * y * w).sum(1) / np.maximum((f**2 * w).sum(1), 1e-300)
    a = np.where(E < 0, through_origin, a)
    E = np.maximum(E, 0.0)
    # A loss that grows with x has no decreasing power law: the best is a constant.
    flat = a < 0
    E = np.where(flat, (w * y).sum() / w.sum(), E)
    a = np.where(flat, 0.0, a)
    sse = (w * (y - E[:, None] - a[:, None] * f) ** 2).sum(1)
    return sse, E, a


def rate_difference(fit: FitResult, baseline: FitResult,
                    ci_level: float = 0.95) -> tuple[float, tuple[float, float]]:
    """The EBT paper's scaling-rate comparison: (alpha - alpha_base) / alpha_base, with a
    percentile interval from pairing the two fits' independent bootstrap exponents."""
    value = (fit.law.alpha - baseline.law.alpha) / baseline.law.alpha
    if len(fit.alpha_samples) == 0 or len(baseline.alpha_samples) == 0:
        return value, (float("nan"), float("nan"))
    n = min(len(fit.alpha_samples), len(baseline.alpha_samples))
    ratios = (fit.alpha_samples[:n] - baseline.alpha_samples[:n]) / baseline.alpha_samples[:n]
    tail = 100 * (1 - ci_level) / 2
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return value, (float(lo), float(hi))


@dataclass(frozen=True)
class IsoFlopFit:
    """Loss against log N at one compute budget: L = curvature (ln N - ln N*)^2 + L*
    (Chinchilla's approach 2)."""

    budget: float
    """The compute budget C of the runs."""
    coef: tuple[float, float, float]
    """(a, b, c) of L = a x^2 + b x + c with x = ln N."""
    n_opt: float
    """N* at the parabola's minimum; NaN when the parabola has none (a <= 0)."""
    loss_opt: float
    """L at N* (NaN without a minimum)."""
    inside: bool
    """N* lies within the fitted sizes (an optimum outside them is an extrapolation)."""
    n_points: int
    """Runs fitted."""

    def __call__(self, n) -> np.ndarray:
        return np.polyval(self.coef, np.log(np.asarray(n, dtype=float)))


def fit_isoflop(n, loss, budget: float) -> IsoFlopFit:
    """Least-squares parabola of the loss in ln N through the runs of one compute budget."""
    n = np.asarray(n, dtype=float)
    loss = np.asarray(loss, dtype=float)
    distinct = len(np.unique(n))
    if distinct < MIN_POINTS:
        raise TooFewPoints(f"{distinct} distinct size(s) at C={budget:.3g}, need at least "
                           f"{MIN_POINTS}")
    a, b, c = (float(v) for v in np.polyfit(np.log(n), loss, 2))
    if a <= 0:
        return IsoFlopFit(budget, (a, b, c), math.nan, math.nan, False, len(n))
    x_opt = -b / (2 * a)
    n_opt = math.exp(x_opt)
    return IsoFlopFit(budget, (a, b, c), n_opt, c - b * b / (4 * a),
                      bool(n.min() <= n_opt <= n.max()), len(n))


@dataclass(frozen=True)
class PowerFit:
    """y = scale * x**exponent, fitted by least squares in log-log."""

    scale: float
    exponent: float
    n_points: int

    def __call__(self, x) -> np.ndarray:
        return self.scale * np.asarray(x, dtype=float) ** self.exponent


def fit_power(x, y) -> PowerFit:
    """Straight line through (ln x, ln y); two distinct x at least."""
    x, y = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    if len(np.unique(x)) < 2:
        raise TooFewPoints(f"{len(np.unique(x))} distinct point(s), need at least 2")
    slope, intercept = np.polyfit(x, y, 1)
    return PowerFit(float(np.exp(intercept)), float(slope), len(x))
