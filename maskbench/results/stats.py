"""Leaderboard statistics: confidence intervals, paired comparisons, compute-to-target, summary tables.

The question maskbench answers is comparative (does an arm beat the unmasked baseline at equal
compute?), so every figure carries its uncertainty: means over seeds with Student-t intervals, a
comparison against the baseline at the final point, and the compute at which an arm matches the
baseline's quality at each of the baseline's horizons. Arms run with the same seed share the initial
weights, the data order and the evaluation noise, so the comparison pairs them by seed
(`paired_difference`: per-seed differences, a paired t-interval, a bootstrap interval, the minimum
detectable effect and a verdict that claims no more than the interval; `Target`: per-seed
compute-to-target ratios read off monotone fits of each run's curve); rows that do not pair (a merged
CSV whose seeds differ) fall back to Welch's unpaired test (`welch_difference`) and say so.

FD and validation loss are co-primary (`CO_PRIMARY`): every verdict is given on both, side by side,
and `agreement` says where they disagree. Rows may carry each metric's own sampling error (`<metric>_se`,
`sampling_se`): one seed then gets an interval from it alone, comparisons say how much of the
seed-to-seed spread it explains, and the minimum detectable effect uses the larger of the two. A study's
plan (`Family`) names the tests it reads verdicts from; `correct` adjusts their p-values together (Holm)
and every other reading is labelled exploratory. `debiased_cosine` serves the gradient-fidelity probe
(`maskbench probe gradfid`). Lower is better for FID (and for the oracle Fréchet distance stored in `fid`
on synth, labelled by `fid_features`) and for val_loss; higher is better for CLIP score and alignment.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.optimize
import scipy.stats

from maskbench.results.leaderboard import Row

METRICS = ("fid", "clip_score", "val_loss", "align_acc")
LOWER_IS_BETTER = {"fid": True, "val_loss": True, "clip_score": False, "align_acc": False}
CO_PRIMARY = ("fid", "val_loss")  # FD and validation loss: every verdict table shows both
LABELS = {"fid": "FD", "clip_score": "CLIP", "val_loss": "val loss", "align_acc": "align"}
COMPUTE = {"train_flops": "FLOPs", "gpu_hours": "GPU-h"}  # the two compute axes of compute-to-target
FORMATS = ("table", "markdown", "csv")

Estimate = tuple[float, float]  # (mean, confidence-interval half-width; NaN for one value)
Bound = str  # "" a value, "<=" an upper bound (reached at the first point), ">" a lower bound (not reached)


def mean_ci(values: Sequence[float], level: float = 0.95) -> Estimate:
    """Mean and half-width of its two-sided Student-t confidence interval.

    half-width = t_{(1+level)/2, n-1} · s / √n, with s the sample standard deviation (ddof=1).
    With three seeds the t quantile (4.30 at 95%) is more than twice the normal 1.96: the honest
    width for so few runs. One value has no spread estimate, so its half-width is NaN.
    """
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("mean_ci needs at least one value")
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    if x.size == 1:
        return float(x[0]), math.nan
    quantile = scipy.stats.t.ppf((1 + level) / 2, df=x.size - 1)
    return float(x.mean()), float(quantile * scipy.stats.sem(x))


def sampling_se(row: Row, metric: str) -> float | None:
    """The row's own sampling error of `metric`, from its `<metric>_se` column, or None.

    The evaluator writes a bootstrap standard deviation over its eval samples for FD and CLIP score and
    a standard error for val loss and alignment: how far the figure would move with other eval samples
    of the same model. Rows written before it did (or by an evaluator that does not) have none.
    """
    value = row.get(f"{metric}_se")
    return None if value is None else float(value)


def sampling_ses(rows: Sequence[Row], metric: str) -> list[float] | None:
    """The rows' own sampling errors of `metric`; None unless every row has one (older rows have none)."""
    found = [sampling_se(row, metric) for row in rows]
    return None if None in found else found


