"""The measured compute multiplier (`maskbench.results.multiplier`): M read off the baseline's measured ladder.

Checked against synthetic rows whose truth is known, including the case the fitted curves get wrong: a
baseline whose log-log slope steepens with compute (as the fair study's validation loss does)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from maskbench.results.multiplier import ABOVE, BELOW, make_ladder, measured_multipliers
from maskbench.results.rows import as_read

B = 3.2e13
LADDER = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)  # the baseline's eval points of its budget, 4 B: B/8 ... 4 B
ARM = (1 / 8, 1 / 4, 1 / 2, 1.0)                     # an arm's, of B


def steepening(c: np.ndarray | float) -> np.ndarray:
    """A baseline curve whose local exponent rises from ~0.35 at B/8 to ~0.77 at 4 B: log L = −1 − 0.6 u − 0.06 u²,
    u = log(C / B). No E + A·C^−α with E >= 0 has a rising exponent."""
    u = np.log(np.asarray(c, dtype=float) / B)
    return np.exp(-1.0 - 0.6 * u - 0.06 * u**2)


def rows_of(arm: str, seed: int, points: tuple[float, ...], budget: float, values: np.ndarray, se: np.ndarray,
            **extra) -> list[dict]:
    """One run's rows: val loss `values` at `points` of its `budget`, each with sampling error `se`."""
    return [as_read({"run_id": f"{arm}-s{seed}-{budget:g}", "arm": arm, "dataset": "synth", "model": "tiny",
                     "batch_size": 64, "budget_flops": budget, "point": p, "seed": seed, "train_flops": p * budget,
                     "val_loss": float(v), "val_loss_se": float(e), "precision": "fp32", "draw_scheme": "crn-v3",
                     "device": "cpu:test", **extra})
            for p, v, e in zip(points, values, se)]


def study(rng: np.random.Generator, truth_m: float, seeds: int = 5, noise: float = 0.01) -> list[dict]:
    """mask0's ladder to 4 B and mask75 to B, per seed: mask75 at C is mask0 at truth_m · C. A seed's
    curves share a random level (common random numbers: the seed's data and draws move both arms alike) and
    each row has independent eval noise of `noise` relative, which its SE column states."""
    rows = []
    for seed in range(seeds):
        level = math.exp(0.05 * rng.normal())
        for arm, points, budget, m in (("mask0", LADDER, 4 * B, 1.0), ("mask75", ARM, B, truth_m)):
            flops = np.asarray(points) * budget
            truth = level * steepening(m * flops)
            rows += rows_of(arm, seed, tuple(p for p in points), budget,
                            truth * (1 + noise * rng.normal(size=truth.size)), noise * truth)
    return rows


def test_a_ladder_inverts_a_measured_curve_and_bounds_beyond_its_ends():
    """On a power law (a line in log-log) the interpolation is exact; past the ends M is a bound."""
    flops = np.asarray(LADDER) * 4 * B
    values = 2.0 * (flops / B) ** -0.5
    ladder = make_ladder(rows_of("mask0", 0, LADDER, 4 * B, values, 0.01 * values), "val_loss")
    target = 2.0 * (0.7) ** -0.5                          # mask0's value at 0.7 B
    assert ladder.compute_for(target) == (pytest.approx(0.7 * B, rel=1e-12), "")  # PCHIP keeps a line a line
    assert ladder.compute_for(values[0]) == (pytest.approx(flops[0]), "")
    assert ladder.compute_for(0.5 * values[-1]) == (pytest.approx(flops[-1]), ABOVE)
    assert ladder.compute_for(2 * values[0]) == (pytest.approx(flops[0]), BELOW)


def test_a_ladder_that_goes_back_up_is_read_on_its_monotone_fit():
    """A horizon where eval noise made the curve rise is pooled with its neighbour (0.8 at B/4 and 0.82 at B/2
    become ~0.81 at both), so a lucky early point does not "reach" a value the run then fell back from: 0.805
    is reached after B/2, not between B/8 and B/4 as the raw points would say."""
    values = np.asarray([1.0, 0.8, 0.82, 0.6, 0.5, 0.4])
    ladder = make_ladder(rows_of("mask0", 0, LADDER, 4 * B, values, np.full(6, 0.01)), "val_loss")
    assert np.all(np.diff(ladder.fitted) <= 0) and ladder.fitted[1] == ladder.fitted[2]
    flops, bound = ladder.compute_for(0.805)
    assert bound == "" and B / 2 < flops < B


