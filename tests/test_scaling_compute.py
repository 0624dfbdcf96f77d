"""Scaling at equal compute: the joint law, IsoFLOP parabolas, the compute-optimal allocation and
compute-equivalent gains, each recovered from synthetic runs drawn from known laws with noise."""
import math

import numpy as np
import pytest

from pretrain.scaling.allocation import FlopsModel, compute_equivalent_gain, optimal_allocation
from pretrain.scaling.analysis import Point, analyse_family, compare
from pretrain.scaling.fit import TooFewPoints, fit_isoflop, fit_power
from pretrain.scaling.joint import JointLaw, TooFewRuns, fit_joint_law

# A Chinchilla-like law at small scale: both terms matter over the grid below.
TRUE = JointLaw(E=1.8, A=60.0, alpha=0.35, B=300.0, beta=0.30)
SIX_N = FlopsModel(math.log(6.0), 1.0)
"""C = 6 N D: the allocation then has a closed form to check against."""
N_GRID = np.geomspace(1e4, 1e6, 4)
D_GRID = np.geomspace(1e6, 1e8, 4)


def analytic_optimum(law: JointLaw, c: float) -> float:
    """N*(C) of L = E + A N^-a + B D^-b with C = 6 N D: dL/dN = 0 gives
    N* = (a A / (b B))^(1 / (a + b)) (C / 6)^(b / (a + b))."""
    a, b = law.alpha, law.beta
    return (a * law.A / (b * law.B)) ** (1 / (a + b)) * (c / 6) ** (b / (a + b))


def noisy_grid(seed: int, noise: float = 0.005):
    n, d = np.meshgrid(N_GRID, D_GRID, indexing="ij")
    n, d = n.ravel(), d.ravel()
    rng = np.random.default_rng(seed)
    return n, d, TRUE(n, d) * np.exp(noise * rng.standard_normal(n.size))


def test_optimal_allocation_matches_the_closed_form():
    budgets = np.array([1e11, 1e12, 1e13])
    n_opt, d_opt, l_opt = optimal_allocation(TRUE, SIX_N, budgets, (1e4, 1e6))
    for c, n, d, loss in zip(budgets, n_opt, d_opt, l_opt):
        assert n == pytest.approx(analytic_optimum(TRUE, c), rel=0.01)
        assert 6 * n * d == pytest.approx(c, rel=1e-9)
        assert loss == pytest.approx(TRUE(n, d))
    # The optimum is a minimum: 20% off N* in either direction costs loss.
    for factor in (0.8, 1.25):
        n = n_opt[1] * factor
        assert TRUE(n, 1e12 / (6 * n)) > l_opt[1]


def test_joint_law_recovers_parameters_optimum_and_resists_an_outlier():
    n, d, loss = noisy_grid(seed=0)
    fit = fit_joint_law(n, d, loss, n_bootstrap=0)
    law = fit.law
    # 0.5% noise on 16 runs: E within 7%, the exponents within 10% (E is the least
    # determined: the smallest loss of the grid is still 1.9 x E).
    assert law.E == pytest.approx(TRUE.E, rel=0.07)
    assert law.alpha == pytest.approx(TRUE.alpha, rel=0.10)
    assert law.beta == pytest.approx(TRUE.beta, rel=0.10)
    assert fit.at_bound == ()
    # What the fit is for: the compute-optimal size, within 25% over a decade beyond the data.
    for c in (1e11, 1e12):
        n_opt = optimal_allocation(law, SIX_N, [c], (1e4, 1e6))[0][0]
        assert n_opt == pytest.approx(analytic_optimum(TRUE, c), rel=0.25)
    # A diverged run (loss 30% too high) barely moves the Huber fit.
    loss[5] *= 1.3
    robust = fit_joint_law(n, d, loss, n_bootstrap=0).law
    assert robust.alpha == pytest.approx(law.alpha, rel=0.1)
    assert robust.beta == pytest.approx(law.beta, rel=0.1)


def test_joint_law_intervals_cover_the_truth_at_about_the_stated_rate():
    """Nominal 90% intervals over 12 independent synthetic sweeps: a count below 8 would be
    undercoverage (P < 3% for a calibrated interval)."""
    covered = {"alpha": 0, "beta": 0, "E": 0}
    reps = 12
    for seed in range(reps):
        n, d, loss = noisy_grid(seed=100 + seed, noise=0.01)
        fit = fit_joint_law(n, d, loss, n_bootstrap=30, ci_level=0.9, seed=seed)
        for name in covered:
            lo, hi = fit.ci(name)
            assert lo < hi
            covered[name] += lo <= getattr(TRUE, name) <= hi
    assert all(count >= 8 for count in covered.values()), covered