def monotone_fit(points: Sequence[tuple[float, float]],
                 higher_is_better: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A curve's isotonic least-squares fit: (x ascending, fitted values), non-increasing in x when lower
    is better, non-decreasing when higher is better.

    Eval noise makes a training curve wiggle; read raw, a lucky early point "reaches" a target the run
    then falls back from, so compute-to-target swings with single evaluations. The fit is the monotone
    curve closest in squared error (pool-adjacent-violators, `scipy.optimize.isotonic_regression`, equal
    weights): each run of points that goes the wrong way is replaced by its mean. It uses only the order
    of x, so it is the same on FLOPs, device-hours, eval points or their logarithms.
    """
    if not points:
        raise ValueError("monotone_fit needs at least one point")
    xs, ys = (np.asarray(column, dtype=float) for column in zip(*sorted(points)))
    return xs, scipy.optimize.isotonic_regression(ys, increasing=higher_is_better).x


def compute_to_target(points: Sequence[tuple[float, float]], target: float,
                      higher_is_better: bool = False) -> float | None:
    """Compute (x) at which a curve's monotone fit first reaches a target value, or None.

    The fitted points (`monotone_fit`) are joined by straight lines in x. If the first one already
    reaches the target (value <= target) its x is returned: nothing is known before it. Otherwise, for
    the first segment (x0, y0) -> (x1, y1) of the fit with y0 > target >= y1,
        x = x0 + (y0 - target) / (y0 - y1) · (x1 - x0).
    None means the target is not reached within the points. With higher_is_better the inequalities flip
    (CLIP score, alignment). Because the fit is monotone, x never decreases as the target gets harder. On
    the leaderboard x is train FLOPs or device-hours; lines in x (not log x) as before the fit existed.
    """
    if not points:
        return None
    xs, fit = monotone_fit(points, higher_is_better)
    gaps = (fit - target) * (-1.0 if higher_is_better else 1.0)  # > 0: not there yet; non-increasing
    reached = np.flatnonzero(gaps <= 0)
    if reached.size == 0:
        return None
    i = int(reached[0])
    if i == 0:
        return float(xs[0])
    return float(xs[i - 1] + gaps[i - 1] / (gaps[i - 1] - gaps[i]) * (xs[i] - xs[i - 1]))


def run_curve(run: Sequence[Row], metric: str, x_field: str) -> list[tuple[float, float]]:
    """One run's (x_field, metric) points, from its rows that record both."""
    return [(row[x_field], row[metric]) for row in run if row[x_field] is not None and row[metric] is not None]


def horizon_target(base_run: Sequence[Row], metric: str, point: float) -> float:
    """A baseline run's value at one of its eval points (a horizon), read off its monotone fit over the
    eval points: the target an arm's run of the same seed is asked to reach."""
    xs, fit = monotone_fit(run_curve(base_run, metric, "point"), not LOWER_IS_BETTER[metric])
    return float(np.interp(point, xs, fit))


def seed_ratio(arm_run: Sequence[Row], base_run: Sequence[Row], metric: str, x_field: str,
               target: float) -> tuple[float, Bound]:
    """One seed's compute-to-target ratio: the arm's x_field (FLOPs or device-hours) at which its monotone
    fit reaches the target, over the baseline's, both read the same way (`compute_to_target`), and its
    bound: "" a value; "<=" the arm is there at its first point, so nothing is known before it and the
    ratio is an upper bound; ">" the arm never gets there, and its last x over the baseline's is a lower
    bound. NaN: the runs do not record x_field (or the baseline never reaches the target)."""
    higher = not LOWER_IS_BETTER[metric]
    arm_curve = run_curve(arm_run, metric, x_field)
    base = compute_to_target(run_curve(base_run, metric, x_field), target, higher)
    if not arm_curve or base is None or base <= 0:
        return math.nan, ""
    arm = compute_to_target(arm_curve, target, higher)
    if arm is None:
        return max(x for x, _ in arm_curve) / base, ">"
    return arm / base, "<=" if arm == min(x for x, _ in arm_curve) else ""


POWER = 0.80                 # the power at which the minimum detectable effect is stated
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0           # fixed: the same CSV always prints the same bootstrap interval
MIN_BOOTSTRAP = 3            # fewer pairs resample to a handful of distinct means: no interval shown


@dataclass(frozen=True)
class Difference:
    """arm − baseline on one metric, with its interval, p-value, minimum detectable effect and verdict.

    `test` is "paired" (per-seed differences d_i; n = n_base = pairs) or "welch" (two independent
    samples; n and n_base are their sizes). `mean` is the mean difference (paired: mean of d_i, which
    equals the difference of the means). lo/hi is the two-sided t-interval, NaN (and p, mde NaN) when
    there is none. `boot` is the bootstrap percentile interval of the mean difference, paired only
    and only with at least MIN_BOOTSTRAP pairs. `se` is the standard error of `mean` from the seeds'
    spread, `eval_se` the one the rows' own sampling errors alone imply (`eval_se_of_difference`; NaN
    without them). `p_adj` is p after the plan's multiplicity correction (`correct`; p without one).
    """
    test: str
    n: int
    n_base: int
    mean: float
    lo: float
    hi: float
    p: float
    mde: float
    verdict: str
    boot: tuple[float, float] | None = None
    se: float = math.nan
    eval_se: float = math.nan
    p_adj: float = math.nan

    @property
    def eval_share(self) -> float:
        """eval_se / se: near 1 or above, the seeds differ by no more than the evaluation's own noise."""
        return self.eval_se / self.se if self.se > 0 else math.nan


def minimum_detectable_effect(se: float, df: float, level: float = 0.95, power: float = POWER) -> float:
    """The smallest true effect a two-sided t-test at 1 − level detects with probability `power`.

    MDE = (t_{(1+level)/2, df} + t_{power, df}) · SE (Bloom 1995, "Minimum detectable effects: a simple
    way to report the statistical power of experimental designs", Evaluation Review 19(5), eq. 1;
    the usual normal-approximation power formula with t quantiles for the small-sample case). Paired:
    SE = s_d/√n, df = n − 1, so at 95% and 80% power MDE = (t_{0.975,n−1} + t_{0.80,n−1})·s_d/√n.
    """
    if not (df > 0 and math.isfinite(se)):
        return math.nan
    return float((scipy.stats.t.ppf((1 + level) / 2, df) + scipy.stats.t.ppf(power, df)) * se)


def eval_se_of_difference(arm_se: Sequence[float] | None, base_se: Sequence[float] | None) -> float:
    """The standard error of mean(arm) − mean(base) that the rows' sampling errors alone imply, NaN
    without them: √(Σ se_a,i²/n_a² + Σ se_b,j²/n_b²), treating each row's eval noise as independent.

    Paired rows share the eval seed, so their noise may partly cancel in d_i: this is the larger,
    cautious figure, paired or not.
    """
    if not arm_se or not base_se:
        return math.nan
    a, b = np.asarray(arm_se, dtype=float), np.asarray(base_se, dtype=float)
    return float(math.sqrt(np.sum(a**2) / a.size**2 + np.sum(b**2) / b.size**2))


def _mde(se: float, eval_se: float, df: float, level: float, power: float) -> float:
    """The MDE on the larger of the seed-to-seed SE and the eval-noise SE. The seeds' spread already
    contains the eval noise, but a few seeds can happen to agree closely; the eval noise, measured over
    thousands of samples, is a floor that the true spread of the mean cannot be below."""
    return minimum_detectable_effect(se if math.isnan(eval_se) else max(se, eval_se), df, level, power)


def verdict(lo: float, hi: float, mde: float, lower_is_better: bool) -> str:
    """What an interval of arm − baseline allows one to say, and no more.

    "better" only if the whole interval lies strictly on the better side of 0 (below it when lower
    is better), "worse" only if it lies strictly on the other; an interval that touches or spans 0
    is "no difference detected", with the effect these runs would have detected (the MDE, at the
    power it was computed for: POWER unless the caller chose another).
    """
    if math.isnan(lo) or math.isnan(hi):
        return "not tested: no interval from fewer than 2 runs"
    below, above = hi < 0, lo > 0
    if below or above:
        return "better" if below == lower_is_better else "worse"
    return f"no difference detected; an effect larger than {mde:.3g} would have been detected"


def bootstrap_ci(values: Sequence[float], level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean (scipy.stats.bootstrap, a fixed seed), or None below
    MIN_BOOTSTRAP values: three pairs resample to only 10 distinct multisets, fewer to 3 or 1."""
    x = np.asarray(values, dtype=float)
    if x.size < MIN_BOOTSTRAP:
        return None
    result = scipy.stats.bootstrap((x,), np.mean, n_resamples=resamples, confidence_level=level,
                                   method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def _two_sided_p(mean: float, se: float, df: float) -> float:
    """p of the two-sided t-test of mean = 0; with no spread (se = 0) 0 unless mean is 0 too."""
    if se > 0:
        return float(2 * scipy.stats.t.sf(abs(mean) / se, df))
    return 0.0 if mean != 0 else math.nan


def paired_difference(arm: Sequence[float], base: Sequence[float], lower_is_better: bool = True,
                      level: float = 0.95, power: float = POWER, arm_se: Sequence[float] | None = None,
                      base_se: Sequence[float] | None = None) -> Difference:
    """Paired comparison of arm and baseline runs, arm[i] and base[i] sharing seed i.

    d_i = arm_i − base_i; interval d̄ ± t_{(1+level)/2, n−1} · s_d/√n (scipy.stats.ttest_rel's), p
    from t = d̄ / (s_d/√n) on n − 1 degrees of freedom, MDE as `minimum_detectable_effect` on the larger
    of s_d/√n and the eval-noise SE (`eval_se_of_difference`, from arm_se/base_se: the rows' sampling
    errors, when they have them), and the bootstrap percentile interval of d̄ beside it. The verdict
    reads the t-interval. One pair has no interval; identical differences (s_d = 0) give a zero-width one.
    """
    a, b = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_difference needs two equally long, non-empty lists, got {a.shape} and {b.shape}")
    d = a - b
    n, mean = d.size, float(d.mean())
    eval_se = eval_se_of_difference(arm_se, base_se)
    lo = hi = p = mde = se = math.nan
    if n >= 2:
        se = float(d.std(ddof=1) / math.sqrt(n))
        half = scipy.stats.t.ppf((1 + level) / 2, n - 1) * se
        lo, hi = mean - half, mean + half
        p = _two_sided_p(mean, se, n - 1)
        mde = _mde(se, eval_se, n - 1, level, power)
    return Difference("paired", n, n, mean, float(lo), float(hi), p, mde, verdict(lo, hi, mde, lower_is_better),
                      bootstrap_ci(d, level), se=se, eval_se=eval_se, p_adj=p)


def welch_difference(arm: Sequence[float], base: Sequence[float], lower_is_better: bool = True,
                     level: float = 0.95, power: float = POWER, arm_se: Sequence[float] | None = None,
                     base_se: Sequence[float] | None = None) -> Difference:
    """Unpaired comparison (runs that share no seeds): Welch's t on mean(arm) − mean(base).

    Interval (ā − b̄) ± t_{(1+level)/2, df} · √(s_a²/n_a + s_b²/n_b), unequal variances, with the
    Welch–Satterthwaite df = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1)); p from
    t = (ā − b̄) / √(s_a²/n_a + s_b²/n_b) on that df (scipy.stats.ttest_ind(equal_var=False)'s); MDE the same
    formula on the larger of that SE and the eval-noise SE, with that df. Fewer than 2 runs on a side: no
    interval.
    """
    a, b = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError("welch_difference needs runs on both sides")
    mean = float(a.mean() - b.mean())
    eval_se = eval_se_of_difference(arm_se, base_se)
    lo = hi = p = mde = se = math.nan
    if a.size >= 2 and b.size >= 2:
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        se = math.sqrt(va + vb)
        if se > 0:
            df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
            half = scipy.stats.t.ppf((1 + level) / 2, df) * se
            lo, hi = mean - half, mean + half
            p = _two_sided_p(mean, se, df)
            mde = _mde(se, eval_se, df, level, power)
        else:
            lo = hi = mean
            p, mde = (0.0 if mean else math.nan), 0.0
    return Difference("welch", int(a.size), int(b.size), mean, float(lo), float(hi), p, mde,
                      verdict(lo, hi, mde, lower_is_better), se=se, eval_se=eval_se, p_adj=p)


@dataclass(frozen=True)
class Ratio:
    """Per-seed ratios of compute to a target, summarised on the log scale.

    `geomean` = exp(mean log r_i), lo/hi = exp(mean ± t_{(1+level)/2, n−1} · sd(log r)/√n) (NaN for one
    seed), p the two-sided t-test of mean log r = 0 (ratio 1), `p_adj` that p after the plan's
    multiplicity correction (`correct`; p without one). When some seeds' ratios are only bounds
    (`seed_ratio`), so is the summary: `bound` ">" when `not_reached` > 0 seeds never reached the target
    (a lower bound), "<=" when some reached it at their first point (an upper bound); lo/hi are then
    the interval of the bounds, and p is NaN: bounds are not estimates to test.
    """
    geomean: float
    lo: float
    hi: float
    n: int
    not_reached: int = 0
    p: float = math.nan
    p_adj: float = math.nan
    bound: Bound = ""


def ratio_summary(ratios: Sequence[float], level: float = 0.95, bounds: Sequence[Bound] = ()) -> Ratio | None:
    """Summary of per-seed ratios, bounds[i] the bound of ratio i ("" by default); None for no seeds or
    for a NaN among them (a run without the compute column)."""
    if not ratios or any(math.isnan(r) for r in ratios):
        return None
    bounds = list(bounds) or [""] * len(ratios)
    bound = ">" if ">" in bounds else "<=" if "<=" in bounds else ""
    logs = np.log(np.asarray(ratios, dtype=float))
    mean, half = mean_ci(logs, level)
    p = _two_sided_p(mean, float(scipy.stats.sem(logs)), logs.size - 1) if logs.size > 1 and not bound else math.nan
    return Ratio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(ratios), bounds.count(">"),
                 p=p, p_adj=p, bound=bound)


def ratio_verdict(ratio: Ratio | None, alpha: float) -> str:
    """What a compute-to-target ratio allows one to say: "pays" when its geometric mean is below 1 and
    its (corrected) p below alpha (uncorrected at level 1 − alpha: the whole interval below 1), "does not
    pay" when above 1 likewise, "undecided" otherwise; "" without a ratio.

    A bound is not tested, so it gets no verdict either way, only what it is: "not reached (k/n)" for a
    lower bound (k of n seeds never got there; their last point stands in, so the true ratio could be
    anything above it, or the target never be reached) and "reached at first point" for an upper bound.
    `Family.pays` and `agreement` read both as undecided."""
    if ratio is None:
        return ""
    if ratio.bound == ">":
        return f"not reached ({ratio.not_reached}/{ratio.n})"
    if ratio.bound == "<=":
        return "reached at first point"
    if not ratio.p_adj < alpha:
        return "undecided"
    return "pays" if ratio.geomean < 1 else "does not pay"


def agreement(verdicts: Sequence[str]) -> str:
    """"disagree" when the metrics' verdicts point different ways: one better (or pays), another worse
    (or does not pay) or nothing detected; "agree" when they all point the same way, nothing detected
    included; "" for fewer than two verdicts."""
    if len(verdicts) < 2:
        return ""
    return "agree" if len({_direction(v) for v in verdicts}) == 1 else "disagree"


def _direction(verdict_: str) -> int:
    if verdict_.startswith("better") or verdict_ == "pays":
        return 1
    return -1 if verdict_.startswith(("worse", "does not pay")) else 0


CORRECTIONS = ("holm", "none")


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values (Holm 1979, "A simple sequentially rejective multiple test
    procedure", Scand. J. Statist. 6(2)): with the m tested p-values sorted, p_(1) <= ... <= p_(m),
        p_adj_(i) = min(1, max_{j <= i} (m − j + 1) · p_(j)),
    returned in the input order. Rejecting where p_adj < alpha keeps the chance of any false
    rejection in the family at alpha, with no assumption on how the tests depend on each other. A NaN
    (an untested hypothesis) stays NaN and does not count in m."""
    p = np.asarray(pvalues, dtype=float)
    adjusted = np.full(p.shape, math.nan)
    tested = np.flatnonzero(~np.isnan(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    steps = (order.size - np.arange(order.size)) * p[order]
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(steps))
    return adjusted


@dataclass(frozen=True)
class Family:
    """The tests a study's plan reads verdicts from, corrected together; every other reading explores.

    A test is planned when its metric is one of `metrics` (and, for a compute-to-target ratio, when it
    is on the `compute` axis); the family is every planned test a report prints (per arm or cell and
    planned metric: the paired difference, and the ratio at each target), across arms, horizons, cells
    and metrics, adjusted by `method` at `alpha`. Holm assumes nothing about how the tests depend on each
    other; correcting across the metrics too is cautious when "pays" needs every one of them, but keeps
    each metric's own verdict (better / worse) honest as well. `confirmatory` is True only when the plan
    was written before every row it reads; otherwise even its planned readings are exploratory. Without a
    plan (`EXPLORATORY`): no planned test, no correction, everything exploratory.
    """
    metrics: tuple[str, ...] = ()
    compute: str = "train_flops"
    method: str = "none"
    alpha: float = 0.05
    confirmatory: bool = False

    def planned(self, metric: str, compute: str | None = None) -> bool:
        return metric in self.metrics and compute in (None, self.compute)

    def reading(self, metric: str, compute: str | None = None) -> str:
        """The label of a reading: "confirmatory" (planned, plan before the data) or "exploratory"."""
        return "confirmatory" if self.confirmatory and self.planned(metric, compute) else "exploratory"

    def compared(self) -> tuple[str, ...]:
        """The metrics every verdict table shows: the planned ones, then FD and val loss (co-primary)."""
        return tuple(dict.fromkeys((*self.metrics, *CO_PRIMARY)))

    def pays(self, verdicts: dict[str, str]) -> str:
        """The plan's "pays" over metrics: pays on every planned one (every co-primary one without a plan),
        does not pay when one of them does not, undecided otherwise."""
        words = [verdicts.get(metric, "") for metric in (self.metrics or CO_PRIMARY)]
        if all(word == "pays" for word in words):
            return "pays"
        return "does not pay" if "does not pay" in words else "undecided"


EXPLORATORY = Family()


def adjust(pvalues: Sequence[float], family: Family) -> np.ndarray:
    """The family's p-values after its correction (Holm, or none: unchanged)."""
    return holm(pvalues) if family.method == "holm" else np.asarray(pvalues, dtype=float)


def corrected_difference(difference: Difference, p_adj: float, family: Family) -> Difference:
    """A difference with its corrected p; a verdict the corrected p no longer carries is withdrawn."""
    word = difference.verdict
    if word in ("better", "worse") and not p_adj < family.alpha:
        word = (f"no difference detected after {family.method} (uncorrected: {word}); an effect larger than "
                f"{difference.mde:.3g} would have been detected")
    return replace(difference, p_adj=float(p_adj), verdict=word)


@dataclass(frozen=True)
class Target:
    """Compute-to-target at one horizon (eval point) of the baseline, on each compute axis.

    Per seed the target is the baseline run's own value there, read off its monotone fit
    (`horizon_target`), and the ratio is the compute the arm's run of that seed needs to reach it over
    the compute the baseline's needs (`seed_ratio`); `value` is the mean of the per-seed targets.
    """
    point: float
    value: float
    ratios: dict[str, Ratio | None]  # by compute axis ("train_flops", "gpu_hours")


@dataclass(frozen=True)
class Comparison:
    """An arm against the baseline on one metric: the difference at the final point and, when paired,
    compute-to-target at each of the baseline's horizons."""
    metric: str
    difference: Difference
    targets: tuple[Target, ...] = ()
    seeds: tuple[int, ...] = ()    # the paired seeds
    note: str = ""                 # why the runs were not paired
    baseline: str = ""


@dataclass(frozen=True)
class CosineEstimate:
    """cos(E[a], E[b]) debiased, its jackknife interval, and the naive mean per-batch cosine beside it."""
    cosine: float   # NaN when either expected gradient is below the noise (estimated |E a|² <= 0)
    ci_lo: float
    ci_hi: float
    naive: float
    n: int
    loo: tuple[float, ...] = ()  # the n leave-one-batch-out estimates (for intervals of derived quantities)


def jackknife_se(loo: np.ndarray) -> float:
    """The jackknife standard error from n leave-one-out estimates: √((n−1)/n · Σ_k (θ_k − θ̄)²)."""
    n = len(loo)
    return math.sqrt((n - 1) / n * np.sum((loo - loo.mean()) ** 2))


def debiased_cosine(gram_aa: np.ndarray, gram_bb: np.ndarray, gram_ab: np.ndarray,
                    level: float = 0.95) -> CosineEstimate:
    """cos(E[a], E[b]) from n paired gradients (a_i, b_i), each pair computed on the same batch i.

    The question is whether the *expected* gradients point the same way. The cosine of per-batch
    gradients answers another one: with noise, a_i·b_i / (|a_i||b_i|) shrinks towards 0 because the
    noise inflates the norms (|a_i|² = |E a|² + noise). Products of DISTINCT, independent batches are
    unbiased: E[a_i·b_j] = E[a]·E[b] for i != j. So with the U-statistics
        <E a, E b> ≈ Σ_{i≠j} a_i·b_j / (n(n−1)),   |E a|² ≈ Σ_{i≠j} a_i·a_j / (n(n−1)),   same for b,
    cosine = ab / √(aa·bb), NaN when aa or bb <= 0 (the signal is below the noise). Inputs are the n×n
    Gram matrices G_aa[i, j] = a_i·a_j, G_bb[i, j] = b_i·b_j, G_ab[i, j] = a_i·b_j, so a caller keeps
    n² numbers instead of the gradients. The n(n−1) factors cancel in the ratio.

    Interval: leave-one-batch-out jackknife, exact from the Gram matrices (dropping batch k removes row
    and column k), with the normal quantile: cosine ± z·√((n−1)/n · Σ_k (θ_k − θ̄)²). A bootstrap would
    pair a batch with its own copy and bring the noise bias back. NaN bounds when a leave-one-out
    estimate is NaN. Needs n >= 3 (each leave-one-out estimate needs two distinct batches).
    """
    grams = [np.asarray(g, dtype=np.float64) for g in (gram_aa, gram_bb, gram_ab)]
    n = grams[0].shape[0]
    if any(g.shape != (n, n) for g in grams) or n < 3:
        raise ValueError(f"debiased_cosine needs three n×n Gram matrices with n >= 3, got shapes "
                         f"{[g.shape for g in grams]}")
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    diagonals = [np.diag(g) for g in grams]                                        # 3×n
    off = [g.sum() - d.sum() for g, d in zip(grams, diagonals)]                    # Σ_{i≠j}, 3 scalars
    # Dropping batch k removes its off-diagonal row and column: S − rowsum_k − colsum_k + 2·G_kk.
    loo = [s - g.sum(1) - g.sum(0) + 2 * d for s, g, d in zip(off, grams, diagonals)]  # 3×n
    cosine = _cosine(*off)
    jack = _cosine(*loo)                                                           # n
    half = scipy.stats.norm.ppf((1 + level) / 2) * jackknife_se(jack)
    naive = float(np.mean(diagonals[2] / np.sqrt(diagonals[0] * diagonals[1])))
    return CosineEstimate(float(cosine), float(cosine - half), float(cosine + half), naive, n, tuple(jack.tolist()))


def _cosine(aa: np.ndarray, bb: np.ndarray, ab: np.ndarray) -> np.ndarray:
    """ab / √(aa·bb) elementwise, NaN wherever aa or bb is not positive."""
    valid = (aa > 0) & (bb > 0)
    return np.where(valid, ab / np.sqrt(np.where(valid, aa * bb, 1.0)), math.nan)


@dataclass
class Summary:
    """One leaderboard line: an arm at one eval point of a (dataset, model, budget) group, or a
    published reference row (non-empty `source`), which is never pooled with measured runs.

    `comparisons` is set on each arm's final eval point only, and only when the group has the baseline
    arm: per compared metric (FD and val loss always, a plan's primary metrics too), the paired (or, when
    the seeds do not pair, Welch) comparison with the baseline, with compute-to-target at each of the
    baseline's horizons; empty for the baseline itself. `eval_only` names the metrics whose interval comes
    from the one row's own sampling error instead of seeds.
    """

    dataset: str | None
    model: str | None
    batch_size: int | None        # tokens per step change what masking buys: never pooled across batch sizes
    budget_flops: float | None
    arm: str
    point: float | None
    n: int
    metrics: dict[str, Estimate | None]
    train_flops: float | None
    gpu_hours: float | None
    fid_features: str
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    source: str = ""
    notes: tuple[str, ...] = ()
    started_from: str = ""        # `source_family` of the trained run these runs started from ("" from scratch)
    eval_only: tuple[str, ...] = ()

    @property
    def is_reference(self) -> bool:
        return bool(self.source)

    @property
    def group(self) -> tuple:
        return self.dataset, self.model, self.batch_size, self.budget_flops, self.started_from


def summarize(rows: Sequence[Row], baseline_arm: str = "mask0", metrics: Sequence[str] = CO_PRIMARY,
              level: float = 0.95) -> list[Summary]:
    """Group measured rows by (dataset, model, batch size, budget) and summarise each arm at each point.

    Per arm and point: seeds, mean ± CI of every metric, mean GPU-hours and train FLOPs. Per arm (at its
    final point), against the baseline, on each of `metrics` the rows measure: the `Comparison` (paired by
    seed when the seeds pair, with per-seed compute-to-target ratios at each baseline horizon; Welch's
    otherwise, saying why); a group without FID says so in its notes. A point evaluated twice (same run_id
    and point) counts once, the later row winning. Reference rows follow, one record each.
    """
    unknown = [metric for metric in metrics if metric not in LOWER_IS_BETTER]
    if unknown or not metrics:
        raise ValueError(f"unknown metric(s) {unknown or 'none given'}; choose from {', '.join(LOWER_IS_BETTER)}")
    summary: list[Summary] = []
    for rows_of_group in measured_groups(rows).values():
        summary.extend(_summarize_group(rows_of_group, baseline_arm, tuple(metrics), level))
    summary.extend(_reference(row) for row in rows if row["source"])
    return summary


def measured_groups(rows: Sequence[Row]) -> dict[tuple, list[Row]]:
    """Measured rows by (dataset, model, batch_size, budget_flops, source_family), in sorted order; a
    point evaluated twice (same run_id and point) counts once, the later row winning."""
    latest = {(row["run_id"], row["point"]): row for row in rows if not row["source"]}
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for row in latest.values():
        key = (row["dataset"], row["model"], row["batch_size"] or 0, row["budget_flops"], source_family(row))
        groups[key].append(row)
    return {key: groups[key] for key in sorted(groups)}


def source_family(row: Row) -> str:
    """Where a run started: "" from scratch, else its `init_from` source's arm-data-model (run id less its
    seed and hash). Runs that continue trained weights are never pooled with runs from scratch, and the
    runs of one seed started from the same seed's source, so they still pair by seed."""
    source = (row.get("init_from") or "").partition("@")[0]
    return source.rsplit("-", 2)[0] if source else ""


def _summarize_group(rows: list[Row], baseline_arm: str, metrics: tuple[str, ...], level: float) -> list[Summary]:
    """Records of one (dataset, model, budget) group, the baseline arm first."""
    notes = []
    if "fid" in metrics and all(row["fid"] is None for row in rows):
        notes.append("no FID in this group: no FD comparison")
    arms: dict[str, dict[float, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        arms[row["arm"]][row["point"]].append(row)
    if baseline_arm not in arms:
        notes.append(f"no {baseline_arm!r} runs in this group: no compute-to-target or comparison")
    features = _fid_features(rows)
    curves = {arm: [_point(points[p], features, level, tuple(notes)) for p in sorted(points)]
              for arm, points in arms.items()}
    if baseline_arm in arms:
        base_runs = arms[baseline_arm][max(arms[baseline_arm])]
        for arm, curve in curves.items():
            if arm == baseline_arm:  # no test of the baseline against itself
                continue
            final_runs = arms[arm][max(arms[arm])]
            found = {metric: _comparison(final_runs, base_runs, rows, metric, baseline_arm, level)
                     for metric in metrics}
            curve[-1].comparisons = {metric: c for metric, c in found.items() if c is not None}
    order = sorted(curves, key=lambda arm: (arm != baseline_arm, arm))
    return [record for arm in order for record in curves[arm]]


def _comparison(final_runs: list[Row], base_runs: list[Row], rows: list[Row], metric: str,
                baseline_arm: str, level: float) -> Comparison | None:
    """An arm's final rows against the baseline's on one metric: paired by seed when every arm seed has
    exactly one baseline partner (and each side one run per seed), Welch's unpaired test otherwise."""
    lower = LOWER_IS_BETTER[metric]
    arm_final = [row for row in final_runs if row[metric] is not None]
    base_final = [row for row in base_runs if row[metric] is not None]
    if not arm_final or not base_final:
        return None
    by_seed = {side: defaultdict(list) for side in ("arm", "base")}
    for side, finals in (("arm", arm_final), ("base", base_final)):
        for row in finals:
            by_seed[side][row["seed"]].append(row)
    repeated = sorted({seed for side in by_seed.values() for seed, found in side.items() if len(found) > 1})
    unpaired = sorted(set(by_seed["arm"]) - set(by_seed["base"]))
    if repeated or unpaired:
        why = (f"seed(s) {_seeds(repeated)} appear in more than one run of an arm" if repeated else
               f"seed(s) {_seeds(unpaired)} have no {baseline_arm} partner")
        difference = welch_difference(_values(arm_final, metric), _values(base_final, metric), lower, level,
                                      arm_se=sampling_ses(arm_final, metric),
                                      base_se=sampling_ses(base_final, metric))
        return Comparison(metric, difference, note=f"unpaired (Welch): {why}", baseline=baseline_arm)
    seeds = sorted(by_seed["arm"])
    arm_rows = [by_seed["arm"][seed][0] for seed in seeds]
    base_rows = [by_seed["base"][seed][0] for seed in seeds]
    difference = paired_difference(_values(arm_rows, metric), _values(base_rows, metric), lower, level,
                                   arm_se=sampling_ses(arm_rows, metric), base_se=sampling_ses(base_rows, metric))
    runs = defaultdict(list)
    for row in rows:
        runs[row["run_id"]].append(row)
    pairs = [(runs[a["run_id"]], runs[b["run_id"]]) for a, b in zip(arm_rows, base_rows)]
    return Comparison(metric, difference, _targets(pairs, metric, level), tuple(seeds), baseline=baseline_arm)


def _targets(pairs: list[tuple[list[Row], list[Row]]], metric: str, level: float) -> tuple[Target, ...]:
    """Compute-to-target at each horizon of the baseline that every paired seed's baseline run evaluated:
    per seed the baseline run's fitted value there, reached by both runs of that seed."""
    horizons = set.intersection(*({row["point"] for row in base if row[metric] is not None} for _, base in pairs))
    targets = []
    for point in sorted(horizons):
        values = [horizon_target(base, metric, point) for _, base in pairs]
        ratios = {}
        for x in COMPUTE:
            readings = [seed_ratio(arm, base, metric, x, value) for (arm, base), value in zip(pairs, values)]
            ratios[x] = ratio_summary([r for r, _ in readings], level, [bound for _, bound in readings])
        targets.append(Target(point, float(np.mean(values)), ratios))
    return tuple(targets)


def correct(summary: Sequence[Summary], family: Family) -> tuple[list[Summary], int]:
    """The summary with the p-values of the family's tests adjusted together (`adjust`), each difference's
    verdict re-read at the corrected p, and the number of tests in the family: for every arm and planned
    metric, the difference at the final point and the ratio on the planned compute axis at each target."""
    planned = [c for record in summary for metric, c in record.comparisons.items() if family.planned(metric)]
    pvalues = [p for c in planned for p in _planned_ps(c, family.compute)]
    adjusted = iter(adjust(pvalues, family))
    out = [replace(record, comparisons={metric: _adjusted(c, adjusted, family) if family.planned(metric) else c
                                        for metric, c in record.comparisons.items()}) for record in summary]
    return out, int(np.sum(~np.isnan(np.asarray(pvalues, dtype=float))))


def _planned_ps(c: Comparison, compute: str) -> list[float]:
    """A comparison's planned p-values: its difference's, then its ratio's on `compute` at each target."""
    return [c.difference.p, *(t.ratios[compute].p if t.ratios.get(compute) else math.nan for t in c.targets)]


def _adjusted(c: Comparison, p_adj: Iterator[float], family: Family) -> Comparison:
    """The comparison with its planned tests' corrected p-values, taken from p_adj in `_planned_ps` order."""
    difference = corrected_difference(c.difference, next(p_adj), family)
    targets = []
    for target in c.targets:
        ratio, p = target.ratios.get(family.compute), float(next(p_adj))
        targets.append(replace(target, ratios={**target.ratios, family.compute: ratio and replace(ratio, p_adj=p)}))
    return replace(c, difference=difference, targets=tuple(targets))


def _seeds(seeds: list[int]) -> str:
    return ", ".join(str(seed) for seed in seeds)


def _fid_features(rows: list[Row]) -> str:
    """The one feature space of a group's FIDs; Fréchet distances in different ones don't compare."""
    spaces = sorted({row["fid_features"] or "" for row in rows if row["fid"] is not None})
    if len(spaces) > 1:
        row = rows[0]
        raise ValueError(f"{row['dataset']}/{row['model']}/{row['budget_flops']:g} mixes FID features "
                         f"{', '.join(spaces)}; their FIDs are not comparable")
    return spaces[0] if spaces else ""


def _point(runs: list[Row], features: str, level: float, notes: tuple[str, ...]) -> Summary:
    """The record of one arm at one eval point, pooling its seeds."""
    first = runs[0]
    estimates = {metric: _estimate(runs, metric, level) for metric in METRICS}
    return Summary(
        dataset=first["dataset"], model=first["model"], batch_size=first["batch_size"],
        budget_flops=first["budget_flops"], arm=first["arm"], point=first["point"], n=len(runs),
        started_from=source_family(first),
        metrics={metric: estimate for metric, (estimate, _) in estimates.items()},
        eval_only=tuple(metric for metric, (_, eval_only) in estimates.items() if eval_only),
        train_flops=_mean(_values(runs, "train_flops")), gpu_hours=_mean(_values(runs, "gpu_hours")),
        fid_features=features, notes=notes,
    )


def _estimate(runs: list[Row], metric: str, level: float) -> tuple[Estimate | None, bool]:
    """Mean ± t-interval over the seeds, and False. One seed has no spread to show: when its row has a
    sampling error, its value ± z_{(1+level)/2} · SE, and True: an interval from eval noise alone, which
    says nothing of how another seed would land."""
    values = _values(runs, metric)
    if not values:
        return None, False
    if len(values) == 1:
        se = sampling_se(next(row for row in runs if row[metric] is not None), metric)
        if se is not None:
            return (values[0], float(scipy.stats.norm.ppf((1 + level) / 2) * se)), True
    return mean_ci(values, level), False


def _reference(row: Row) -> Summary:
    """A published row as its own record: one value per metric, no interval, its citation kept."""
    return Summary(
        dataset=row["dataset"], model=row["model"], batch_size=row["batch_size"],
        budget_flops=row["budget_flops"], arm=row["arm"], point=row["point"], n=1,
        metrics={m: (row[m], math.nan) if row[m] is not None else None for m in METRICS},
        train_flops=row["train_flops"], gpu_hours=row["gpu_hours"],
        fid_features=row["fid_features"] or "", source=row["source"],
    )


def _values(runs: Sequence[Row], column: str) -> list[float]:
    return [row[column] for row in runs if row[column] is not None]


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


# "FD", not "FID": the column is Inception FID only where its features say inception (on synth it is the
# oracle's Fréchet distance); `fd_note` says so under every table.
TABLE_HEADER = ("dataset", "model", "batch", "budget", "arm", "point", "n", "FD", "FD features", "CLIP",
                "val loss", "align", "GPU-h", "ref")
RATIO_PARTS = ("bound", "geomean", "lo", "hi", "p", "p_adj", "not_reached")
CSV_HEADER = ("dataset", "model", "batch_size", "budget_flops", "started_from", "arm", "point", "n",
              *(f"{m}{suffix}" for m in METRICS for suffix in ("", "_ci")), "eval_only",
              "train_flops", "gpu_hours", "fid_features")
CSV_PER_METRIC = ("test", "pairs", "diff", "diff_lo", "diff_hi", "boot_lo", "boot_hi", "p", "p_adj", "mde", "se",
                  "eval_se", "verdict", "target",
                  *(f"{axis}_{part}" for axis in ("flops_ratio", "hours_ratio") for part in RATIO_PARTS),
                  "ratio_verdict")
CSV_TAIL = ("agreement", "pays", "ratio_agreement", "reading", "source", "notes")


FD_NOTE = ("FD: Fréchet distance in the features named beside it; Inception FID only for "
           "inception-2015-12-05-clean (oracle-synth-v1 is the synth oracle's, standin-random-inception a random "
           "network's)")
EVAL_ONLY_NOTE = ("(eval SE): one seed; its value ± z·SE from the row's own sampling error (bootstrap SD over eval "
                  "samples for FD and CLIP, standard error for val loss and align): eval noise only, not how "
                  "another seed would land")
COMPARISON_NOTE = (
    "Δ: arm − {baseline} on the metric named, at the final point. paired: runs of the same seed share initial "
    "weights, data order and evaluation noise, so Δ is the mean of per-seed differences with the paired "
    "t-interval; welch: the seeds do not pair, Δ is the difference of means with Welch's interval. verdict: "
    "better / worse only when the whole {pct} t-interval lies on one side of 0 (lower is better for FD and val "
    "loss, higher for CLIP and align) and p adj < {alpha:g}; otherwise no difference detected, and MDE is the "
    "smallest effect these runs detect with 80% power at two-sided {alpha:g}, (t + t_0.80)·SE, SE the larger of "
    "the seeds' and the eval noise's. p adj: p after the plan's correction ({method}). eval/seed SE: the SE of Δ "
    "that the rows' own sampling errors imply over the one the seeds' spread gives (near 1 or above: the seeds "
    "differ by no more than eval noise; empty: rows without sampling errors). bootstrap: percentile interval of "
    "the mean difference, {resamples} resamples, fixed seed, not shown below {min_boot} pairs. metrics: whether "
    "the metrics' verdicts point the same way.")
TARGETS_NOTE = (
    "Compute to target: at each horizon (eval point) of {baseline}, per seed, the target is {baseline}'s value "
    "there read off the isotonic (monotone) fit of its run's curve, and the ratio is the FLOPs (GPU-h) the arm's "
    "run of that seed needs to reach it on its own monotone fit (straight lines between fitted points) over what "
    "{baseline}'s needs; geometric mean over seeds with the {pct} t-interval of the log ratios. <=: an upper "
    "bound (some seed's arm was there at its first point); >: a lower bound (k/n not reached: k seeds never got "
    "there, their last point stands in); bounds are not tested. verdict and p adj are of the {axis} ratio: pays "
    "when below 1 with p adj < {alpha:g}, does not pay when above 1 likewise, undecided otherwise; a bound gets "
    "no verdict, only 'not reached (k/n)' or 'reached at first point', and counts as undecided in pays and "
    "metrics. pays: {pays}.")


def render(summary: Sequence[Summary], fmt: str = "table", family: Family = EXPLORATORY) -> str:
    """The summary as aligned text tables, Markdown tables, or CSV (full precision).

    Table and Markdown give one line per arm and eval point; then, per arm and compared metric (FD and
    val loss, side by side, and a plan's primary metrics), the comparison with the baseline at the final
    point; then, per arm and baseline horizon, compute-to-target on every compared metric with the
    plan's "pays"; then every place the metrics disagree, and the notes. Intervals are at 1 − alpha of
    the family (95% without a plan); every verdict is labelled confirmatory or exploratory (`Family`).
    In CSV, one row per record, with the ratios at the record's own point.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    metrics = family.compared()
    if fmt == "csv":
        return _render_csv(summary, metrics, family)
    sources = list(dict.fromkeys(r.source for r in summary if r.is_reference))
    tables = [(None, TABLE_HEADER, [_table_cells(r, sources) for r in summary])]
    notes = list(dict.fromkeys(note for r in summary for note in _group_notes(r)))
    notes += [f"[{i}] {source}" for i, source in enumerate(sources, 1)]
    notes += [FD_NOTE] + ([EVAL_ONLY_NOTE] if any(r.eval_only for r in summary) else [])
    compared = [r for r in summary if r.comparisons]
    lines_of_disagreement = []
    if compared:
        baseline, pct = next(iter(compared[0].comparisons.values())).baseline, _pct(1 - family.alpha)
        tables += [
            (f"Against {baseline} at the final point:", _comparison_header(pct),
             [_comparison_cells(r, metric, metrics, family) for r in compared for metric in metrics
              if metric in r.comparisons]),
            (f"Compute to reach {baseline}'s value at each of its horizons:", _targets_header(metrics, pct),
             [_target_cells(r, point, metrics, family) for r in compared for point in _horizons(r)]),
        ]
        lines_of_disagreement = _disagreements(compared, metrics, family)
        notes += [COMPARISON_NOTE.format(baseline=baseline, pct=pct, alpha=family.alpha, method=family.method,
                                         resamples=f"{BOOTSTRAP_RESAMPLES:,}", min_boot=MIN_BOOTSTRAP),
                  TARGETS_NOTE.format(baseline=baseline, pct=pct, alpha=family.alpha, axis=COMPUTE[family.compute],
                                      pays=_pays_rule(family))]
    if fmt == "markdown":
        lines = []
        for title, header, cells in tables:
            lines += ([title, ""] if title else []) + _markdown_table(header, cells) + [""]
        return "\n".join(lines + [f"- {line}" for line in (*lines_of_disagreement, *notes)])
    lines = []
    for title, header, cells in tables:
        lines += ([title] if title else []) + _text_table(header, cells) + [""]
    return "\n".join(lines + lines_of_disagreement + ([""] if lines_of_disagreement else []) + notes)


def _pct(level: float) -> str:
    return f"{100 * level:g}%"


def _comparison_header(pct: str) -> tuple[str, ...]:
    return ("dataset", "model", "batch", "budget", "arm", "metric", "test", "n", f"Δ ({pct} CI)",
            f"bootstrap {pct}", "p", "p adj", "MDE", "eval/seed SE", "verdict", "metrics", "reading")


def _targets_header(metrics: Sequence[str], pct: str) -> tuple[str, ...]:
    per_metric = ("target", f"FLOPs ratio ({pct} CI)", f"GPU-h ratio ({pct} CI)", "p adj", "verdict")
    return ("dataset", "model", "batch", "budget", "arm", "horizon",
            *(f"{LABELS[metric]} {column}" for metric in metrics for column in per_metric), "pays", "metrics",
            "reading")


def _pays_rule(family: Family) -> str:
    metrics = " and ".join(LABELS[m] for m in (family.metrics or CO_PRIMARY))
    return f"the {COMPUTE[family.compute]} ratio pays on every one of {metrics}"


def _text_table(header: Sequence[str], cells: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [header, ["-" * width for width in widths], *cells]]


def _markdown_table(header: Sequence[str], cells: list[list[str]]) -> list[str]:
    return [_markdown_line(header), _markdown_line(["---"] * len(header)), *(_markdown_line(row) for row in cells)]


def _group_cells(record: Summary) -> list[str]:
    return [record.dataset or "", _model_cell(record), _int(record.batch_size), _g(record.budget_flops), record.arm]


def _comparison_cells(record: Summary, metric: str, metrics: Sequence[str], family: Family) -> list[str]:
    """Display strings of one comparison, in `_comparison_header` order."""
    c = record.comparisons[metric]
    d = c.difference
    n = f"{d.n} pairs" if d.test == "paired" else f"{d.n} vs {d.n_base}"
    interval = "" if math.isnan(d.lo) else f" [{d.lo:.3g}, {d.hi:.3g}]"
    boot = f"[{d.boot[0]:.3g}, {d.boot[1]:.3g}]" if d.boot else (f"n < {MIN_BOOTSTRAP}" if d.test == "paired" else "")
    return [*_group_cells(record), metric, d.test, n, f"{d.mean:.4g}{interval}", boot, _g(_finite(d.p)),
            _g(_finite(d.p_adj)), _g(_finite(d.mde)), _g(_finite(d.eval_share)), d.verdict,
            agreement(_final_verdicts(record, metrics)), family.reading(metric)]


def _final_verdicts(record: Summary, metrics: Sequence[str]) -> list[str]:
    return [record.comparisons[m].difference.verdict for m in metrics if m in record.comparisons]


def _horizons(record: Summary) -> list[float]:
    """The baseline horizons an arm's comparisons read compute-to-target at."""
    return sorted({t.point for c in record.comparisons.values() for t in c.targets})


def _target_at(record: Summary, metric: str, point: float) -> Target | None:
    c = record.comparisons.get(metric)
    return next((t for t in c.targets if t.point == point), None) if c else None


def _ratio_verdicts(record: Summary, point: float, metrics: Sequence[str], family: Family) -> dict[str, str]:
    """Per metric with a reading at this horizon, the verdict on its ratio on the plan's compute axis."""
    targets = {metric: _target_at(record, metric, point) for metric in metrics}
    return {metric: ratio_verdict(t.ratios[family.compute], family.alpha) for metric, t in targets.items() if t}


def _target_cells(record: Summary, point: float, metrics: Sequence[str], family: Family) -> list[str]:
    """Display strings of one arm at one baseline horizon, in `_targets_header` order."""
    cells = [*_group_cells(record), _g(point)]
    for metric in metrics:
        t = _target_at(record, metric, point)
        planned = t and t.ratios[family.compute]
        cells += ["", "", "", "", ""] if t is None else [
            f"{t.value:.4g}", _ratio(t.ratios["train_flops"]), _ratio(t.ratios["gpu_hours"]),
            _g(_finite(planned.p_adj) if planned else None), ratio_verdict(planned, family.alpha)]
    verdicts = _ratio_verdicts(record, point, metrics, family)
    return [*cells, family.pays(verdicts), agreement(list(verdicts.values())),
            _reading(family, list(verdicts), family.compute)]


def _reading(family: Family, metrics: Sequence[str], compute: str | None = None) -> str:
    """One label when the metrics' readings share it, else each metric's."""
    labels = {metric: family.reading(metric, compute) for metric in metrics}
    if len(set(labels.values())) <= 1:
        return next(iter(labels.values()), "")
    return ", ".join(f"{LABELS[metric]} {label}" for metric, label in labels.items())


def _disagreements(compared: Sequence[Summary], metrics: Sequence[str], family: Family) -> list[str]:
    """One line per arm and reading (the final point, a horizon's ratio) where the metrics disagree."""
    lines = []
    for record in compared:
        where = f"disagree: {group_label(*record.group)} {record.arm}"
        final = {m: record.comparisons[m].difference.verdict for m in metrics if m in record.comparisons}
        readings = [("at the final point", final)]
        readings += [(f"{COMPUTE[family.compute]} ratio at horizon {point:g}",
                      _ratio_verdicts(record, point, metrics, family)) for point in _horizons(record)]
        lines += [f"{where} {at}: " + ", ".join(f"{LABELS[m]} {v.split(';')[0]}" for m, v in verdicts.items())
                  for at, verdicts in readings if agreement(list(verdicts.values())) == "disagree"]
    return lines


def _ratio(ratio: Ratio | None) -> str:
    """'[bound]geomean [lo, hi]', and how many seeds never reached the target."""
    if ratio is None:
        return ""
    interval = "" if math.isnan(ratio.lo) else f" [{ratio.lo:.3g}, {ratio.hi:.3g}]"
    missed = f" ({ratio.not_reached}/{ratio.n} not reached)" if ratio.not_reached else ""
    return f"{ratio.bound}{ratio.geomean:.3f}{interval}{missed}"


def group_label(dataset: str | None, model: str | None, batch_size: int | None, budget_flops: float | None,
                started_from: str = "") -> str:
    """dataset/model[ from SOURCE][/bBATCH]/budget: a group's name in notes (the batch when rows record one)."""
    start = f" from {started_from}" if started_from else ""
    batch = f"/b{batch_size}" if batch_size else ""
    return f"{dataset}/{model}{start}{batch}/{_g(budget_flops)}"


def _group_notes(record: Summary) -> list[str]:
    """A record's group notes, prefixed with its group so they read on their own under a table."""
    group = group_label(*record.group)
    extra = [f"{record.arm}: {c.note}" for c in record.comparisons.values() if c.note]
    return [f"{group}: {note}" for note in dict.fromkeys((*record.notes, *extra))]


def _table_cells(record: Summary, sources: list[str]) -> list[str]:
    """Display strings of one record, in TABLE_HEADER order."""
    def pm(metric: str) -> str:
        return _pm(record.metrics[metric]) + (" (eval SE)" if metric in record.eval_only else "")

    return [
        *_group_cells(record), _g(record.point), str(record.n), pm("fid"), record.fid_features,
        pm("clip_score"), pm("val_loss"), pm("align_acc"), _g(record.gpu_hours),
        f"[{sources.index(record.source) + 1}]" if record.is_reference else "",
    ]


def _pm(estimate: Estimate | None) -> str:
    """'mean ± half-width' to 4 significant digits; the mean alone when there is no interval."""
    if estimate is None:
        return ""
    mean, half = estimate
    return f"{mean:.4g}" if math.isnan(half) else f"{mean:.4g} ± {half:.2g}"


def _g(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _model_cell(record: Summary) -> str:
    """The model, and the trained run its group started from (`init_from`), if any."""
    return (record.model or "") + (f" from {record.started_from}" if record.started_from else "")


def _int(value: int | None) -> str:
    return "" if value is None else str(value)


def _markdown_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _render_csv(summary: Sequence[Summary], metrics: Sequence[str], family: Family) -> str:
    """Full precision, one row per record; no value (or no interval) is an empty cell. Per compared metric:
    the comparison at the final point on the arm's final record, and on each arm's record the ratios at the
    baseline horizon of the same point."""
    finals = {(r.group, r.arm): r for r in summary if r.comparisons}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow((*CSV_HEADER, *(f"{m}_{column}" for m in metrics for column in CSV_PER_METRIC), *CSV_TAIL))
    for r in summary:
        final = finals.get((r.group, r.arm))
        estimates = [x for m in METRICS for x in (r.metrics[m] or (None, None))]
        blocks = [x for m in metrics for x in _csv_metric(r, final, m, family)]
        verdicts = _ratio_verdicts(final, r.point, metrics, family) if final else {}
        shown = [m for m in metrics if m in r.comparisons] or list(verdicts)
        values = (r.dataset, r.model, r.batch_size, r.budget_flops, r.started_from, r.arm, r.point, r.n, *estimates,
                  ";".join(r.eval_only), r.train_flops, r.gpu_hours, r.fid_features, *blocks,
                  agreement(_final_verdicts(r, metrics)), family.pays(verdicts) if verdicts else None,
                  agreement(list(verdicts.values())), _reading(family, shown), r.source,
                  "; ".join(_group_notes(r)))
        writer.writerow(["" if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values])
    return buffer.getvalue()


def _csv_metric(record: Summary, final: Summary | None, metric: str, family: Family) -> tuple:
    """One metric's CSV cells (test ... ratio_verdict): the difference where the record holds the comparison,
    the ratios where the arm's comparison has a target at the record's point; empty otherwise."""
    c = record.comparisons.get(metric)
    d = c.difference if c else None
    difference = (None,) * 13 if d is None else (
        d.test, d.n if d.test == "paired" else None, d.mean, d.lo, d.hi, *(d.boot or (None, None)), d.p, d.p_adj,
        d.mde, d.se, d.eval_se, d.verdict)
    t = _target_at(final, metric, record.point) if final else None
    if t is None:
        return (*difference, *(None,) * (2 + 2 * len(RATIO_PARTS)))
    ratios = [x for axis in COMPUTE for r in [t.ratios[axis]]
              for x in ((r.bound, r.geomean, r.lo, r.hi, r.p, r.p_adj, r.not_reached) if r
                        else (None,) * len(RATIO_PARTS))]
    return (*difference, t.value, *ratios, ratio_verdict(t.ratios[family.compute], family.alpha))
