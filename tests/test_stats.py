"""Leaderboard statistics against hand-computed figures and scipy on small fixture CSVs: intervals,
paired comparisons and their verdicts (at the interval's edges too), Welch's fallback, compute-to-target
ratios, the MLPerf-style scores and the RCP rule, rendering, plots."""

import csv
import io
import math

import numpy as np
import pytest
import scipy.stats
from PIL import Image

from maskbench.results import mlperf
from maskbench.results.leaderboard import append_rows, read_rows
from maskbench.results.plots import plot_leaderboard
from maskbench.results.report import leaderboard_main
from maskbench.results.stats import (
    bootstrap_ci, compute_to_target, mean_ci, minimum_detectable_effect, paired_difference, ratio_summary, render,
    summarize, verdict, welch, welch_difference,
)

# Two-sided 95% / 99% Student-t quantiles from a printed table (df = 2, 3, 4), and the one-sided 80% ones
# (the power term of the minimum detectable effect).
T975_DF2, T975_DF3, T995_DF3 = 4.302652729911275, 3.182446305284263, 5.840909309733355
T975_DF4, T80_DF2, T80_DF4 = 2.776445105197793, 1.060660171779821, 0.940964563204454
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


def test_welch_matches_the_formula():
    a, b = np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0, 8.0])
    va, vb = a.var(ddof=1) / 3, b.var(ddof=1) / 4
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    assert welch(a, b) == pytest.approx((t, 2 * scipy.stats.t.sf(abs(t), df)))
    assert welch([1.0], [1.0, 2.0]) is None


def test_summary_figures_match_hand_computation(board):
    summary = summarize(board)
    base = record(summary, "mask0", 1.0)
    assert base.n == 3  # the stale 999 re-evaluation and the reference row are not pooled
    assert base.metrics["fid"] == pytest.approx((210.0, T975_DF2 * 10.0 / math.sqrt(3)))
    assert base.metrics["clip_score"] == pytest.approx((31.0, T975_DF2 * 1.0 / math.sqrt(3)))
    assert base.metrics["val_loss"] == pytest.approx((0.52, T975_DF2 * 0.02 / math.sqrt(3)))
    assert base.metrics["align_acc"] is None
    assert base.gpu_hours == pytest.approx(2.0) and base.fid_features == "oracle-synth-v1"
    assert base.target == pytest.approx(210.0) and base.flops_to_target == pytest.approx(1.0)
    assert base.welch_p is None

    masked = record(summary, "mask75", 1.0)
    # FLOPs curve (0.5, 250) -> (1.0, 160) crosses 210 at 0.5 + 40/90 * 0.5;
    # hours curve (0.6/2.0, 250) -> (1.2/2.0, 160) at 0.3 + 40/90 * 0.3.
    assert masked.flops_to_target == pytest.approx(0.5 + 40 / 90 * 0.5)
    assert masked.hours_to_target == pytest.approx(0.3 + 40 / 90 * 0.3)
    t = -50.0 / math.sqrt(100 / 3 + 100 / 3)  # equal variances: Welch's df is 4
    assert masked.welch_p == pytest.approx(2 * scipy.stats.t.sf(abs(t), 4))
    assert record(summary, "mask75", 0.5).flops_to_target is None  # set on the final point only

    single = record(summary, "mask75_then0", 1.0)
    assert single.target == pytest.approx(210.0) and single.flops_to_target is None
    assert math.isnan(single.metrics["fid"][1]) and single.welch_p is None

    (reference,) = [r for r in summary if r.is_reference]
    assert reference.metrics["fid"][0] == 1.0 and reference.source == "a paper, table 2"
    assert [r.arm for r in summary][:2] == ["mask0", "mask0"]  # the baseline leads its group


def test_render_formats(board):
    summary = summarize(board)
    table = render(summary)
    assert "not reached" in table and "oracle-synth-v1" in table and "210 ± 25" in table
    assert "[1] a paper, table 2" in table
    markdown = render(summary, "markdown").splitlines()
    assert markdown[1].startswith("| --- |") and len(markdown[0].split("|")) == len(markdown[2].split("|"))
    rows = list(csv.DictReader(io.StringIO(render(summary, "csv"))))
    (final,) = [r for r in rows if r["arm"] == "mask75" and r["point"] == "1.0"]
    assert float(final["flops_to_target"]) == pytest.approx(0.5 + 40 / 90 * 0.5)
    assert float(final["fid"]) == pytest.approx(160.0)
    with pytest.raises(ValueError, match="unknown format"):
        render(summary, "html")


def test_val_loss_stands_in_only_when_a_group_has_no_fid(tmp_path):
    rows = [run_row(arm, seed, point, None, point * BUDGET, point, val_loss=value + 0.02 * seed)
            for arm, curve in (("mask0", {0.5: 0.8, 1.0: 0.6}), ("mask75", {0.5: 0.7, 1.0: 0.5}))
            for point, value in curve.items() for seed in range(2)]
    append_rows(tmp_path / "board.csv", rows)
    summary = summarize(read_rows([tmp_path / "board.csv"]))
    masked = record(summary, "mask75", 1.0)
    assert masked.target_metric == "val_loss" and masked.target == pytest.approx(0.61)
    assert masked.flops_to_target == pytest.approx(0.5 + (0.71 - 0.61) / (0.71 - 0.51) * 0.5)
    assert "no FID in this group: compute-to-target and the comparisons use val_loss" in render(summary)
    assert masked.comparison.metric == "val_loss" and masked.comparison.difference.test == "paired"
    assert masked.comparison.difference.mean == pytest.approx(-0.1)


