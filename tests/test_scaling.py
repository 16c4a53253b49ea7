"""The compute curves (`maskbench.results.scaling`): the fitter recovers known curves, its intervals over seeds
cover the truth at about their nominal rate, M and the crossover match their closed forms, the held-out check
applies the rule it is given, and `maskbench leaderboard` prints and draws them.

Every random draw comes from a fixed seed, so each test is deterministic: a tolerance below is set wide enough
that other seeds would pass it too (it says how many standard deviations it allows), so that it fails only
when the fitter really changed."""

import math
import re

import numpy as np
import pytest
import scipy.optimize
from PIL import Image

from maskbench.results.estimators import mean_ci
from maskbench.results.leaderboard import leaderboard_main
from maskbench.results.rows import append_rows, as_read
from maskbench.results.scaling import (
    GroupFit,
    Held,
    Points,
    SeedFit,
    fit_groups,
    fit_seed,
    intervals_disjoint,
    multiplier_at,
    paired_relative_error,
    prediction_failed,
)
from maskbench.results.study_plan import load_plan
from maskbench.results.tables import render_scaling

B = 1e14                                              # the budget: the largest horizon's FLOPs
FLOOR = 0.05                                          # E
TRUTH = {"mask0": (0.30, 0.60), "mask75": (0.22, 0.45)}  # arm: (A, α)
POINTS = tuple(2.0**-k for k in range(5, -1, -1))     # horizons 1/32 ... 1 of B


def value(amplitude: float, exponent: float, point: float | np.ndarray) -> float | np.ndarray:
    return FLOOR + amplitude * np.asarray(point) ** -exponent


def draw(rng: np.random.Generator, noise: float, jitter: float = 0.0) -> dict[str, Points]:
    """One seed's curves: each arm's A and α moved by `jitter` (relative, the seed's own training), each
    point by `noise` (relative eval noise, which the fitter is told as the point's SE)."""
    curves = {}
    for arm, (amplitude, exponent) in TRUTH.items():
        seed_a, seed_alpha = amplitude * (1 + jitter * rng.normal()), exponent * (1 + jitter * rng.normal())
        truth = value(seed_a, seed_alpha, np.asarray(POINTS))
        curves[arm] = Points(B * np.asarray(POINTS), truth * (1 + noise * rng.normal(size=truth.size)), noise * truth)
    return curves


# ------------------------------------------------------------------------------------------- the fitter
def test_the_fitter_recovers_known_curves_and_its_residuals_are_the_eval_noise():
    truths = {arm: value(a, e, np.asarray(POINTS)) for arm, (a, e) in TRUTH.items()}
    fit = fit_seed({arm: Points(B * np.asarray(POINTS), truth, 0.01 * truth) for arm, truth in truths.items()}, B)
    assert fit.floor == pytest.approx(FLOOR, rel=1e-6)
    for arm, (amplitude, exponent) in TRUTH.items():
        assert (fit.amplitude[arm], fit.exponent[arm]) == pytest.approx((amplitude, exponent), rel=1e-6)
    # 0.1% eval noise on 20 seeds: E (the weakest-determined) within 10%, A and α within 2%, and χ²/dof about 1
    # (12 points, 5 parameters: its mean over 20 fits has an SD of 0.12; 0.3 is 2.5 SDs) because the residuals
    # are scaled by the points' own errors.
    rng = np.random.default_rng(1)
    fits = [fit_seed(draw(rng, noise=0.001), B) for _ in range(20)]
    assert all(abs(f.floor / FLOOR - 1) < 0.1 for f in fits)
    for arm, (amplitude, exponent) in TRUTH.items():
        assert all(abs(f.amplitude[arm] / amplitude - 1) < 0.02 and abs(f.exponent[arm] / exponent - 1) < 0.02
                   for f in fits)
    assert abs(np.mean([f.chi2_dof for f in fits]) - 1) < 0.3


