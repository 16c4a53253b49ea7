"""Leaderboard statistics: confidence intervals, paired comparisons, compute-to-target, summary tables.

The question maskbench answers is comparative (does an arm beat the unmasked baseline at equal
compute?), so every figure carries its uncertainty: means over seeds with Student-t intervals, a
comparison against the baseline at the final point, and the compute at which an arm matches the
baseline's final quality. Arms run with the same seed share the initial weights, the data order and
the evaluation noise, so the comparison pairs them by seed (`paired_difference`: per-seed
differences, a paired t-interval, a bootstrap interval, the minimum detectable effect and a verdict
that claims no more than the interval; `seed_ratios`: per-seed compute-to-target ratios); rows that
do not pair (a merged CSV whose seeds differ) fall back to Welch's unpaired test
(`welch_difference`) and say so. `debiased_cosine` serves the gradient-fidelity probe (`maskbench
probe gradfid`). Lower is better for FID (and for the oracle Fréchet distance stored in `fid` on
synth, labelled by `fid_features`) and for val_loss; higher is better for CLIP score and alignment.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

from maskbench.results.leaderboard import Row

METRICS = ("fid", "clip_score", "val_loss", "align_acc")
LOWER_IS_BETTER = {"fid": True, "val_loss": True, "clip_score": False, "align_acc": False}
FORMATS = ("table", "markdown", "csv")

Estimate = tuple[float, float]  # (mean, confidence-interval half-width; NaN for one value)


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


def compute_to_target(points: Sequence[tuple[float, float]], target: float,
                      higher_is_better: bool = False) -> float | None:
    """Compute (x) at which a curve of eval points first reaches a target value, or None.

    The curve joins the (x, value) points, sorted by x, with straight lines. If the first point
    already reaches the target (value <= target) its x is returned: nothing is known before it.
    Otherwise, for the first segment (x0, y0) -> (x1, y1) with y0 > target >= y1,
        x = x0 + (y0 - target) / (y0 - y1) · (x1 - x0).
    None means the target is not reached within the points. With higher_is_better the
    inequalities flip (CLIP score, alignment). On the leaderboard x is the arm's train_flops over
    the baseline's budget (or its GPU-hours over the baseline's final GPU-hours).
    """
    sign = -1.0 if higher_is_better else 1.0
    previous: tuple[float, float] | None = None
    for x, value in sorted(points):
        gap = sign * (value - target)  # > 0: not there yet
        if gap <= 0:
            if previous is None:
                return float(x)
            x0, gap0 = previous
            return float(x0 + gap0 / (gap0 - gap) * (x - x0))
        previous = (x, gap)
    return None


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """Two-sided Welch's t-test of mean(a) = mean(b): (t, p), or None with fewer than 2 values.

    t = (ā - b̄) / √(s_a²/n_a + s_b²/n_b), unequal variances, with Welch–Satterthwaite degrees of
    freedom df = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a-1) + (s_b²/n_b)²/(n_b-1)).
    """
    if len(a) < 2 or len(b) < 2:
        return None
    result = scipy.stats.ttest_ind(a, b, equal_var=False)
    return float(result.statistic), float(result.pvalue)


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
    and only with at least MIN_BOOTSTRAP pairs.
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


def paired_difference(arm: Sequence[float], base: Sequence[float], lower_is_better: bool = True,
                      level: float = 0.95, power: float = POWER) -> Difference:
    """Paired comparison of arm and baseline runs, arm[i] and base[i] sharing seed i.

    d_i = arm_i − base_i; interval d̄ ± t_{(1+level)/2, n−1} · s_d/√n (scipy.stats.ttest_rel's), p
    from t = d̄ / (s_d/√n) on n − 1 degrees of freedom, MDE as `minimum_detectable_effect`, and the
    bootstrap percentile interval of d̄ beside it. The verdict reads the t-interval. One pair has
    no interval; identical differences (s_d = 0) give a zero-width one.
    """
    a, b = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_difference needs two equally long, non-empty lists, got {a.shape} and {b.shape}")
    d = a - b
    n, mean = d.size, float(d.mean())
    lo = hi = p = mde = math.nan
    if n >= 2:
        se = float(d.std(ddof=1) / math.sqrt(n))
        half = scipy.stats.t.ppf((1 + level) / 2, n - 1) * se
        lo, hi = mean - half, mean + half
        if se > 0:
            p = float(2 * scipy.stats.t.sf(abs(mean) / se, n - 1))
        elif mean != 0:
            p = 0.0
        mde = minimum_detectable_effect(se, n - 1, level, power)
    return Difference("paired", n, n, mean, float(lo), float(hi), p, mde,
                      verdict(lo, hi, mde, lower_is_better), bootstrap_ci(d, level))


def welch_difference(arm: Sequence[float], base: Sequence[float], lower_is_better: bool = True,
                     level: float = 0.95, power: float = POWER) -> Difference:
    """Unpaired comparison (runs that share no seeds): Welch's t on mean(arm) − mean(base).

    Interval (ā − b̄) ± t_{(1+level)/2, df} · √(s_a²/n_a + s_b²/n_b), df Welch–Satterthwaite (as
    `welch`), MDE the same formula on that SE and df. Fewer than 2 runs on a side: no interval.
    """
    a, b = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError("welch_difference needs runs on both sides")
    mean = float(a.mean() - b.mean())
    lo = hi = p = mde = math.nan
    if a.size >= 2 and b.size >= 2:
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        se = math.sqrt(va + vb)
        if se > 0:
            df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
            half = scipy.stats.t.ppf((1 + level) / 2, df) * se
            lo, hi = mean - half, mean + half
            p = float(2 * scipy.stats.t.sf(abs(mean) / se, df))
            mde = minimum_detectable_effect(se, df, level, power)
        else:
            lo = hi = mean
            p, mde = (0.0 if mean else math.nan), 0.0
    return Difference("welch", int(a.size), int(b.size), mean, float(lo), float(hi), p, mde,
                      verdict(lo, hi, mde, lower_is_better))


@dataclass(frozen=True)
class Ratio:
    """Per-seed ratios of compute to a target, summarised on the log scale.

    `geomean` = exp(mean log r_i), lo/hi = exp(mean ± t_{(1+level)/2, n−1} · sd(log r)/√n) (NaN for one
    seed). When `not_reached` seeds never reached the target within their runs, their ratio is only
    known to exceed the run's length, so no summary is given (geomean None).
    """
    geomean: float | None
    lo: float
    hi: float
    n: int
    not_reached: int = 0


def ratio_summary(ratios: Sequence[float | None], level: float = 0.95) -> Ratio | None:
    """Summary of per-seed ratios (None: that seed did not reach the target); None for no seeds or
    for a NaN among them (a run without the compute column)."""
    if not ratios or any(r is not None and math.isnan(r) for r in ratios):
        return None
    missed = sum(r is None for r in ratios)
    if missed:
        return Ratio(None, math.nan, math.nan, len(ratios), missed)
    mean, half = mean_ci(np.log(np.asarray(ratios, dtype=float)), level)
    return Ratio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(ratios))


@dataclass(frozen=True)
class Comparison:
    """An arm against the baseline at the final point: the difference on the target metric and, when
    paired, the per-seed ratios of FLOPs and of device-hours to the baseline's final value."""
    metric: str
    difference: Difference
    flops_ratio: Ratio | None = None
    hours_ratio: Ratio | None = None
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

    The comparison fields are set on each arm's final eval point only, and only when the group
    has the baseline arm: `target` is the baseline's final mean of `target_metric`;
    `flops_to_target` / `hours_to_target` are the fractions of the baseline's budget / final
    GPU-hours at which this arm's mean curve reaches it (None with a target: not reached);
    `welch_p` is Welch's p against the baseline's final runs; `comparison` is the paired (or, when
    the seeds do not pair, Welch) comparison with its verdict, None for the baseline itself.
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
    target_metric: str
    target: float | None = None
    flops_to_target: float | None = None
    hours_to_target: float | None = None
    welch_p: float | None = None
    comparison: Comparison | None = None
    source: str = ""
    notes: tuple[str, ...] = ()
    started_from: str = ""        # `source_family` of the trained run these runs started from ("" from scratch)

    @property
    def is_reference(self) -> bool:
        return bool(self.source)


def summarize(rows: Sequence[Row], baseline_arm: str = "mask0", metric: str = "fid",
              level: float = 0.95) -> list[Summary]:
    """Group measured rows by (dataset, model, batch size, budget) and summarise each arm at each point.

    Per arm and point: seeds, mean ± CI of every metric, mean GPU-hours and train FLOPs. Per arm
    (at its final point), against the baseline's final point on `metric`: compute-to-target of the
    mean curve, Welch's p, and the `Comparison` (paired by seed when the seeds pair, with per-seed
    compute-to-target ratios; Welch's otherwise, saying why). If metric is "fid" and no row of a
    group has one, the group uses val_loss instead and says so in its notes. A point evaluated
    twice (same run_id and point) counts once, the later row winning. Reference rows follow, one
    record each.
    """
    if metric not in LOWER_IS_BETTER:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(LOWER_IS_BETTER)}")
    summary: list[Summary] = []
    for rows_of_group in measured_groups(rows).values():
        summary.extend(_summarize_group(rows_of_group, baseline_arm, metric, level))
    summary.extend(_reference(row, metric) for row in rows if row["source"])
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


