"""The crossover map's per-seed compute-to-target ratios against hand-computed figures, and its plot."""

import math
import re

import pytest
import scipy.stats
from PIL import Image

from maskbench.results.crossover import correct_cells, crossover_cells, crossover_figure, plot_crossover, render_cells
from maskbench.results.estimators import ZERO_SPREAD, ratio_verdict
from maskbench.results.multiplicity import Family
from maskbench.results.rows import COLUMNS
from maskbench.results.tables import DETAILS_HINT, WIDTH

BUDGET = 1e12


def row(arm: str, seed: int, point: float, fid: float, model: str = "micro_s", batch: int = 64, **extra) -> dict:
    cells = dict.fromkeys(COLUMNS)
    cells.update(run_id=f"{arm}-{model}-b{batch}-s{seed}", arm=arm, dataset="synth", model=model,
                 params={"micro_xs": 1, "micro_s": 2}[model], batch_size=batch, seed=seed, budget_flops=BUDGET,
                 point=point, train_flops=point * BUDGET, fid=fid, source="", **extra)
    return cells


def test_ratio_is_the_interpolated_flops_to_the_baseline_value_per_seed() -> None:
    """Seed 0: mask0 reaches 100 at 0.5; mask75 goes 120 -> 80 between 0.25 and 0.5, so it crosses 100 at
    0.375 (ratio 0.75). Seed 1: mask75 crosses at 0.25 + 0.25 * 10/40 = 0.3125 (ratio 0.625)."""
    rows = [row("mask0", 0, 0.5, 100.0), row("mask75", 0, 0.25, 120.0), row("mask75", 0, 0.5, 80.0),
            row("mask0", 1, 0.5, 110.0), row("mask75", 1, 0.25, 120.0), row("mask75", 1, 0.5, 80.0)]
    (cell,) = crossover_cells(rows)
    logs = [math.log(0.75), math.log(0.625)]
    half = scipy.stats.t.ppf(0.975, 1) * scipy.stats.sem(logs)
    reading = cell.readings["fid"]
    assert cell.n == 2 and reading.ratio.bound == "" and list(cell.readings) == ["fid"]  # these rows have no val loss
    assert reading.ratio.geomean == pytest.approx(math.sqrt(0.75 * 0.625))
    assert (reading.ratio.lo, reading.ratio.hi) == pytest.approx((math.exp(sum(logs) / 2 - half),
                                                                  math.exp(sum(logs) / 2 + half)))
    assert reading.difference.test == "paired"
    assert reading.difference.mean == pytest.approx(((80 - 100) + (80 - 110)) / 2)
    assert ratio_verdict(reading.ratio, 0.05) == "undecided"  # df = 1: the interval straddles 1


def test_an_unreached_target_is_a_lower_bound_above_1_and_no_verdict() -> None:
    """mask75 ends at 60 at twice mask0's FLOPs, above mask0's 50: ratio > 2, but untested, so it neither
    pays nor does not pay; the cell's combined reading is undecided and the metrics agree (nothing decided)."""
    rows = [row("mask0", 0, 0.5, 50.0, val_loss=0.5), row("mask75", 0, 0.5, 90.0, val_loss=0.6),
            row("mask75", 0, 1.0, 60.0, val_loss=0.55)]
    (cell,) = crossover_cells(rows)
    ratio = cell.readings["fid"].ratio
    assert ratio.bound == ">" and ratio.geomean == pytest.approx(2.0)
    assert ratio_verdict(ratio, 0.05) == "not reached (1/1)"
    line = render_cells([cell]).splitlines()[2]
    assert line.count("| not reached (1/1) |") == 2 and line.endswith("| undecided | agree | exploratory |")


def test_a_target_met_at_the_first_point_is_an_upper_bound_below_1_and_no_verdict() -> None:
    """Both metrics reached at mask75's first point, a quarter of mask0's FLOPs: <= 0.25 on each, which
    does not pay either: the combined reading stays undecided."""
    rows = [row("mask0", 0, 1.0, 50.0, val_loss=0.5), row("mask75", 0, 0.25, 40.0, val_loss=0.4),
            row("mask75", 0, 1.0, 30.0, val_loss=0.3)]
    (cell,) = crossover_cells(rows)
    for reading in cell.readings.values():
        assert reading.ratio.bound == "<=" and reading.ratio.geomean == pytest.approx(0.25)
        assert ratio_verdict(reading.ratio, 0.05) == "reached at first point"
    line = render_cells([cell]).splitlines()[2]
    assert line.count("| reached at first point |") == 2 and line.endswith("| undecided | agree | exploratory |")


