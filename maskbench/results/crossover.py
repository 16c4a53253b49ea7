"""The crossover map: masking's compute-to-target ratio over model size, tokens per batch and horizon.

The public evidence disagrees on whether masking pays at equal compute (MicroDiT's 1.16B model at
batch 2048 found 0% masking best; tiny models lean the other way; MaskDiT's step-time gain vanishes at
batch 16), so the answer is a function, not a number. One cell is (model, batch size, horizon): the
horizon is an eval point of a single-phase arm, a valid shorter run under the constant learning rate
(a two-phase arm's early points are not: its phase boundaries move with the budget).

Per seed (the two arms share initial weights, data order and evaluation noise):
    ratio_s = FLOPs the masked run needs to reach the baseline's metric at the horizon
              / the baseline's FLOPs at the horizon,
read off the masked run's curve by `compute_to_target`. ratio < 1: masking reaches the same quality with
less compute. A ratio is only bounded when the masked curve reaches the target at its first point (<=) or
never (>); the cell then says so instead of pretending to a value. The cell's ratio is the geometric mean
over seeds with a Student-t interval on log ratio (ratios multiply, so their logs are what averages).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from maskbench.results.leaderboard import Row
from maskbench.results.stats import (LOWER_IS_BETTER, Difference, compute_to_target, paired_difference,
                                     ratio_summary, source_family)

Bound = str  # "" a value, "<=" reached at the masked run's first point, ">" not reached within its points


@dataclass(frozen=True)
class Cell:
    """One (model, batch size, horizon) cell of the map, pooled over the seeds both arms ran."""

    model: str
    params: int
    batch_size: int
    point: float                  # horizon as a fraction of the budget
    horizon_flops: float          # the baseline's mean train FLOPs at that point
    n: int                        # seeds with both arms
    ratio: float                  # geometric mean of the per-seed ratios (or of their bounds)
    ratio_ci: tuple[float, float] | None  # its 95% interval (None for one seed)
    bound: Bound                  # "" unless some seed's ratio is only a bound: then the worst such
    difference: Difference | None  # masked − baseline at the horizon, paired by seed, with its verdict
                                   # (None when the masked arm has no eval point at that horizon)

    @property
    def pays(self) -> bool | None:
        """True when the whole interval of the ratio lies below 1, False above, None undecided."""
        if self.bound == ">" and self.ratio >= 1:
            return False
        if self.ratio_ci is None or self.bound:
            return None
        low, high = self.ratio_ci
        return True if high < 1 else False if low > 1 else None


def crossover_cells(rows: Sequence[Row], arm: str = "mask75", baseline: str = "mask0",
                    metric: str = "fid") -> list[Cell]:
    """Every (model, batch size, baseline eval point) cell with at least one seed run by both arms."""
    if metric not in LOWER_IS_BETTER:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(LOWER_IS_BETTER)}")
    curves: dict[tuple, dict[str, dict[int, list[Row]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    latest = {(row["run_id"], row["point"]): row for row in rows if not row["source"] and row[metric] is not None}
    for row in latest.values():
        if row["arm"] in (arm, baseline):
            key = (row["dataset"], row["model"], row["batch_size"], row["budget_flops"], source_family(row))
            curves[key][row["arm"]][row["seed"]].append(row)
    cells = []
    for key in sorted(curves, key=lambda k: (k[0], _first(curves[k])["params"], *k[1:])):
        by_arm = curves[key]
        seeds = sorted(set(by_arm[arm]) & set(by_arm[baseline]))
        if seeds:
            cells.extend(_cells(by_arm[baseline], by_arm[arm], seeds, metric))
    return cells


def _first(by_arm: dict[str, dict[int, list[Row]]]) -> Row:
    return next(iter(next(iter(by_arm.values())).values()))[0]


def _cells(base: dict[int, list[Row]], masked: dict[int, list[Row]], seeds: list[int], metric: str) -> list[Cell]:
    """The cells of one (model, batch, budget) pair of runs: one per baseline eval point all seeds have."""
    lower = LOWER_IS_BETTER[metric]
    points = sorted(set.intersection(*({r["point"] for r in base[s]} for s in seeds)))
    first = base[seeds[0]][0]
    cells = []
    for point in points:
        ratios, bounds, pairs, flops = [], [], [], []
        for seed in seeds:
            at = next(r for r in base[seed] if r["point"] == point)
            curve = sorted((r["train_flops"], r[metric]) for r in masked[seed])
            needed = compute_to_target(curve, at[metric], higher_is_better=not lower)
            if needed is None:
                ratios.append(curve[-1][0] / at["train_flops"])
                bounds.append(">")
            else:
                ratios.append(needed / at["train_flops"])
                bounds.append("<=" if needed == curve[0][0] else "")
            same = [r[metric] for r in masked[seed] if r["point"] == point]
            pairs.append((same[0], at[metric]) if same else None)
            flops.append(at["train_flops"])
        difference = paired_difference(*zip(*pairs), lower_is_better=lower) if None not in pairs else None
        cells.append(_cell(first, point, float(np.mean(flops)), ratios, bounds, difference))
    return cells


def _cell(first: Row, point: float, horizon_flops: float, ratios: list[float], bounds: list[Bound],
          difference: Difference | None) -> Cell:
    """Pool the seeds: geometric mean and log-scale t-interval of the ratios; the worst bound any seed has."""
    summary = ratio_summary(ratios)
    ci = None if math.isnan(summary.lo) else (summary.lo, summary.hi)
    bound = ">" if ">" in bounds else "<=" if "<=" in bounds else ""
    return Cell(model=first["model"], params=first["params"], batch_size=first["batch_size"], point=point,
                horizon_flops=horizon_flops, n=len(ratios), ratio=summary.geomean, ratio_ci=ci, bound=bound,
                difference=difference)


def render_cells(cells: Sequence[Cell]) -> str:
    """The map as a markdown table, one line per cell."""
    lines = ["| model | params | batch | horizon | FLOPs | n | FLOPs ratio (95% CI) | pays | masked − baseline "
             "(95% CI) | verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        ci = f" ({c.ratio_ci[0]:.2f}–{c.ratio_ci[1]:.2f})" if c.ratio_ci else ""
        pays = {True: "yes", False: "no", None: "undecided"}[c.pays]
        d = c.difference
        diff = "" if d is None else f"{d.mean:.4g}" + ("" if math.isnan(d.lo) else f" [{d.lo:.3g}, {d.hi:.3g}]")
        lines.append(f"| {c.model} | {c.params} | {c.batch_size} | {c.point:g} | {c.horizon_flops:.3g} | {c.n} | "
                     f"{c.bound}{c.ratio:.2f}{ci} | {pays} | {diff} | {'' if d is None else d.verdict} |")
    return "\n".join(lines)


def plot_crossover(cells: Sequence[Cell], out_path: str | os.PathLike, title: str = "") -> Path:
    """A heatmap of log2 ratio (rows model × batch, columns horizon) beside ratio-vs-horizon curves."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on clusters or CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    if not cells:
        raise ValueError("no crossover cells: both arms need runs with the same seeds")
    rows = sorted({(c.params, c.model, c.batch_size) for c in cells})
    points = sorted({c.point for c in cells})
    grid = np.full((len(rows), len(points)), np.nan)
    for c in cells:
        grid[rows.index((c.params, c.model, c.batch_size)), points.index(c.point)] = math.log2(c.ratio)
    fig, (heat, curves) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.6 * len(rows)), constrained_layout=True)
    limit = max(1.0, float(np.nanmax(np.abs(grid))))
    image = heat.imshow(grid, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    for c in cells:
        heat.text(points.index(c.point), rows.index((c.params, c.model, c.batch_size)),
                  f"{c.bound}{c.ratio:.2f}", ha="center", va="center", fontsize=8)
    heat.set_xticks(range(len(points)), [f"{p:g}" for p in points])
    heat.set_yticks(range(len(rows)), [f"{m} b{b}" for _, m, b in rows])
    heat.set_xlabel("horizon (fraction of the budget)")
    fig.colorbar(image, ax=heat, label="log2 FLOPs-to-target ratio (< 0: masking pays)")
    for params, model, batch in rows:
        line = sorted((c for c in cells if (c.params, c.model, c.batch_size) == (params, model, batch)),
                      key=lambda c: c.horizon_flops)
        curves.plot([c.horizon_flops for c in line], [c.ratio for c in line], marker="o", label=f"{model} b{batch}")
    curves.axhline(1.0, color="k", lw=0.8)
    curves.set(xscale="log", yscale="log", xlabel="baseline train FLOPs at the horizon",
               ylabel="masked FLOPs to reach the baseline / baseline FLOPs")
    curves.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap
    curves.legend(fontsize=8)
    fig.suptitle(title or "crossover map: masking's compute-to-target ratio")
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