def test_group_problems_are_said(board):
    without_baseline = summarize(board, baseline_arm="mask50")
    assert all(r.target is None for r in without_baseline)
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
    # bootstrap: scipy's percentile interval with the fixed seed, i.e. resampled indices from that generator
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, 5, (10_000, 5))].mean(axis=1)
    assert found.boot == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
    assert paired_difference(arm, base).boot == found.boot  # deterministic


def test_paired_difference_with_few_or_identical_pairs():
    two = paired_difference([1.0, 3.0], [2.0, 2.0])
    assert two.boot is None and two.n == 2 and not math.isnan(two.lo)
    assert bootstrap_ci([1.0, 2.0]) is None and bootstrap_ci([1.0, 2.0, 4.0]) is not None
    one = paired_difference([1.0], [2.0])
    assert math.isnan(one.lo) and math.isnan(one.mde) and one.verdict.startswith("not tested")
    same = paired_difference([3.0, 4.0, 5.0], [4.0, 5.0, 6.0])  # every d_i = -1: a zero-width interval
    assert (same.lo, same.hi, same.p, same.mde) == (-1.0, -1.0, 0.0, 0.0) and same.verdict == "better"
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
    assert found.p == pytest.approx(welch(a, b)[1])
    se = math.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 4)
    t975, t80 = scipy.stats.t.ppf(0.975, reference.df), scipy.stats.t.ppf(0.8, reference.df)
    assert found.mde == pytest.approx((t975 + t80) * se) and found.boot is None
    assert welch_difference([1.0], [1.0, 2.0]).verdict.startswith("not tested")


def test_ratio_summary_is_a_geometric_mean_with_a_log_t_interval():
    ratios = [0.25, 0.5, 1.0]
    logs = np.log(ratios)
    half = T975_DF2 * logs.std(ddof=1) / math.sqrt(3)
    found = ratio_summary(ratios)
    assert found.geomean == pytest.approx(0.5) and found.n == 3
    assert (found.lo, found.hi) == pytest.approx((math.exp(logs.mean() - half), math.exp(logs.mean() + half)))
    missed = ratio_summary([0.5, None, 0.7])
    assert missed.geomean is None and missed.not_reached == 1
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
    c = masked.comparison
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
    for found, expected in ((c.flops_ratio, flops), (c.hours_ratio, hours)):
        assert found == ratio_summary(expected)
        assert found.geomean == pytest.approx(math.exp(np.mean(np.log(expected))))


def test_unpaired_seeds_fall_back_to_welch_and_say_so(paired_board):
    extra = [dict(row, run_id="mask75-s7", seed=7, fid=row["fid"] + 5) for row in paired_board
             if row["arm"] == "mask75" and row["seed"] == 0]
    summary = summarize([*paired_board, *extra])
    (masked,) = [r for r in summary if r.arm == "mask75" and r.point == 1.0]
    c = masked.comparison
    assert c.difference.test == "welch" and (c.difference.n, c.difference.n_base) == (4, 4)
    assert c.flops_ratio is None and c.note == "unpaired (Welch): seed(s) 7 have no mask0 partner"
    assert c.difference.p == pytest.approx(masked.welch_p)
    table = render(summary)
    assert "synth/tiny/1e+12: mask75: unpaired (Welch): seed(s) 7 have no mask0 partner" in table
    assert "4 vs 4" in table
    twice = [dict(row, run_id="mask0-again") for row in paired_board if row["arm"] == "mask0" and row["seed"] == 0]
    (masked,) = [r for r in summarize([*paired_board, *twice]) if r.arm == "mask75" and r.point == 1.0]
    assert masked.comparison.note == "unpaired (Welch): seed(s) 0 appear in more than one run of an arm"


def test_an_arm_that_never_reaches_the_target_has_no_ratio(paired_board):
    worse = [dict(row, fid=row["fid"] + 100) if row["arm"] == "mask75" and row["seed"] == 1 else row
             for row in paired_board]
    (masked,) = [r for r in summarize(worse) if r.arm == "mask75" and r.point == 1.0]
    assert masked.comparison.flops_ratio.not_reached == 1 and masked.comparison.flops_ratio.geomean is None
    assert "1/3 not reached" in render(summarize(worse))