def compared_metric(rows: Sequence[Row], metric: str) -> str:
    """The metric a group is compared on: `metric`, or val_loss when it is fid and no row has an FID."""
    return "val_loss" if metric == "fid" and all(row["fid"] is None for row in rows) else metric


def _summarize_group(rows: list[Row], baseline_arm: str, metric: str, level: float) -> list[Summary]:
    """Records of one (dataset, model, budget) group, the baseline arm first."""
    notes = []
    compared_on = compared_metric(rows, metric)
    if compared_on != metric:
        notes.append("no FID in this group: compute-to-target and the comparisons use val_loss")
    arms: dict[str, dict[float, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        arms[row["arm"]][row["point"]].append(row)
    if baseline_arm not in arms:
        notes.append(f"no {baseline_arm!r} runs in this group: no compute-to-target or comparison")
    features = _fid_features(rows)
    curves = {arm: [_point(points[p], features, compared_on, level, tuple(notes))
                    for p in sorted(points)] for arm, points in arms.items()}
    if baseline_arm in arms:
        base_runs = arms[baseline_arm][max(arms[baseline_arm])]
        for arm, curve in curves.items():
            final_runs = arms[arm][max(arms[arm])]
            others = [] if arm == baseline_arm else base_runs  # no test of the baseline against itself
            _compare(curve, curves[baseline_arm][-1], final_runs, others)
            if others and curve[-1].target is not None:
                curve[-1].comparison = _comparison(final_runs, base_runs, rows, compared_on, baseline_arm, level)
    order = sorted(curves, key=lambda arm: (arm != baseline_arm, arm))
    return [record for arm in order for record in curves[arm]]


def _comparison(final_runs: list[Row], base_runs: list[Row], rows: list[Row], metric: str,
                baseline_arm: str, level: float) -> Comparison | None:
    """An arm's final rows against the baseline's: paired by seed when every arm seed has exactly one
    baseline partner (and each side one run per seed), Welch's unpaired test otherwise."""
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
        difference = welch_difference(_values(arm_final, metric), _values(base_final, metric), lower, level)
        return Comparison(metric, difference, note=f"unpaired (Welch): {why}", baseline=baseline_arm)
    seeds = sorted(by_seed["arm"])
    pairs = [(by_seed["arm"][seed][0], by_seed["base"][seed][0]) for seed in seeds]
    difference = paired_difference([a[metric] for a, _ in pairs], [b[metric] for _, b in pairs], lower, level)
    runs = defaultdict(list)
    for row in rows:
        runs[row["run_id"]].append(row)
    ratios = {x: ratio_summary([_seed_ratio(runs[a["run_id"]], runs[b["run_id"]], metric, x, b[metric])
                                for a, b in pairs], level) for x in ("train_flops", "gpu_hours")}
    return Comparison(metric, difference, ratios["train_flops"], ratios["gpu_hours"], tuple(seeds),
                      baseline=baseline_arm)


def _seed_ratio(arm_run: list[Row], base_run: list[Row], metric: str, x_field: str,
                target: float) -> float | None:
    """One seed's compute-to-target ratio: the arm's x_field (FLOPs or device-hours) at which its own
    curve first reaches the baseline's final value of this seed, over the baseline's (its first reach
    of its own final value; its final x on a monotone curve). None: the arm never reaches it; NaN:
    the runs do not record x_field."""
    higher = not LOWER_IS_BETTER[metric]
    reach = [compute_to_target([(row[x_field], row[metric]) for row in run
                                if row[x_field] is not None and row[metric] is not None], target, higher)
             for run in (arm_run, base_run)]
    if reach[1] is None or reach[1] <= 0:
        return math.nan  # the baseline's curve has no x_field: no ratio at all
    return None if reach[0] is None else reach[0] / reach[1]


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


def _point(runs: list[Row], features: str, target_metric: str, level: float,
           notes: tuple[str, ...]) -> Summary:
    """The record of one arm at one eval point, pooling its seeds."""
    first = runs[0]
    return Summary(
        dataset=first["dataset"], model=first["model"], batch_size=first["batch_size"],
        budget_flops=first["budget_flops"], arm=first["arm"], point=first["point"], n=len(runs),
        started_from=source_family(first),
        metrics={metric: _estimate(_values(runs, metric), level) for metric in METRICS},
        train_flops=_mean(_values(runs, "train_flops")), gpu_hours=_mean(_values(runs, "gpu_hours")),
        fid_features=features, target_metric=target_metric, notes=notes,
    )


def _compare(curve: list[Summary], base_final: Summary, final_runs: list[Row],
             base_runs: list[Row]) -> None:
    """Set the target, compute-to-target and Welch's p on the last record of an arm's curve."""
    final, metric = curve[-1], base_final.target_metric
    if base_final.metrics[metric] is None:
        return
    final.target = base_final.metrics[metric][0]
    final.flops_to_target = _reach(curve, metric, "train_flops", final.budget_flops, final.target)
    if base_final.gpu_hours:
        final.hours_to_target = _reach(curve, metric, "gpu_hours", base_final.gpu_hours, final.target)
    test = welch(_values(final_runs, metric), _values(base_runs, metric))
    final.welch_p = test[1] if test else None


def _reach(curve: list[Summary], metric: str, x_field: str, x_unit: float,
           target: float) -> float | None:
    """compute_to_target of an arm's mean curve, its x being x_field in units of x_unit."""
    points = [(getattr(r, x_field) / x_unit, r.metrics[metric][0]) for r in curve
              if getattr(r, x_field) is not None and r.metrics[metric] is not None]
    return compute_to_target(points, target, higher_is_better=not LOWER_IS_BETTER[metric])


def _reference(row: Row, metric: str) -> Summary:
    """A published row as its own record: one value per metric, no interval, its citation kept."""
    return Summary(
        dataset=row["dataset"], model=row["model"], batch_size=row["batch_size"],
        budget_flops=row["budget_flops"], arm=row["arm"], point=row["point"], n=1,
        metrics={m: (row[m], math.nan) if row[m] is not None else None for m in METRICS},
        train_flops=row["train_flops"], gpu_hours=row["gpu_hours"],
        fid_features=row["fid_features"] or "", target_metric=metric, source=row["source"],
    )


def _values(runs: list[Row], column: str) -> list[float]:
    return [row[column] for row in runs if row[column] is not None]


def _estimate(values: list[float], level: float) -> Estimate | None:
    return mean_ci(values, level) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


# "FD", not "FID": the column is Inception FID only where its features say inception (on synth it is the
# oracle's Fréchet distance); `fd_note` says so under every table.
TABLE_HEADER = ("dataset", "model", "batch", "budget", "arm", "point", "n", "FD", "FD features", "CLIP",
                "val loss", "align", "GPU-h", "FLOPs to target", "GPU-h to target", "ref")
COMPARISON_HEADER = ("dataset", "model", "batch", "budget", "arm", "metric", "test", "n", "Δ (95% CI)", "bootstrap 95%",
                     "p", "MDE", "verdict", "FLOPs ratio (95% CI)", "GPU-h ratio (95% CI)")
CSV_HEADER = ("dataset", "model", "batch_size", "budget_flops", "started_from", "arm", "point", "n",
              *(f"{m}{suffix}" for m in METRICS for suffix in ("", "_ci")),
              "train_flops", "gpu_hours", "fid_features", "target_metric", "target",
              "flops_to_target", "hours_to_target", "welch_p",
              "test", "pairs", "diff", "diff_lo", "diff_hi", "boot_lo", "boot_hi", "p", "mde", "verdict",
              *(f"{x}_{suffix}" for x in ("flops_ratio", "hours_ratio")
                for suffix in ("geomean", "lo", "hi", "not_reached")),
              "source", "notes")


FD_NOTE = ("FD: Fréchet distance in the features named beside it; Inception FID only for "
           "inception-2015-12-05-clean (oracle-synth-v1 is the synth oracle's, standin-random-inception a random "
           "network's)")
COMPARISON_NOTE = (
    "Δ: arm − {baseline} on the metric named, at the final point. paired: runs of the same seed share initial "
    "weights, data order and evaluation noise, so Δ is the mean of per-seed differences with the paired "
    "t-interval; welch: the seeds do not pair, Δ is the difference of means with Welch's interval. verdict: "
    "better / worse only when the whole 95% t-interval lies on one side of 0 (lower is better for FD and val "
    "loss, higher for CLIP and align); otherwise no difference detected, and MDE is the smallest effect these "
    "runs detect with 80% power at two-sided 5%, (t_0.975 + t_0.80)·SE. bootstrap: percentile interval of the "
    "mean difference, {resamples} resamples, fixed seed, not shown below {min_boot} pairs. FLOPs / GPU-h ratio: per "
    "seed, what the arm spends to reach {baseline}'s final value of the same seed over what {baseline} spends, "
    "geometric mean with the 95% t-interval of the log-ratios.")


def render(summary: Sequence[Summary], fmt: str = "table") -> str:
    """The summary as aligned text tables, Markdown tables, or CSV (full precision).

    Table and Markdown give one line per arm and eval point, then one line per comparison with the
    baseline (test, difference and intervals, p, MDE, verdict, compute ratios), then the notes: the
    groups', each reference row's citation by number, and what the columns mean. In CSV, one row
    per record; `flops_to_target` empty while `target` is set means "not reached".
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "csv":
        return _render_csv(summary)
    sources = list(dict.fromkeys(r.source for r in summary if r.is_reference))
    cells = [_table_cells(r, sources) for r in summary]
    compared = [r for r in summary if r.comparison is not None]
    comparisons = [_comparison_cells(r) for r in compared]
    notes = list(dict.fromkeys(note for r in summary for note in _group_notes(r)))
    notes += [f"[{i}] {source}" for i, source in enumerate(sources, 1)]
    notes.append(FD_NOTE)
    title = []
    if compared:
        baseline = compared[0].comparison.baseline
        title = [f"Against {baseline} at the final point:"]
        notes.append(COMPARISON_NOTE.format(baseline=baseline, resamples=f"{BOOTSTRAP_RESAMPLES:,}",
                                            min_boot=MIN_BOOTSTRAP))
    if fmt == "markdown":
        lines = _markdown_table(TABLE_HEADER, cells)
        if compared:
            lines += ["", *title, "", *_markdown_table(COMPARISON_HEADER, comparisons)]
        return "\n".join(lines + [""] + [f"- {note}" for note in notes])
    lines = _text_table(TABLE_HEADER, cells)
    if compared:
        lines += ["", *title, *_text_table(COMPARISON_HEADER, comparisons)]
    return "\n".join(lines + ([""] + notes if notes else []))


def _text_table(header: Sequence[str], cells: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [header, ["-" * width for width in widths], *cells]]


def _markdown_table(header: Sequence[str], cells: list[list[str]]) -> list[str]:
    return [_markdown_line(header), _markdown_line(["---"] * len(header)), *(_markdown_line(row) for row in cells)]


def _comparison_cells(record: Summary) -> list[str]:
    """Display strings of one comparison, in COMPARISON_HEADER order."""
    c = record.comparison
    d = c.difference
    n = f"{d.n} pairs" if d.test == "paired" else f"{d.n} vs {d.n_base}"
    interval = "" if math.isnan(d.lo) else f" [{d.lo:.3g}, {d.hi:.3g}]"
    boot = f"[{d.boot[0]:.3g}, {d.boot[1]:.3g}]" if d.boot else (f"n < {MIN_BOOTSTRAP}" if d.test == "paired" else "")
    return [record.dataset or "", _model_cell(record), _int(record.batch_size), _g(record.budget_flops), record.arm,
            c.metric, d.test, n,
            f"{d.mean:.4g}{interval}", boot, _g(None if math.isnan(d.p) else d.p),
            _g(None if math.isnan(d.mde) else d.mde), d.verdict, _ratio(c.flops_ratio), _ratio(c.hours_ratio)]


def _ratio(ratio: Ratio | None) -> str:
    if ratio is None:
        return ""
    if ratio.geomean is None:
        return f"{ratio.not_reached}/{ratio.n} not reached"
    return f"{ratio.geomean:.3f}" + ("" if math.isnan(ratio.lo) else f" [{ratio.lo:.3g}, {ratio.hi:.3g}]")


def group_label(dataset: str | None, model: str | None, batch_size: int | None, budget_flops: float | None,
                started_from: str = "") -> str:
    """dataset/model[ from SOURCE][/bBATCH]/budget: a group's name in notes (the batch when rows record one)."""
    start = f" from {started_from}" if started_from else ""
    batch = f"/b{batch_size}" if batch_size else ""
    return f"{dataset}/{model}{start}{batch}/{_g(budget_flops)}"


def _group_notes(record: Summary) -> list[str]:
    """A record's group notes, prefixed with its group so they read on their own under a table."""
    group = group_label(record.dataset, record.model, record.batch_size, record.budget_flops, record.started_from)
    extra = [f"{record.arm}: {record.comparison.note}"] if record.comparison and record.comparison.note else []
    return [f"{group}: {note}" for note in (*record.notes, *extra)]


def _table_cells(record: Summary, sources: list[str]) -> list[str]:
    """Display strings of one record, in TABLE_HEADER order."""
    return [
        record.dataset or "", _model_cell(record), _int(record.batch_size), _g(record.budget_flops), record.arm,
        _g(record.point), str(record.n), _pm(record.metrics["fid"]), record.fid_features,
        _pm(record.metrics["clip_score"]), _pm(record.metrics["val_loss"]),
        _pm(record.metrics["align_acc"]), _g(record.gpu_hours),
        _to_target(record, record.flops_to_target), _to_target(record, record.hours_to_target),
        f"[{sources.index(record.source) + 1}]" if record.is_reference else "",
    ]


def _to_target(record: Summary, fraction: float | None) -> str:
    if record.target is None:
        return ""
    return "not reached" if fraction is None else f"{fraction:.3f}"


def _pm(estimate: Estimate | None) -> str:
    """'mean ± half-width' to 4 significant digits; the mean alone when there is no interval."""
    if estimate is None:
        return ""
    mean, half = estimate
    return f"{mean:.4g}" if math.isnan(half) else f"{mean:.4g} ± {half:.2g}"


def _g(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _model_cell(record: Summary) -> str:
    """The model, and the trained run its group started from (`init_from`), if any."""
    return (record.model or "") + (f" from {record.started_from}" if record.started_from else "")


def _int(value: int | None) -> str:
    return "" if value is None else str(value)


def _markdown_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _render_csv(summary: Sequence[Summary]) -> str:
    """Full precision, one CSV_HEADER row per record; no value (or no interval) is an empty cell."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for r in summary:
        estimates = [x for m in METRICS for x in (r.metrics[m] or (None, None))]
        values = (r.dataset, r.model, r.batch_size, r.budget_flops, r.started_from, r.arm, r.point, r.n, *estimates, r.train_flops,
                  r.gpu_hours, r.fid_features, r.target_metric, r.target, r.flops_to_target,
                  r.hours_to_target, r.welch_p, *_comparison_values(r.comparison), r.source,
                  "; ".join((*r.notes, *([r.comparison.note] if r.comparison and r.comparison.note else []))))
        writer.writerow(["" if v is None or (isinstance(v, float) and math.isnan(v)) else v
                         for v in values])
    return buffer.getvalue()


def _comparison_values(c: Comparison | None) -> tuple:
    """The comparison's CSV cells (test ... hours_ratio_not_reached), all empty without one."""
    if c is None:
        return (None,) * 18
    d = c.difference
    ratios = [x for r in (c.flops_ratio, c.hours_ratio)
              for x in ((r.geomean, r.lo, r.hi, r.not_reached) if r else (None,) * 4)]
    return (d.test, d.n if d.test == "paired" else None, d.mean, d.lo, d.hi, *(d.boot or (None, None)), d.p,
            d.mde, d.verdict, *ratios)
