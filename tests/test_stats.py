"""Leaderboard statistics against hand-computed figures and scipy on small fixture CSVs: intervals,
paired comparisons and their verdicts (at the interval's edges too), Welch's fallback, compute-to-target
ratios, the MLPerf-style scores and the RCP rule, rendering, plots."""

import csv
import dataclasses
import io
import math
import re

import numpy as np
import pytest
import scipy.stats
from PIL import Image

from maskbench.results import mlperf
from maskbench.results.estimators import (
    ZERO_SPREAD,
    Difference,
    agreement,
    holm,
    mean_ci,
    minimum_detectable_effect,
    paired_difference,
    ratio_summary,
    ratio_verdict,
    verdict,
    welch_difference,
)
from maskbench.results.leaderboard import leaderboard_main
from maskbench.results.multiplicity import Family, correct, corrected_difference
from maskbench.results.plots import plot_leaderboard
from maskbench.results.rows import append_rows, read_rows
from maskbench.results.summary import summarize
from maskbench.results.tables import render
from maskbench.results.targets import compute_to_target, monotone_fit, run_curve

# Two-sided 95% / 99% Student-t quantiles from a printed table (df = 2, 3, 4), and the one-sided 80% ones
# (the power term of the minimum detectable effect).
T975_DF2, T975_DF3, T995_DF3 = 4.302652729911275, 3.182446305284263, 5.840909309733355
T975_DF4, T80_DF2, T80_DF4 = 2.776445105197793, 1.060660171779821, 0.940964563204454
T975_DF1 = 12.706204736174707
BUDGET = 1e12


def run_row(arm: str, seed: int, point: float, fid: float | None, train_flops: float, gpu_hours: float,
            **extra) -> dict:
    return {"run_id": f"{arm}-s{seed}", "arm": arm, "dataset": "synth", "model": "tiny",
            "budget_flops": BUDGET, "point": point, "seed": seed, "fid": fid, "train_flops": train_flops,
            "gpu_hours": gpu_hours, "fid_features": "oracle-synth-v1" if fid is not None else None, **extra}


@pytest.fixture
def board(tmp_path):
    """mask0 and mask75 with 3 seeds at points 0.5 and 1.0, mask75_then0 with one seed, one stale
    re-evaluation, one reference row in the same group."""
    rows = [run_row("mask0", 0, 1.0, 999.0, 1e12, 2.0)]  # stale: re-evaluated below
    for seed in range(3):
        rows += [
            run_row("mask0", seed, 0.5, 300.0 + 10 * seed, (0.49 + 0.01 * seed) * BUDGET, 1.0),
            run_row("mask0", seed, 1.0, 200.0 + 10 * seed, BUDGET, 1.9 + 0.1 * seed,
                    clip_score=30.0 + seed, val_loss=0.5 + 0.02 * seed),
            run_row("mask75", seed, 0.5, 260.0 - 10 * seed, (0.49 + 0.01 * seed) * BUDGET, 0.6),
            run_row("mask75", seed, 1.0, 150.0 + 10 * seed, (0.99 + 0.01 * seed) * BUDGET, 1.2),
        ]
    rows += [run_row("mask75_then0", 0, 0.5, 400.0, 0.5 * BUDGET, 1.0),
             run_row("mask75_then0", 0, 1.0, 300.0, BUDGET, 2.0),
             {**run_row("mask0", 0, 1.0, 1.0, BUDGET, 0.1), "run_id": "ref", "source": "a paper, table 2"}]
    path = tmp_path / "board.csv"
    append_rows(path, rows)
    return read_rows([path], on_error="abort")


def record(summary, arm, point):
    (found,) = [r for r in summary if r.arm == arm and r.point == point and not r.is_reference]
    return found


def test_mean_ci_is_student_t():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    sem = x.std(ddof=1) / 2
    assert mean_ci(x) == pytest.approx((2.5, T975_DF3 * sem))
    assert mean_ci(x, level=0.99)[1] == pytest.approx(T995_DF3 * sem)
    mean, half = mean_ci([7.0])
    assert mean == 7.0 and math.isnan(half)
    with pytest.raises(ValueError, match="at least one"):
        mean_ci([])


def test_compute_to_target_interpolates_and_reports_not_reached():
    curve = [(1.0, 100.0), (0.25, 300.0), (0.5, 200.0)]  # out of order on purpose
    assert compute_to_target(curve, 150.0) == pytest.approx(0.5 + (200 - 150) / (200 - 100) * 0.5)
    assert compute_to_target(curve, 200.0) == pytest.approx(0.5)
    assert compute_to_target(curve, 400.0) == pytest.approx(0.25)  # already there at the first point
    assert compute_to_target(curve, 50.0) is None
    accuracy = [(0.5, 0.2), (1.0, 0.6)]
    assert compute_to_target(accuracy, 0.5, higher_is_better=True) == pytest.approx(0.5 + 0.3 / 0.4 * 0.5)


def test_welch_difference_p_matches_the_formula():
    a, b = np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0, 8.0])
    va, vb = a.var(ddof=1) / 3, b.var(ddof=1) / 4
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    found = welch_difference(a, b)
    assert found.p == pytest.approx(2 * scipy.stats.t.sf(abs(t), df)) and found.se == pytest.approx(math.sqrt(va + vb))
    half = scipy.stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert (found.lo, found.hi) == pytest.approx((a.mean() - b.mean() - half, a.mean() - b.mean() + half))


def test_summary_figures_match_hand_computation(board):
    summary = summarize(board)
    base = record(summary, "mask0", 1.0)
    assert base.n == 3  # the stale 999 re-evaluation and the reference row are not pooled
    assert base.metrics["fid"] == pytest.approx((210.0, T975_DF2 * 10.0 / math.sqrt(3)))
    assert base.metrics["clip_score"] == pytest.approx((31.0, T975_DF2 * 1.0 / math.sqrt(3)))
    assert base.metrics["val_loss"] == pytest.approx((0.52, T975_DF2 * 0.02 / math.sqrt(3)))
    assert base.metrics["align_acc"] is None
    assert base.gpu_hours == pytest.approx(2.0) and base.fid_features == "oracle-synth-v1"
    assert not base.comparisons  # the baseline is not tested against itself

    masked = record(summary, "mask75", 1.0)
    c = masked.comparisons["fid"]
    d = c.difference  # every seed's mask75 is 50 below its mask0: a zero-width paired interval, no p, no verdict
    assert d.test == "paired" and (d.mean, d.lo, d.hi) == pytest.approx((-50.0, -50.0, -50.0))
    assert math.isnan(d.p) and d.verdict == ZERO_SPREAD
    assert not record(summary, "mask75", 0.5).comparisons  # set on the final point only
    # At mask0's final horizon seed s's target is 200 + 10s (the stale 999 of seed 0 is not read), which mask0
    # reaches at its last point: FLOPs 1e12, hours 1.9 + 0.1s. mask75's seed s crosses it on its segment
    # ((0.49 + 0.01s)·1e12, 260 − 10s) -> (.. + 0.5e12, 150 + 10s), gap g = 60 − 20s above it at the start:
    # FLOPs (0.49 + 0.01s + g/(g + 50)·0.5)·1e12, hours 0.6 + g/(g + 50)·0.6.
    final = c.targets[-1]
    assert final.point == 1.0 and final.value == pytest.approx(210.0)  # the mean of the per-seed targets
    gaps = [60.0, 40.0, 20.0]
    flops = [0.49 + 0.01 * s + g / (g + 50) * 0.5 for s, g in enumerate(gaps)]
    hours = [(0.6 + g / (g + 50) * 0.6) / (1.9 + 0.1 * s) for s, g in enumerate(gaps)]
    for axis, expected in (("train_flops", ratio_summary(flops)), ("gpu_hours", ratio_summary(hours))):
        found = final.ratios[axis]
        assert (found.geomean, found.lo, found.hi, found.p) == pytest.approx((expected.geomean, expected.lo,
                                                                             expected.hi, expected.p))
    assert final.ratios["train_flops"].geomean == pytest.approx(math.exp(np.mean(np.log(flops))))

    single = record(summary, "mask75_then0", 1.0)  # seed 0 only, ends at 300: never reaches mask0's 200
    assert math.isnan(single.metrics["fid"][1])
    assert single.comparisons["fid"].difference.verdict.startswith("not tested")
    ratio = single.comparisons["fid"].targets[-1].ratios["train_flops"]
    assert (ratio.bound, ratio.not_reached, ratio.n, ratio.geomean) == (">", 1, 1, pytest.approx(1.0))

    (reference,) = [r for r in summary if r.is_reference]
    assert reference.metrics["fid"][0] == 1.0 and reference.source == "a paper, table 2"
    assert [r.arm for r in summary][:2] == ["mask0", "mask0"]  # the baseline leads its group


