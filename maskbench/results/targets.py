"""Compute-to-target: the compute at which a run's monotone (isotonic) fit reaches a target value.

An arm pays when it reaches the baseline's quality with less compute. Per seed, the target is the
baseline run's value at one of its eval points (a horizon), and the ratio is the compute the arm's run
of that seed needs to reach it over what the baseline's needs, both read off monotone fits of each
run's curve so that eval noise cannot make an early lucky point "reach" it. The fits weight each point
by its sampling error (`estimators.curve_errors`): a point scored on 256 samples does not outvote one
scored on 2,048.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.optimize

from maskbench.metrics import get_metric
from maskbench.results.estimators import Bound, Ratio, curve_errors
from maskbench.results.rows import Row

COMPUTE = {"train_flops": "FLOPs", "gpu_hours": "device-h"}  # the two compute axes of compute-to-target
Weights = Sequence[float] | None  # one per point of a curve, in its order; None: equal weights


def monotone_fit(points: Sequence[tuple[float, float]], higher_is_better: bool = False,
                 weights: Weights = None) -> tuple[np.ndarray, np.ndarray]:
    """A curve's isotonic weighted least-squares fit: (x ascending, fitted values), non-increasing in x
    when lower is better, non-decreasing when higher is better.

    Eval noise makes a training curve wiggle; read raw, a lucky early point "reaches" a target the run
    then falls back from, so compute-to-target swings with single evaluations. The fit is the monotone
    curve closest in weighted squared error (pool-adjacent-violators, `scipy.optimize.isotonic_regression`):
    each run of points that goes the wrong way is replaced by its weighted mean, the weights being
    1/SE² of each point (`run_curve`) or equal. It uses only the order of x, so it is the same on FLOPs,
    device-hours, eval points or their logarithms.
    """
    if not points:
        raise ValueError("monotone_fit needs at least one point")
    xs, ys = (np.asarray(column, dtype=float) for column in zip(*points))
    order = np.lexsort((ys, xs))
    w = None if weights is None else np.asarray(weights, dtype=float)[order]
    return xs[order], scipy.optimize.isotonic_regression(ys[order], weights=w, increasing=higher_is_better).x


def compute_to_target(points: Sequence[tuple[float, float]], target: float,
                      higher_is_better: bool = False, weights: Weights = None) -> float | None:
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
    xs, fit = monotone_fit(points, higher_is_better, weights)
    gaps = (fit - target) * (-1.0 if higher_is_better else 1.0)  # > 0: not there yet; non-increasing
    i = _first_reached(gaps)
    if i is None:
        return None
    if i == 0:
        return float(xs[0])
    return float(xs[i - 1] + gaps[i - 1] / (gaps[i - 1] - gaps[i]) * (xs[i] - xs[i - 1]))


def _first_reached(gaps: np.ndarray) -> int | None:
    """The index of the first fitted point at or past the target (gap <= 0), None when none is."""
    reached = np.flatnonzero(gaps <= 0)
    return int(reached[0]) if reached.size else None


def reached_on_pooled(points: Sequence[tuple[float, float]], target: float, higher_is_better: bool = False,
                      weights: Weights = None) -> bool:
    """Whether a curve's monotone fit reaches `target` at a fitted point that pools measured points across which
    the raw curve went the wrong way (rose, for a metric where lower is better).

    The fit (`monotone_fit`) replaces a stretch that goes back up by its weighted mean, so a run whose value fell
    below the target and then rose again reaches it on the fit at the mean of the stretch: the reading rests on
    a point the run moved away from (TREAD's FD on the literature study: 9,277, then 10,419 at the end, pooled to
    reach `mask0`'s 10,635 with 0.74 of its FLOPs). False when the target is not reached, or is reached at a
    point the fit left as measured.
    """
    if not points:
        return False
    xs, ys = (np.asarray(column, dtype=float) for column in zip(*points))
    raw = ys[np.lexsort((ys, xs))]
    _, fit = monotone_fit(points, higher_is_better, weights)
    i = _first_reached((fit - target) * (-1.0 if higher_is_better else 1.0))
    if i is None:
        return False
    block = np.isclose(fit, fit[i], rtol=1e-12, atol=0.0)  # the fitted level the target is reached at ...
    start = i
    while start > 0 and block[start - 1]:
        start -= 1
    stop = i
    while stop + 1 < fit.size and block[stop + 1]:
        stop += 1
    stretch = raw[start:stop + 1]  # ... and the measured points it pools
    return bool(stretch.size > 1 and not np.allclose(stretch, stretch[0], rtol=1e-12, atol=0.0))


def run_curve(run: Sequence[Row], metric: str, x_field: str) -> tuple[list[tuple[float, float]], Weights]:
    """One run's (x_field, metric) points, from its rows that record both, and their weights 1/SE² (None:
    equal; `curve_errors` refuses a curve that mixes sample counts without errors)."""
    rows = [row for row in run if row[x_field] is not None and row[metric] is not None]
    errors = curve_errors(rows, metric) if rows else None
    return [(row[x_field], row[metric]) for row in rows], errors and [1 / error**2 for error in errors]


def horizon_target(base_run: Sequence[Row], metric: str, point: float) -> float:
    """A baseline run's value at one of its eval points (a horizon), read off its monotone fit over the
    eval points: the target an arm's run of the same seed is asked to reach."""
    points, weights = run_curve(base_run, metric, "point")
    xs, fit = monotone_fit(points, not get_metric(metric).lower_is_better, weights)
    return float(np.interp(point, xs, fit))