def test_the_measured_multiplier_recovers_the_truth_where_the_fitted_form_is_wrong():
    """400 synthetic studies, 5 seeds each, on a baseline whose exponent steepens: the 95% interval of the
    measured M covers the true M (1.5 at every horizon) at about its nominal rate at every horizon, and its
    geometric mean is unbiased to within 2%."""
    rng = np.random.default_rng(11)
    covered, means = np.zeros(len(ARM)), np.zeros((400, len(ARM)))
    for trial in range(400):
        (found,) = measured_multipliers(study(rng, 1.5), metrics=("val_loss",))
        assert found.arm == "mask75" and found.points == ARM
        for i, m in enumerate(found.multipliers):
            assert m.bound == ""
            covered[i] += m.lo <= 1.5 <= m.hi
            means[trial, i] = m.geomean
    assert np.all((covered / 400 >= 0.92) & (covered / 400 <= 0.99)), covered / 400
    assert np.all(np.abs(np.exp(np.log(means).mean(axis=0)) / 1.5 - 1) < 0.02)


def test_a_trend_in_m_is_measured_with_its_sign():
    """An arm whose advantage shrinks with compute (M = 2 at B/8 falling to 1 at B) reads a negative trend."""
    rng = np.random.default_rng(5)
    rows = []
    for seed in range(5):
        ladder = steepening(np.asarray(LADDER) * 4 * B)
        rows += rows_of("mask0", seed, LADDER, 4 * B, ladder * (1 + 0.002 * rng.normal(size=6)), 0.002 * ladder)
        flops = np.asarray(ARM) * B
        truth_m = 2.0 * (flops / (B / 8)) ** (-1 / 3)  # 2 at B/8, 1 at B
        arm = steepening(truth_m * flops)
        rows += rows_of("mask75", seed, ARM, B, arm * (1 + 0.002 * rng.normal(size=4)), 0.002 * arm)
    (found,) = measured_multipliers(rows, metrics=("val_loss",))
    mean, half = found.trend
    assert found.trend_seeds == 5
    assert mean + half < 0 and mean == pytest.approx(-1 / 3, abs=0.05)


def test_an_arm_past_the_ladder_reads_a_bound_and_one_seed_of_it_makes_the_mean_a_bound():
    """An arm better than the ladder's end on one seed: that seed reads M > reach / C, the mean over seeds is
    a lower bound, and its test is kept (it can only understate M)."""
    rng = np.random.default_rng(2)
    rows = study(rng, 1.5)
    better = [dict(row, val_loss=row["val_loss"] / 10) if row["arm"] == "mask75" and row["seed"] == 0 else row
              for row in rows]
    (found,) = measured_multipliers(better, metrics=("val_loss",))
    at_b = found.at_budget
    assert at_b.bound == ABOVE and at_b.not_reached == 1 and not math.isnan(at_b.p)
    seed0 = [r for r in found.readings[-1] if r.seed == 0][0]
    assert seed0.bound == ABOVE and seed0.multiplier == pytest.approx(4.0, rel=1e-6)


def test_the_ladder_is_each_seeds_furthest_baseline_run_and_the_shorter_one_reads_1():
    """With a ladder (mask0 to 4 B) beside the study's own mask0 run to B, the arms read on the ladder, and
    the shorter mask0 run is read as a check: its M is 1 where the two runs agree."""
    rng = np.random.default_rng(4)
    rows = study(rng, 1.5, noise=0.0)
    own = [dict(row, run_id=f"{row['run_id']}-own", budget_flops=B, train_flops=row["train_flops"],
                point=row["train_flops"] / B) for row in rows if row["arm"] == "mask0" and row["train_flops"] <= B]
    found = {a.arm: a for a in measured_multipliers(rows + own, metrics=("val_loss",))}
    assert set(found) == {"mask0", "mask75"}
    assert all(m.geomean == pytest.approx(1.0, rel=1e-9) for m in found["mask0"].multipliers)
    assert found["mask75"].reach == pytest.approx(4 * B)


def test_other_cpus_are_read_and_said_other_draws_or_devices_are_set_aside():
    """A ladder from another CPU model is read with a note (float rounding, not other draws); one with another
    draw scheme, or on a GPU against a CPU, is not read on that seed."""
    rows = study(np.random.default_rng(6), 1.5)
    moved = [dict(row, device="cpu:other") if row["arm"] == "mask0" else row for row in rows]
    (found,) = measured_multipliers(moved, metrics=("val_loss",))
    assert found.seeds == (0, 1, 2, 3, 4) and any("cpu:test vs the ladder's cpu:other" in n for n in found.notes)
    cut = [dict(row, draw_scheme="crn-v2") if row["arm"] == "mask0" and row["seed"] == 1 else
           dict(row, device="NVIDIA H100") if row["arm"] == "mask0" and row["seed"] == 2 else row for row in rows]
    (found,) = measured_multipliers(cut, metrics=("val_loss",))
    assert found.seeds == (0, 3, 4)
    assert any("seed(s) 1" in n and "draw_scheme" in n for n in found.notes)
    assert any("seed(s) 2" in n and "device" in n for n in found.notes)