def test_intervals_over_seeds_cover_the_truth_at_about_their_nominal_rate():
    """100 studies of 4 seeds, each seed with its own A and α (3% jitter) and 1% eval noise: the 95% t-intervals
    over seeds of E, each arm's A and α, and M at B cover the truth in about 95% of studies. Tolerances: each
    figure at least 86% (4 binomial SDs of 2.2 points below 95%), all six together within 95 ± 4% (their
    coverages are correlated within a study, so the pooled SD lies between 0.9 and 2.2 points)."""
    rng = np.random.default_rng(2026)
    truth_m = (TRUTH["mask0"][0] / TRUTH["mask75"][0]) ** (1 / TRUTH["mask0"][1])  # M at B, closed form
    covered: dict[str, list[bool]] = {name: [] for name in ("E", "A mask0", "α mask0", "A mask75", "α mask75", "M")}
    for _ in range(100):
        fits = [fit_seed(draw(rng, noise=0.01, jitter=0.03), B, seed) for seed in range(4)]
        estimates = {"E": (mean_ci([f.floor for f in fits]), FLOOR)}
        for arm, (amplitude, exponent) in TRUTH.items():
            estimates[f"A {arm}"] = mean_ci([f.amplitude[arm] for f in fits]), amplitude
            estimates[f"α {arm}"] = mean_ci([f.exponent[arm] for f in fits]), exponent
        for name, ((mean, half), truth) in estimates.items():
            covered[name].append(abs(mean - truth) <= half)
        m = multiplier_at(fits, "mask75", "mask0", B)
        covered["M"].append(m.lo <= truth_m <= m.hi)
    rates = {name: float(np.mean(found)) for name, found in covered.items()}
    assert all(rate >= 0.86 for rate in rates.values()), rates
    assert abs(np.mean(list(rates.values())) - 0.95) <= 0.04, rates


# ------------------------------------------------------------------------------- M and the crossover
def curve_rows(arm: str, seed: int, amplitude: float, exponent: float, noise: float = 0.0,
               rng: np.random.Generator | None = None, scale: dict[float, float] | None = None, **extra) -> list[dict]:
    """One run's rows at every horizon: val loss on the curve (times 1 + noise·N(0, 1), and by `scale` at some
    points), FD 1000 times it, each with a 1% sampling error."""
    rows = []
    for point in POINTS:
        truth = float(value(amplitude, exponent, point))
        loss = truth * (1 + noise * rng.normal() if noise else 1) * (scale or {}).get(point, 1.0)
        rows.append(as_read({"run_id": f"{arm}-s{seed}", "arm": arm, "dataset": "synth", "model": "tiny",
                             "batch_size": 64, "budget_flops": B, "point": point, "seed": seed,
                             "train_flops": point * B, "gpu_hours": point, "val_loss": loss,
                             "val_loss_se": 0.01 * truth, "fid": 1000 * loss,
                             "fid_se": 10 * truth, "fid_features": "oracle-synth-v1", "fid_n": 2048,
                             "precision": "fp32", "draw_scheme": "crn-v3", **extra}))
    return rows


def ladder_rows(seed: int, noise: float, rng: np.random.Generator, bend: float = 1.0) -> list[dict]:
    """mask0's ladder: a run of the seed to 4 B on the same curve (times `bend` past B: a curve that steepens
    there), each value with a 1% sampling error and `noise` relative scatter."""
    a, e = TRUTH["mask0"]
    rows = []
    for c in (*POINTS, 2.0, 4.0):
        truth = float(value(a, e, c)) * (bend if c > 1 else 1.0)
        loss = truth * (1 + noise * rng.normal())
        rows.append(as_read({"run_id": f"mask0-ladder-s{seed}", "arm": "mask0", "dataset": "synth", "model": "tiny",
                             "batch_size": 64, "budget_flops": 4 * B, "point": c / 4, "seed": seed,
                             "train_flops": c * B, "gpu_hours": c, "val_loss": loss, "val_loss_se": 0.01 * truth,
                             "fid": 1000 * loss, "fid_se": 10 * truth, "fid_features": "oracle-synth-v1",
                             "fid_n": 2048, "precision": "fp32", "draw_scheme": "crn-v3"}))
    return rows


def test_the_fit_is_shown_only_where_it_predicts_the_ladder_past_b():
    """3 seeds at 0.1% scatter: mask0's fit on horizons up to B predicts its ladder at 2 B and 4 B within 3
    sampling errors, and the curves are shown; where the ladder bends 5% below the form past B, the check fails
    (a bias), and so it does at 1% scatter (too imprecise to vouch for): no fitted M past the ladder, no C*."""
    def fit_of(noise: float, bend: float) -> GroupFit:
        rng = np.random.default_rng(1)
        rows = [row for seed in range(3) for arm, (a, e) in TRUTH.items()
                for row in curve_rows(arm, seed, a, e, noise, rng)]
        rows += [row for seed in range(3) for row in ladder_rows(seed, noise, rng, bend)]
        return next(f for f in fit_groups(rows, metrics=("val_loss",)) if f.budget == B)

    held = fit_of(0.001, 1.0)
    assert [p.flops for p in held.ladder] == [2 * B, 4 * B] and held.ladder_held is True
    assert "fitted curves not shown" not in render_scaling([held]) and "held" in render_scaling([held])
    for noise, bend in ((0.001, 0.95), (0.01, 1.0)):
        failed = fit_of(noise, bend)
        assert failed.ladder_held is False
        text = render_scaling([failed])
        assert "fitted curves not shown: the fit of mask0 on its horizons up to B missed its own ladder" in text
        assert "crossover C*" not in text and "failed" in text