def test_render_formats(board):
    summary = summarize(board)
    table = render(summary)
    assert "(1/1 not reached)" in table and "oracle-synth-v1" in table and "210 ± 25" in table
    assert "[1] a paper, table 2" in table
    markdown = render(summary, "markdown").splitlines()
    assert markdown[1].startswith("| --- |") and len(markdown[0].split("|")) == len(markdown[2].split("|"))
    rows = list(csv.DictReader(io.StringIO(render(summary, "csv"))))
    (final,) = [r for r in rows if r["arm"] == "mask75" and r["point"] == "1.0"]
    ratio = record(summary, "mask75", 1.0).comparisons["fid"].targets[-1].ratios["train_flops"]
    assert float(final["fid_flops_ratio_geomean"]) == pytest.approx(ratio.geomean)
    assert float(final["fid_target"]) == pytest.approx(210.0) and float(final["fid"]) == pytest.approx(160.0)
    with pytest.raises(ValueError, match="unknown format"):
        render(summary, "html")


def test_val_loss_stands_in_only_when_a_group_has_no_fid(tmp_path):
    rows = [run_row(arm, seed, point, None, point * BUDGET, point, val_loss=value + 0.02 * seed)
            for arm, curve in (("mask0", {0.5: 0.8, 1.0: 0.6}), ("mask75", {0.5: 0.7, 1.0: 0.5}))
            for point, value in curve.items() for seed in range(2)]
    append_rows(tmp_path / "board.csv", rows)
    summary = summarize(read_rows([tmp_path / "board.csv"]))
    masked = record(summary, "mask75", 1.0)
    assert "no FID in this group: no FD comparison" in render(summary)
    assert list(masked.comparisons) == ["val_loss"]
    # Seed s: mask0 reaches its own final 0.6 + 0.02s at its last point (1e12 FLOPs, 1 hour); mask75 crosses it
    # halfway along (0.5, 0.7 + 0.02s) -> (1.0, 0.5 + 0.02s): 0.75 of mask0's FLOPs and hours on both seeds.
    final = masked.comparisons["val_loss"].targets[-1]
    assert final.value == pytest.approx(0.61)
    for axis in ("train_flops", "gpu_hours"):
        ratio = final.ratios[axis]
        assert (ratio.geomean, ratio.lo, ratio.hi) == pytest.approx((0.75, 0.75, 0.75)) and ratio.bound == ""
    assert masked.comparisons["val_loss"].difference.test == "paired"
    assert masked.comparisons["val_loss"].difference.mean == pytest.approx(-0.1)


def test_group_problems_are_said(board):
    without_baseline = summarize(board, baseline_arm="mask50")
    assert not any(r.comparisons for r in without_baseline)
    assert "no 'mask50' runs in this group" in render(without_baseline)
    mixed = [dict(board[1], fid_features="inception-v3", run_id="other"), *board]
    with pytest.raises(ValueError, match="mixes FID features"):
        summarize(mixed)


def test_plot_writes_a_png(board, tmp_path):
    path = plot_leaderboard(board, tmp_path / "out" / "board.png")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(path) as image:
        assert image.width > 500 and image.height > 200
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_leaderboard([r for r in board if r["source"]], tmp_path / "empty.png")



# ------------------------------------------------------------------------------- paired statistics
def test_paired_difference_agrees_with_scipy_and_a_hand_computation():
    arm = np.array([150.0, 171.0, 198.0, 160.0, 149.0])
    base = np.array([200.0, 230.0, 210.0, 190.0, 205.0])
    d = arm - base                                          # -50, -59, -12, -30, -56
    found = paired_difference(arm, base, lower_is_better=True)
    se = d.std(ddof=1) / math.sqrt(5)
    assert found.test == "paired" and found.n == found.n_base == 5
    assert found.mean == pytest.approx(d.mean())
    assert (found.lo, found.hi) == pytest.approx((d.mean() - T975_DF4 * se, d.mean() + T975_DF4 * se))
    reference = scipy.stats.ttest_rel(arm, base)
    assert (found.lo, found.hi) == pytest.approx(tuple(reference.confidence_interval(0.95)))
    assert found.p == pytest.approx(reference.pvalue)
    assert found.mde == pytest.approx((T975_DF4 + T80_DF4) * se)
    assert found.hi < 0 and found.verdict == "better"
    assert paired_difference(base, arm).verdict == "worse" and paired_difference(base, arm, False).verdict == "better"
    assert paired_difference(arm, base, lower_is_better=False).verdict == "worse"
    # the t-interval is the only one: no percentile bootstrap beside it (too narrow at 3-5 pairs, below)
    assert "boot" not in {f.name for f in dataclasses.fields(Difference)}


@pytest.mark.parametrize("n", [3, 5])
def test_the_paired_t_interval_covers_at_its_nominal_rate_with_few_seeds_and_the_bootstrap_does_not(n):
    """1,500 studies of n normal paired differences, from a fixed seed (so the test is deterministic): the
    t-interval covers the true mean in 95% of them to within 2 points (3.5 binomial SDs of 0.56 points, so no
    other seed would fail it either), while the percentile bootstrap it replaced covers 76% at 3 pairs and 85%
    at 5 (1,000 resamples each)."""
    rng = np.random.default_rng(36)
    draws = rng.normal(2.0, 1.0, size=(1500, n))
    covered = [d.lo <= 2.0 <= d.hi for d in (paired_difference(x, np.zeros(n)) for x in draws)]
    assert abs(np.mean(covered) - 0.95) < 0.02
    means = draws[np.arange(1500)[:, None, None], rng.integers(0, n, (1500, 1000, n))].mean(axis=2)
    lo, hi = np.percentile(means, [2.5, 97.5], axis=1)
    assert np.mean((lo <= 2.0) & (2.0 <= hi)) < 0.88


def test_paired_difference_with_few_or_identical_pairs():
    two = paired_difference([1.0, 3.0], [2.0, 2.0])
    assert two.n == 2 and (two.lo, two.hi) == pytest.approx((-T975_DF1, T975_DF1))  # d = -1, 1: s_d/√2 = 1
    one = paired_difference([1.0], [2.0])
    assert math.isnan(one.lo) and math.isnan(one.mde) and one.verdict.startswith("not tested")
    same = paired_difference([3.0, 4.0, 5.0], [4.0, 5.0, 6.0])  # every d_i = -1: a zero-width interval
    assert (same.lo, same.hi) == (-1.0, -1.0) and math.isnan(same.p) and math.isnan(same.mde)
    assert same.verdict == ZERO_SPREAD                     # never "better" with p = 0
    floored = paired_difference([3.0, 4.0, 5.0], [4.0, 5.0, 6.0], arm_se=[1.0] * 3, base_se=[1.0] * 3)
    assert floored.mde == pytest.approx(minimum_detectable_effect(math.sqrt(2 / 3), 2))  # the eval noise's
    identical = paired_difference([3.0, 4.0, 5.0], [3.0, 4.0, 5.0])  # zero mean, zero spread: p = 1
    assert identical.p == 1.0 and identical.verdict.startswith("no difference detected: zero spread")
    welch = welch_difference([2.0, 2.0, 2.0], [1.0, 1.0])  # constant on both sides
    assert (welch.lo, welch.hi) == (1.0, 1.0) and math.isnan(welch.p) and welch.verdict == ZERO_SPREAD
    assert welch_difference([2.0, 2.0], [2.0, 2.0]).p == 1.0
    ratio = ratio_summary([0.5, 0.5, 0.5])  # every seed's ratio the same: no test, no verdict
    assert ratio.geomean == pytest.approx(0.5) and math.isnan(ratio.p) and ratio_verdict(ratio, 0.05) == "undecided"
    assert ratio_summary([1.0, 1.0]).p == 1.0
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1.0, 2.0], [1.0])


def test_the_minimum_detectable_effect_is_the_t_formula():
    assert minimum_detectable_effect(1.0, 2) == pytest.approx(T975_DF2 + T80_DF2)
    assert minimum_detectable_effect(2.5, 4) == pytest.approx(2.5 * (T975_DF4 + T80_DF4))
    assert minimum_detectable_effect(1.0, 4, power=0.5) == pytest.approx(T975_DF4)  # t_0.5 = 0
    assert math.isnan(minimum_detectable_effect(1.0, 0))


@pytest.mark.parametrize(("lo", "hi", "lower_is_better", "expected"), [
    (-2.0, -1e-12, True, "better"), (-2.0, 0.0, True, "no difference"), (0.0, 2.0, True, "no difference"),
    (1e-12, 2.0, True, "worse"), (-2.0, 2.0, True, "no difference"),
    (1e-12, 2.0, False, "better"), (0.0, 2.0, False, "no difference"), (-2.0, 0.0, False, "no difference"),
    (-2.0, -1e-12, False, "worse"), (math.nan, math.nan, True, "not tested"),
])
def test_the_verdict_never_claims_more_than_the_interval(lo, hi, lower_is_better, expected):
    """An interval touching 0 is not on either side of it."""
    found = verdict(lo, hi, 3.5, lower_is_better)
    assert found.startswith(expected)
    if expected == "no difference":
        assert found == "no difference detected; an effect larger than 3.5 would have been detected"