def test_joint_law_needs_enough_runs():
    with pytest.raises(TooFewRuns, match="at least 6 runs and 3 distinct values of each"):
        fit_joint_law([1e4, 1e5, 1e6, 1e4, 1e5], [1e6, 1e7, 1e8, 1e7, 1e8], [3, 2.8, 2.6, 2.9, 2.7])
    with pytest.raises(TooFewRuns, match="2 distinct N"):
        fit_joint_law([1e4, 1e5] * 3, [1e6, 1e7, 1e8] * 2, [3, 2.8, 2.6, 2.9, 2.7, 2.5])


def test_isoflop_parabolas_recover_the_optimum_and_its_exponent():
    """Approach 2 on runs around the optimum of three budgets: N* within 15%, and the exponent
    of N*(C) within 0.05 of beta / (alpha + beta)."""
    budgets = [1e11, 1e12, 1e13]
    rng = np.random.default_rng(3)
    optima = []
    for c in budgets:
        n = analytic_optimum(TRUE, c) * np.geomspace(1 / 4, 4, 7)
        loss = TRUE(n, c / (6 * n)) * np.exp(0.002 * rng.standard_normal(n.size))
        fit = fit_isoflop(n, loss, c)
        assert fit.inside
        assert fit.n_opt == pytest.approx(analytic_optimum(TRUE, c), rel=0.15)
        optima.append(fit.n_opt)
    law = fit_power(budgets, optima)
    assert law.exponent == pytest.approx(TRUE.beta / (TRUE.alpha + TRUE.beta), abs=0.05)
    # Sizes all on one side of the optimum: the optimum is flagged as outside them.
    n = analytic_optimum(TRUE, 1e12) * np.geomspace(4, 16, 4)
    assert not fit_isoflop(n, TRUE(n, 1e12 / (6 * n)), 1e12).inside
    with pytest.raises(TooFewPoints, match="2 distinct size"):
        fit_isoflop([1e4, 1e5, 1e5], [3.0, 2.9, 2.95], 1e12)


def _isoflop_points(noise: float, seed: int, seeds_at_optimum: int = 1) -> list[Point]:
    """Five sizes around the optimum of each of three budgets (C = 6 N D), the loss with
    Gaussian noise of `noise` nats; the size nearest the optimum as the mean of
    `seeds_at_optimum` seeds, as `report.best_of_cells` gives it."""
    rng = np.random.default_rng(seed)
    points = []
    for c in (1e11, 1e12, 1e13):
        for i, n in enumerate(analytic_optimum(TRUE, c) * np.geomspace(1 / 4, 4, 5)):
            losses = tuple(float(TRUE(n, c / (6 * n))) + noise * rng.standard_normal(
                seeds_at_optimum if i == 2 else 1))
            points.append(Point(f"c{c:g}-{i}", {"N": n, "D": c / (6 * n), "C": c},
                                sum(losses) / len(losses), f"c{c:g}-{i}", c, {}, 6 * n,
                                losses if len(losses) > 1 else ()))
    return points


def test_isoflop_optimum_intervals_cover_the_true_exponents_and_widen_with_noise():
    """The bootstrap of N*(C): its interval for a holds beta / (alpha + beta), b's holds
    alpha / (alpha + beta), D*/N* at the middle budget is inside its interval (within the parabola's bias), and ten times the
    run noise gives a wider interval for a. The noise assumed is the seeds' spread where seeds ran, at least the parabolas' scatter."""
    a_true = TRUE.beta / (TRUE.alpha + TRUE.beta)
    widths = []
    for noise in (0.002, 0.02):
        family = analyse_family("g", _isoflop_points(noise, seed=5, seeds_at_optimum=3),
                                n_bootstrap=400, seed=0)
        (a_lo, a_hi), (b_lo, b_hi) = family.optimum_ci["a"], family.optimum_ci["b"]
        assert a_lo < a_true < a_hi and b_lo < 1 - a_true < b_hi
        assert family.n_opt_law.exponent == pytest.approx(a_true, abs=a_hi - a_lo)
        assert noise / 3 < family.noise_sd < 3 * noise
        n_opt = analytic_optimum(TRUE, 1e12)  # the budgets' geometric mean
        lo, hi = family.optimum_ci["tokens_per_param"]
        # (a parabola in ln N is not the law's IsoFLOP curve: its vertex is off by a few %)
        assert lo / 1.1 < 1e12 / (6 * n_opt) / n_opt < hi * 1.1
        widths.append(a_hi - a_lo)
    assert widths[1] > 2 * widths[0]


