"""Estimators of the leaderboard statistics: intervals, paired and unpaired differences, ratios, Holm.

The question maskbench answers is comparative (does an arm beat the unmasked baseline at equal
compute?), so every figure carries its uncertainty: means over seeds with Student-t intervals
(`mean_ci`), and comparisons against the baseline. Arms run with the same seed share the initial
weights, the data order and the evaluation noise, so a comparison pairs them by seed
(`paired_difference`: per-seed differences, a paired t-interval, the minimum detectable effect and a
verdict that claims no more than the interval); rows that do not pair fall back to Welch's unpaired test
(`welch_difference`). Studies have 3 to 5 seeds: Student-t intervals are exact for normal differences at
any n, while a percentile bootstrap over so few pairs is too narrow (it resamples to a handful of
distinct means and ignores the t quantile), so there is none. A zero spread over seeds gives no p at all
(never p = 0, which a correction would read as infinitely significant). Rows may carry each metric's
own sampling error (`<metric>_se`, `sampling_se`): comparisons then say how much of the seed-to-seed
spread it explains, the minimum detectable effect uses the larger of the two, and fits along one run's
curve weight its points by it (`curve_errors`). Per-seed compute-to-target ratios are summarised on the
log scale (`ratio_summary`), and a plan's p-values adjusted together by `holm`.
`debiased_cosine` serves the gradient-fidelity probe (`maskbench probe gradfid`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

from maskbench.metrics import METRICS
from maskbench.results.rows import Row

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
    return float(x.mean()), float(quantile * _sem(x))


def _sem(x: np.ndarray) -> float:
    """s/√n, as scipy.stats.sem gives it (without its input checks, which cost milliseconds a call: a
    leaderboard with its compute curves summarises hundreds of sets of per-seed figures)."""
    return float(x.std(ddof=1) / math.sqrt(x.size))


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


# The column counting each metric's samples, where a row records one (`Metric.sample_count`).
SAMPLE_COUNT = {m.name: m.sample_count for m in METRICS if m.sample_count}


def curve_errors(rows: Sequence[Row], metric: str) -> list[float] | None:
    """The sampling errors to weight the points of one run's curve by (rows in curve order), or None for
    equal weights; a ValueError when neither is right.

    A figure scored on 256 samples is far noisier than one on 2,048 (FD 1,589 against 179 for one model),
    so a fit along a curve that mixes them must weight each point by 1/SE². Rows without positive errors
    (older rows; a binomial error of 0 at accuracy 0 or 1) get equal weights, which is right only when
    every point was scored on the same number of samples: a curve whose sample counts differ and which
    carries no errors is refused, not pooled.
    """
    errors = sampling_ses(rows, metric)
    if errors is not None and all(error > 0 for error in errors):
        return errors
    counts = sorted({row.get(SAMPLE_COUNT[metric]) or 0 for row in rows}) if metric in SAMPLE_COUNT else []
    if len(counts) > 1:
        raise ValueError(f"run {rows[0]['run_id']}: its {metric} points were scored on different numbers of samples "
                         f"({SAMPLE_COUNT[metric]} {', '.join(map(str, counts))}) and do not all carry a positive "
                         f"{metric}_se to weight them by: one fit cannot pool them")
    return None


POWER = 0.80                 # the power at which the minimum detectable effect is stated


@dataclass(frozen=True)
class Difference:
    """arm − baseline on one metric, with its interval, p-value, minimum detectable effect and verdict.

    `test` is "paired" (per-seed differences d_i; n = n_base = pairs) or "welch" (two independent
    samples; n and n_base are their sizes). `mean` is the mean difference (paired: mean of d_i, which
    equals the difference of the means). lo/hi is the two-sided t-interval, NaN (and p, mde NaN) when
    there is none; a zero spread over seeds makes it zero-wide, with p NaN (1 when the mean is 0 too) and
    an inconclusive verdict. `se` is the standard error of `mean` from the seeds' spread, `eval_se` the
    one the rows' own sampling errors alone imply (`eval_se_of_difference`; NaN without them). `p_adj` is
    p after the plan's multiplicity correction (`correct`; p without one).
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
    A zero SE (runs that agree exactly) says nothing about what they would detect: NaN.
    """
    if not (df > 0 and math.isfinite(se) and se > 0):
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
    power it was computed for: POWER unless the caller chose another). A zero-wide interval comes from
    runs whose differences are all the same: no spread to measure uncertainty by, so no verdict either way.
    """
    if math.isnan(lo) or math.isnan(hi):
        return "not tested: no interval from fewer than 2 runs"
    if lo == hi:
        return ZERO_SPREAD if lo != 0 else "no difference detected: zero spread, every difference is 0"
    below, above = hi < 0, lo > 0
    if below or above:
        return "better" if below == lower_is_better else "worse"
    return f"no difference detected; an effect larger than {mde:.3g} would have been detected"


ZERO_SPREAD = "inconclusive: zero spread over seeds, so no interval width and no p"


