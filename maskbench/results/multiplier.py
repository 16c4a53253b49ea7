"""The measured compute multiplier: what an arm's value is worth in the baseline's compute, read off the
baseline's *measured* curve of the same seed, never off a fitted one.

For arm a, seed s, metric L and horizon C (the arm's training FLOPs at one of its eval points):

    M_a,s(C) = C₀,s(L_a,s(C)) / C,

C₀,s(v) the FLOPs seed s's baseline needs to reach the value v. The baseline's curve is its run of that seed
that reaches furthest (its *ladder*: a study runs it past the arms' budget, `baseline.reach`, so that the
arms' values lie on it), made monotone (`targets.monotone_fit`, weighted by the rows' sampling errors) and
joined by a monotone cubic of log C against log L (against −L for a metric where higher is better). M > 1:
the arm's FLOPs buy what more of the baseline's would. This is how the field states a speed-up (REPA's and
TREAD's: the baseline run until it matches the method, one seed); here every seed reads its own baseline
(common random numbers pair them) and the seeds give the interval. Unlike a fitted curve it has no form to
be wrong, only noise, which the seeds measure.

Never past the ladder: an arm better than the ladder's last value reads M > C_last / C (a lower bound, ">"),
one worse than its first M <= C_first / C (an upper bound, "<="). Over seeds: the geometric mean with the
t-interval of log M; with bounds of one direction among the seeds that mean (bounds as values) is itself a
bound of that direction, and its test can only err towards 1, so a verdict may read it in the bound's
direction and never against it (`estimators.ratio_summary(test_bounds=True)`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.interpolate

from maskbench.metrics import get_metric
from maskbench.results.estimators import Bound, Estimate, Ratio, curve_errors, mean_ci, ratio_summary
from maskbench.results.rows import Row, auxiliary_flops
from maskbench.results.summary import SIZE_TOLERANCE, condition_mismatch, measured_groups
from maskbench.results.targets import monotone_fit

ABOVE, BELOW = ">", "<="  # a lower bound on M (the arm beats the ladder's end); an upper bound (misses its start)


# ------------------------------------------------------------------------------------------- one seed
def scaled(metric: str, values: np.ndarray | float) -> np.ndarray:
    """The scale on which a curve is joined by straight lines and "better" is smaller: log L for a metric
    where lower is better (a power law is a line there; such a metric must be positive), −L otherwise."""
    values = np.asarray(values, dtype=float)
    if not get_metric(metric).lower_is_better:
        return -values
    if np.any(values <= 0):
        raise ValueError(f"{metric}: the measured multiplier reads a lower-is-better metric on a log scale, "
                         f"and a value is not positive ({values.min():g})")
    return np.log(values)


@dataclass(frozen=True)
class Ladder:
    """One seed's baseline curve as the multiplier reads it: log FLOPs ascending and the metric's monotone
    fit on the `scaled` axis (non-increasing), with the run's last row (its conditions and size)."""
    metric: str
    log_flops: np.ndarray
    fitted: np.ndarray
    row: Row

    @property
    def reach(self) -> float:
        """The FLOPs of its last horizon."""
        return float(math.exp(self.log_flops[-1]))

    def compute_for(self, value: float) -> tuple[float, Bound]:
        """C₀: the FLOPs at which the curve first reaches the metric value `value`, and its bound: ">" when
        it never does (C₀ beyond its reach), "<=" when even its first horizon is better (C₀ at most that).

        Between horizons, log C is a monotone cubic (PCHIP) of the scaled value through the fitted points, a
        pooled stretch kept by its last point (below its level the curve leaves from there). Straight lines
        would cut the corner of a curve that bends in log-log and read M biased: on a baseline whose exponent
        steepens as the fair study's does, their 95% intervals covered the truth 81-88% of the time, PCHIP's
        94-97% (tests/test_multiplier.py)."""
        target = float(scaled(self.metric, value))
        if target < self.fitted[-1]:
            return self.reach, ABOVE
        if target > self.fitted[0]:
            return float(math.exp(self.log_flops[0])), BELOW
        hit = np.flatnonzero(self.fitted == target)
        if hit.size:
            return float(math.exp(self.log_flops[hit[0]])), ""
        last = np.append(self.fitted[1:] != self.fitted[:-1], True)  # each pooled stretch's last point
        inverse = scipy.interpolate.PchipInterpolator(-self.fitted[last], self.log_flops[last])
        return float(math.exp(inverse(-target))), ""