def seed_ratio(arm_run: Sequence[Row], base_run: Sequence[Row], metric: str, x_field: str,
               target: float) -> tuple[float, Bound]:
    """One seed's compute-to-target ratio: the arm's x_field (FLOPs or device-hours) at which its monotone
    fit reaches the target, over the baseline's, both read the same way (`compute_to_target`), and its
    bound: "" a value; "<=" the arm is there at its first point, so nothing is known before it and the
    ratio is an upper bound; ">" the arm never gets there, and its last x over the baseline's is a lower
    bound. NaN: the runs do not record x_field (or the baseline never reaches the target)."""
    higher = not get_metric(metric).lower_is_better
    arm_curve, arm_weights = run_curve(arm_run, metric, x_field)
    base_curve, base_weights = run_curve(base_run, metric, x_field)
    base = compute_to_target(base_curve, target, higher, base_weights)
    if not arm_curve or base is None or base <= 0:
        return math.nan, ""
    arm = compute_to_target(arm_curve, target, higher, arm_weights)
    if arm is None:
        return max(x for x, _ in arm_curve) / base, ">"
    return arm / base, "<=" if arm == min(x for x, _ in arm_curve) else ""


def seed_pooled(arm_run: Sequence[Row], metric: str, x_field: str, target: float) -> bool:
    """Whether one seed's arm run reaches the target on its monotone fit only at a point that pools a stretch
    where its raw curve went the wrong way (`reached_on_pooled`): its ratio rests on a value the run did not
    keep."""
    curve, weights = run_curve(arm_run, metric, x_field)
    return reached_on_pooled(curve, target, not get_metric(metric).lower_is_better, weights)


@dataclass(frozen=True)
class Target:
    """Compute-to-target at one horizon (eval point) of the baseline, on each compute axis.

    Per seed the target is the baseline run's own value there, read off its monotone fit
    (`horizon_target`), and the ratio is the compute the arm's run of that seed needs to reach it over
    the compute the baseline's needs (`seed_ratio`); `value` is the mean of the per-seed targets, `values`
    the per-seed ones. Where the baseline's curve goes back up, its fit pools horizons into one level:
    when that makes every seed's target here the same as at an earlier horizon, the ratios here are that
    horizon's too, one test and not two, and `repeats` names it (None otherwise). `pooled` counts, per
    compute axis, the seeds whose arm run reaches the target only at a point its fit pooled over a stretch
    where the run went the wrong way (`seed_pooled`): a ratio that rests on them is flagged, not read as
    measured.
    """
    point: float
    value: float
    ratios: dict[str, Ratio | None]  # by compute axis ("train_flops", "gpu_hours")
    values: tuple[float, ...] = ()
    repeats: float | None = None
    pooled: dict[str, int] = field(default_factory=dict)  # by compute axis: seeds reached on a pooled point