def test_cells_split_by_model_and_batch_and_need_both_arms_per_seed() -> None:
    rows = [row(arm, seed, p, 100.0 - 10 * p * (arm == "mask75") * (1 + seed / 10), model=m, batch=b)
            for arm in ("mask0", "mask75") for seed in range(3) for p in (0.5, 1.0)
            for m in ("micro_xs", "micro_s") for b in (32, 128)]
    rows.append(row("mask0", 7, 1.0, 1.0))  # no mask75 partner: ignored
    cells = crossover_cells(rows)
    assert {(c.model, c.batch_size, c.point) for c in cells} == {
        (m, b, p) for m in ("micro_xs", "micro_s") for b in (32, 128) for p in (0.5, 1.0)}
    assert all(c.n == 3 for c in cells)
    assert [c.model for c in cells][:4] == ["micro_xs"] * 4  # smallest model first
    assert "| micro_s | 2 | 128 | 1 |" in render_cells(cells)
    assert all(c.readings["fid"].difference.verdict == "better" for c in cells)  # lower by 10·p·(1 + s/10) at seed s
    constant = crossover_cells([dict(r, fid=100.0 - 10 * r["point"] * (r["arm"] == "mask75")) for r in rows])
    assert all(c.readings["fid"].difference.verdict == ZERO_SPREAD for c in constant)  # 10·p at every seed: no p


def val_loss(arm: str, seed: int, point: float, batch: int) -> float:
    """mask0 falls from 1; mask75 falls 1.5 times as fast at batch 32 but stays above mask0 at batch 128."""
    if arm == "mask75" and batch == 128:
        return 1.5 - 0.01 * point
    return 1.0 - 0.3 * point * (1 + 0.5 * (arm == "mask75")) - 0.01 * seed


def test_plot_draws_a_row_per_metric_with_bounds_hatched_not_coloured(tmp_path) -> None:
    """At horizon 0.25 mask75 is already there at its first point (an upper bound) on both metrics; at
    batch 128 it never reaches mask0's val loss (lower bounds). Neither kind is coloured as a value."""
    rows = [row(arm, seed, p, 100.0 - 30 * p * (1 + 0.5 * (arm == "mask75")) - seed, batch=b,
                val_loss=val_loss(arm, seed, p, b))
            for arm in ("mask0", "mask75") for seed in range(2) for p in (0.25, 0.5, 1.0) for b in (32, 128)]
    cells = crossover_cells(rows)
    figure = crossover_figure(cells)
    heatmaps = [ax for ax in figure.axes if ax.images]
    assert [ax.get_title().split(":")[0] for ax in heatmaps] == ["FD", "val loss"]
    fd, loss = (ax.images[0].get_array().mask for ax in heatmaps)  # (rows b32, b128; horizons 0.25, 0.5, 1)
    assert fd.tolist() == [[True, False, False]] * 2
    assert loss.tolist() == [[True, False, False], [True, True, True]]
    assert sum(text.get_text().startswith(">") for text in heatmaps[1].texts) == 3
    assert sum(bool(patch.get_hatch()) for patch in heatmaps[1].patches) == 4
    curves = [ax.get_title().split(":")[0] for ax in figure.axes if ax.get_xscale() == "log"]
    assert curves == ["FD", "val loss"]
    path = plot_crossover(cells, tmp_path / "map.png")
    assert Image.open(path).size[0] > 600


def test_plot_refuses_an_empty_map(tmp_path) -> None:
    with pytest.raises(ValueError, match="no crossover cells"):
        plot_crossover([], tmp_path / "map.png")


def test_leaderboard_crossover_prints_and_draws_the_map(tmp_path, capsys) -> None:
    from maskbench.results.leaderboard import leaderboard_main
    from maskbench.results.rows import append_rows

    csv_path = tmp_path / "crossover.csv"
    append_rows(csv_path, [row(arm, seed, p, 100.0 - 30 * p * (1 + (arm == "mask75")) - seed)
                           for arm in ("mask0", "mask75") for seed in range(2) for p in (0.5, 1.0)])
    assert leaderboard_main([str(csv_path)], plot=str(tmp_path / "map.png"), crossover="mask75") == 0
    out = capsys.readouterr().out  # text: one table per (model, batch) under its heading, within WIDTH columns
    assert out.count("micro_s (2 params) / batch 64 (n: 2; reading: exploratory)") == 1
    assert re.search(r"^0\.5 ", out, re.MULTILINE) and re.search(r"^1 ", out, re.MULTILINE)
    assert max(len(line) for line in out.splitlines()) <= WIDTH and out.rstrip().endswith(DETAILS_HINT)
    assert (tmp_path / "map.png").is_file()
    assert leaderboard_main([str(csv_path)], "markdown", crossover="mask75") == 0
    assert capsys.readouterr().out.count("| micro_s | 2 | 64 |") == 2  # Markdown: every column, a line per cell
    assert leaderboard_main([str(csv_path)], crossover="sprint75") == 2  # an arm the rows lack: bad input
    assert "--crossover sprint75: no such arm in these rows; they have mask0, mask75" in capsys.readouterr().err
    assert leaderboard_main([str(csv_path)], crossover="mask75", baseline="mask75_then0") == 1
    assert "no crossover cells" in capsys.readouterr().err