def make_ladder(run: Sequence[Row], metric: str, axis: str = "train_flops") -> Ladder | None:
    """A baseline run's rows as a `Ladder` on the compute `axis` (None with no row recording the metric and the
    axis), its points weighted by 1/SE² on the scaled axis (`curve_errors`; equal where the rows carry none) so
    that a noisy horizon does not outvote a precise one where the raw curve goes the wrong way."""
    rows = sorted((row for row in run if row[metric] is not None and row[axis]), key=lambda row: row[axis])
    if not rows:
        return None
    values = np.asarray([row[metric] for row in rows], dtype=float)
    errors = curve_errors(rows, metric)
    weights = None
    if errors and min(errors) > 0:  # d log L = dL / L: the error on the log axis is the relative error
        on_axis = np.asarray(errors) / (values if get_metric(metric).lower_is_better else 1.0)
        weights = list(1 / on_axis**2)
    points = list(zip(np.log([row[axis] for row in rows]), scaled(metric, values)))
    log_flops, fitted = monotone_fit(points, higher_is_better=False, weights=weights)
    return Ladder(metric, log_flops, fitted, rows[-1])


def seed_multiplier(ladder: Ladder, flops: float, value: float) -> tuple[float, Bound]:
    """One seed's M at one horizon: C₀(value) / flops and its bound."""
    baseline_flops, bound = ladder.compute_for(value)
    return baseline_flops / flops, bound


# --------------------------------------------------------------------------------------- over seeds
@dataclass(frozen=True)
class SeedReading:
    """One seed's M at one horizon, as read: the arm's FLOPs and value there, M and its bound."""
    seed: int
    flops: float
    value: float
    multiplier: float
    bound: Bound


@dataclass(frozen=True)
class ArmMultiplier:
    """One arm's measured M on one metric in one leaderboard group, at each of its horizons, and its trend."""
    group: tuple
    metric: str
    arm: str
    baseline: str
    points: tuple[float, ...]                      # the arm's eval points ...
    flops: tuple[float, ...]                       # ... and their mean training FLOPs
    multipliers: tuple[Ratio | None, ...]          # M over seeds at each (None: bounds both ways, or no seed)
    readings: tuple[tuple[SeedReading, ...], ...]  # per horizon, per seed
    trend: Estimate | None                         # mean d log M / d log C over seeds, and its half-width
    trend_seeds: int                               # the seeds with >= 2 values of M (the trend's n)
    reach: float                                   # the ladders' last horizon (mean over seeds, on `axis`)
    axis: str = "train_flops"                      # the compute M is a ratio of: FLOPs, or device-hours
    charged: bool = False                          # the arm's auxiliary FLOPs (`rows.auxiliary_flops`) added to its C
    notes: tuple[str, ...] = ()

    @property
    def at_budget(self) -> Ratio | None:
        """M at the arm's largest horizon, B: what the verdict reads."""
        return self.multipliers[-1] if self.multipliers else None

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(sorted({r.seed for horizon in self.readings for r in horizon}))


@dataclass(frozen=True)
class Reading:
    """How M is read: on which compute axis, and whether the arm's auxiliary FLOPs are charged to it."""
    axis: str = "train_flops"
    charged: bool = False


