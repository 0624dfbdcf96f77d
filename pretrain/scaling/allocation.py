"""Compute-optimal allocation and compute-equivalent gains from fitted laws.

A run of a model with N parameters trained on D tokens costs C = flops_per_token(N) x D. The
FLOPs per token are each family's own (the trainer's accounting: recurrent steps, EBT's descent
and second-order backward, the readout), so they are not 6 N: `FlopsModel` interpolates them
through the family's runs as a power of N. The compute-optimal model at budget C minimises
L(N, C / flops_per_token(N)) over N; the frontier L*(C) is that minimum. The compute-equivalent
gain of a family against a baseline at C is C_base / C, where C_base is the compute at which
the baseline's frontier reaches the family's frontier loss at C: above 1 the family needs less
compute for the same loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pretrain.scaling.joint import JointLaw

N_SEARCH_DECADES = 3.0
"""The optimum is searched from 10^-3 x the smallest to 10^3 x the largest N fitted; an optimum
at either end is reported as outside the search (NaN)."""
GAIN_SEARCH_DECADES = 3.0
"""Baseline compute is searched within 10^-3 .. 10^3 x C; a loss the baseline does not reach
in that range gives no gain (NaN)."""
_N_GRID_POINTS = 601


@dataclass(frozen=True)
class FlopsModel:
    """Training FLOPs per token = exp(log_scale) * N**exponent, fitted to a family's runs."""

    log_scale: float
    """Natural log of the FLOPs per token at N = 1."""
    exponent: float
    """How FLOPs per token grow with N (1 for 6N; less when the readout dominates)."""

    @classmethod
    def fit(cls, n, flops_per_token) -> FlopsModel:
        """Least squares in log-log through (N, FLOPs per token) pairs; a single model size
        gives exponent 1 (FLOPs proportional to N, the 6N convention)."""
        log_n, log_f = np.log(np.asarray(n, float)), np.log(np.asarray(flops_per_token, float))
        if len(np.unique(log_n)) < 2:
            return cls(float(np.mean(log_f - log_n)), 1.0)
        slope, intercept = np.polyfit(log_n, log_f, 1)
        return cls(float(intercept), float(slope))

    def __call__(self, n) -> np.ndarray:
        return np.exp(self.log_scale) * np.asarray(n, dtype=float) ** self.exponent


def optimal_allocation(law: JointLaw, flops: FlopsModel, budgets, n_range: tuple[float, float]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N*, D*, L*) at each compute budget: the N minimising L(N, C / flops_per_token(N)) on a
    log grid around `n_range` (the fitted sizes), refined by a parabola through the best grid
    point and its neighbours; NaN where the optimum lies at the end of the searched range."""
    budgets = np.atleast_1d(np.asarray(budgets, dtype=float))
    log_n = np.linspace(np.log(n_range[0]) - N_SEARCH_DECADES * np.log(10),
                        np.log(n_range[1]) + N_SEARCH_DECADES * np.log(10), _N_GRID_POINTS)
    n = np.exp(log_n)
    loss = law(n[None, :], budgets[:, None] / flops(n)[None, :])  # [budgets, grid]
    best = loss.argmin(1)
    inside = (best > 0) & (best < len(n) - 1)
    i = np.clip(best, 1, len(n) - 2)
    rows = np.arange(len(budgets))
    y0, y1, y2 = loss[rows, i - 1], loss[rows, i], loss[rows, i + 1]
    curvature = y0 - 2 * y1 + y2
    shift = np.where(curvature > 0, 0.5 * (y0 - y2) / np.where(curvature > 0, curvature, 1), 0)
    step = log_n[1] - log_n[0]
    n_opt = np.exp(log_n[i] + np.clip(shift, -1, 1) * step)
    d_opt = budgets / flops(n_opt)
    l_opt = law(n_opt, d_opt)
    nan = np.full(len(budgets), np.nan)
    return (np.where(inside, n_opt, nan), np.where(inside, d_opt, nan),
            np.where(inside, l_opt, nan))


def frontier(law: JointLaw, flops: FlopsModel, budgets, n_range) -> np.ndarray:
    """L*(C): the lowest loss the law gives at each compute budget."""
    return optimal_allocation(law, flops, budgets, n_range)[2]


def compute_equivalent_gain(family: tuple[JointLaw, FlopsModel, tuple[float, float]],
                            baseline: tuple[JointLaw, FlopsModel, tuple[float, float]],
                            budgets) -> np.ndarray:
    """C_base / C at each budget C (see the module docstring); each side is (law, FLOPs model,
    fitted N range)."""
    budgets = np.atleast_1d(np.asarray(budgets, dtype=float))
    target = frontier(*family[:2], budgets, family[2])
    span = GAIN_SEARCH_DECADES
    grid = np.geomspace(budgets.min() * 10**-span, budgets.max() * 10**span, 400)
    base = frontier(*baseline[:2], grid, baseline[2])
    ok = np.isfinite(base)
    grid, base = grid[ok], base[ok]
    gain = np.full(len(budgets), np.nan)
    if len(base) < 2:
        return gain
    # The frontier falls with compute: interpolate log C as a function of the loss, where the
    # baseline's frontier is strictly decreasing (np.interp wants increasing abscissae).
    keep = np.concatenate([[True], np.diff(base) < 0])
    grid, base = grid[keep], base[keep]
    reached = np.isfinite(target) & (target <= base[0]) & (target >= base[-1])
    log_c = np.interp(target[reached], base[::-1], np.log(grid[::-1]))
    gain[reached] = np.exp(log_c) / budgets[reached]
    return gain


def frontier_slope(law: JointLaw, flops: FlopsModel, c_range: tuple[float, float],
                   n_range: tuple[float, float]) -> float:
    """The mean log-log slope -d log L* / d log C of the frontier over `c_range` (the scaling
    rate in compute, as the EBT paper compares it)."""
    low, high = frontier(law, flops, list(c_range), n_range)
    return float(-(np.log(high) - np.log(low)) / (np.log(c_range[1]) - np.log(c_range[0])))