@pytest.mark.parametrize(("shift", "expected"), [(1 + 1e-6, "better"), (1 - 1e-6, "no difference")])
def test_the_verdict_at_the_interval_edge_from_data(shift, expected):
    """Differences m + (-1, 0, 1): the interval's upper end is m + t·1/√3, just below or just above 0."""
    half = T975_DF2 / math.sqrt(3)
    arm = -half * shift + np.array([-1.0, 0.0, 1.0])
    found = paired_difference(arm, np.zeros(3))
    assert found.hi == pytest.approx(-half * shift + half, rel=1e-3)
    assert (found.hi < 0) == (expected == "better") and found.verdict.startswith(expected)


def test_welch_difference_agrees_with_scipy():
    a, b = np.array([150.0, 160.0, 175.0]), np.array([200.0, 210.0, 230.0, 190.0])
    found = welch_difference(a, b)
    reference = scipy.stats.ttest_ind(a, b, equal_var=False)
    assert found.test == "welch" and (found.n, found.n_base) == (3, 4)
    assert found.mean == pytest.approx(a.mean() - b.mean())
    assert (found.lo, found.hi) == pytest.approx(tuple(reference.confidence_interval(0.95)))
    assert found.p == pytest.approx(reference.pvalue)
    se = math.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 4)
    t975, t80 = scipy.stats.t.ppf(0.975, reference.df), scipy.stats.t.ppf(0.8, reference.df)
    assert found.mde == pytest.approx((t975 + t80) * se) and found.hi < 0 and found.verdict == "better"
    assert welch_difference([1.0], [1.0, 2.0]).verdict.startswith("not tested")


def test_ratio_summary_is_a_geometric_mean_with_a_log_t_interval():
    ratios = [0.25, 0.5, 1.0]
    logs = np.log(ratios)
    half = T975_DF2 * logs.std(ddof=1) / math.sqrt(3)
    found = ratio_summary(ratios)
    assert found.geomean == pytest.approx(0.5) and found.n == 3 and found.bound == ""
    assert (found.lo, found.hi) == pytest.approx((math.exp(logs.mean() - half), math.exp(logs.mean() + half)))
    t = abs(logs.mean()) / (logs.std(ddof=1) / math.sqrt(3))  # the log ratios' one-sample t against 0
    assert found.p == found.p_adj == pytest.approx(2 * scipy.stats.t.sf(t, 2))
    missed = ratio_summary([0.5, 1.2, 0.7], bounds=["", ">", ""])  # seed 1 never got there: a lower bound
    assert missed.bound == ">" and missed.not_reached == 1 and math.isnan(missed.p)
    assert missed.geomean == pytest.approx((0.5 * 1.2 * 0.7) ** (1 / 3))
    early = ratio_summary([0.5, 0.6], bounds=["<=", ""])  # seed 0 was there at its first point: an upper bound
    assert early.bound == "<=" and early.not_reached == 0 and math.isnan(early.p)
    assert ratio_summary([]) is None and ratio_summary([0.5, math.nan]) is None


@pytest.fixture
def paired_board(tmp_path):
    """mask0 and mask75, seeds 0-2, points 0.5 and 1.0; mask0 also has seed 3 (unpartnered, unused)."""
    fids = {"mask0": ([300.0, 320.0, 310.0, 330.0], [200.0, 230.0, 210.0, 240.0]),
            "mask75": ([220.0, 250.0, 260.0], [150.0, 170.0, 200.0])}
    hours = {"mask0": (1.0, 2.0), "mask75": (0.6, 1.2)}
    rows = [run_row(arm, seed, point, fid[i][seed], point * BUDGET, hours[arm][i])
            for arm, fid in fids.items() for seed in range(len(fid[0])) for i, point in enumerate((0.5, 1.0))]
    append_rows(tmp_path / "paired.csv", rows)
    return read_rows([tmp_path / "paired.csv"], on_error="abort")


def test_arms_pair_by_seed_with_per_seed_compute_ratios(paired_board):
    (masked,) = [r for r in summarize(paired_board) if r.arm == "mask75" and r.point == 1.0]
    c = masked.comparisons["fid"]
    assert c.baseline == "mask0" and c.seeds == (0, 1, 2) and c.metric == "fid" and not c.note
    d = np.array([150.0 - 200, 170 - 230, 200 - 210])  # -50, -60, -10
    se = d.std(ddof=1) / math.sqrt(3)
    assert c.difference.test == "paired" and c.difference.mean == pytest.approx(-40.0)
    assert (c.difference.lo, c.difference.hi) == pytest.approx((-40 - T975_DF2 * se, -40 + T975_DF2 * se))
    assert c.difference.mde == pytest.approx((T975_DF2 + T80_DF2) * se)
    assert c.difference.verdict == ("no difference detected; an effect larger than "
                                    f"{c.difference.mde:.3g} would have been detected")
    # Seed s reaches mask0's final FD of seed s on the segment (0.5, f_0.5) -> (1.0, f_1); mask0 at its final point.
    flops = [0.5 + (220 - 200) / 70 * 0.5, 0.5 + (250 - 230) / 80 * 0.5, 0.5 + (260 - 210) / 60 * 0.5]
    hours = [(0.6 + (f - 0.5) / 0.5 * 0.6) / 2.0 for f in flops]
    final = c.targets[-1]
    assert final.point == 1.0 and final.value == pytest.approx(np.mean([200.0, 230.0, 210.0]))
    for found, expected in ((final.ratios["train_flops"], flops), (final.ratios["gpu_hours"], hours)):
        assert found == ratio_summary(expected)
        assert found.geomean == pytest.approx(math.exp(np.mean(np.log(expected))))
    # At mask0's first horizon mask75 is already below mask0's value at its own first point: only an upper bound.
    assert c.targets[0].point == 0.5 and c.targets[0].ratios["train_flops"].bound == "<="


def test_unpaired_seeds_fall_back_to_welch_and_say_so(paired_board):
    extra = [dict(row, run_id="mask75-s7", seed=7, fid=row["fid"] + 5) for row in paired_board
             if row["arm"] == "mask75" and row["seed"] == 0]
    summary = summarize([*paired_board, *extra])
    (masked,) = [r for r in summary if r.arm == "mask75" and r.point == 1.0]
    c = masked.comparisons["fid"]
    assert c.difference.test == "welch" and (c.difference.n, c.difference.n_base) == (4, 4)
    assert c.targets == () and c.note == "unpaired (Welch): seed(s) 7 have no mask0 partner"
    arm_fids = [row["fid"] for row in [*paired_board, *extra] if row["arm"] == "mask75" and row["point"] == 1.0]
    base_fids = [row["fid"] for row in paired_board if row["arm"] == "mask0" and row["point"] == 1.0]
    assert c.difference.p == pytest.approx(scipy.stats.ttest_ind(arm_fids, base_fids, equal_var=False).pvalue)
    table = render(summary)
    assert "synth/tiny/1e+12: mask75: unpaired (Welch): seed(s) 7 have no mask0 partner" in table
    assert "4 vs 4" in table
    twice = [dict(row, run_id="mask0-again") for row in paired_board if row["arm"] == "mask0" and row["seed"] == 0]
    (masked,) = [r for r in summarize([*paired_board, *twice]) if r.arm == "mask75" and r.point == 1.0]
    assert masked.comparisons["fid"].note == "unpaired (Welch): seed(s) 0 appear in more than one run of an arm"


def test_an_arm_that_never_reaches_the_target_gives_a_lower_bound(paired_board):
    """Seed 1's mask75 ends at 270, above mask0's 230: its last point (the budget) over mask0's stands in."""
    worse = [dict(row, fid=row["fid"] + 100) if row["arm"] == "mask75" and row["seed"] == 1 else row
             for row in paired_board]
    (masked,) = [r for r in summarize(worse) if r.arm == "mask75" and r.point == 1.0]
    ratio = masked.comparisons["fid"].targets[-1].ratios["train_flops"]
    assert ratio.not_reached == 1 and ratio.bound == ">" and math.isnan(ratio.p)
    reached = [0.5 + (220 - 200) / 70 * 0.5, 0.5 + (260 - 210) / 60 * 0.5]
    assert ratio.geomean == pytest.approx((reached[0] * 1.0 * reached[1]) ** (1 / 3))
    assert ratio_verdict(ratio, 0.05) == "not reached (1/3)"  # a lower bound: untested, no verdict
    table = render(summarize(worse))
    assert f">{ratio.geomean:.3f} [" in table and "(1/3 not reached)" in table