def test_on_a_steepening_baseline_the_fit_is_flagged_while_m_holds():
    """The same steepening study with 0.2% eval noise: mask0's E + A·C^−α fitted on its horizons up to B
    misses its own ladder at 2 B and 4 B (the check fails, so no fitted M past the ladder and no C* is shown),
    while the measured M reads the truth, 1.5, within its interval at B."""
    from maskbench.results.scaling import fit_groups
    from maskbench.results.tables import render_scaling

    rows = study(np.random.default_rng(8), 1.5, noise=0.002)
    rows += [dict(row, run_id=row["run_id"] + "-own", budget_flops=B, point=row["train_flops"] / B)  # mask0's run to B
             for row in rows if row["arm"] == "mask0" and row["train_flops"] <= B]
    fit = next(f for f in fit_groups(rows, metrics=("val_loss",)) if f.budget == B)
    assert fit.ladder_held is False and any(p.held is False for p in fit.ladder)
    assert "fitted curves not shown" in render_scaling([fit])
    found = {m.arm: m for m in measured_multipliers(rows, metrics=("val_loss",))}
    assert found["mask75"].at_budget.lo <= 1.5 <= found["mask75"].at_budget.hi


def test_device_hours_are_read_only_between_rows_of_one_device_model():
    """On FLOPs a ladder from another CPU model is read (with a note); on device-hours it is refused: another
    model's hour is another unit, so no ratio is printed and the note says "different devices"."""
    from maskbench.results.multiplier import Reading

    rows = [dict(row, gpu_hours=row["train_flops"] / 1e13) for row in study(np.random.default_rng(9), 1.5)]
    hours = Reading(axis="gpu_hours")
    (same,) = measured_multipliers(rows, metrics=("val_loss",), how=hours)
    assert same.at_budget.geomean == pytest.approx(1.5, rel=0.05)
    moved = [dict(row, device="cpu:other") if row["arm"] == "mask0" else row for row in rows]
    (refused,) = measured_multipliers(moved, metrics=("val_loss",), how=hours)
    assert refused.points == () and refused.at_budget is None
    assert refused.notes == ("not read on seed(s) 0, 1, 2, 3, 4: different devices (cpu:test vs cpu:other)",)
    (flops,) = measured_multipliers(moved, metrics=("val_loss",))
    assert flops.at_budget is not None


def test_charging_an_arms_auxiliary_flops_lowers_its_multiplier():
    """An arm that spent 0.5 B outside its steps (REPA's encoder pretraining, `encoder_flops`): charged, its C at
    B is 1.5 B, so M(B) falls from 1.5 to about 1.0; uncharged it is unchanged."""
    from maskbench.results.multiplier import Reading

    rows = [dict(row, encoder_flops=0.5 * B) if row["arm"] == "mask75" else row
            for row in study(np.random.default_rng(10), 1.5, noise=0.002)]
    (plain,) = measured_multipliers(rows, metrics=("val_loss",))
    (charged,) = measured_multipliers(rows, metrics=("val_loss",), how=Reading(charged=True))
    assert plain.at_budget.geomean == pytest.approx(1.5, rel=0.02)
    assert charged.at_budget.geomean == pytest.approx(1.0, rel=0.02) and charged.charged
    # a row with the auxiliary_flops column reads it, not encoder_flops (rows from before it had only the encoder's)
    newer = [dict(row, encoder_flops=None, auxiliary_flops=row.get("encoder_flops")) for row in rows]
    (again,) = measured_multipliers(newer, metrics=("val_loss",), how=Reading(charged=True))
    assert again.at_budget.geomean == charged.at_budget.geomean


def test_a_ladder_run_on_another_process_count_is_not_read():
    """Seed 2's ladder ran on 2 processes and mask75 on 1, each one stream a process (rows from before
    data_streams): they drew other samples (docs/runs.md), so that seed's M is not read, and the note names the
    counts (`summary.CONDITIONS` holds data_streams)."""
    rows = [dict(row, n_devices=2 if row["arm"] == "mask0" and row["seed"] == 2 else 1)
            for row in study(np.random.default_rng(11), 1.5)]
    (found,) = measured_multipliers(rows, metrics=("val_loss",))
    assert found.seeds == (0, 1, 3, 4)
    assert any("seed(s) 2" in note and "data_streams (1 vs 2)" in note for note in found.notes), found.notes