def test_the_multiplier_is_the_inverse_of_the_baselines_curve():
    """M(C) = C'/C with L_mask0(C') = L_mask75(C): the closed form against a root-finder on the curves."""
    fit = SeedFit(0, B, FLOOR, {arm: a for arm, (a, _) in TRUTH.items()}, {arm: e for arm, (_, e) in TRUTH.items()},
                  math.nan)
    for flops in (B / 32, B / 3, B, 7 * B):
        target = fit.value("mask75", flops)
        reached = scipy.optimize.brentq(lambda c, t=target: fit.value("mask0", c) - t, B / 1e4, B * 1e4, xtol=1.0)
        assert float(fit.multiplier("mask75", "mask0", flops)) == pytest.approx(reached / flops, rel=1e-6)
    assert float(fit.multiplier("mask0", "mask0", B / 5)) == pytest.approx(1.0)


def test_the_crossover_is_where_m_reaches_1_or_none_within_k_times_b():
    """Noise-free curves on 3 identical seeds: M falls through 1 at C* = B·(A_75/A_0)^(1/(α_75 − α_0)) = 7.9 B,
    with the trend α_75/α_0 − 1 = −0.25. mask50 (A 0.25, α 0.58) keeps M > 1 until B·(0.25/0.30)^(1/(0.58 − 0.60))
    = 9,100 B: none within 10× of B, read when the window reaches 10^5 B. M at each horizon is the closed form."""
    rows = [row for seed in range(3) for arm, (a, e) in {**TRUTH, "mask50": (0.25, 0.58)}.items()
            for row in curve_rows(arm, seed, a, e)]
    (fit,) = [f for f in fit_groups(rows) if f.metric == "val_loss"]
    arms = {arm.arm: arm for arm in fit.arms}
    assert fit.budget == B and fit.horizons == tuple(p * B for p in POINTS) and fit.weighted
    masked = arms["mask75"]
    expected = B * (0.22 / 0.30) ** (1 / (0.45 - 0.60))
    assert masked.crossover.flops == pytest.approx(expected, rel=1e-4)
    assert (masked.crossover.crossing, masked.crossover.seeds) == (3, 3)
    assert masked.trend[0] == pytest.approx(0.45 / 0.60 - 1, rel=1e-4)
    for point, m in zip(POINTS, masked.multipliers):
        assert m.geomean == pytest.approx((0.30 / 0.22) ** (1 / 0.60) * point ** (0.45 / 0.60 - 1), rel=1e-4)
    none = arms["mask50"].crossover
    assert none.flops is None and (none.crossing, none.seeds) == (0, 3) and math.isnan(none.lo)
    wide = {arm.arm: arm for arm in fit_groups(rows, within=1e5)[0].arms}["mask50"].crossover
    assert wide.flops == pytest.approx(B * (0.25 / 0.30) ** (1 / (0.58 - 0.60)), rel=1e-3)


def test_the_crossover_is_the_geometric_mean_of_the_seeds_only_when_every_seed_crosses():
    """Seeds whose α differ: C*_s = B·(A_75/A_0)^(1/(α_75,s − α_0,s)) per seed, their geometric mean with the
    t-interval of log C*. When one seed's C* lies past 10 B, there is none within 10× of B (2 of 3 cross)."""
    def study(exponents: list[tuple[float, float]]) -> list[dict]:
        return [row for seed, (e0, e75) in enumerate(exponents)
                for row in [*curve_rows("mask0", seed, 0.30, e0), *curve_rows("mask75", seed, 0.22, e75)]]

    exponents = [(0.60, 0.45), (0.62, 0.45), (0.65, 0.46)]  # C* 7.9, 6.2 and 5.1 B
    crossover = fit_groups(study(exponents), metrics=("val_loss",))[0].arms[1].crossover
    mean, half = mean_ci([math.log(0.22 / 0.30) / (e75 - e0) for e0, e75 in exponents])
    assert (crossover.flops, crossover.lo, crossover.hi) == pytest.approx(
        (B * math.exp(mean), B * math.exp(mean - half), B * math.exp(mean + half)), rel=1e-3)
    late = fit_groups(study([*exponents[:2], (0.58, 0.56)]), metrics=("val_loss",))[0].arms[1].crossover
    assert late.flops is None and (late.crossing, late.seeds) == (2, 3)


