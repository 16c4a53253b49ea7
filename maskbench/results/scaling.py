"""Compute curves: each arm's metric against training FLOPs, and where the gap between arms goes.

The other tables compare arms at the horizons that were run; on this machine no horizon is near a plateau,
so the question is how the gap moves as compute grows. As the field does (Kaplan et al. 2020; Hoffmann et
al. 2022's L(C) = E + A·C^−α), each arm's curve of a metric that falls towards a floor (validation loss, FD)
is fitted per seed by

    L_a(C) = E + A_a · (C / B)^(−α_a),

C the training FLOPs, B the FLOPs of the group's largest horizon (so A_a is the arm's excess over the floor
at B, on the metric's own scale), and E one floor shared by the arms of a group: the same data, model and
evaluation leave the same irreducible part, whatever the training did. From the fits:

- the compute multiplier M_a(C): the FLOPs the baseline needs to reach the value the arm reaches with C,
  over C (above 1 the arm's FLOPs are worth more than the baseline's). With E shared the baseline's curve
  inverts in closed form, and log M is a straight line in log C:
      log M_a(C) = (log A_base − log A_a) / α_base + (α_a / α_base − 1) · log(C / B);
  its slope, α_a / α_base − 1, is the trend of M with compute;
- the crossover C*, where M_a = 1: on one seed's curves C* = B · (A_a / A_base)^(1 / (α_a − α_base));
- a held-out check: the curves fitted on the horizons up to B/2 predict each arm's metric and M at B, and
  a rule fixed before the data (`FAILURE_RULES`, named in the study's PLAN.md) says whether that failed.
  Where it failed, the arm's crossover is not read (it would be a prediction of a form that just failed).

A seed's arms share initial weights, data order and draws, so its fits pair them as the paired tests do
(and under the same conditions only: `summary.paired_by_condition`); every figure is a per-seed figure
summarised over seeds with a Student-t interval (`estimators.mean_ci`, `estimators.ratio_summary`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import scipy.optimize

from maskbench.config.schema import TrainConfig
from maskbench.metrics import CO_PRIMARY
from maskbench.results.estimators import (
    Estimate,
    Ratio,
    curve_errors,
    mean_ci,
    ratio_summary,
    sampling_se,
    sampling_ses,
)
from maskbench.results.multiplier import family_rows, ladder_runs
from maskbench.results.rows import Row
from maskbench.results.summary import SIZE_TOLERANCE, measured_groups, paired_by_condition

WARMUP_STEPS = TrainConfig.warmup_steps  # the rows do not record the warm-up; the default's is the studies'.

MIN_HORIZONS = 3          # a curve has three parameters (E, A, α)
CROSSOVER_WITHIN = 10.0   # k: a crossover is read within [B/k, k·B], and is "none within k× of B" elsewhere
WARMUP_FACTOR = 4         # a horizon of fewer steps than 4× the LR warm-up is left out of every fit (fair PLAN)
LADDER_TOLERANCE = 3.0    # the ladder check holds when its error's interval lies within ± this many SEs


class Interval(NamedTuple):
    """A figure and its interval: the value predicted or measured, with lo and hi (NaN when there is none)."""
    value: float
    lo: float
    hi: float


# ------------------------------------------------------------------------------------------------ one seed
@dataclass(frozen=True)
class Points:
    """One run's curve: FLOPs, values and each value's standard error (what its residual is scaled by)."""
    flops: np.ndarray
    values: np.ndarray
    errors: np.ndarray


@dataclass(frozen=True)
class SeedFit:
    """One seed's curves, L_a(C) = E_a + amplitude[a] · (C / budget)^(−exponent[a]), for every arm fitted: one
    floor shared by the arms (`fit_seed`), or each arm's own (`floors`, `fit_apart`)."""
    seed: int
    budget: float                  # B
    floor: float                   # E, shared by the arms (NaN when each has its own)
    amplitude: dict[str, float]    # A per arm
    exponent: dict[str, float]     # α per arm
    chi2_dof: float                # Σ residual² / (points − parameters): about 1 when the curve fits to eval noise
    floors: dict[str, float] | None = None  # E per arm, when not shared

    def floor_of(self, arm: str) -> float:
        return self.floors[arm] if self.floors is not None else self.floor

    def value(self, arm: str, flops: np.ndarray | float) -> np.ndarray:
        """The arm's fitted metric at `flops`."""
        x = np.asarray(flops, dtype=float) / self.budget
        return self.floor_of(arm) + self.amplitude[arm] * x ** -self.exponent[arm]

    def baseline_flops(self, baseline: str, value: np.ndarray | float) -> np.ndarray:
        """C₀: the FLOPs at which the baseline's curve reaches `value` (inf at or below its floor)."""
        excess = np.asarray(value, dtype=float) - self.floor_of(baseline)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(excess > 0, self.budget * (excess / self.amplitude[baseline]) ** (-1 / self.exponent[baseline]),
                            np.inf)

    def multiplier_line(self, arm: str, baseline: str) -> tuple[float, float]:
        """log M_a(C) = b + g · log(C / B): (b, g). Exact with a shared floor (the inverse is then a line in log C);
        with floors apart, the least-squares line through log M over [B/8, B], which the trend reads."""
        if self.floors is None:
            a, base = self.exponent[arm], self.exponent[baseline]
            return (math.log(self.amplitude[baseline]) - math.log(self.amplitude[arm])) / base, a / base - 1
        u = np.linspace(math.log(1 / 8), 0.0, 9)
        log_m = np.log(self.multiplier(arm, baseline, self.budget * np.exp(u)))
        if not np.all(np.isfinite(log_m)):
            return math.inf, 0.0
        g, b = np.polyfit(u, log_m, 1)
        return float(b), float(g)

    def multiplier(self, arm: str, baseline: str, flops: np.ndarray | float) -> np.ndarray:
        if self.floors is None:
            b, g = self.multiplier_line(arm, baseline)
            return np.exp(b + g * np.log(np.asarray(flops, dtype=float) / self.budget))
        flops = np.asarray(flops, dtype=float)
        return self.baseline_flops(baseline, self.value(arm, flops)) / flops