def test_comparisons_render_in_every_format(paired_board):
    summary = summarize(paired_board)
    table = render(summary, details=True).splitlines()
    start = table.index("Against mask0 at the final point:")
    assert table[start + 1].split()[:8] == ["dataset", "model", "batch", "budget", "arm", "metric", "test", "n"]
    assert "3 pairs" in table[start + 3] and "no difference detected" in table[start + 3]
    assert table[start + 3].endswith("exploratory")  # no plan
    assert any(line.startswith("Δ: arm − mask0") for line in table)
    horizons = table.index("Compute to reach mask0's value at each of its horizons:")
    first, final = table[horizons + 3:horizons + 5]  # mask75 at mask0's horizons 0.5 and 1
    ratio = summary[-1].comparisons["fid"].targets[-1].ratios["train_flops"]
    assert "<=1.000 [1, 1]" in first and f"{ratio.geomean:.3f} [{ratio.lo:.3g}, {ratio.hi:.3g}]" in final
    markdown = render(summary, "markdown").splitlines()
    second = markdown.index("Against mask0 at the final point:") + 2
    assert markdown[second].startswith("| dataset | model |") and markdown[second + 1].startswith("| --- |")
    assert len(markdown[second].split("|")) == len(markdown[second + 2].split("|"))
    records = list(csv.DictReader(io.StringIO(render(summary, "csv"))))
    (final,) = [r for r in records if r["arm"] == "mask75" and r["point"] == "1.0"]
    assert final["fid_test"] == "paired" and final["fid_pairs"] == "3"
    assert float(final["fid_diff"]) == pytest.approx(-40.0)
    assert final["fid_verdict"].startswith("no difference detected") and final["fid_mde"]
    d = summary[-1].comparisons["fid"].difference
    assert (float(final["fid_diff_lo"]), float(final["fid_diff_hi"])) == pytest.approx((d.lo, d.hi))
    assert not any("boot" in column for column in final)
    ratio = summary[-1].comparisons["fid"].targets[-1].ratios["train_flops"]
    assert float(final["fid_flops_ratio_geomean"]) == pytest.approx(ratio.geomean)
    (half,) = [r for r in records if r["arm"] == "mask75" and r["point"] == "0.5"]  # the ratio at horizon 0.5
    assert half["fid_flops_ratio_bound"] == "<=" and half["fid_test"] == "" and half["reading"] == "exploratory"
    (base,) = [r for r in records if r["arm"] == "mask0" and r["point"] == "1.0"]
    assert base["fid_test"] == "" and base["fid_verdict"] == "" and base["fid_flops_ratio_geomean"] == ""


def test_the_committed_leaderboard_renders_with_paired_comparisons(capsys):
    rows = read_rows(["results/pre_crn/leaderboard.csv"], on_error="abort")
    summary = summarize(rows)
    compared = [r for r in summary if r.comparisons and r.model == "tiny"]  # the two-seed results
    differences = [c.difference for r in compared for c in r.comparisons.values()]
    assert len(compared) == 7 and len(differences) == 14 and all(d.test == "paired" for d in differences)
    maskdit = next(r for r in summary if r.arm == "maskdit50" and r.model == "tiny" and r.point == 1.0)
    assert not maskdit.comparisons and "params (2,288,368 vs 1,875,824: +22%" in maskdit.notes[-1]  # its wide decoder
    assert all(d.n == 2 for d in differences)
    assert leaderboard_main(["results/pre_crn/leaderboard.csv"], "table", None, "mask0", "abort") == 0
    out = capsys.readouterr().out  # every paired t-interval printed, and no bootstrap column
    assert all(f"[{d.lo:.3g}, {d.hi:.3g}]" in out for d in differences if not math.isnan(d.lo))
    assert "bootstrap" not in out


# ------------------------------------------------------------------------------------------- MLPerf
def test_olympic_mean_drops_the_fastest_and_the_slowest():
    assert mlperf.olympic_mean([5.0, 1.0, 3.0, 4.0, 2.0]) == pytest.approx(3.0)
    assert mlperf.olympic_mean([5.0, None, 3.0, 4.0, 2.0]) == pytest.approx(4.0)  # None is the slowest
    assert mlperf.olympic_mean([5.0, None, 3.0, None, 2.0]) is None               # two: invalid
    assert mlperf.olympic_mean([1.0, 2.0]) is None


def test_rcp_reproduces_the_rules_worked_example():
    """training_rules.adoc, Appendix: RCP Examples (5 submission runs)."""
    ref128 = [16, 14, 16, 17, 16, 16, 15, 16, 15, 16]
    ref256 = [20, 21, 21, 20, 22, 22, 21, 21, 20, 20]
    r128, r256 = mlperf.rcp(ref128, 5), mlperf.rcp(ref256, 5)
    assert (r128.mean, r128.stdev) == pytest.approx((15.75, 0.433), abs=1e-3)
    assert (r256.mean, r256.stdev) == pytest.approx((20.75, 0.661), abs=1e-3)
    assert round(r128.min_mean, 2) == 15.21 and round(r256.min_mean, 2) == 19.93
    assert r128.mean / r128.min_mean - 1 == pytest.approx(0.0353, abs=5e-4)  # "max allowed speedup 3.53%"
    assert mlperf.olympic_mean([15, 15, 15, 16, 16]) >= r128.min_mean  # S1 passes
    assert mlperf.olympic_mean([19, 19, 19, 20, 21]) < r256.min_mean   # S2 fails
    # The closed form is the bound MLPerf's rcp_checker bisects for: the p = 0.05 one-sided t-test's edge.
    t, p = scipy.stats.ttest_ind_from_stats(r128.min_mean, r128.stdev, 3, r128.mean, r128.stdev, 8)
    assert t < 0 and p / 2 == pytest.approx(0.05)


def test_mlperf_first_reach_is_the_first_evaluation_at_the_target():
    """MLPerf stops a run's clock at its first evaluation that reaches the target: no fit, no interpolation."""
    wiggly = [(16.0, 20.0), (1.0, 100.0), (8.0, 100.0), (2.0, 60.0), (4.0, 50.0)]  # any order in; back up at 8
    assert mlperf.first_reach(wiggly, 150.0) == 1.0   # there at the first evaluation
    assert mlperf.first_reach(wiggly, 60.0) == 2.0    # exactly at the target counts
    assert mlperf.first_reach(wiggly, 80.0) == 2.0    # not 1 + 20/40 between evaluations
    assert mlperf.first_reach(wiggly, 55.0) == 4.0    # although 8 is back at 100
    assert mlperf.first_reach(wiggly, 20.0) == 16.0 and mlperf.first_reach(wiggly, 10.0) is None
    # The monotone fit pools 2, 4 and 8 to 70: it reads 80 between 1 and 2, and 55 only on (8, 70) -> (16, 20).
    assert compute_to_target(wiggly, 80.0) == pytest.approx(1 + 20 / 30)
    assert compute_to_target(wiggly, 55.0) == pytest.approx(8 + 15 / 50 * 8)
    accuracy = [(1.0, 0.1), (2.0, 0.5), (4.0, 0.6), (8.0, 0.2), (16.0, 0.9)]  # higher is better
    assert mlperf.first_reach(accuracy, 0.6, higher_is_better=True) == 4.0
    assert mlperf.first_reach(accuracy, 0.95, higher_is_better=True) is None


# First evaluation (in eighths of the budget) at which each seed's FD reaches 209; None: never.
FIRST_REACH = {"mask0": [6, 7, 8, 7, 6, 7, 8, 7, 7, 8], "mask50": [6, 7, 7, 7, 7, 7, 7, 7, 7, 8],
               "mask75": [2, 3, 4, 3, 4, 3, 4, 3, 4, None]}
MLPERF_HOURS = {"mask0": 2.0, "mask50": 2.0, "mask75": 1.2}  # device-hours at the budget, k/8 of it at eval k


@pytest.fixture
def ten_seeds(tmp_path):
    """mask0, mask50 (within the baseline's noise) and mask75 (much faster), 10 seeds each, evaluated at every
    eighth of the budget. A run's FD is 300 − 10k at eval k before its FIRST_REACH and its final value (mask0
    200 + seed, so the target is mask0 seed 9's 209; mask50 199 + seed; mask75 150 + seed) from there on, except
    mask75 seed 1, which touches 205 at eval 3, climbs back to 260 at eval 4 and is down for good from eval 5."""
    rows = []
    finals = {"mask0": 200.0, "mask50": 199.0, "mask75": 150.0}
    for arm, firsts in FIRST_REACH.items():
        for seed, first in enumerate(firsts):
            fids = [finals[arm] + seed if first is not None and k >= first else 300.0 - 10 * k for k in range(1, 9)]
            if arm == "mask75" and seed == 1:
                fids[2:4] = [205.0, 260.0]
            rows += [run_row(arm, seed, k / 8, fid, k / 8 * BUDGET, k / 8 * MLPERF_HOURS[arm])
                     for k, fid in enumerate(fids, 1)]
    append_rows(tmp_path / "ten.csv", rows)
    return read_rows([tmp_path / "ten.csv"], on_error="abort")


