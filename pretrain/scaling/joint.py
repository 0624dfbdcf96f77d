"""The joint law L(N, D) = E + A / N^alpha + B / D^beta (Chinchilla's approach 3), numpy only.

For fixed exponents the law is linear in (E, A, B), so the fit is a variable projection: the
exponents are searched on a log grid (refined once around the best cell) and at every grid point
E, A, B >= 0 are solved in closed form. The loss is Huber's on relative residuals
(L - L_hat) / L, i.e. on log L to first order, as Chinchilla and its replication use; it is
minimised by iteratively reweighted least squares, so a few outlying runs (a diverged learning
rate, a lucky seed) pull the fit far less than under least squares. A grid instead of a local
optimiser started from a few points cannot end in a local minimum of the exponents it did not
look at, and gives the same answer on every machine. Intervals: runs resampled with replacement.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

EXPONENT_RANGE = (0.01, 3.0)
"""Exponents searched; a fit at either end is flagged (the data did not pin that exponent)."""
HUBER_DELTA = 1e-3
"""Huber's threshold on the relative (log) residual, Chinchilla's choice: residuals above it
count linearly."""
MIN_DISTINCT = 3
"""Distinct N and distinct D values needed: each of A, alpha and B, beta needs three."""
MIN_POINTS = 6
"""Runs needed for five parameters with one degree of freedom left."""
_COARSE = np.geomspace(*EXPONENT_RANGE, 24)
_IRLS_ITERATIONS = (2, 5, 5, 5)
"""Reweighting rounds on the coarse grid and on each refinement."""
_BATCH_ELEMENTS = 4_000_000
"""Grid points x runs per batched solve (bounds the memory of fitting many resamples at once)."""
# Subsets of (E, A, B) left free when the unconstrained solution has a negative coefficient.
_SUBSETS = [np.array(s) for r in (3, 2, 1) for s in itertools.combinations(range(3), r)]


class TooFewRuns(ValueError):
    """Too few runs, or too few distinct N or D, for the joint law."""


@dataclass(frozen=True)
class JointLaw:
    """L(N, D) = E + A * N**-alpha + B * D**-beta."""

    E: float
    """Irreducible loss."""
    A: float
    """Scale of the parameter term."""
    alpha: float
    """Exponent of N."""
    B: float
    """Scale of the data term."""
    beta: float
    """Exponent of D."""

    def __call__(self, n, d) -> np.ndarray:
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        return self.E + self.A * n**-self.alpha + self.B * d**-self.beta


PARAMETERS = ("E", "A", "alpha", "B", "beta")


@dataclass(frozen=True)
class JointFit:
    """A joint law fitted to runs, with its bootstrap laws."""

    law: JointLaw
    """The fit to all runs."""
    n_points: int
    """Runs fitted."""
    samples: tuple[JointLaw, ...]
    """The fits to the bootstrap resamples (empty when not bootstrapped)."""
    ci_level: float
    """Coverage of the percentile intervals."""
    at_bound: tuple[str, ...]
    """Names of the exponents that sit at an end of EXPONENT_RANGE."""

    def ci(self, name: str) -> tuple[float, float]:
        """Percentile interval of parameter `name` (NaN without bootstrap samples)."""
        return percentile_interval([getattr(s, name) for s in self.samples], self.ci_level)


def percentile_interval(values, ci_level: float) -> tuple[float, float]:
    """(low, high) percentile interval of the finite `values`; NaN when there are none."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan")
    tail = 100 * (1 - ci_level) / 2
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def fit_joint_law(n, d, loss, *, n_bootstrap: int = 1000, ci_level: float = 0.95,
                  seed: int = 0, huber_delta: float = HUBER_DELTA) -> JointFit:
    """Fit L(N, D) = E + A N^-alpha + B D^-beta to runs with N parameters, D tokens and `loss`."""
    n, d, loss = (np.asarray(v, dtype=float) for v in (n, d, loss))
    if not (n.shape == d.shape == loss.shape and n.ndim == 1):
        raise ValueError("N, D and the losses must be 1-d of equal length")
    if not all(np.all(np.isfinite(v)) and np.all(v > 0) for v in (n, d, loss)):
        raise ValueError("N, D and the losses must be finite and positive")
    n_distinct, d_distinct = len(np.unique(n)), len(np.unique(d))
    if len(n) < MIN_POINTS or min(n_distinct, d_distinct) < MIN_DISTINCT:
        raise TooFewRuns(f"{len(n)} runs with {n_distinct} distinct N and {d_distinct} distinct "
                         f"D; the joint law needs at least {MIN_POINTS} runs and "
                         f"{MIN_DISTINCT} distinct values of each")
    # Work with N / N_ref and D / D_ref (geometric means) so the scales stay O(loss).
    n_ref, d_ref = np.exp(np.mean(np.log(n))), np.exp(np.mean(np.log(d)))

    def fit(counts: np.ndarray) -> list[JointLaw]:
        found = _fit(n / n_ref, d / d_ref, loss, counts, huber_delta)
        return [JointLaw(E, a * n_ref**alpha, alpha, b * d_ref**beta, beta)
                for E, a, alpha, b, beta in found]

    (law,) = fit(np.ones((1, len(n))))
    # A case-bootstrap resample is a vector of counts (how often each run was drawn), so many
    # resamples are fitted at once as rows of one weighted problem.
    rng = np.random.default_rng(seed)
    counts = []
    while len(counts) < n_bootstrap:
        drawn = rng.multinomial(len(n), np.full(len(n), 1 / len(n)))
        if min(len(np.unique(n[drawn > 0])), len(np.unique(d[drawn > 0]))) >= MIN_DISTINCT:
            counts.append(drawn)  # else a resample that cannot determine both exponents
    samples: list[JointLaw] = []
    chunk = max(1, _BATCH_ELEMENTS // (len(_COARSE) ** 2 * len(n)))
    for start in range(0, len(counts), chunk):
        samples += fit(np.array(counts[start:start + chunk], dtype=float))
    at_bound = tuple(name for name in ("alpha", "beta")
                     if np.isclose(getattr(law, name), EXPONENT_RANGE).any())
    return JointFit(law, len(n), tuple(samples), ci_level, at_bound)


def _fit(n, d, loss, counts, huber_delta) -> np.ndarray:
    """[(E, a, alpha, b, beta)] for each row of run weights `counts`: the best point of a
    coarse exponent grid, then, three times, the best point of a finer grid spanning the
    neighbouring cells of the last best point."""
    rows = len(counts)
    alphas = np.tile(_COARSE, (rows, 1))
    betas = alphas.copy()
    for iterations in _IRLS_ITERATIONS:
        ka, kb = alphas.shape[1], betas.shape[1]
        grid_a = np.repeat(alphas, kb, axis=1).ravel()  # [rows * ka * kb], row-major per fit
        grid_b = np.tile(betas, (1, ka)).ravel()
        weights = np.repeat(counts, ka * kb, axis=0)
        objective, coef = _solve(n, d, loss, grid_a, grid_b, weights, huber_delta, iterations)
        best = objective.reshape(rows, ka * kb).argmin(1)
        flat = np.arange(rows) * ka * kb + best
        result = np.stack([coef[flat, 0], coef[flat, 1], grid_a[flat], coef[flat, 2],
                           grid_b[flat]], 1)
        i, j = best // kb, best % kb
        alphas = _refined(alphas, i)
        betas = _refined(betas, j)
    return result


def _refined(grid: np.ndarray, best: np.ndarray, points: int = 9) -> np.ndarray:
    """Per row, `points` values spanning the cells next to the row's best grid value."""
    rows = np.arange(len(grid))
    lo = grid[rows, np.maximum(best - 1, 0)]
    hi = grid[rows, np.minimum(best + 1, grid.shape[1] - 1)]
    return lo[:, None] + (hi - lo)[:, None] * np.linspace(0, 1, points)[None, :]


def _solve(n, d, loss, alphas, betas, weights, huber_delta, iterations):
    """For every (alpha, beta) pair, with its run weights: E, a, b >= 0 minimising the Huber
    loss of the relative residuals (by `iterations` rounds of reweighted least squares), and
    that loss."""
    # The three columns of the design matrix at every grid point: 1, n^-alpha, d^-beta.
    columns = (np.ones((len(alphas), len(n))), n[None, :] ** -alphas[:, None],
               d[None, :] ** -betas[:, None])
    huber_w = np.ones_like(weights)
    for _ in range(iterations):
        coef = _nonnegative_wls(columns, loss, weights * huber_w / loss**2)
        r = (loss - sum(coef[:, k, None] * columns[k] for k in range(3))) / loss
        # Huber's weights: 1 inside the threshold, delta / |r| outside.
        huber_w = np.minimum(1.0, huber_delta / np.maximum(np.abs(r), 1e-12))
    abs_r = np.abs(r)
    huber = np.where(abs_r <= huber_delta, 0.5 * r**2, huber_delta * (abs_r - 0.5 * huber_delta))
    return (weights * huber).sum(axis=1), coef


def _nonnegative_wls(columns, y, w):
    """argmin_{c >= 0} sum_r w (y - sum_k c_k columns_k)^2 for every grid row: the
    unconstrained solution where it is feasible, else the best feasible one with some
    coefficients held at 0 (the non-negative least-squares optimum is one of these)."""
    # Normal equations from the pairwise weighted sums ([grid] each: cheap for tiny systems).
    weighted = [w * col for col in columns]
    gram = np.empty((len(w), 3, 3))
    for k in range(3):
        for j in range(k, 3):
            gram[:, k, j] = gram[:, j, k] = np.einsum("gr,gr->g", weighted[k], columns[j])
    rhs = np.stack([weighted[k] @ y for k in range(3)], -1)
    yy = w @ (y * y)
    best = np.zeros_like(rhs)
    best_sse = np.full(len(rhs), np.inf)
    todo = np.arange(len(rhs))
    for subset in _SUBSETS:
        k = len(subset)
        # A tiny ridge keeps near-collinear columns (n^-alpha ~ 1 as alpha -> 0) solvable.
        g = gram[np.ix_(todo, subset, subset)] + 1e-12 * np.eye(k)
        r = rhs[np.ix_(todo, subset)]
        c = np.linalg.solve(g, r[..., None])[..., 0]
        # At a least-squares solution the residual sum is y'Wy - c'X'Wy.
        sse = yy[todo] - (c * r).sum(1)
        feasible = (c >= 0).all(1)
        better = feasible & (sse < best_sse[todo])
        best_sse[todo[better]] = sse[better]
        best[todo[better]] = 0.0
        best[np.ix_(todo[better], subset)] = c[better]
        if k == 3:  # rows whose unconstrained solution is feasible are done
            todo = todo[~feasible]
            if todo.size == 0:
                break
    return best
