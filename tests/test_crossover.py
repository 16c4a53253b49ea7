"""The crossover map's per-seed compute-to-target ratios against hand-computed figures, and its plot."""

import math

import pytest
import scipy.stats
from PIL import Image

from maskbench.results.crossover import crossover_cells, plot_crossover, render_cells
from maskbench.results.leaderboard import COLUMNS

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
    assert cell.n == 2 and cell.bound == ""
    assert cell.ratio == pytest.approx(math.sqrt(0.75 * 0.625))
    assert cell.ratio_ci == pytest.approx((math.exp(sum(logs) / 2 - half), math.exp(sum(logs) / 2 + half)))
    assert cell.difference.test == "paired" and cell.difference.mean == pytest.approx(((80 - 100) + (80 - 110)) / 2)
    assert cell.pays is None  # df = 1: the interval straddles 1


def test_unreached_target_is_a_lower_bound_and_means_masking_does_not_pay() -> None:
    rows = [row("mask0", 0, 1.0, 50.0), row("mask75", 0, 0.5, 90.0), row("mask75", 0, 1.0, 60.0)]
    (cell,) = crossover_cells(rows)
    assert cell.bound == ">" and cell.ratio == pytest.approx(1.0) and cell.pays is False


def test_target_met_at_the_first_point_is_an_upper_bound() -> None:
    rows = [row("mask0", 0, 1.0, 50.0), row("mask75", 0, 0.25, 40.0), row("mask75", 0, 1.0, 30.0)]
    (cell,) = crossover_cells(rows)
    assert cell.bound == "<=" and cell.ratio == pytest.approx(0.25) and cell.pays is None


def test_cells_split_by_model_and_batch_and_need_both_arms_per_seed() -> None:
    rows = [row(arm, seed, p, 100.0 - 10 * p * (arm == "mask75"), model=m, batch=b)
            for arm in ("mask0", "mask75") for seed in range(3) for p in (0.5, 1.0)
            for m in ("micro_xs", "micro_s") for b in (32, 128)]
    rows.append(row("mask0", 7, 1.0, 1.0))  # no mask75 partner: ignored
    cells = crossover_cells(rows)
    assert {(c.model, c.batch_size, c.point) for c in cells} == {
        (m, b, p) for m in ("micro_xs", "micro_s") for b in (32, 128) for p in (0.5, 1.0)}
    assert all(c.n == 3 for c in cells)
    assert [c.model for c in cells][:4] == ["micro_xs"] * 4  # smallest model first
    assert "| micro_s | 2 | 128 | 1 |" in render_cells(cells)
    assert all(c.difference.verdict == "better" for c in cells)  # mask75 is lower by 10·p at every seed


def test_plot_writes_a_heatmap_and_curves(tmp_path) -> None:
    rows = [row(arm, seed, p, 100.0 - 30 * p * (1 + (arm == "mask75")) - seed, batch=b)
            for arm in ("mask0", "mask75") for seed in range(2) for p in (0.25, 0.5, 1.0) for b in (32, 128)]
    path = plot_crossover(crossover_cells(rows), tmp_path / "map.png")
    assert Image.open(path).size[0] > 600


def test_plot_refuses_an_empty_map(tmp_path) -> None:
    with pytest.raises(ValueError, match="no crossover cells"):
        plot_crossover([], tmp_path / "map.png")


def test_leaderboard_crossover_prints_and_draws_the_map(tmp_path, capsys) -> None:
    from maskbench.results.leaderboard import append_rows
    from maskbench.results.report import leaderboard_main

    csv_path = tmp_path / "crossover.csv"
    append_rows(csv_path, [row(arm, seed, p, 100.0 - 30 * p * (1 + (arm == "mask75")) - seed)
                           for arm in ("mask0", "mask75") for seed in range(2) for p in (0.5, 1.0)])
    assert leaderboard_main([str(csv_path)], plot=str(tmp_path / "map.png"), crossover="mask75") == 0
    out = capsys.readouterr().out
    assert out.count("| micro_s | 2 | 64 |") == 2 and (tmp_path / "map.png").is_file()
    assert leaderboard_main([str(csv_path)], crossover="sprint75") == 1
    assert "no crossover cells" in capsys.readouterr().err
