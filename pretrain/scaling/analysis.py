"""Scaling at equal compute, per family: IsoFLOP parabolas (Chinchilla's approach 2), the joint
law L(N, D) (approach 3) with the compute-optimal allocation it implies, and each family's
compute-equivalent gain and exponent differences against its baseline, with bootstrap intervals.

Inputs are `Point`s (one per sweep cell: the cell's best run, see `report.best_of_cells`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pretrain.scaling.allocation import (FlopsModel, compute_equivalent_gain, frontier_slope,
                                         optimal_allocation)
from pretrain.scaling.fit import (MIN_POINTS, IsoFlopFit, PowerFit, TooFewPoints, fit_isoflop,
                                  fit_power)
from pretrain.scaling.joint import (JointFit, JointLaw, TooFewRuns, fit_joint_law,
                                    percentile_interval)

GAIN_BUDGETS = 7
"""Compute budgets (log-spaced over the compared runs' range) at which gains are reported."""
EXPONENTS = ("alpha", "beta", "compute_slope")
"""Exponents compared with the baseline: the joint law's alpha and beta, and the mean log-log
slope of its frontier L*(C) over the compared compute range."""


@dataclass(frozen=True)
class Law:
    """One of the laws fitted per family: the metric against N, C or D of a `Point`."""

    symbol: str
    """N, D or C."""
    name: str
    """Word used in tags and file names."""
    label: str
    """Axis label."""


LAWS = (
    Law("N", "params", "parameters N"),
    Law("C", "flops", "training FLOPs C"),
    Law("D", "tokens", "training tokens D"),
)


@dataclass(frozen=True)
class Point:
    """One run (or one cell's best run) as the fits see it."""

    run_name: str
    x: dict[str, float]
    """N (parameters), D (tokens) and C (training FLOPs) of the run."""
    loss: float
    """The fitted metric (lower is better)."""
    cell: str
    """Sweep cell: runs differing only in axis values share it (else the run's name)."""
    budget: float | None
    """The sweep's compute budget of the run (None: not a compute-budget sweep)."""
    axes: dict = field(default_factory=dict, compare=False)
    """Axis key -> value of the run (e.g. {"optimizer.lr": 0.003})."""
    flops_per_token: float = math.nan
    """Training FLOPs per token of the run's model."""
    seed_losses: tuple[float, ...] = field(default=(), compare=False)
    """The metric of each seed when the point is a mean over seeds (`loss` is their mean);
    empty for a single run."""


@dataclass
class FamilyAnalysis:
    """What one family's runs say about compute-optimal scaling."""

    group: str
    points: list[Point]
    isoflop: list[IsoFlopFit] = field(default_factory=list)
    """One parabola per compute budget with enough sizes."""
    n_opt_law: PowerFit | None = None
    """N*(C) = k C^a through the parabolas' interior optima."""
    d_opt_law: PowerFit | None = None
    """D*(C) = C / flops_per_token(N*(C)), likewise."""
    optimum_ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Percentile intervals of the IsoFLOP optimum: `a` and `b` (the exponents of N*(C) and
    D*(C)) and `tokens_per_param` (D*/N* at the geometric mean of the budgets), from
    `optimum_bootstrap`."""
    noise_sd: float = math.nan
    """The loss noise of one run that the bootstrap of the optimum assumes (see
    `optimum_bootstrap`)."""
    joint: JointFit | None = None
    """L(N, D) = E + A / N^alpha + B / D^beta."""
    flops: FlopsModel | None = None
    """FLOPs per token against N through the family's runs."""
    notes: list[str] = field(default_factory=list)

    @property
    def n_range(self) -> tuple[float, float]:
        n = [p.x["N"] for p in self.points]
        return min(n), max(n)

    @property
    def c_range(self) -> tuple[float, float]:
        c = [p.x["C"] for p in self.points]
        return min(c), max(c)

    def allocation(self, budgets, law: JointLaw | None = None):
        """(N*, D*, L*) of the joint law (or of `law`, e.g. a bootstrap sample) at `budgets`."""
        return optimal_allocation(law or self.joint.law, self.flops, budgets, self.n_range)

    def allocation_exponents(self, law: JointLaw | None = None) -> tuple[float, float]:
        """The exponents a, b of N* ~ C^a and D* ~ C^b implied by the joint law over the
        family's compute range (a + b is the FLOPs-per-token correction of 1)."""
        lo, hi = self.c_range
        n_opt, d_opt, _ = self.allocation([lo, hi], law)
        span = math.log(hi / lo)
        return (float(np.log(n_opt[1] / n_opt[0]) / span),
                float(np.log(d_opt[1] / d_opt[0]) / span))


def analyse_family(group: str, points: list[Point], *, n_bootstrap: int, seed: int,
                   ci_level: float = 0.95) -> FamilyAnalysis:
    """IsoFLOP parabolas per budget, N*(C) and D*(C) through them, and the joint law."""
    result = FamilyAnalysis(group, points)
    result.flops = FlopsModel.fit([p.x["N"] for p in points],
                                  [p.flops_per_token for p in points])
    by_budget: dict[float, list[Point]] = {}
    for p in points:
        if p.budget is not None:
            by_budget.setdefault(p.budget, []).append(p)
    for budget, runs in sorted(by_budget.items()):
        try:
            fit = fit_isoflop([p.x["N"] for p in runs], [p.loss for p in runs], budget)
        except TooFewPoints as err:
            result.notes.append(f"IsoFLOP: {err}")
            continue
        result.isoflop.append(fit)
        if not fit.inside:
            where = "no minimum (loss not convex in log N)" if math.isnan(fit.n_opt) else \
                f"optimum N*={fit.n_opt:.3g} outside the sizes run"
            result.notes.append(f"IsoFLOP C={budget:.3g}: {where}; widen the sizes")
    interior = [f for f in result.isoflop if f.inside]
    if len(interior) >= 2:
        budgets = [f.budget for f in interior]
        n_opt = [f.n_opt for f in interior]
        result.n_opt_law = fit_power(budgets, n_opt)
        result.d_opt_law = fit_power(budgets, np.asarray(budgets) / result.flops(n_opt))
        runs = [by_budget[b] for b in budgets]
        result.noise_sd = noise_sd(runs, [f for f in interior])
        result.optimum_ci, kept = optimum_bootstrap(runs, result.flops, result.noise_sd,
                                                    n_bootstrap=n_bootstrap, seed=seed,
                                                    ci_level=ci_level)
        if kept < 0.95 * n_bootstrap:
            result.notes.append(f"N*(C) intervals: {n_bootstrap - kept} of {n_bootstrap} "
                                "resamples had a parabola without a minimum and were left out")
    elif by_budget:
        result.notes.append(f"N*(C): {len(interior)} budget(s) with an optimum inside the "
                            "sizes, need at least 2")
    try:
        result.joint = fit_joint_law([p.x["N"] for p in points], [p.x["D"] for p in points],
                                     [p.loss for p in points], n_bootstrap=n_bootstrap,
                                     ci_level=ci_level, seed=seed)
    except TooFewRuns as err:
        result.notes.append(f"joint law: {err}")
        return result
    for name in result.joint.at_bound:
        result.notes.append(f"joint law: {name} at the search bound (the data do not pin it)")
    return result


def noise_sd(runs: list[list[Point]], fits: list[IsoFlopFit]) -> float:
    """The loss noise of one run: the spread between seeds where cells ran several (pooled
    sample standard deviation), or the parabolas' residual scatter where that is larger (the
    points then scatter around their parabola more than seeds do, and the intervals must
    say so)."""
    within = [(len(p.seed_losses) - 1, float(np.var(p.seed_losses, ddof=1)))
              for budget in runs for p in budget if len(p.seed_losses) > 1]
    dof = sum(d for d, _ in within)
    seed_sd = math.sqrt(sum(d * v for d, v in within) / dof) if dof else 0.0
    residual, residual_dof = 0.0, 0
    for budget, fit in zip(runs, fits):
        n = np.array([p.x["N"] for p in budget])
        residual += float(np.sum((np.array([p.loss for p in budget]) - fit(n)) ** 2))
        residual_dof += len(budget) - 3
    residual_sd = math.sqrt(residual / residual_dof) if residual_dof > 0 else 0.0
    return max(seed_sd, residual_sd)


def optimum_bootstrap(runs: list[list[Point]], flops: FlopsModel, sd: float, *,
                      n_bootstrap: int, seed: int, ci_level: float
                      ) -> tuple[dict[str, tuple[float, float]], int]:
    """Intervals of the exponents a, b of N*(C) ~ C^a and D*(C) ~ C^b and of the tokens per
    parameter at the optimum, by a parametric bootstrap: every point's loss is redrawn around
    its measured value with the run noise `sd` (divided by sqrt(seeds) for a mean over seeds),
    the parabolas refitted, and the optima's laws with them. A resample whose parabola has no
    minimum at some budget is left out; returns the intervals and the resamples kept."""
    rng = np.random.default_rng(seed)
    budgets = np.array([budget[0].budget for budget in runs])
    centre = float(np.exp(np.mean(np.log(budgets))))
    samples = []
    for _ in range(n_bootstrap):
        n_opt = []
        for budget in runs:
            loss = [p.loss + rng.normal(0.0, sd / math.sqrt(max(len(p.seed_losses), 1)))
                    for p in budget]
            n_opt.append(fit_isoflop([p.x["N"] for p in budget], loss, budget[0].budget).n_opt)
        if any(math.isnan(n) for n in n_opt):
            continue
        n_law = fit_power(budgets, n_opt)
        d_law = fit_power(budgets, budgets / flops(n_opt))
        samples.append((n_law.exponent, d_law.exponent, float(d_law(centre) / n_law(centre))))
    if not samples:
        return {}, 0
    columns = list(zip(*samples))
    return {name: percentile_interval(column, ci_level)
            for name, column in zip(("a", "b", "tokens_per_param"), columns)}, len(samples)


@dataclass
class Comparison:
    """A family against its baseline at equal compute."""

    group: str
    baseline: str
    budgets: np.ndarray
    """Compute budgets C of the gains (log-spaced over both families' runs)."""
    gain: np.ndarray
    """Compute-equivalent gain at each budget (NaN where the baseline never reaches the loss)."""
    gain_ci: tuple[np.ndarray, np.ndarray]
    """Percentile interval of the gain at each budget."""
    exponents: dict[str, tuple[float, float, tuple[float, float]]]
    """Name (EXPONENTS) -> (family's value, family minus baseline, interval of the difference)."""
    ci_level: float


def compare(family: FamilyAnalysis, baseline: FamilyAnalysis, ci_level: float = 0.95
            ) -> Comparison:
    """Gains and exponent differences, the intervals from pairing the two families'
    independent bootstrap laws (sample i of one with sample i of the other)."""
    lo = min(family.c_range[0], baseline.c_range[0])
    hi = max(family.c_range[1], baseline.c_range[1])
    budgets = np.geomspace(lo, hi, GAIN_BUDGETS)
    c_range = (lo, hi)

    def side(analysis: FamilyAnalysis, law: JointLaw):
        return law, analysis.flops, analysis.n_range

    def exponents(analysis: FamilyAnalysis, law: JointLaw) -> dict[str, float]:
        return {"alpha": law.alpha, "beta": law.beta,
                "compute_slope": frontier_slope(law, analysis.flops, c_range, analysis.n_range)}

    gain = compute_equivalent_gain(side(family, family.joint.law),
                                   side(baseline, baseline.joint.law), budgets)
    mine, theirs = exponents(family, family.joint.law), exponents(baseline, baseline.joint.law)
    gains, deltas = [], {name: [] for name in EXPONENTS}
    for law, base_law in zip(family.joint.samples, baseline.joint.samples):
        gains.append(compute_equivalent_gain(side(family, law), side(baseline, base_law),
                                             budgets))
        a, b = exponents(family, law), exponents(baseline, base_law)
        for name in EXPONENTS:
            deltas[name].append(a[name] - b[name])
    samples = np.array(gains).reshape(-1, len(budgets))
    intervals = [percentile_interval(samples[:, i], ci_level) for i in range(len(budgets))]
    gain_ci = (np.array([i[0] for i in intervals]), np.array([i[1] for i in intervals]))
    return Comparison(family.group, baseline.group, budgets, gain, gain_ci,
                      {name: (mine[name], mine[name] - theirs[name],
                              percentile_interval(deltas[name], ci_level))
                       for name in EXPONENTS}, ci_level)


def too_few_message(families: list[FamilyAnalysis], laws_fitted: bool) -> str | None:
    """The error when no law of any kind could be fitted, naming what each needs."""
    if laws_fitted or any(f.isoflop or f.joint for f in families):
        return None
    most = max(families, key=lambda f: len(f.points))
    return (f"too few runs for any law (the most in one group: {len(most.points)}, "
            f"{most.group}): L(N) and L(C) need runs at {MIN_POINTS} or more distinct sizes "
            f"or compute, L(D) {MIN_POINTS} token budgets, an IsoFLOP parabola {MIN_POINTS} "
            "sizes at one compute budget, the joint law 6 runs with 3 distinct N and 3 "
            "distinct D")