# ---------------------------------------------------------------------------------------------- held out
def test_the_failure_rules_and_an_undecidable_prediction():
    """paired relative error (results/fair/PLAN.md's rule): a metric fails when mean r = (measured − predicted) /
    measured is told from 0 and beyond 5% (val loss) or 15% (FD); M when its log ratio is told from 0 and the
    ratio lies outside [0.8, 1.25]. intervals disjoint: when the two intervals over seeds do not overlap."""
    measured = np.ones(3)

    def loss(predicted: list[float], quantity: str = "val_loss") -> Held:
        return Held(quantity, np.asarray(predicted), measured, 0.95)

    assert paired_relative_error(loss([0.93, 0.94, 0.92]))                # r = 7%, told from 0: fails
    assert not paired_relative_error(loss([0.97, 0.96, 0.98]))            # 3%: real but small
    assert not paired_relative_error(loss([0.90, 1.10, 0.95]))            # 1.7%, not told from 0
    assert not paired_relative_error(loss([0.93, 0.94, 0.92], "fid"))     # 7% is within FD's 15%
    fitted = np.array([1.2, 1.25, 1.22])
    assert paired_relative_error(Held("M", fitted * np.array([1.27, 1.28, 1.26]), fitted, 0.95))
    assert not paired_relative_error(Held("M", fitted * np.array([1.08, 1.07, 1.09]), fitted, 0.95))
    # the predicted mean 1 ± 0.25 (t·0.1/√3) against a measured 2 ± 0.25, then 1.2 ± 0.25
    assert intervals_disjoint(Held("val_loss", np.array([1.0, 1.1, 0.9]), np.array([2.0, 2.1, 1.9]), 0.95))
    assert not intervals_disjoint(Held("val_loss", np.array([1.0, 1.1, 0.9]), np.array([1.2, 1.3, 1.1]), 0.95))
    assert prediction_failed(Held("val_loss", np.array([0.5]), np.array([1.0]), 0.95), paired_relative_error) is None


def test_the_held_out_fit_predicts_b_and_fails_where_the_curve_bends_after_b_over_2():
    """4 seeds with 1% noise: the fit on horizons 1/32 ... 1/2 predicts every arm's value and M at B within
    the measured intervals. When mask75's value at B comes out 20% below its curve, its prediction fails;
    mask0's still holds."""
    rng = np.random.default_rng(7)
    rows = [row for seed in range(4) for arm, (a, e) in TRUTH.items() for row in curve_rows(arm, seed, a, e, 0.01, rng)]
    rows += [row for seed in range(4) for row in ladder_rows(seed, 0.0, rng)]  # a ladder the check passes
    fit = fit_groups(rows, metrics=("val_loss",))[0]
    assert fit.held_out_points == POINTS[:-1]
    assert [(p.arm, p.quantity, p.failed) for p in fit.held_out] == [
        ("mask0", "val_loss", False), ("mask75", "val_loss", False), ("mask75", "M", False)]
    for p in fit.held_out[:2]:
        assert p.predicted.lo < float(value(*TRUTH[p.arm], 1.0)) < p.predicted.hi
    bent = [dict(row, val_loss=row["val_loss"] * 0.8) if row["arm"] == "mask75" and row["point"] == 1.0 else row
            for row in rows]
    for rule in ("intervals disjoint", "paired relative error"):
        fit = fit_groups(bent, metrics=("val_loss",), rule=rule)[0]
        found = {(p.arm, p.quantity): p.failed for p in fit.held_out}
        assert found[("mask75", "val_loss")] is True and found[("mask0", "val_loss")] is False
        assert fit.failed("mask75") and not fit.failed("mask0")
        assert "not read: its held-out prediction failed" in render_scaling([fit])


def test_arms_run_under_other_conditions_are_left_out_of_that_seeds_fit():
    rows = [row for seed in range(3) for arm, (a, e) in TRUTH.items()
            for row in curve_rows(arm, seed, a, e, precision="bf16" if (arm, seed) == ("mask75", 1) else "fp32")]
    fit = fit_groups(rows, metrics=("val_loss",))[0]
    assert [(arm.arm, arm.seeds) for arm in fit.arms] == [("mask0", 3), ("mask75", 2)]
    assert fit.notes == ("mask75: not paired with mask0 on seed(s) 1: precision (bf16 vs fp32) differ",)