def fit_apart(curves: dict[str, Points], budget: float, seed: int = 0) -> SeedFit:
    """Each arm's curve fitted on its own (`fit_seed` on one curve): no floor shared across arms, since nothing
    on the rows says the arms share one (results/fair/PLAN.md's amendment)."""
    fits = {arm: fit_seed({arm: points}, budget, seed) for arm, points in curves.items()}
    dof = [f.chi2_dof for f in fits.values() if math.isfinite(f.chi2_dof)]
    return SeedFit(seed, budget, math.nan, {a: f.amplitude[a] for a, f in fits.items()},
                   {a: f.exponent[a] for a, f in fits.items()}, float(np.mean(dof)) if dof else math.nan,
                   floors={a: f.floor for a, f in fits.items()})


def fit_seed(curves: dict[str, Points], budget: float, seed: int = 0) -> SeedFit:
    """Weighted least-squares fit of one seed's curves, the floor shared: residuals (y − L(C)) / SE.

    Solved by `scipy.optimize.least_squares` (Levenberg–Marquardt) over θ = (log E, log A_1, log α_1, log A_2,
    ...): in log-parameter space E, A and α stay positive without bounds, and parameters that span decades
    share one scale. With x = C/B and P = A·x^(−α), the Jacobian of each residual is −E/SE, −P/SE and
    P·α·log x / SE in log E, log A and log α. A floor and a power law trade off against each other on a few
    points, so the fit starts from three floors (0.1, 0.5, 0.9 of the lowest value; each arm's A and α from a
    line through log(y − E) against log x) and keeps the best.
    """
    arms = sorted(curves)
    arm = np.concatenate([np.full(curves[a].values.size, i) for i, a in enumerate(arms)])  # each point's arm
    log_x = np.concatenate([np.log(curves[a].flops / budget) for a in arms])
    y = np.concatenate([curves[a].values for a in arms])
    se = np.concatenate([curves[a].errors for a in arms])

    def terms(theta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """E, P = A·x^(−α) at every point, and α at every point. A trial step may overflow P: it is rejected."""
        with np.errstate(over="ignore"):
            alpha = np.exp(theta[2::2])[arm]
            return float(np.exp(theta[0])), np.exp(theta[1::2][arm] - alpha * log_x), alpha

    def residuals(theta: np.ndarray) -> np.ndarray:
        floor, power, _ = terms(theta)
        return (y - floor - power) / se

    def jacobian(theta: np.ndarray) -> np.ndarray:
        floor, power, alpha = terms(theta)
        jac = np.zeros((y.size, theta.size))
        jac[:, 0] = -floor / se
        jac[np.arange(y.size), 1 + 2 * arm] = -power / se
        jac[np.arange(y.size), 2 + 2 * arm] = power * alpha * log_x / se
        return jac

    starts = (_start(curves, arms, share * float(y.min()), budget) for share in (0.1, 0.5, 0.9))
    best = min((scipy.optimize.least_squares(residuals, x0, jac=jacobian, method="lm") for x0 in starts),
               key=lambda result: result.cost)
    theta, dof = best.x, y.size - best.x.size
    return SeedFit(seed, budget, math.exp(theta[0]), {a: math.exp(theta[1 + 2 * i]) for i, a in enumerate(arms)},
                   {a: math.exp(theta[2 + 2 * i]) for i, a in enumerate(arms)},
                   2 * best.cost / dof if dof > 0 else math.nan)


def _start(curves: dict[str, Points], arms: list[str], floor: float, budget: float) -> np.ndarray:
    """θ to start from: log floor, then per arm the line through log(y − floor) against log(C / B)."""
    theta = [math.log(floor)]
    for arm in arms:
        c = curves[arm]
        slope, intercept = np.polyfit(np.log(c.flops / budget), np.log(np.maximum(c.values - floor, 1e-12)), 1)
        theta += [intercept, math.log(max(-slope, 0.05))]
    return np.asarray(theta)


# ----------------------------------------------------------------------------------------------- a group
@dataclass(frozen=True)
class Crossover:
    """C*, where M = 1: per seed C*_s = B · (A_a / A_base)^(1 / (α_a − α_base)). Read only when every seed's
    lies within [B/k, k·B]: then `flops` is their geometric mean and lo/hi its t-interval (NaN for one seed);
    otherwise `flops` is None ("none within k× of B") and `crossing` says how many seeds do cross there."""
    flops: float | None
    lo: float
    hi: float
    crossing: int
    seeds: int


@dataclass(frozen=True)
class ArmFit:
    """One arm's curve over seeds: A and α (mean and t-interval), M at each horizon, its trend, the crossover."""
    arm: str
    seeds: int
    amplitude: Estimate
    exponent: Estimate
    multipliers: tuple[Ratio | None, ...] = ()  # M at each horizon of the group; () for the baseline
    trend: Estimate | None = None               # the slope of log M against log C (None for the baseline)
    crossover: Crossover | None = None
    floor: Estimate | None = None               # E over seeds, when each arm has its own


class Held(NamedTuple):
    """One held-out figure at B, per seed: what the fit on the horizons up to B/2 predicts, and what was
    measured (for M: what the fit on every horizon gives), paired by seed."""
    quantity: str                  # the metric, or "M"
    predicted: np.ndarray
    measured: np.ndarray
    level: float


@dataclass(frozen=True)
class Prediction:
    """A held-out figure as reported: the predicted and measured means with their intervals over seeds
    (geometric for M), and whether the plan's rule calls the prediction failed (None: fewer than 2 seeds)."""
    arm: str
    quantity: str
    predicted: Interval
    measured: Interval
    failed: bool | None


@dataclass(frozen=True)
class LadderPrediction:
    """The check that can fail where M depends on it: the baseline's curve fitted per seed on its horizons up to
    B (past the warm-up), predicting its ladder's measured value at a horizon past B. It holds when the t-interval
    over seeds of the error (measured − predicted) lies within ± `tolerance` (LADDER_TOLERANCE sampling errors of
    a row there): a biased and an imprecise prediction both fail."""
    flops: float
    predicted: Interval
    measured: Interval
    error: Interval
    tolerance: float
    held: bool | None              # None: one seed, no interval


@dataclass(frozen=True)
class GroupFit:
    """The compute curves of one metric in one leaderboard group (dataset, model, batch, budget, start)."""
    group: tuple
    metric: str
    baseline: str
    budget: float                           # B: the mean FLOPs of the baseline at its largest horizon
    points: tuple[float, ...]               # the horizons (eval points) ...
    horizons: tuple[float, ...]             # ... and their FLOPs
    floor: Estimate                         # E over seeds (NaN: each arm has its own, `ArmFit.floor`)
    arms: tuple[ArmFit, ...]                # the baseline first
    fits: tuple[SeedFit, ...]
    weighted: bool                          # residuals over sampling errors (else over the value: relative)
    within: float                           # k: the crossover is read within [B/k, k·B]
    held_out: tuple[Prediction, ...] = ()
    held_out_points: tuple[float, ...] = ()  # the horizons the held-out fit used
    rule: str = ""
    notes: tuple[str, ...] = ()
    ladder: tuple[LadderPrediction, ...] = ()  # the baseline's fit on horizons <= B against its ladder past B

    @property
    def ladder_held(self) -> bool | None:
        """Whether the fit may be shown: True when every prediction of the ladder past B held, False when one
        failed, None when there is nothing to check (no ladder past B, or one seed)."""
        judged = [p.held for p in self.ladder if p.held is not None]
        return None if not judged else all(judged)

    def curve(self, arm: str, flops: np.ndarray) -> np.ndarray:
        """The arm's fitted value at each of `flops`, the mean over the seeds that fitted it."""
        return np.mean([fit.value(arm, flops) for fit in self.fits if arm in fit.amplitude], axis=0)

    def failed(self, arm: str) -> bool:
        """Whether a held-out prediction of the arm (its metric or its M) failed: its crossover is then not read."""
        return any(p.failed for p in self.held_out if p.arm == arm)

    @property
    def chi2_dof(self) -> float:
        """The median over seeds of each seed's joint fit's χ²/dof."""
        return float(np.median([fit.chi2_dof for fit in self.fits]))


FailureRule = Callable[[Held], bool]
# paired relative error's thresholds, as results/fair/PLAN.md fixed them before its rows: the relative error that
# counts per metric, and the band M's predicted value may lie in around its fitted one.
RELATIVE_TOLERANCE = {"val_loss": 0.05, "fid": 0.15}
M_TOLERANCE = (0.8, 1.25)


def intervals_disjoint(held: Held) -> bool:
    """Failed when the measured value lies outside the prediction's interval widened, on the side facing it,
    by the measured value's own interval: that is, when the two intervals over seeds do not overlap."""
    predicted, measured = (held_interval(held.quantity, values, held.level)
                           for values in (held.predicted, held.measured))
    return measured.hi < predicted.lo or measured.lo > predicted.hi


def paired_relative_error(held: Held) -> bool:
    """Failed when the error is both real and large, seed by seed. A metric: the relative error
    r_s = (measured − predicted) / measured, failed when the t-interval of mean r excludes 0 and |mean r|
    exceeds RELATIVE_TOLERANCE (5% val loss, 15% FD). M: the log ratio predicted / fitted, failed when its
    t-interval excludes 0 and the geometric-mean ratio lies outside M_TOLERANCE ([0.8, 1.25])."""
    if held.quantity == "M":
        mean, half = mean_ci(np.log(held.predicted / held.measured), held.level)
        return abs(mean) > half and not M_TOLERANCE[0] <= math.exp(mean) <= M_TOLERANCE[1]
    mean, half = mean_ci((held.measured - held.predicted) / held.measured, held.level)
    return abs(mean) > half and abs(mean) > RELATIVE_TOLERANCE[held.quantity]


FAILURE_RULES: dict[str, FailureRule] = {"intervals disjoint": intervals_disjoint,
                                         "paired relative error": paired_relative_error}
DEFAULT_RULE = "intervals disjoint"


def prediction_failed(held: Held, rule: FailureRule) -> bool | None:
    """The rule's reading of a held-out figure; None with fewer than 2 seeds (no interval to judge by)."""
    return rule(held) if held.predicted.size >= 2 else None


def held_interval(quantity: str, values: np.ndarray, level: float) -> Interval:
    """The mean of per-seed values and its t-interval; for M, a ratio, the geometric mean and its interval."""
    if quantity == "M":
        ratio = ratio_summary(list(values), level)
        return Interval(ratio.geomean, ratio.lo, ratio.hi)
    mean, half = mean_ci(values, level)
    return Interval(mean, mean - half, mean + half)


def fit_groups(rows: Sequence[Row], baseline: str = "mask0", metrics: Sequence[str] = CO_PRIMARY,
               level: float = 0.95, within: float = CROSSOVER_WITHIN, rule: str = DEFAULT_RULE,
               size_tolerance: float | None = SIZE_TOLERANCE) -> list[GroupFit]:
    """The compute curves of every leaderboard group with the baseline at >= MIN_HORIZONS horizons, per
    metric of `metrics` (ones that fall towards a floor: val loss, FD)."""
    return [replace(found, ladder=ladder_check(family_rows(rows, key, baseline), metric, found.budget, level))
            for key, group in measured_groups(rows).items() for metric in metrics
            if (found := fit_group(key, group, metric, baseline, level, within, rule, size_tolerance)) is not None]


def fit_group(key: tuple, rows: Sequence[Row], metric: str, baseline: str = "mask0", level: float = 0.95,
              within: float = CROSSOVER_WITHIN, rule: str = DEFAULT_RULE,
              size_tolerance: float | None = SIZE_TOLERANCE) -> GroupFit | None:
    """One group's curves of `metric` (None without the baseline at MIN_HORIZONS horizons): per seed the
    joint fit of every arm with MIN_HORIZONS points of that seed, run under the baseline's conditions;
    then over seeds E, each arm's A and α, M at each horizon, the crossover and the held-out check.
    Residuals are over sampling errors only when every row has one, so that all of a fit's residuals are on
    one scale."""
    rows = [row for row in rows if row[metric] is not None and row["train_flops"] is not None and past_warmup(row)]
    base_rows = [row for row in rows if row["arm"] == baseline]
    points = sorted({row["point"] for row in base_rows})
    if len(points) < MIN_HORIZONS:
        return None
    horizons = [float(np.mean([row["train_flops"] for row in base_rows if row["point"] == p])) for p in points]
    budget = horizons[-1]
    errors = sampling_ses(rows, metric)
    weighted = errors is not None and min(errors) > 0
    curves, notes = _seed_curves(rows, metric, baseline, weighted, size_tolerance)
    if not curves:
        return None
    fits = [fit_apart(arms, budget, seed) for seed, arms in sorted(curves.items())]
    held_out, held_points = _held_out(rows, metric, baseline, points, budget, fits, level, rule, weighted,
                                      size_tolerance)
    return GroupFit(key, metric, baseline, budget, tuple(points), tuple(horizons),
                    (math.nan, math.nan), _arm_fits(fits, baseline, horizons, level, within),
                    tuple(fits), weighted, within, held_out, held_points, rule, tuple(notes))


def _seed_curves(rows: Sequence[Row], metric: str, baseline: str, weighted: bool,
                 size_tolerance: float | None) -> tuple[dict[int, dict[str, Points]], list[str]]:
    """Per seed whose baseline has MIN_HORIZONS points, that baseline's curve and those of the arms with as
    many points that ran under its conditions and at its size (the others set aside, one note per arm), as
    `Points`."""
    runs: dict[str, dict[int, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        runs[row["arm"]][row["seed"]].append(row)
    base = runs.get(baseline, {})
    curves: dict[int, dict[str, Points]] = defaultdict(dict)
    notes = []
    for arm, by_seed in sorted(runs.items()):
        seeds = set(by_seed)
        if arm != baseline:
            kept, _, warning = paired_by_condition([run[0] for run in by_seed.values()],
                                                   [run[0] for run in base.values()], baseline, size_tolerance)
            seeds = {row["seed"] for row in kept}
            notes += [f"{arm}: {warning}"] if warning else []
        for seed in sorted(seeds & set(base)):
            if min(len({row["point"] for row in run}) for run in (by_seed[seed], base[seed])) >= MIN_HORIZONS:
                curves[seed][arm] = _points(by_seed[seed], metric, weighted)
    return dict(curves), notes


def _points(rows: Sequence[Row], metric: str, weighted: bool) -> Points:
    """A run's curve, each value's error its sampling error when `weighted`, else the value itself: relative
    errors, as a fit of log L would weight them. `curve_errors` refuses a curve that mixes sample counts
    without sampling errors either way."""
    rows = sorted(rows, key=lambda row: row["train_flops"])
    values = np.asarray([row[metric] for row in rows], dtype=float)
    errors = curve_errors(rows, metric)
    return Points(np.asarray([row["train_flops"] for row in rows], dtype=float), values,
                  np.asarray(errors, dtype=float) if weighted and errors else np.abs(values))


def _arm_fits(fits: Sequence[SeedFit], baseline: str, horizons: Sequence[float], level: float,
              within: float) -> tuple[ArmFit, ...]:
    """Each arm's parameters over the seeds that fitted it, and (not for the baseline) M at each horizon
    and the crossover."""
    out = []
    for arm in _arms(fits, baseline):
        mine = [fit for fit in fits if arm in fit.amplitude]
        fit_of_arm = ArmFit(arm, len(mine), mean_ci([fit.amplitude[arm] for fit in mine], level),
                            mean_ci([fit.exponent[arm] for fit in mine], level),
                            floor=mean_ci([fit.floor_of(arm) for fit in mine], level))
        if arm != baseline:
            fit_of_arm = replace(fit_of_arm,
                                 multipliers=tuple(multiplier_at(mine, arm, baseline, c, level) for c in horizons),
                                 trend=mean_ci([fit.multiplier_line(arm, baseline)[1] for fit in mine], level),
                                 crossover=find_crossover(mine, arm, baseline, within, level))
        out.append(fit_of_arm)
    return tuple(out)


def _arms(fits: Sequence[SeedFit], baseline: str) -> list[str]:
    """The arms any seed fitted, the baseline first."""
    return sorted({arm for fit in fits for arm in fit.amplitude}, key=lambda arm: (arm != baseline, arm))


def multiplier_at(fits: Sequence[SeedFit], arm: str, baseline: str, flops: float,
                  level: float = 0.95) -> Ratio | None:
    """M at `flops`: per seed from that seed's fit, then their geometric mean and t-interval (a ratio); None where
    a seed's arm lies below its baseline's fitted floor (the baseline's curve never gets there: no M)."""
    values = [float(fit.multiplier(arm, baseline, flops)) for fit in fits]
    return ratio_summary(values, level) if all(math.isfinite(v) and v > 0 for v in values) else None


def find_crossover(fits: Sequence[SeedFit], arm: str, baseline: str, within: float = CROSSOVER_WITHIN,
                   level: float = 0.95) -> Crossover:
    """Each seed's C*, where its line log M = b + g·log(C/B) is 0: log(C*/B) = −b/g (none where g = 0, M
    then never changing). Read when every seed's lies within [B/k, k·B]: their geometric mean, with the
    t-interval of log C*."""
    budget = fits[0].budget
    logs = [-b / g for b, g in (fit.multiplier_line(arm, baseline) for fit in fits) if g != 0]
    inside = [u for u in logs if abs(u) <= math.log(within)]
    if len(inside) < len(fits):
        return Crossover(None, math.nan, math.nan, len(inside), len(fits))
    mean, half = mean_ci(inside, level)
    return Crossover(budget * math.exp(mean), budget * math.exp(mean - half), budget * math.exp(mean + half),
                     len(inside), len(fits))


def _held_out(rows: Sequence[Row], metric: str, baseline: str, points: Sequence[float], budget: float,
              fits: Sequence[SeedFit], level: float, rule: str, weighted: bool,
              size_tolerance: float | None) -> tuple[tuple[Prediction, ...], tuple[float, ...]]:
    """Refit on the horizons up to half the largest, and predict at the largest: each arm's metric (against
    its measured values there) and M (against the fit on every horizon). Nothing without MIN_HORIZONS
    horizons up to half."""
    early = [p for p in points if p <= points[-1] / 2 * (1 + 1e-9)]
    if len(early) < MIN_HORIZONS:
        return (), ()
    curves, _ = _seed_curves([row for row in rows if row["point"] <= early[-1]], metric, baseline, weighted,
                             size_tolerance)
    held = {fit.seed: fit for fit in (fit_apart(arms, budget, seed) for seed, arms in sorted(curves.items()))}
    full = {fit.seed: fit for fit in fits}  # a superset: every seed and arm held out is fitted on all horizons
    final = {(row["arm"], row["seed"]): row for row in rows if row["point"] == points[-1]}
    predictions = []
    for arm in _arms(list(held.values()), baseline):
        seeds = [seed for seed, fit in held.items() if arm in fit.amplitude and (arm, seed) in final]
        if not seeds:
            continue
        predicted = [float(held[seed].value(arm, final[arm, seed]["train_flops"])) for seed in seeds]
        figures = [Held(metric, np.asarray(predicted), np.asarray([final[arm, seed][metric] for seed in seeds]), level)]
        if arm != baseline:
            figures.append(Held("M", *(np.asarray([float(by_seed[seed].multiplier(arm, baseline, budget))
                                                   for seed in seeds]) for by_seed in (held, full)), level))
        predictions += [Prediction(arm, figure.quantity, held_interval(figure.quantity, figure.predicted, level),
                                   held_interval(figure.quantity, figure.measured, level),
                                   prediction_failed(figure, FAILURE_RULES[rule])) for figure in figures]
    return tuple(predictions), tuple(early)


# -------------------------------------------------------------------------------------- the ladder check
def past_warmup(row: Row) -> bool:
    """Whether a horizon is fitted: at least WARMUP_FACTOR × the LR warm-up's steps (a rule fixed before the
    ladder's rows, results/fair/PLAN.md: the first doubling after warm-up is steeper than any curve's form)."""
    return row["step"] is None or row["step"] >= WARMUP_FACTOR * WARMUP_STEPS  # no step recorded: no rule to apply


def ladder_check(baseline_rows: Sequence[Row], metric: str, budget: float,
                 level: float = 0.95) -> tuple[LadderPrediction, ...]:
    """Per seed, the baseline's ladder (`multiplier.ladder_runs`) fitted on its horizons up to B past the
    warm-up, predicting its measured value at each horizon past B; over seeds, per horizon, the error's
    t-interval against ± LADDER_TOLERANCE sampling errors (`LadderPrediction`). () without a ladder past B."""
    found: dict[float, list[tuple[float, float, float]]] = defaultdict(list)  # point: (predicted, measured, SE)
    flops: dict[float, list[float]] = defaultdict(list)
    for seed, run in sorted(ladder_runs(baseline_rows).items()):
        run = [row for row in run if row[metric] is not None and row["train_flops"]]
        early = [row for row in run if row["train_flops"] <= budget * (1 + 1e-9) and past_warmup(row)]
        late = [row for row in run if row["train_flops"] > budget * (1 + 1e-9)]
        errors = sampling_ses(run, metric) if late else None
        if len(early) < MIN_HORIZONS or not late or errors is None:
            continue
        fit = fit_seed({"baseline": _points(early, metric, weighted=True)}, budget, seed)
        for row in late:
            found[row["point"]].append((float(fit.value("baseline", row["train_flops"])), row[metric],
                                        sampling_se(row, metric)))
            flops[row["point"]].append(row["train_flops"])
    return tuple(_ladder_prediction(float(np.mean(flops[p])), np.asarray(found[p]), level) for p in sorted(found))


def _ladder_prediction(flops: float, figures: np.ndarray, level: float) -> LadderPrediction:
    predicted, measured, se = figures.T
    tolerance = LADDER_TOLERANCE * float(np.mean(se))
    error = held_interval("error", measured - predicted, level)
    held = None if figures.shape[0] < 2 else bool(-tolerance <= error.lo and error.hi <= tolerance)
    return LadderPrediction(flops, held_interval("value", predicted, level), held_interval("value", measured, level),
                            error, tolerance, held)
