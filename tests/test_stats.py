"""Leaderboard statistics against hand-computed figures on a small fixture CSV, rendering, plots."""

import csv
import io
import math

import numpy as np
import pytest
import scipy.stats
from PIL import Image

from maskbench.results.leaderboard import append_rows, read_rows
from maskbench.results.plots import plot_leaderboard
from maskbench.results.stats import compute_to_target, mean_ci, render, summarize, welch

# Two-sided 95% / 99% Student-t quantiles from a printed table (df = 2, 3).
T975_DF2, T975_DF3, T995_DF3 = 4.302652729911275, 3.182446305284263, 5.840909309733355
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
    assert "no FID in this group: compute-to-target and Welch use val_loss" in render(summary)


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