# ------------------------------------------------------------------------------------------ the command
@pytest.fixture
def study(tmp_path):
    """mask0, mask75 and mask50 (no crossover within 10× of B), 3 seeds, 1% noise, at 1/32 ... 1 of B, with
    mask0's ladder to 4 B (its curve, without scatter: the check holds and the curves are shown); and a
    two-horizon group that gets no curves."""
    rng = np.random.default_rng(3)
    rows = [row for seed in range(3) for arm, (a, e) in {**TRUTH, "mask50": (0.25, 0.58)}.items()
            for row in curve_rows(arm, seed, a, e, 0.01, rng)]
    rows += [row for seed in range(3) for row in ladder_rows(seed, 0.0, rng)]
    rows += [dict(row, model="tiny_deep", run_id=row["run_id"] + "-deep") for row in rows if row["point"] >= 0.5]
    append_rows(tmp_path / "study" / "leaderboard.csv", rows)
    return tmp_path / "study"


def test_leaderboard_prints_the_compute_curves_and_draws_them(study, capsys):
    assert leaderboard_main([str(study / "leaderboard.csv")], plot=str(study / "fid.png")) == 0
    out = capsys.readouterr().out
    block = out[out.index("Compute curves (exploratory"):]
    assert "synth/tiny/b64/1e+14, FD: the ladder check" in block and "tiny_deep" not in block  # 2 horizons: none
    lines = block.splitlines()
    assert max(len(line) for line in lines if not line.startswith(("Compute curves", "synth"))) <= 120
    assert re.search(r"^mask50 +-0\.03\d+ \[.*\] +none within 10× of B \(0 of 3 seeds cross there\)$", block,
                     re.MULTILINE)
    assert re.search(r"^mask75 +-0\.2\d+ \[.*\] +(\d\.\d+e\+14 \[|none within 10× of B)", block, re.MULTILINE)
    assert re.search(r"horizon +FLOPs +M mask50 \(95% CI\) +M mask75 \(95% CI\)", block)
    assert "held out: fitted on horizons 0.03125 to 0.5, predicting 1 (B)" in block
    assert "the prediction fails by the rule 'intervals disjoint'" in block
    with Image.open(study / "fid_fits.png") as image:
        assert image.width > 800
    assert leaderboard_main([str(study / "leaderboard.csv")], "markdown") == 0
    markdown = capsys.readouterr().out
    assert "| arm | E (95% CI) | A (95% CI) | α (95% CI) |" in markdown
    assert "| arm | trend: d log M / d log C (95% CI) | crossover C*: M = 1 (95% CI) |" in markdown
    assert leaderboard_main([str(study / "leaderboard.csv")], "csv") == 0
    assert "Compute curves" not in capsys.readouterr().out  # the CSV stays one table


PLAN = ("---\nstudy: demo\nwritten: 2026-01-01T00:00:00+00:00\nprimary_metrics: [fid, val_loss]\nbaseline: mask0\n"
        "targets: baseline horizons\ntest: paired t over seeds\nalpha: 0.05\ncorrection: holm\n"
        "pays:\n  ratio: flops\n  interval: below 1\n  metrics: all primary\n{extra}---\n# the plan\n")


def test_the_plan_fixes_the_failure_rule_and_how_far_to_look(study, capsys):
    (study / "PLAN.md").write_text(PLAN.format(extra="prediction_fails: paired relative error\n"
                                                     "crossover_within: 100\n"), encoding="utf-8")
    plan = load_plan(study / "PLAN.md")
    assert (plan.prediction_fails, plan.crossover_within) == ("paired relative error", 100.0)
    assert leaderboard_main([str(study / "leaderboard.csv")], details=True) == 0
    out = capsys.readouterr().out
    assert "rule 'paired relative error': Failed when the error is both real and large" in out
    assert "none within 100× of B (0 of 3 seeds cross there)" in out
    assert load_plan("results/fair/PLAN.md").prediction_fails == "paired relative error"  # the committed plan
    (study / "PLAN.md").write_text(PLAN.format(extra="prediction_fails: within 10%\n"), encoding="utf-8")
    with pytest.raises(ValueError, match="prediction_fails must be one of 'intervals disjoint'"):
        load_plan(study / "PLAN.md")
    (study / "PLAN.md").write_text(PLAN.format(extra="crossover_within: 1\n"), encoding="utf-8")
    with pytest.raises(ValueError, match="crossover_within must be a number above 1"):
        load_plan(study / "PLAN.md")