def test_the_map_reads_val_loss_beside_fd_and_marks_a_partial_agreement(capsys) -> None:
    """mask75 reaches mask0's FD at 0.75 of the FLOPs on both seeds (pays on FD); its val loss is worse (never
    reaches mask0's). The map shows both and marks the split as partial (FD's Δ has no test, val loss's ratio is a
    bound: neither reading has two opposite directions); nothing pays without both."""
    rows = []
    for seed in range(3):
        rows += [row("mask0", seed, 0.5, 200.0 + seed, val_loss=0.60),
                 row("mask0", seed, 1.0, 100.0 + seed, val_loss=0.50),
                 row("mask75", seed, 0.5, 150.0 + seed + 2 * (seed == 1), val_loss=0.70),
                 row("mask75", seed, 1.0, 90.0 + seed, val_loss=0.65 + 0.01 * seed)]
    cells = crossover_cells(rows)
    final = cells[-1]
    assert list(final.readings) == ["fid", "val_loss"]
    assert ratio_verdict(final.readings["fid"].ratio, 0.05) == "pays"
    assert ratio_verdict(final.readings["val_loss"].ratio, 0.05) == "not reached (3/3)"  # a lower bound of 1
    assert final.readings["val_loss"].difference.verdict == "worse"
    table = render_cells(cells)
    assert "| val loss FLOPs ratio (95% CI) |" in table.splitlines()[0]
    assert table.splitlines()[-3].endswith("| undecided | partly | exploratory |")
    # Under a plan's Holm correction across its tests, p adj is what the verdict reads.
    corrected, tests = correct_cells(cells, Family(("fid", "val_loss"), method="holm"))
    assert tests == sum(1 for c in cells for r in c.readings.values() for p in (r.ratio.p, r.difference.p)
                        if not math.isnan(p))
    assert corrected[-1].readings["fid"].ratio.p_adj >= cells[-1].readings["fid"].ratio.p


def test_seeds_run_under_other_conditions_are_left_out_of_their_cells_and_named(capsys) -> None:
    """mask75's seed 1 ran in bf16 against mask0's fp32: its cells read seeds 0 and 2 only (the paired difference
    of those two, by hand), and one line under the map names the seed and the field."""
    rows = [row(arm, seed, p, 100.0 - 30 * p * (1 + 0.5 * (arm == "mask75")) - seed * (1 + (arm == "mask75")),
                precision="bf16" if (arm, seed) == ("mask75", 1) else "fp32", draw_scheme="crn-v3")
            for arm in ("mask0", "mask75") for seed in range(3) for p in (0.5, 1.0)]
    cells = crossover_cells(rows)
    assert [c.n for c in cells] == [2, 2]
    assert cells[-1].readings["fid"].difference.mean == pytest.approx(-15.0 - 1.0)  # seeds 0 and 2: −15, −17
    note = "micro_s b64: mask75: not paired with mask0 on seed(s) 1: precision (bf16 vs fp32) differ"
    assert cells[0].notes == (note,) and render_cells(cells).splitlines().count(note) == 1


def test_a_horizon_the_baselines_fit_pooled_repeats_the_earlier_one_and_counts_once_in_holm() -> None:
    """mask0's FD goes back up from 0.5 to 1 on every seed (180 + s, then 200 + s): its fit pools the two to
    190 + s, one target, so the cell at 1 has 0.5's ratio, marked (= 0.5), one test in Holm with 0.5's p adj."""
    rows = []
    for seed in range(3):
        rows += [row("mask0", seed, p, fid + seed) for p, fid in ((0.25, 300.0), (0.5, 180.0), (1.0, 200.0))]
        rows += [row("mask75", seed, p, fid) for p, fid in ((0.25, 250.0 + 2 * seed), (0.5, 210.0 + seed),
                                                           (1.0, 170.0 + 3 * seed))]
    first, half, final = crossover_cells(rows)
    assert (first.readings["fid"].repeats, half.readings["fid"].repeats, final.readings["fid"].repeats) == (
        None, None, 0.5)
    assert final.readings["fid"].ratio == half.readings["fid"].ratio and final.readings["fid"].ratio.p > 0
    assert final.readings["fid"].difference.mean != half.readings["fid"].difference.mean  # Δ is read at each horizon
    corrected, tests = correct_cells([first, half, final], Family(("fid",), method="holm"))
    ps = [p for c in (first, half, final) for p in (c.readings["fid"].ratio.p, c.readings["fid"].difference.p)]
    assert tests == sum(not math.isnan(p) for p in ps) - 1  # the repeated ratio is not a second test
    assert corrected[2].readings["fid"].ratio.p_adj == corrected[1].readings["fid"].ratio.p_adj
    assert "(= 0.5)" in render_cells(corrected).splitlines()[4]