def measured_multipliers(rows: Sequence[Row], baseline: str = "mask0", metrics: Sequence[str] = ("fid", "val_loss"),
                         level: float = 0.95, size_tolerance: float | None = SIZE_TOLERANCE,
                         how: Reading = Reading()) -> list[ArmMultiplier]:
    """Every arm's measured M, per leaderboard group and metric, against the ladder of the baseline in the
    group's family (same data, model, batch and start, any budget). The baseline's own runs of the group
    are read too when its ladder is another run: their M should be 1 (a check on the ladder).

    `how.axis` "gpu_hours" reads M in device-hours, and only between rows of one device model (another
    model's hour is another unit: those seeds are set aside as "different devices"). `how.charged` adds each
    row's auxiliary FLOPs (`rows.auxiliary_flops`) to the arm's compute, as the cost of what it brought from
    outside."""
    out = []
    for key, group in measured_groups(rows).items():
        family = family_rows(rows, key, baseline)
        for metric in metrics:
            ladders = _ladders(family, metric, how.axis)
            for arm, runs in _runs(group).items():
                found = _arm_multiplier(key, metric, arm, baseline, runs, ladders, level, size_tolerance, how)
                if found is not None:
                    out.append(found)
    return out


def _family(key: tuple) -> tuple:
    """A group's key less its budget: the runs a ladder may come from (dataset, model, batch, start)."""
    dataset, model, batch, _budget, start = key
    return dataset, model, batch, start