def _two_sided_p(mean: float, se: float, df: float) -> float:
    """p of the two-sided t-test of mean = 0. With no spread (se = 0) t is 0/0 or ±∞: p is 1 when the
    mean is 0 too, and undefined (NaN) otherwise, never 0: a correction would read p = 0 as infinitely
    significant, and Holm leaves a NaN out of its family."""
    if se > 0:
        return float(2 * scipy.stats.t.sf(abs(mean) / se, df))
    return 1.0 if mean == 0 else math.nan


def paired_difference(arm: Sequence[float], base: Sequence[float], lower_is_better: bool = True,
                      level: float = 0.95, power: float = POWER, arm_se: Sequence[float] | None = None,
                      base_se: Sequence[float] | None = None) -> Difference:
    """Paired comparison of arm and baseline runs, arm[i] and base[i] sharing seed i.

    d_i = arm_i − base_i; interval d̄ ± t_{(1+level)/2, n−1} · s_d/√n (scipy.stats.ttest_rel's), p
    from t = d̄ / (s_d/√n) on n − 1 degrees of freedom, MDE as `minimum_detectable_effect` on the larger
    of s_d/√n and the eval-noise SE (`eval_se_of_difference`, from arm_se/base_se: the rows' sampling
    errors, when they have them). The verdict reads the t-interval. One pair has no interval; identical
    differences (s_d = 0) give a zero-width one, no p and no verdict (`verdict`, `_two_sided_p`).
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
                      se=se, eval_se=eval_se, p_adj=p)


def welch_difference(arm: Sequence[float], base: Sequence[float], lower_is_better: bool = True,
                     level: float = 0.95, power: float = POWER, arm_se: Sequence[float] | None = None,
                     base_se: Sequence[float] | None = None) -> Difference:
    """Unpaired comparison (runs that share no seeds): Welch's t on mean(arm) − mean(base).

    Interval (ā − b̄) ± t_{(1+level)/2, df} · √(s_a²/n_a + s_b²/n_b), unequal variances, with the
    Welch–Satterthwaite df = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1)); p from
    t = (ā − b̄) / √(s_a²/n_a + s_b²/n_b) on that df (scipy.stats.ttest_ind(equal_var=False)'s); MDE the same
    formula on the larger of that SE and the eval-noise SE, with that df. Fewer than 2 runs on a side: no
    interval; no spread on either side: a zero-width one, read as `paired_difference` reads it (df is then
    n_a + n_b − 2, Welch's being 0/0).
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
        df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if se > 0 else a.size + b.size - 2
        half = scipy.stats.t.ppf((1 + level) / 2, df) * se
        lo, hi = mean - half, mean + half
        p = _two_sided_p(mean, se, df)
        mde = _mde(se, eval_se, df, level, power)
    return Difference("welch", int(a.size), int(b.size), mean, float(lo), float(hi), p, mde,
                      verdict(lo, hi, mde, lower_is_better), se=se, eval_se=eval_se, p_adj=p)


@dataclass(frozen=True)
class Ratio:
    """Per-seed ratios of compute to a target, summarised on the log scale.

    `geomean` = exp(mean log r_i), lo/hi = exp(mean ± t_{(1+level)/2, n−1} · sd(log r)/√n) (NaN for one
    seed), p the two-sided t-test of mean log r = 0 (ratio 1; NaN when every seed has the same ratio other
    than 1: no spread, no test, as in `_two_sided_p`), `p_adj` that p after the plan's
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


def ratio_summary(ratios: Sequence[float], level: float = 0.95, bounds: Sequence[Bound] = (),
                  test_bounds: bool = False) -> Ratio | None:
    """Summary of per-seed ratios, bounds[i] the bound of ratio i ("" by default); None for no seeds or
    for a NaN among them (a run without the compute column). With `test_bounds`, bounds of one direction are
    tested as if they were values (a test that can only err towards 1, so its reading holds in the bound's
    direction: the measured compute multiplier's T2) as long as one seed is a value (bounds alone say how far
    the ladder reached, not what the arm did: no test), and bounds of both directions give None."""
    if not ratios or any(math.isnan(r) for r in ratios):
        return None
    bounds = list(bounds) or [""] * len(ratios)
    if test_bounds and ">" in bounds and "<=" in bounds:
        return None
    bound = ">" if ">" in bounds else "<=" if "<=" in bounds else ""
    logs = np.log(np.asarray(ratios, dtype=float))
    mean, half = mean_ci(logs, level)
    tested = logs.size > 1 and (not bound or (test_bounds and "" in bounds))  # bounds alone measure the reach
    p = _two_sided_p(mean, _sem(logs), logs.size - 1) if tested else math.nan
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
    """"disagree" only when the metrics' verdicts point opposite ways: one better (or pays), another worse (or
    does not pay); "partly" when some detect a direction and others nothing; "agree" when they all point the
    same way, nothing detected included; "" for fewer than two verdicts. Nothing detected is not the opposite
    of better: calling that a disagreement would read an underpowered metric as a contrary one."""
    if len(verdicts) < 2:
        return ""
    directions = {_direction(v) for v in verdicts}
    return "agree" if len(directions) == 1 else "disagree" if {1, -1} <= directions else "partly"


def _direction(verdict_: str) -> int:
    if verdict_.startswith("better") or verdict_ == "pays":
        return 1
    return -1 if verdict_.startswith(("worse", "does not pay")) else 0


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