def test_comparisons_render_in_every_format(paired_board):
    summary = summarize(paired_board)
    table = render(summary).splitlines()
    start = table.index("Against mask0 at the final point:")
    assert table[start + 1].split()[:8] == ["dataset", "model", "batch", "budget", "arm", "metric", "test", "n"]
    assert "3 pairs" in table[start + 3] and "no difference detected" in table[start + 3]
    assert any(line.startswith("Δ: arm − mask0") for line in table)
    markdown = render(summary, "markdown").splitlines()
    second = markdown.index("Against mask0 at the final point:") + 2
    assert markdown[second].startswith("| dataset | model |") and markdown[second + 1].startswith("| --- |")
    assert len(markdown[second].split("|")) == len(markdown[second + 2].split("|"))
    records = list(csv.DictReader(io.StringIO(render(summary, "csv"))))
    (final,) = [r for r in records if r["arm"] == "mask75" and r["point"] == "1.0"]
    assert final["test"] == "paired" and final["pairs"] == "3" and float(final["diff"]) == pytest.approx(-40.0)
    assert final["verdict"].startswith("no difference detected") and final["boot_lo"] and final["mde"]
    assert float(final["flops_ratio_geomean"]) == pytest.approx(summary[-1].comparison.flops_ratio.geomean)
    (base,) = [r for r in records if r["arm"] == "mask0" and r["point"] == "1.0"]
    assert base["test"] == "" and base["verdict"] == ""


def test_the_committed_leaderboard_renders_with_paired_comparisons(capsys):
    rows = read_rows(["results/leaderboard.csv"], on_error="abort")
    compared = [r for r in summarize(rows) if r.comparison and r.model == "tiny"]  # the two-seed results
    assert len(compared) == 8 and all(r.comparison.difference.test == "paired" for r in compared)
    assert all(r.comparison.difference.n == 2 and r.comparison.difference.boot is None for r in compared)
    assert leaderboard_main(["results/leaderboard.csv"], "table", None, "mask0", "abort") == 0
    assert "n < 3" in capsys.readouterr().out


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


@pytest.fixture
def ten_seeds(tmp_path):
    """mask0, mask50 (within the baseline's noise) and mask75 (much faster), 10 seeds each."""
    rows = []
    fids = {"mask0": (300.0, 200.0), "mask50": (299.0, 199.0), "mask75": (230.0, 150.0)}
    hours = {"mask0": (1.0, 2.0), "mask50": (1.0, 2.0), "mask75": (0.6, 1.2)}
    for arm, (half, final) in fids.items():
        for seed in range(10):
            late = final + seed + (100 if arm == "mask75" and seed == 9 else 0)  # mask75 seed 9 never gets there
            rows += [run_row(arm, seed, 0.5, half + seed, 0.5 * BUDGET, hours[arm][0]),
                     run_row(arm, seed, 1.0, late, BUDGET, hours[arm][1])]
    append_rows(tmp_path / "ten.csv", rows)
    return read_rows([tmp_path / "ten.csv"], on_error="abort")


def test_mlperf_scores_by_hand(ten_seeds):
    scores, notes = mlperf.mlperf_summary(ten_seeds)
    assert not notes and [s.arm for s in scores] == ["mask0", "mask50", "mask75"]
    base, half, fast = scores
    assert all(s.target == 209.0 and s.runs == 10 for s in scores)  # mask0's worst final FD
    # mask0 seed s reaches 209 on (0.5, 300+s) -> (1.0, 200+s) at 0.5 + (91+s)/200 of the budget.
    reach = [0.5 + (91 + s) / 200 for s in range(10)]
    assert base.flops == pytest.approx(np.mean(reach[1:-1]) * BUDGET)
    assert base.hours == pytest.approx(2 * np.mean(reach[1:-1]))
    assert base.rcp == "reference" and base.speedup == pytest.approx(1.0) and base.reached == 10
    bound = mlperf.rcp([r * BUDGET for r in reach], 10)
    half_reach = [0.5 + (90 + s) / 200 for s in range(10)]
    assert half.flops == pytest.approx(np.mean(half_reach[1:-1]) * BUDGET)
    assert bound.min_mean < half.flops < bound.mean
    assert half.rcp == "normalised"
    assert half.score_hours == pytest.approx(half.hours * bound.mean / half.flops)
    assert half.speedup == pytest.approx(1.0)  # hours ∝ FLOPs here: the speed-up within the noise is not credited
    fast_reach = sorted(0.5 + (21 + s) / 160 for s in range(9))  # seed 9 never reaches: dropped as the slowest
    assert fast.reached == 9 and fast.flops == pytest.approx(np.mean(fast_reach[1:]) * BUDGET)
    assert fast.rcp == "faster than RCP" and fast.score_hours == fast.hours
    assert fast.speedup == pytest.approx(base.hours / fast.hours)
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
    assert leaderboard_main(["results/leaderboard.csv"], "table", None, "mask0", "skip", mlperf=True) == 1
    err = capsys.readouterr().err
    assert "--mlperf scores arms with >= 10 finished runs" in err and "mask0 2" in err
    assert leaderboard_main(["results/leaderboard.csv"], "table", "x.png", "mask0", "skip", mlperf=True) == 2


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
    diff = continued["lsc_convert"].comparison.difference
    assert diff.test == "paired" and diff.n == 3 and diff.mean == pytest.approx(50.0 - 2.0)
    assert "tiny from mask0-synth-tiny" in render(summary)