def _family_points(law: JointLaw, seed: int, noise: float = 0.005):
    n, d = (a.ravel() for a in np.meshgrid(N_GRID, D_GRID, indexing="ij"))
    loss = law(n, d) * np.exp(noise * np.random.default_rng(seed).standard_normal(n.size))
    return [Point(f"r{i}", {"N": n[i], "D": d[i], "C": 6 * n[i] * d[i]}, float(loss[i]), f"r{i}",
                  None, {}, 6 * n[i]) for i in range(len(n))]


def test_compute_equivalent_gain_of_a_known_factor():
    """A family whose loss at (N, D) is the baseline's at (N, k D) reaches, at C, the loss the
    baseline reaches at k C: its gain is k at every budget, and its exponents are the same."""
    k = 3.0
    better = JointLaw(TRUE.E, TRUE.A, TRUE.alpha, TRUE.B * k**-TRUE.beta, TRUE.beta)
    budgets = np.geomspace(1e11, 1e13, 5)
    side = lambda law: (law, SIX_N, (1e4, 1e6))  # noqa: E731
    assert compute_equivalent_gain(side(better), side(TRUE), budgets) == pytest.approx(k, rel=0.01)
    assert compute_equivalent_gain(side(TRUE), side(better), budgets) == pytest.approx(1 / k,
                                                                                       rel=0.01)
    # The same from noisy runs through the fits, with intervals that contain k and no
    # exponent difference.
    family = analyse_family("f", _family_points(better, 1), n_bootstrap=40, seed=1)
    baseline = analyse_family("b", _family_points(TRUE, 2), n_bootstrap=40, seed=2)
    comparison = compare(family, baseline)
    middle = len(comparison.budgets) // 2
    assert comparison.gain[middle] == pytest.approx(k, rel=0.35)
    lo, hi = comparison.gain_ci[0][middle], comparison.gain_ci[1][middle]
    assert lo < k < hi and hi / lo < 10
    for name in ("alpha", "beta"):
        _, delta, (lo, hi) = comparison.exponents[name]
        assert lo < 0 < hi


def test_gain_is_nan_where_the_baseline_frontier_is_undefined():
    """A baseline whose loss only falls with smaller models (no optimum within the search) has
    no frontier: the gain is NaN, not an error."""
    no_optimum = JointLaw(E=1.0, A=0.0, alpha=0.3, B=50.0, beta=0.3)
    gain = compute_equivalent_gain((TRUE, SIX_N, (1e4, 1e6)), (no_optimum, SIX_N, (1e4, 1e6)),
                                   [1e11, 1e12])
    assert np.isnan(gain).all()


def test_a_cells_seeds_are_averaged_and_its_best_learning_rate_kept():
    """Runs differing only in their seed are one variant, its loss their mean (a lucky seed
    does not pick the variant); the cell keeps its best variant over the other axes."""
    from pretrain.scaling.report import best_of_cells

    def run(name, lr, loss, seed=None):
        axes = {"optimizer.lr": lr} | ({"seed": seed} if seed is not None else {})
        return Point(name, {"N": 1e4, "D": 1e6, "C": 6e10}, loss, "cell", 6e10, axes, 6e4)

    runs = [run("a", 1e-3, 2.00), run("a1", 1e-3, 2.10, seed=1), run("a2", 1e-3, 2.12, seed=2),
            run("b", 3e-3, 2.05), run("other", 1e-3, 3.0)]
    runs[-1] = Point("other", runs[-1].x, 3.0, "other-cell", 6e10, {"optimizer.lr": 1e-3}, 6e4)
    best = best_of_cells(runs)
    assert [p.run_name for p in best] == ["b", "other"]  # 2.05 beats the seeds' mean 2.073
    assert best[0].seed_losses == () and best[1].loss == 3.0
    best = best_of_cells(runs[:3] + runs[4:])
    assert best[0].loss == pytest.approx((2.00 + 2.10 + 2.12) / 3)
    assert best[0].seed_losses == (2.00, 2.10, 2.12)