def _runs(group: Sequence[Row]) -> dict[str, dict[int, list[Row]]]:
    """The group's rows by arm and seed (one run each: a group has one budget)."""
    runs: dict[str, dict[int, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in group:
        runs[row["arm"]][row["seed"]].append(row)
    return {arm: dict(by_seed) for arm, by_seed in sorted(runs.items())}


def ladder_runs(baseline_rows: Sequence[Row]) -> dict[int, list[Row]]:
    """Per seed, the baseline's run that reaches furthest (its rows): one run, so one machine and one stream
    of draws, however many shorter runs of the seed there are."""
    by_run: dict[str, list[Row]] = defaultdict(list)
    for row in baseline_rows:
        by_run[row["run_id"]].append(row)
    furthest: dict[int, list[Row]] = {}
    for run in by_run.values():
        seed, reach = run[0]["seed"], max(row["train_flops"] or 0 for row in run)
        if seed not in furthest or reach > max(row["train_flops"] or 0 for row in furthest[seed]):
            furthest[seed] = run
    return furthest


def _ladders(baseline_rows: Sequence[Row], metric: str, axis: str) -> dict[int, Ladder]:
    """Per seed, `ladder_runs`' run as a `Ladder` of the metric on the compute axis."""
    return {seed: ladder for seed, run in ladder_runs(baseline_rows).items()
            if (ladder := make_ladder(run, metric, axis)) is not None}


def family_rows(rows: Sequence[Row], key: tuple, arm: str) -> list[Row]:
    """An arm's measured rows in a group's family: the group's data, model, batch and start, any budget."""
    return [row for k, g in measured_groups(rows).items() if _family(k) == _family(key) for row in g
            if row["arm"] == arm]


def ladder_mismatch(row: Row, ladder_row: Row, size_tolerance: float | None,
                    axis: str = "train_flops") -> tuple[list[str], str]:
    """Why a run may not be read on a ladder (`summary.condition_mismatch`: precision, draws, size, or the
    device's kind) and, apart, a note when the two ran on different CPU models: on FLOPs a curve's point,
    unlike a paired difference, tolerates the float rounding two CPUs differ by (results/fair/PLAN.md measured
    it at about one sampling error by B), so it is said, not refused. On device-hours it is refused: the
    hours of two device models are not one unit."""
    fields = condition_mismatch(row, ladder_row, size_tolerance)
    devices = [row.get("device") or "", ladder_row.get("device") or ""]
    if devices[0] != devices[1] and axis != "train_flops":
        return [f for f in fields if not f.startswith("device (")] + [
            f"different devices ({devices[0] or 'unknown'} vs {devices[1] or 'unknown'})"], ""
    if all(device.startswith("cpu") for device in devices) and devices[0] != devices[1]:
        fields = [field for field in fields if not field.startswith("device (")]
        return fields, f"device ({devices[0]} vs the ladder's {devices[1]})"
    return fields, ""


def _arm_multiplier(key: tuple, metric: str, arm: str, baseline: str, runs: dict[int, list[Row]],
                    ladders: dict[int, Ladder], level: float, size_tolerance: float | None,
                    how: Reading) -> ArmMultiplier | None:
    """One arm's M at each of its horizons over the seeds that have a ladder it may be read on."""
    readable, set_aside, machines = {}, {}, set()
    for seed, run in sorted(runs.items()):
        ladder = ladders.get(seed)
        if ladder is None or (arm == baseline and run[-1]["run_id"] == ladder.row["run_id"]):
            continue  # no ladder for this seed; or the run is the ladder itself, M ≡ 1
        fields, machine = ladder_mismatch(run[-1], ladder.row, size_tolerance, how.axis)
        if fields:
            set_aside[seed] = ", ".join(fields)
            continue
        readable[seed] = [row for row in run if row[metric] is not None and row[how.axis]]
        machines |= {machine} if machine else set()
    points = sorted({row["point"] for run in readable.values() for row in run})
    notes = [f"not read on seed(s) {', '.join(map(str, s))}: {why}"
             for why, s in _by_reason(set_aside).items()] + [f"read across machines: {m}" for m in sorted(machines)]
    if not points:  # every seed set aside (another device's hours, other draws): said, with no reading
        return ArmMultiplier(key, metric, arm, baseline, (), (), (), (), None, 0, math.nan, how.axis, how.charged,
                             tuple(notes)) if set_aside else None
    readings = tuple(tuple(SeedReading(seed, _compute(row, how), row[metric],
                                       *seed_multiplier(ladders[seed], _compute(row, how), row[metric]))
                           for seed, run in readable.items() for row in run if row["point"] == point)
                     for point in points)
    multipliers = tuple(ratio_summary([r.multiplier for r in horizon], level, [r.bound for r in horizon],
                                      test_bounds=True) for horizon in readings)
    trend, trend_seeds = _trend(readings, level)
    return ArmMultiplier(key, metric, arm, baseline, tuple(points),
                         tuple(float(np.mean([r.flops for r in horizon])) for horizon in readings), multipliers,
                         readings, trend, trend_seeds, float(np.mean([ladders[s].reach for s in readable])),
                         how.axis, how.charged, tuple(notes))


def _compute(row: Row, how: Reading) -> float:
    """The arm's compute at a row on the reading's axis, its auxiliary FLOPs added when charged."""
    return row[how.axis] + ((auxiliary_flops(row) or 0.0) if how.charged else 0.0)


def _trend(readings: Sequence[Sequence[SeedReading]], level: float) -> tuple[Estimate | None, int]:
    """Per seed, the least-squares slope of log M against log C over its horizons where M is a value (at
    least two); their mean and t-interval half-width (NaN for one seed), and how many seeds gave one."""
    by_seed: dict[int, list[SeedReading]] = defaultdict(list)
    for horizon in readings:
        for r in horizon:
            if not r.bound:
                by_seed[r.seed].append(r)
    slopes = [float(np.polyfit(np.log([r.flops for r in rs]), np.log([r.multiplier for r in rs]), 1)[0])
              for rs in by_seed.values() if len(rs) >= 2]
    return (mean_ci(slopes, level) if slopes else None), len(slopes)


def _by_reason(set_aside: dict[int, str]) -> dict[str, list[int]]:
    reasons: dict[str, list[int]] = defaultdict(list)
    for seed, why in set_aside.items():
        reasons[why].append(seed)
    return dict(reasons)