def test_mlperf_scores_by_hand(ten_seeds):
    scores, notes = mlperf.mlperf_summary(ten_seeds)
    assert not notes and [s.arm for s in scores] == ["mask0", "mask50", "mask75"]
    base, half, fast = scores
    assert all(s.target == 209.0 and s.runs == 10 for s in scores)  # mask0's worst final FD
    # Olympic means in eighths: mask0 [6 7 7 7 7 7 8 8] = 7.125, mask50 [7]*8 = 7, mask75 [3 3 3 3 4 4 4 4] = 3.5
    # (its seed 9 never reaches 209: dropped as the slowest; seed 1 counts at eval 3, though it goes back up).
    assert base.flops == pytest.approx(7.125 / 8 * BUDGET) and base.hours == pytest.approx(7.125 / 8 * 2.0)
    assert base.rcp == "reference" and base.speedup == pytest.approx(1.0) and base.reached == 10
    bound = mlperf.rcp([k / 8 * BUDGET for k in FIRST_REACH["mask0"]], 10)
    assert half.flops == pytest.approx(7 / 8 * BUDGET)
    assert bound.min_mean < half.flops < bound.mean
    assert half.rcp == "normalised"
    assert half.score_hours == pytest.approx(half.hours * bound.mean / half.flops)
    assert half.speedup == pytest.approx(1.0)  # hours ∝ FLOPs here: the speed-up within the noise is not credited
    assert fast.reached == 9 and fast.flops == pytest.approx(3.5 / 8 * BUDGET)
    assert fast.hours == pytest.approx(3.5 / 8 * 1.2)
    assert fast.rcp == "faster than RCP" and fast.score_hours == fast.hours
    assert fast.speedup == pytest.approx(base.hours / fast.hours)
    # The monotone fit would read seed 1 at 4 + 23.5/81.5 eighths (evals 3 and 4 pooled to 232.5), not at 3.
    wiggly = [(row["train_flops"], row["fid"]) for row in ten_seeds if row["run_id"] == "mask75-s1"]
    assert compute_to_target(wiggly, 209.0) == pytest.approx((4 + 23.5 / 81.5) / 8 * BUDGET)
    text = mlperf.render_mlperf(scores, notes)
    assert "faster than RCP" in text and "olympic mean" in text
    rows = list(csv.DictReader(io.StringIO(mlperf.render_mlperf(scores, notes, "csv"))))
    assert [r["rcp"] for r in rows] == ["reference", "normalised", "faster than RCP"]


def test_mlperf_needs_ten_runs_per_arm(ten_seeds, capsys):
    fewer = [r for r in ten_seeds if not (r["arm"] == "mask50" and r["seed"] > 4)]
    scores, notes = mlperf.mlperf_summary(fewer)
    assert [s.arm for s in scores] == ["mask0", "mask75"]
    assert notes == ["synth/tiny/1e+12: MLPerf scoring needs >= 10 finished runs per arm; runs with a final fid: "
                     "mask0 10, mask50 5, mask75 10"]
    assert leaderboard_main(["results/pre_crn/leaderboard.csv"], "table", None, "mask0", "skip", mlperf=True) == 1
    err = capsys.readouterr().err
    assert "--mlperf scores arms with >= 10 finished runs" in err and "mask0 2" in err
    assert leaderboard_main(["results/pre_crn/leaderboard.csv"], "table", "x.png", "mask0", "skip", mlperf=True) == 2


def _through_csv(tmp_path, rows: list[dict]) -> list[dict]:
    append_rows(tmp_path / "rows.csv", rows)
    return read_rows([tmp_path / "rows.csv"], on_error="abort")


def test_batch_sizes_are_never_pooled(tmp_path):
    """Tokens per step change what masking buys (the crossover map's axis), so each batch size is its own group."""
    rows = [run_row("mask0", seed, 1.0, 100.0 + seed + batch, BUDGET, 1.0, batch_size=batch,
                    run_id=f"mask0-b{batch}-s{seed}") for seed in range(2) for batch in (16, 128)]
    finals = {r.batch_size: r for r in summarize(_through_csv(tmp_path, rows))}
    assert sorted(finals) == [16, 128] and all(r.n == 2 for r in finals.values())
    assert finals[16].metrics["fid"][0] == pytest.approx(116.5)


def test_runs_continued_from_a_trained_run_form_their_own_paired_group(tmp_path):
    """Skip-DiT's conversion is compared with continuing the same source, seed by seed; neither pools with
    runs from scratch (whose mask0 would otherwise give a seed two runs and break the pairing)."""
    rows = [run_row("mask0", seed, 1.0, 300.0 + seed, BUDGET, 1.0) for seed in range(3)]
    for arm, fid in (("mask0", 200.0), ("lsc_convert", 250.0)):
        rows += [run_row(arm, seed, 1.0, fid + 2 * seed * (arm == "mask0"), BUDGET, 1.0,
                         run_id=f"{arm}-continued-s{seed}", init_from=f"mask0-synth-tiny-s{seed}-0123abcd@1")
                 for seed in range(3)]
    summary = summarize(_through_csv(tmp_path, rows))
    scratch = [r for r in summary if not r.started_from]
    continued = {r.arm: r for r in summary if r.started_from}
    assert [r.arm for r in scratch] == ["mask0"] and scratch[0].n == 3
    assert set(continued) == {"mask0", "lsc_convert"} and continued["mask0"].started_from == "mask0-synth-tiny"
    diff = continued["lsc_convert"].comparisons["fid"].difference
    assert diff.test == "paired" and diff.n == 3 and diff.mean == pytest.approx(50.0 - 2.0)
    assert "tiny from mask0-synth-tiny" in render(summary)


# ------------------------------------------------------------------------- monotone compute-to-target
CURVE = [(1.0, 100.0), (2.0, 60.0), (4.0, 50.0), (8.0, 100.0), (16.0, 20.0)]  # lower is better; 8 goes back up


def test_the_monotone_fit_pools_the_violation_by_hand():
    """Pool-adjacent-violators: 50 < 100 pools (4, 8) to 75, then 60 < 75 pools (2, 4, 8) to (60+50+100)/3 = 70."""
    xs, fit = monotone_fit(list(reversed(CURVE)))  # any order in
    assert xs.tolist() == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert fit.tolist() == pytest.approx([100.0, 70.0, 70.0, 70.0, 20.0])
    # higher is better: 0.6 > 0.2 pools (4, 8) to 0.4, then 0.5 > 0.4 pools (2, 4, 8) to 1.3/3.
    accuracy = [(1.0, 0.1), (2.0, 0.5), (4.0, 0.6), (8.0, 0.2), (16.0, 0.9)]
    pooled = 1.3 / 3
    assert monotone_fit(accuracy, higher_is_better=True)[1].tolist() == pytest.approx([0.1, pooled, pooled, pooled, 0.9])


@pytest.mark.parametrize(("target", "expected"), [
    (150.0, 1.0),                       # there at the first point: nothing is known before it
    (80.0, 1.0 + 20 / 30 * 1.0),        # (1, 100) -> (2, 70)
    (70.0, 2.0),                        # the pooled level is first reached at its first point
    (55.0, 8.0 + 15 / 50 * 8.0),        # (8, 70) -> (16, 20): raw points would cross at 3 (2 -> 4)
    (45.0, 8.0 + 25 / 50 * 8.0),        # raw points: 13.5 (8 -> 16, from 100)
    (20.0, 16.0),
    (10.0, None),
])
def test_compute_to_target_reads_the_monotone_fit_by_hand(target, expected):
    found = compute_to_target(CURVE, target)
    assert found == (None if expected is None else pytest.approx(expected))


def test_compute_to_target_higher_is_better_reads_the_fit():
    accuracy = [(1.0, 0.1), (2.0, 0.5), (4.0, 0.6), (8.0, 0.2), (16.0, 0.9)]
    # fit 0.1, 0.433.., 0.433.., 0.433.., 0.9: 0.6 is crossed on (8, 1.3/3) -> (16, 0.9), not at 4 as raw
    pooled = 1.3 / 3
    assert compute_to_target(accuracy, 0.6, higher_is_better=True) == pytest.approx(8 + (0.6 - pooled) / (0.9 - pooled) * 8)
    assert compute_to_target(accuracy, 0.95, higher_is_better=True) is None


def test_compute_to_target_is_monotone_in_the_target():
    """A harder target never takes less compute, on a noisy curve either way up."""
    noisy = [(2.0**k, value) for k, value in enumerate([90.0, 70.0, 75.0, 40.0, 55.0, 30.0, 35.0, 12.0])]
    targets = np.linspace(95.0, 5.0, 181)                                         # easiest first
    reached = [compute_to_target(noisy, t) for t in targets]
    found = [x for x in reached if x is not None]
    assert found == sorted(found) and reached[-1] is None and len(found) > 150
    rising = [(x, -value) for x, value in noisy]
    found = [compute_to_target(rising, -t, higher_is_better=True) for t in targets]
    assert [x for x in found if x is not None] == sorted(x for x in found if x is not None)


def test_compute_to_target_is_read_at_every_baseline_horizon(tmp_path):
    """Two seeds, mask0 and mask75 at 0.25, 0.5, 1 of the budget (FLOPs = point · budget, hours = point)."""
    fids = {"mask0": [(400.0, 300.0, 200.0), (420.0, 310.0, 210.0)],
            "mask75": [(350.0, 250.0, 150.0), (380.0, 290.0, 160.0)]}
    rows = [run_row(arm, seed, point, fid[seed][i], point * BUDGET, point)
            for arm, fid in fids.items() for seed in (0, 1) for i, point in enumerate((0.25, 0.5, 1.0))]
    (masked,) = [r for r in summarize(_through_csv(tmp_path, rows)) if r.arm == "mask75" and r.point == 1.0]
    first, half, final = masked.comparisons["fid"].targets
    assert [t.point for t in (first, half, final)] == [0.25, 0.5, 1.0]
    assert (first.value, half.value, final.value) == pytest.approx((410.0, 305.0, 205.0))  # mean of per-seed targets
    # 0.25: mask75 starts below 400 / 420, so the ratio is only known to be <= 0.25 / 0.25.
    assert first.ratios["train_flops"].bound == "<=" and first.ratios["train_flops"].geomean == pytest.approx(1.0)
    # 0.5: seed 0 reaches 300 on (0.25, 350) -> (0.5, 250), seed 1 reaches 310 on (0.25, 380) -> (0.5, 290).
    at_half = [(0.25 + 50 / 100 * 0.25) / 0.5, (0.25 + 70 / 90 * 0.25) / 0.5]
    found, expected = half.ratios["train_flops"], ratio_summary(at_half)
    assert (found.geomean, found.lo, found.hi, found.p) == pytest.approx((expected.geomean, expected.lo, expected.hi,
                                                                         expected.p))
    assert half.ratios["gpu_hours"].geomean == pytest.approx(math.sqrt(at_half[0] * at_half[1]))
    at_final = [0.5 + 50 / 100 * 0.5, 0.5 + 80 / 130 * 0.5]
    assert final.ratios["train_flops"].geomean == pytest.approx(math.sqrt(at_final[0] * at_final[1]))


def test_a_noisy_baseline_sets_its_fitted_value_as_the_target(tmp_path):
    """mask0 goes 300 -> 180 -> 200: its fit pools the last two to 190, the target at both horizons."""
    rows = [run_row("mask0", 0, p, fid, p * BUDGET, p) for p, fid in ((0.25, 300.0), (0.5, 180.0), (1.0, 200.0))]
    rows += [run_row("mask75", 0, p, fid, p * BUDGET, p) for p, fid in ((0.25, 250.0), (0.5, 210.0), (1.0, 170.0))]
    (masked,) = [r for r in summarize(_through_csv(tmp_path, rows)) if r.arm == "mask75" and r.point == 1.0]
    _, half, final = masked.comparisons["fid"].targets
    assert half.value == final.value == pytest.approx(190.0)
    # mask0 reaches 190 on (0.25, 300) -> (0.5, 190) at 0.5; mask75 on (0.5, 210) -> (1.0, 170) at 0.75.
    assert final.ratios["train_flops"].geomean == pytest.approx(0.75 / 0.5)


# ------------------------------------------------------------------------------ FD and val loss, always
@pytest.fixture
def split_board(tmp_path):
    """mask75 lower FD than mask0 on every seed, while its val loss is within mask0's noise."""
    rows = []
    for seed, (fid0, fid75, loss0, loss75) in enumerate([(200.0, 150.0, 0.50, 0.52), (230.0, 170.0, 0.55, 0.53),
                                                         (210.0, 165.0, 0.51, 0.52)]):
        for arm, fid, loss in (("mask0", fid0, loss0), ("mask75", fid75, loss75)):
            rows += [run_row(arm, seed, 0.5, fid + 100, 0.5 * BUDGET, 0.5, val_loss=loss + 0.3),
                     run_row(arm, seed, 1.0, fid, BUDGET, 1.0, val_loss=loss)]
    return _through_csv(tmp_path, rows)


def test_both_metrics_are_compared_and_a_partial_agreement_is_not_called_a_disagreement(split_board):
    """FD better, val loss nothing detected: "partly", not "disagree" (an underpowered metric is not a contrary
    one); only opposite directions disagree."""
    summary = summarize(split_board)
    (masked,) = [r for r in summary if r.arm == "mask75" and r.point == 1.0]
    fid, loss = masked.comparisons["fid"].difference, masked.comparisons["val_loss"].difference
    assert fid.verdict == "better" and loss.verdict.startswith("no difference detected")
    assert loss.mean == pytest.approx(np.mean([0.02, -0.02, 0.01]))
    table = render(summary, details=True).splitlines()
    start = table.index("Against mask0 at the final point:")
    assert "  fid  " in table[start + 3] and "  val_loss  " in table[start + 4]  # side by side
    assert all("partly" in line for line in table[start + 3:start + 5])
    assert not any(line.startswith("disagree:") for line in table)
    assert agreement(["better", "worse"]) == "disagree" and agreement(["better", "better"]) == "agree"
    markdown = render(summary, "markdown")
    assert "| FD target | FD FLOPs ratio (95% CI) |" in markdown and "| val loss target |" in markdown
    record = next(r for r in csv.DictReader(io.StringIO(render(summary, "csv"))) if r["arm"] == "mask75"
                  and r["point"] == "1.0")
    assert record["fid_verdict"] == "better" and record["agreement"] == "partly"


def test_agreeing_metrics_are_not_marked(paired_board):
    rows = [dict(row, val_loss=row["fid"] / 1000) for row in paired_board]  # val loss tracks FD exactly
    table = render(summarize(rows))
    assert "disagree" not in table.split("FD: Fréchet")[0]


# ------------------------------------------------------------------------------------- sampling error
def test_one_seed_gets_an_interval_from_its_sampling_error_alone(tmp_path):
    rows = [run_row("mask0", 0, 1.0, 200.0, BUDGET, 1.0, fid_se=5.0, val_loss=0.5)]  # no val_loss_se
    (record,) = summarize(_through_csv(tmp_path, rows))
    assert record.metrics["fid"] == pytest.approx((200.0, scipy.stats.norm.ppf(0.975) * 5.0))
    assert record.eval_only == ("fid",) and math.isnan(record.metrics["val_loss"][1])
    table = render([record], details=True)
    assert "200 ± 9.8 (eval SE)" in table and "(eval SE): one seed" in table


def test_sampling_errors_set_the_eval_share_and_floor_the_mde():
    arm, base = [150.0, 171.0, 160.0], [200.0, 220.0, 212.0]        # d = -50, -49, -52: s_d = 1.53
    arm_se, base_se = [6.0, 6.0, 6.0], [8.0, 8.0, 8.0]
    found = paired_difference(arm, base, arm_se=arm_se, base_se=base_se)
    d = np.subtract(arm, base)
    se = d.std(ddof=1) / math.sqrt(3)
    eval_se = math.sqrt(3 * 36 + 3 * 64) / 3                        # √(Σ se_a² + Σ se_b²) / n = 10/√3
    assert found.se == pytest.approx(se) and found.eval_se == pytest.approx(eval_se)
    assert found.eval_share == pytest.approx(eval_se / se)
    assert found.mde == pytest.approx((T975_DF2 + T80_DF2) * eval_se)  # the eval noise is the larger
    assert (found.lo, found.hi) == pytest.approx((d.mean() - T975_DF2 * se, d.mean() + T975_DF2 * se))
    without = paired_difference(arm, base)
    assert math.isnan(without.eval_se) and without.mde == pytest.approx((T975_DF2 + T80_DF2) * se)
    assert math.isnan(paired_difference(arm, base, arm_se=arm_se).eval_se)  # one side without: none
    welch_found = welch_difference(arm, base, arm_se=arm_se, base_se=base_se)
    assert welch_found.eval_se == pytest.approx(eval_se)


def test_summaries_use_sampling_errors_when_every_row_has_one(split_board):
    with_se = [dict(row, fid_se=40.0) for row in split_board]
    (masked,) = [r for r in summarize(with_se) if r.arm == "mask75" and r.point == 1.0]
    fid = masked.comparisons["fid"].difference
    assert fid.eval_se == pytest.approx(math.sqrt(6 * 40.0**2) / 3) and fid.mde == pytest.approx(
        (T975_DF2 + T80_DF2) * max(fid.se, fid.eval_se))
    assert math.isnan(masked.comparisons["val_loss"].difference.eval_se)
    table = render(summarize(with_se), details=True).splitlines()
    row = next(line for line in table if " fid " in line and "paired" in line)
    assert f"  {fid.eval_share:.3g}  " in row
    one_missing = [dict(row, fid_se=None if row["seed"] == 0 else 40.0) for row in split_board]
    (masked,) = [r for r in summarize(one_missing) if r.arm == "mask75" and r.point == 1.0]
    assert math.isnan(masked.comparisons["fid"].difference.eval_se)


# --------------------------------------------------------------------------- multiplicity and families
def test_holm_against_a_hand_computation():
    """m = 4 tested: sorted 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 -> max(0.06, 0.04) = 0.06."""
    found = holm([0.01, 0.04, 0.03, 0.005, math.nan])
    assert found[:4].tolist() == pytest.approx([0.03, 0.06, 0.06, 0.02]) and math.isnan(found[4])
    assert holm([0.5, 0.6]).tolist() == [1.0, 1.0]  # capped at 1
    assert holm([0.02]).tolist() == [0.02] and holm([]).size == 0


def test_a_correction_withdraws_verdicts_its_p_no_longer_carries():
    holm_family = Family(("fid",), method="holm")
    better = paired_difference([150.0, 171.0, 160.0], [200.0, 220.0, 212.0])
    assert better.verdict == "better" and better.p < 0.05
    kept = corrected_difference(better, 0.049, holm_family)
    assert kept.verdict == "better" and kept.p_adj == 0.049
    withdrawn = corrected_difference(better, 0.06, holm_family)
    assert withdrawn.verdict.startswith("no difference detected after holm (uncorrected: better)")
    ratio = ratio_summary([0.5, 0.55, 0.6])
    assert ratio_verdict(ratio, 0.05) == "pays"
    from dataclasses import replace
    assert ratio_verdict(replace(ratio, p_adj=0.2), 0.05) == "undecided"


def test_a_bound_gets_no_verdict_and_leaves_pays_and_agreement_undecided():
    """Bounds are not tested: a lower bound well above 1 is not "does not pay", an upper bound well below 1
    is not "pays", and beside a ratio that pays the plan's "pays" stays undecided."""
    lower = ratio_summary([2.0, 1.8, 1.6], bounds=[">", "", ""])
    upper = ratio_summary([0.3, 0.35, 0.4], bounds=["<=", "<=", ""])
    assert lower.geomean > 1 and ratio_verdict(lower, 0.05) == "not reached (1/3)"
    assert upper.hi < 1 and ratio_verdict(upper, 0.05) == "reached at first point"
    pays = ratio_verdict(ratio_summary([0.5, 0.55, 0.6]), 0.05)
    for bound in (ratio_verdict(lower, 0.05), ratio_verdict(upper, 0.05)):
        assert Family().pays({"fid": pays, "val_loss": bound}) == "undecided"
        assert agreement([bound, "undecided"]) == "agree" and agreement([bound, pays]) == "partly"


def test_correct_adjusts_the_plans_tests_together(paired_board):
    """One arm, planned metric fid: the final difference and the FLOPs ratio at horizon 1 (horizon 0.5 is a
    bound, not a test): Holm over m = 2 by hand."""
    summary = summarize(paired_board)
    c = next(r for r in summary if r.comparisons).comparisons["fid"]
    p_diff, p_ratio = c.difference.p, c.targets[-1].ratios["train_flops"].p
    corrected, tests = correct(summary, Family(("fid",), method="holm"))
    assert tests == 2
    low, high = sorted((p_diff, p_ratio))
    expected = {low: min(1.0, 2 * low), high: min(1.0, max(2 * low, high))}
    c = next(r for r in corrected if r.comparisons).comparisons["fid"]
    assert c.difference.p_adj == pytest.approx(expected[p_diff])
    assert c.targets[-1].ratios["train_flops"].p_adj == pytest.approx(expected[p_ratio])
    assert c.targets[-1].ratios["gpu_hours"].p_adj == c.targets[-1].ratios["gpu_hours"].p  # not planned
    unplanned, none = correct(summary, Family(("clip_score",), method="holm"))
    assert none == 0 and unplanned == summary


# ------------------------------------------------------------ sampling-error weights, pooled horizons, conditions
def test_the_monotone_fit_weights_each_point_by_its_sampling_error():
    """(2, 60) and (4, 80) go the wrong way and pool: to their mean 70 with equal weights, to the 1/SE²-weighted
    (60·1 + 80·¼)/1.25 = 64 when 80 was scored with twice the error. The target 70 is then reached on
    (1, 100) -> (2, 64) at 1 + 30/36, not at 2."""
    curve = [(1.0, 100.0), (2.0, 60.0), (4.0, 80.0)]
    weights = [1.0, 1.0, 0.25]
    assert monotone_fit(curve)[1].tolist() == pytest.approx([100.0, 70.0, 70.0])
    assert monotone_fit(curve, weights=weights)[1].tolist() == pytest.approx([100.0, 64.0, 64.0])
    assert compute_to_target(curve, 70.0) == pytest.approx(2.0)
    assert compute_to_target(curve, 70.0, weights=weights) == pytest.approx(1 + 30 / 36)
    rows = [run_row("mask0", 0, p, fid, p * BUDGET, p, fid_se=se, fid_n=n)
            for p, fid, se, n in ((0.25, 100.0, 1.0, 2048), (0.5, 60.0, 1.0, 2048), (1.0, 80.0, 2.0, 512))]
    assert run_curve(rows, "fid", "point") == ([(0.25, 100.0), (0.5, 60.0), (1.0, 80.0)], weights)
    assert run_curve([dict(row, fid_se=None, fid_n=256) for row in rows], "fid", "point")[1] is None  # equal


def test_a_curve_mixing_sample_counts_without_errors_is_refused(tmp_path):
    """FD on 256 samples and on 2,048 cannot be pooled with equal weights: without fid_se to weight them by,
    compute-to-target refuses the run, naming it."""
    rows = [run_row(arm, 0, p, fid, p * BUDGET, p, fid_n=256 if p < 1 else 2048)
            for arm in ("mask0", "mask75") for p, fid in ((0.5, 300.0), (1.0, 200.0))]
    with pytest.raises(ValueError, match=r"run mask0-s0: its fid points were scored on different numbers of samples "
                                         r"\(fid_n 256, 2048\)"):
        summarize(board := _through_csv(tmp_path, rows))
    weighted = [dict(row, fid_se=50.0 if row["fid_n"] == 256 else 18.0) for row in board]
    (masked,) = [r for r in summarize(weighted) if r.arm == "mask75" and r.point == 1.0]
    assert masked.comparisons["fid"].targets[-1].ratios["train_flops"].geomean == pytest.approx(1.0)


@pytest.fixture
def pooled_board(tmp_path):
    """mask0's FD goes back up from 0.5 to 1 on every seed (180 + s, then 200 + s), so its fit pools the two
    horizons to 190 + s: one target. mask75 falls throughout."""
    rows = []
    for seed in range(3):
        rows += [run_row("mask0", seed, p, fid + seed, p * BUDGET, p) for p, fid in ((0.25, 300.0), (0.5, 180.0),
                                                                                     (1.0, 200.0))]
        rows += [run_row("mask75", seed, p, fid, p * BUDGET, p) for p, fid in ((0.25, 250.0 + 2 * seed),
                                                                               (0.5, 210.0 + seed),
                                                                               (1.0, 170.0 + 3 * seed))]
    return _through_csv(tmp_path, rows)


def test_horizons_the_baselines_fit_pooled_are_one_test_in_holm(pooled_board):
    """At 0.5 and 1 every seed's target is 190 + s: the ratios are the same numbers, so Holm counts the
    difference and the ratio at 0.5 (the 0.25 ratio is a bound, untested), not also the ratio at 1."""
    summary = summarize(pooled_board)
    c = next(r for r in summary if r.comparisons).comparisons["fid"]
    first, half, final = c.targets
    assert half.values == final.values == pytest.approx((190.0, 191.0, 192.0))
    assert (first.repeats, half.repeats, final.repeats) == (None, None, 0.5)
    # seed s reaches 190 + s on (0.5, 210 + s) -> (1, 170 + 3s): at 0.5 + 20/(40 − 2s)·0.5; mask0 at 0.5
    expected = ratio_summary([(0.5 + 20 / (40 - 2 * s) * 0.5) / 0.5 for s in range(3)])
    assert final.ratios["train_flops"] == half.ratios["train_flops"] == expected
    corrected, tests = correct(summary, Family(("fid",), method="holm"))
    assert tests == 2
    low, high = sorted((c.difference.p, expected.p))
    holm_by_hand = {low: min(1.0, 2 * low), high: min(1.0, max(2 * low, high))}  # m = 2
    c = next(r for r in corrected if r.comparisons).comparisons["fid"]
    assert c.difference.p_adj == pytest.approx(holm_by_hand[c.difference.p])
    assert c.targets[1].ratios["train_flops"].p_adj == pytest.approx(holm_by_hand[expected.p])
    assert c.targets[2].ratios["train_flops"].p_adj == c.targets[1].ratios["train_flops"].p_adj
    table = render(corrected, family=Family(("fid",), method="holm"), details=True)
    assert re.search(r"mask75\s+1\s+191 \(= 0\.5\)", table) and table.count("(= 0.5)") == 1


@pytest.fixture
def conditions_board(tmp_path):
    """mask0, mask75 and mask50, seeds 0-2, points 0.5 and 1; mask75 each seed 40 below, mask50 20 below (with
    a spread). Precision fp32 and draws crn-v3 everywhere except as each test changes them."""
    rows = [run_row(arm, seed, p, (300.0 if p < 1 else 200.0) + seed - shift * (1 + seed / 10), p * BUDGET, p,
                    precision="fp32", draw_scheme="crn-v3")
            for arm, shift in (("mask0", 0.0), ("mask75", 40.0), ("mask50", 20.0)) for seed in range(3)
            for p in (0.5, 1.0)]
    return _through_csv(tmp_path, rows)


def test_runs_under_different_conditions_are_not_paired_and_the_field_is_named(conditions_board):
    """mask75's seed 1 ran in bf16 against mask0's fp32: that seed is left out of the paired test and of
    compute-to-target (two pairs remain), and one note names the field and the values."""
    rows = [dict(row, precision="bf16") if row["arm"] == "mask75" and row["seed"] == 1 else row
            for row in conditions_board]
    summary = summarize(rows)
    masked = next(r for r in summary if r.arm == "mask75" and r.comparisons)
    c = masked.comparisons["fid"]
    assert c.seeds == (0, 2) and c.difference.n == 2 and all(t.ratios["train_flops"].n == 2 for t in c.targets)
    assert next(r for r in summary if r.arm == "mask50" and r.comparisons).comparisons["fid"].seeds == (0, 1, 2)
    warning = "synth/tiny/1e+12: mask75: not paired with mask0 on seed(s) 1: precision (bf16 vs fp32) differ"
    assert render(summary).splitlines().count(warning) == 1
    drawn = [dict(row, draw_scheme="crn-v2", device="cuda:H200") if row["arm"] == "mask75" else row
             for row in conditions_board]
    summary = summarize(drawn)
    masked = next(r for r in summary if r.arm == "mask75" and r.point == 1.0)
    assert not masked.comparisons  # no seed pairs: no comparison at all, and the note says why
    assert masked.notes[-1] == ("mask75: not paired with mask0 on seed(s) 0, 1, 2: device (cuda:H200 vs unknown), "
                                "draw_scheme (crn-v2 vs crn-v3) differ")


def test_an_empty_condition_is_unknown_and_pairs_only_with_unknown(conditions_board):
    """Rows written before precision and draw_scheme existed have them empty: unknown pairs with unknown (old
    CSVs pair as they did), never with a known value."""
    old = [dict(row, precision=None, draw_scheme=None) for row in conditions_board]
    assert next(r for r in summarize(old) if r.arm == "mask75" and r.comparisons).comparisons["fid"].seeds == (0, 1, 2)
    half = [dict(row, precision=None) if row["arm"] == "mask0" else row for row in conditions_board]
    masked = next(r for r in summarize(half) if r.arm == "mask75" and r.point == 1.0)
    assert not masked.comparisons
    assert masked.notes[-1] == "mask75: not paired with mask0 on seed(s) 0, 1, 2: precision (fp32 vs unknown) differ"


def test_runs_split_into_other_stream_counts_are_not_paired_and_the_note_says_why(conditions_board):
    """mask0's seed 1 ran on 2 data streams, mask75's on 1, at one global batch: each stream draws its own share of
    the samples and noise (docs/runs.md), so the two saw other samples. That seed is set aside, and the note names
    the counts and the reason; one stream count on both sides pairs, whatever the process counts (train.data_streams),
    and a row from before the column counts its processes as its streams."""
    rows = [dict(row, data_streams=2 if row["arm"] == "mask0" and row["seed"] == 1 else 1) for row in conditions_board]
    masked = next(r for r in summarize(rows) if r.arm == "mask75" and r.comparisons)
    assert masked.comparisons["fid"].seeds == (0, 2)
    assert masked.notes[-1] == ("mask75: not paired with mask0 on seed(s) 1: data_streams (1 vs 2) differ: runs split "
                                "into other stream counts draw other samples")
    old = [dict(row, n_devices=2 if row["arm"] == "mask0" and row["seed"] == 1 else 1) for row in conditions_board]
    assert next(r for r in summarize(old) if r.arm == "mask75" and r.comparisons).comparisons["fid"].seeds == (0, 2)
    fixed = [dict(row, data_streams=2, n_devices=2 if row["arm"] == "mask0" and row["seed"] == 1 else 1)
             for row in conditions_board]
    assert next(r for r in summarize(fixed) if r.arm == "mask75" and r.comparisons).comparisons["fid"].seeds == (
        0, 1, 2)


def test_arms_of_different_sizes_are_not_compared_unless_allowed(conditions_board, tmp_path, capsys):
    """mask75 with 46% more parameters than mask0 (SPRINT's old extra blocks): no seed pairs, so no comparison,
    and the note names both counts and the flag; 4% more pairs as one size. --allow-size-mismatch compares
    the 46% and says so in the table."""
    sized = [dict(row, params={"mask0": 1_875_824, "mask75": 2_733_552, "mask50": 1_950_000}[row["arm"]])
             for row in conditions_board]
    summary = summarize(sized)
    masked = next(r for r in summary if r.arm == "mask75" and r.point == 1.0)
    assert not masked.comparisons
    assert masked.notes[-1] == ("mask75: not paired with mask0 on seed(s) 0, 1, 2: params (2,733,552 vs 1,875,824: "
                                "+46%, beyond ±5%) differ (--allow-size-mismatch compares them)")
    assert next(r for r in summary if r.arm == "mask50" and r.comparisons).comparisons["fid"].seeds == (0, 1, 2)
    allowed = next(r for r in summarize(sized, size_tolerance=None) if r.arm == "mask75" and r.point == 1.0)
    assert allowed.comparisons["fid"].seeds == (0, 1, 2)
    assert allowed.notes[-1] == ("mask75: compared with mask0 although params (2,733,552 vs 1,875,824: +46%, "
                                 "beyond ±5%) (--allow-size-mismatch)")
    path = tmp_path / "sized.csv"
    append_rows(path, sized)
    assert leaderboard_main([str(path)], "table", allow_size_mismatch=True) == 0
    assert "(--allow-size-mismatch)" in capsys.readouterr().out
    assert leaderboard_main([str(path)], "table") == 0
    assert "(--allow-size-mismatch compares them)" in capsys.readouterr().out


def test_crossover_of_an_arm_the_rows_lack_is_bad_input(conditions_board, tmp_path, capsys):
    """`--crossover mask57` (a typo) is refused with the arms the rows have and exit 2, not an empty map."""
    path = tmp_path / "board.csv"
    append_rows(path, conditions_board)
    assert leaderboard_main([str(path)], "table", crossover="mask57") == 2
    assert "--crossover mask57: no such arm in these rows; they have mask0, mask50, mask75" in capsys.readouterr().err


def test_an_arm_with_a_pretrained_encoder_reports_its_cost_beside_the_budget(conditions_board):
    """REPA's frozen encoder was trained before the run: its FLOPs sit in `encoder_flops`, outside train_flops, and
    the summary says what they were as a share of the budget; an arm without one (0 or empty) gets no note."""
    rows = [dict(row, encoder_flops=4.23e12 if row["arm"] == "mask75" else 0.0) for row in conditions_board]
    final = {r.arm: r for r in summarize(rows) if r.point == 1.0}
    assert f"mask75: its frozen encoder's pretraining cost 4.23e+12 FLOPs ({4.23e12 / BUDGET:.0%} of the budget), " \
           "not counted in train_flops" in final["mask75"].notes
    assert not any("encoder" in note for note in final["mask50"].notes + final["mask0"].notes)


def test_hours_are_labelled_by_the_device_they_were_measured_on(conditions_board):
    """CPU hours are not GPU hours: the table's hours column says which device kind each record's rows name."""
    cpu = [dict(row, device="cpu:x86_64") for row in conditions_board]
    assert "device-h" in render(summarize(cpu)) and re.search(r"\| 1 CPU \|", render(summarize(cpu), "markdown"))
    mixed = [dict(row, device="H100" if row["seed"] == 0 else "cpu:x86_64") for row in conditions_board]
    assert {r.device for r in summarize(mixed) if not r.is_reference} == {"mixed"}
    assert {r.device for r in summarize(conditions_board)} == {""}  # not recorded: no label
