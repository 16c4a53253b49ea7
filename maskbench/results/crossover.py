"""The crossover map: masking's compute-to-target ratio over model size, tokens per batch and horizon.

The public evidence disagrees on whether masking pays at equal compute (MicroDiT's 1.16B model at
batch 2048 found 0% masking best; tiny models lean the other way; MaskDiT's step-time gain vanishes at
batch 16), so the answer is a function, not a number. One cell is (model, batch size, horizon): the
horizon is an eval point of a single-phase arm, a valid shorter run under the constant learning rate
(a two-phase arm's early points are not: its phase boundaries move with the budget).

Per seed (the two arms share initial weights, data order and evaluation noise), on FD and validation
loss alike (co-primary), the target is the baseline run's value at the horizon read off the monotone
fit of its curve, and
    ratio_s = FLOPs the masked run needs to reach it / FLOPs the baseline run needs to reach it,
both read off the runs' monotone fits (`targets.seed_ratio`). ratio < 1: masking reaches the same quality
with less compute. A ratio is only bounded when the masked run is there at its first point (<=) or never
(>); the cell then says so instead of pretending to a value. The cell's ratio is the geometric mean over
seeds with a Student-t interval on log ratio (ratios multiply, so their logs are what averages).

As in the summary (`summary.paired_by_condition`, `multiplicity.correct`): a seed whose two runs differ in a
condition (device, precision, draw scheme) is left out of its cells, and a note says so; where the baseline's
fit pools two horizons on every seed (its curve went back up), the later one's targets and ratios are the
earlier one's (`Reading.repeats`), one test counted once in the correction.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from maskbench.metrics import CO_PRIMARY, compared_metrics, get_metric
from maskbench.results.estimators import (
    Difference,
    Ratio,
    agreement,
    paired_difference,
    ratio_summary,
    ratio_verdict,
    sampling_ses,
)
from maskbench.results.multiplicity import EXPLORATORY, Family, adjust, corrected_difference
from maskbench.results.rows import Row
from maskbench.results.summary import SIZE_TOLERANCE, paired_by_condition, source_family
from maskbench.results.tables import WIDTH, compact_table, layout, wrap_lines
from maskbench.results.targets import horizon_target, seed_ratio

if TYPE_CHECKING:  # matplotlib loads only when a map is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Reading:
    """One metric's reading of a cell, pooled over the seeds both arms ran."""

    ratio: Ratio                   # per-seed FLOPs ratios (or their bounds): geometric mean, log t-interval, p
    difference: Difference | None  # masked − baseline at the horizon, paired by seed, with its verdict
                                   # (None when the masked arm has no eval point at that horizon)
    repeats: float | None = None   # the earlier horizon whose per-seed targets (so ratio) these are, if any
    targets: tuple[float, ...] = ()  # the per-seed targets


@dataclass(frozen=True)
class Cell:
    """One (model, batch size, horizon) cell of the map."""

    model: str
    params: int
    batch_size: int
    point: float                  # horizon as a fraction of the budget
    horizon_flops: float          # the baseline's mean train FLOPs at that point
    n: int                        # seeds with both arms, run under the same conditions
    readings: dict[str, Reading]  # by metric: FD and val loss (and a plan's primary metrics), where measured
    group: tuple = ()             # (dataset, model, batch size, budget, start): the runs the cell reads
    notes: tuple[str, ...] = ()   # seeds left out because their runs' conditions differ


def crossover_cells(rows: Sequence[Row], arm: str = "mask75", baseline: str = "mask0",
                    metrics: Sequence[str] = CO_PRIMARY, level: float = 0.95,
                    size_tolerance: float | None = SIZE_TOLERANCE) -> list[Cell]:
    """Every (model, batch size, baseline eval point) cell with at least one seed run by both arms, read on
    each of `metrics` the rows measure, intervals at `level`."""
    unknown = [metric for metric in metrics if metric not in compared_metrics()]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {', '.join(compared_metrics())}")
    runs: dict[tuple, dict[str, dict[int, list[Row]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    latest = {(row["run_id"], row["point"]): row for row in rows if not row["source"]}
    for row in latest.values():
        if row["arm"] in (arm, baseline):
            key = (row["dataset"], row["model"], row["batch_size"], row["budget_flops"], source_family(row))
            runs[key][row["arm"]][row["seed"]].append(row)
    cells = []
    for key in sorted(runs, key=lambda k: (k[0], _first(runs[k])["params"], *k[1:])):
        by_arm = runs[key]
        seeds = sorted(set(by_arm[arm]) & set(by_arm[baseline]))
        kept, _, warning = paired_by_condition([by_arm[arm][s][0] for s in seeds],
                                               [by_arm[baseline][s][0] for s in seeds], baseline, size_tolerance)
        seeds = sorted(row["seed"] for row in kept)
        notes = (f"{key[1]} b{key[2]}: {arm}: {warning}",) if warning else ()
        if seeds:
            cells.extend(replace(cell, group=key, notes=notes)
                         for cell in _cells(by_arm[baseline], by_arm[arm], seeds, metrics, level))
    return cells


def _first(by_arm: dict[str, dict[int, list[Row]]]) -> Row:
    return next(iter(next(iter(by_arm.values())).values()))[0]


def _cells(base: dict[int, list[Row]], masked: dict[int, list[Row]], seeds: list[int], metrics: Sequence[str],
           level: float) -> list[Cell]:
    """The cells of one (model, batch, budget) pair of runs: one per baseline eval point all seeds have."""
    points = sorted(set.intersection(*({r["point"] for r in base[s]} for s in seeds)))
    first = base[seeds[0]][0]
    cells, earlier = [], {}  # per metric, the last horizon read and its reading (a repeat is read against it)
    for point in points:
        flops = [next(r["train_flops"] for r in base[s] if r["point"] == point) for s in seeds]
        readings = {metric: _reading(base, masked, seeds, metric, point, level, earlier.get(metric))
                    for metric in metrics}
        readings = {metric: r for metric, r in readings.items() if r is not None}
        earlier.update({metric: (point, r) for metric, r in readings.items()})
        cells.append(Cell(model=first["model"], params=first["params"], batch_size=first["batch_size"],
                          point=point, horizon_flops=float(np.mean(flops)), n=len(seeds), readings=readings))
    return cells


def _reading(base: dict[int, list[Row]], masked: dict[int, list[Row]], seeds: list[int], metric: str,
             point: float, level: float, earlier: tuple[float, Reading] | None = None) -> Reading | None:
    """One metric at one horizon: per-seed ratios and the paired difference there; None where a seed's
    baseline has no value of the metric at the horizon. Where every seed's target is the `earlier` reading's
    (the previous horizon's: the baseline's fit pooled the two), the ratio is that one's and `repeats` names
    the horizon it was first read at."""
    at = [next(r for r in base[s] if r["point"] == point) for s in seeds]
    if any(r[metric] is None for r in at):
        return None
    targets = tuple(horizon_target(base[s], metric, point) for s in seeds)
    if earlier is not None and earlier[1].targets == targets:
        before, reading = earlier
        ratio, repeats = reading.ratio, before if reading.repeats is None else reading.repeats
    else:
        readings = [seed_ratio(masked[s], base[s], metric, "train_flops", target) for s, target in zip(seeds, targets)]
        ratio, repeats = ratio_summary([r for r, _ in readings], level, [bound for _, bound in readings]), None
    if ratio is None:
        return None
    same = [next((r for r in masked[s] if r["point"] == point and r[metric] is not None), None) for s in seeds]
    difference = None if None in same else paired_difference(
        [r[metric] for r in same], [r[metric] for r in at], get_metric(metric).lower_is_better, level,
        arm_se=sampling_ses(same, metric), base_se=sampling_ses(at, metric))
    return Reading(ratio, difference, repeats, targets)


def correct_cells(cells: Sequence[Cell], family: Family) -> tuple[list[Cell], int]:
    """The cells with the p-values of the family's tests adjusted together (`multiplicity.adjust`), each
    difference's verdict re-read at the corrected p, and the number of tests in the family: per cell and
    planned metric, the FLOPs ratio (when FLOPs is the plan's compute axis) and the paired difference. A
    ratio that repeats an earlier horizon's (`Reading.repeats`) is that test, counted once: it takes the
    corrected p of the horizon it repeats."""
    def planned_ps(metric: str, reading: Reading) -> list[float]:
        tested = family.planned(metric, "train_flops") and reading.repeats is None
        return [reading.ratio.p if tested else math.nan, reading.difference.p if reading.difference else math.nan]

    pvalues = [p for cell in cells for metric, reading in cell.readings.items() if family.planned(metric)
               for p in planned_ps(metric, reading)]
    adjusted = iter(adjust(pvalues, family))
    out, corrected = [], {}  # corrected: (group, metric, horizon) -> the ratio's corrected p
    for cell in cells:
        readings = {}
        for metric, reading in cell.readings.items():
            if family.planned(metric):
                ratio_p, difference_p = float(next(adjusted)), next(adjusted)
                if reading.repeats is not None:
                    ratio_p = corrected.get((cell.group, metric, reading.repeats), ratio_p)
                corrected[cell.group, metric, cell.point] = ratio_p
                reading = replace(
                    reading,
                    ratio=replace(reading.ratio, p_adj=ratio_p) if family.planned(metric, "train_flops") else reading.ratio,
                    difference=reading.difference and corrected_difference(reading.difference, difference_p, family))
            readings[metric] = reading
        out.append(replace(cell, readings=readings))
    return out, int(np.sum(~np.isnan(np.asarray(pvalues, dtype=float))))


def cell_verdicts(cell: Cell, alpha: float) -> dict[str, str]:
    """Per metric, what the cell's FLOPs ratio allows one to say (`estimators.ratio_verdict`)."""
    return {metric: ratio_verdict(reading.ratio, alpha) for metric, reading in cell.readings.items()}


def _agreement(cell: Cell, alpha: float) -> str:
    """"disagree (ratio)", "(Δ)" or "(ratio, Δ)" where the metrics' ratio or difference verdicts point
    different ways; otherwise `estimators.agreement` of the ratios."""
    ratios = list(cell_verdicts(cell, alpha).values())
    differences = [r.difference.verdict for r in cell.readings.values() if r.difference]
    split = [name for name, verdicts in (("ratio", ratios), ("Δ", differences)) if agreement(verdicts) == "disagree"]
    return f"disagree ({', '.join(split)})" if split else agreement(ratios)


CROSSOVER_NOTE = (
    "FLOPs ratio: per seed, the FLOPs the masked run needs to reach the baseline's value at the horizon (read "
    "off the monotone fit of its curve) over the FLOPs the baseline needs, on the runs' monotone fits; geometric "
    "mean over seeds, {pct} t-interval of the log ratios; <= an upper bound (a masked run was there at its first "
    "point), > a lower bound (a masked run never got there), neither tested. p adj: its p after the plan's "
    "correction ({method}). ratio verdict: pays when the ratio is below 1 with p adj < {alpha:g}, does not pay "
    "when above 1 likewise, undecided otherwise; a bound gets no verdict, only what it is: 'not reached (k/n)' "
    "(k of n seeds' masked runs never got there) or 'reached at first point'. (= h): the baseline's fit pooled "
    "this horizon with horizon h on every seed, so its targets and ratio are h's, one test counted once. A seed "
    "whose two runs differ in device, precision or draw scheme is left out of its cells (a line above says "
    "which). Δ: masked − baseline at the "
    "horizon, paired t-interval. pays: the ratio pays on every one of {pays_on}, does not pay when it does not "
    "on one of them, undecided otherwise. metrics: whether the metrics' verdicts point the same way. In pays "
    "and metrics a bound counts as undecided.")


def render_cells(cells: Sequence[Cell], family: Family = EXPLORATORY, compact: bool = False) -> str:
    """The map as a markdown table, one line per cell: per compared metric (FD and val loss side by side,
    and a plan's primary metrics) the FLOPs ratio with its verdict and the paired difference with its, then
    the plan's "pays", whether the metrics agree, and whether the reading is confirmatory; then a note.
    `compact`: text within `tables.WIDTH` columns instead, one table per (model, batch) under its heading, with
    the columns a verdict is read from (horizon, n, per metric the ratio, p adj and its verdict, then pays and
    metrics); the differences are the markdown's (`--details`)."""
    metrics = family.compared()
    pct = f"{100 * (1 - family.alpha):g}%"
    per_metric = (f"FLOPs ratio ({pct} CI)", "p adj", "ratio verdict", f"Δ ({pct} CI)", "verdict")
    header = ["model", "params", "batch", "horizon", "FLOPs", "n",
              *(f"{get_metric(m).label} {column}" for m in metrics for column in per_metric), "pays", "metrics", "reading"]
    rows = []
    for c in cells:
        verdicts = cell_verdicts(c, family.alpha)
        cells_of_metrics = [x for m in metrics for x in _metric_cells(c.readings.get(m), family.alpha)]
        reading = sorted({family.reading(m, "train_flops") for m in c.readings})
        rows.append([c.model, str(c.params), str(c.batch_size), f"{c.point:g}", f"{c.horizon_flops:.3g}", str(c.n),
                     *cells_of_metrics, family.pays(verdicts), _agreement(c, family.alpha), ", ".join(reading)])
    pays_on = " and ".join(get_metric(m).label for m in (family.metrics or CO_PRIMARY))
    notes = [*dict.fromkeys(note for c in cells for note in c.notes),
             CROSSOVER_NOTE.format(pct=pct, method=family.method, alpha=family.alpha, pays_on=pays_on)]
    if not compact:
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines + ["", *notes[:-1], *([""] if notes[:-1] else []), notes[-1]])
    keep = ["horizon", "n", *(f"{get_metric(m).label} {column}" for m in metrics for column in per_metric[:3]),
            "pays", "metrics", "reading"]
    groups: dict[tuple[str, ...], list[list[str]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[:3]), []).append(row)
    tables = [compact_table(f"{model} ({params} params) / batch {batch}", header, group, keep, lift=("n", "reading"))
              for (model, params, batch), group in groups.items()]
    return "\n".join(layout(tables, "table", WIDTH) + wrap_lines(notes, WIDTH))


def _metric_cells(reading: Reading | None, alpha: float) -> list[str]:
    """One metric's five cells of a map line (empty where the rows do not measure it)."""
    if reading is None:
        return [""] * 5
    r, d = reading.ratio, reading.difference
    ci = "" if math.isnan(r.lo) else f" ({r.lo:.2f}–{r.hi:.2f})"
    p_adj = "" if math.isnan(r.p_adj) else f"{r.p_adj:.2g}"
    diff = "" if d is None else f"{d.mean:.4g}" + ("" if math.isnan(d.lo) else f" [{d.lo:.3g}, {d.hi:.3g}]")
    repeats = "" if reading.repeats is None else f" (= {reading.repeats:g})"
    return [f"{r.bound}{r.geomean:.2f}{ci}{repeats}", p_adj, ratio_verdict(r, alpha), diff,
            "" if d is None else d.verdict]


BOUND_MARKERS = {"": "o", ">": "^", "<=": "v"}  # a value; a lower bound (at least); an upper bound (at most)


def crossover_figure(cells: Sequence[Cell], title: str = "") -> Figure:
    """The map as a figure, one row of panels per metric the cells read (FD and val loss, and a plan's
    primary metrics): a heatmap of log2 ratio (rows model × batch, columns horizon) and the ratio against
    the baseline's FLOPs at the horizon.

    A bound is not a value, so it is not drawn as one: its heatmap cell is hatched and left uncoloured,
    labelled ">r, k/n not reached" or "<=r at first point", and its curve point is a hollow triangle
    pointing the way the truth may lie, off the line that joins the values. One colour scale, symmetric
    about ratio 1, serves every panel, so the metrics compare by eye."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on clusters or CI
    import matplotlib.pyplot as plt

    shown = list(dict.fromkeys(metric for c in cells for metric in c.readings))
    if not shown:
        raise ValueError("no crossover cells: both arms need runs with the same seeds")
    rows = sorted({(c.params, c.model, c.batch_size) for c in cells})
    limit = max([1.0, *(abs(math.log2(r.ratio.geomean)) for c in cells for r in c.readings.values())])
    fig, axes = plt.subplots(len(shown), 2, figsize=(14, len(shown) * (1.8 + 0.55 * len(rows))),
                             width_ratios=(1.15, 1), squeeze=False, layout="constrained")
    for metric, (heat, curves) in zip(shown, axes):
        _heatmap(heat, cells, metric, rows, limit)
        _curves(curves, cells, metric, rows, limit)
    axes[0, 1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5), title="model, batch")
    axes[-1, 1].legend(handles=_bound_key(), fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5),
                       title="per cell")
    fig.suptitle(title or "crossover map: masking's compute-to-target ratio")
    return fig


def plot_crossover(cells: Sequence[Cell], out_path: str | os.PathLike, title: str = "") -> Path:
    """Write `crossover_figure` as a PNG; return its path."""
    import matplotlib.pyplot as plt

    fig = crossover_figure(cells, title)
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _heatmap(ax: Axes, cells: Sequence[Cell], metric: str, rows: list[tuple], limit: float) -> None:
    """Log2 ratio per (model × batch, horizon) on one metric, with its colour bar; bounds hatched."""
    from matplotlib.patches import Rectangle

    points = sorted({c.point for c in cells})
    grid = np.full((len(rows), len(points)), np.nan)  # (rows, horizons) log2 ratio; NaN: a bound or no reading
    for c in cells:
        if metric not in c.readings:
            continue
        ratio = c.readings[metric].ratio
        i, j = rows.index((c.params, c.model, c.batch_size)), points.index(c.point)
        if ratio.bound:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="0.75", lw=0))
        else:
            grid[i, j] = math.log2(ratio.geomean)
        dark = abs(grid[i, j]) > 0.55 * limit  # NaN compares False: bounds sit on white
        ax.text(j, i, _cell_label(ratio), ha="center", va="center", fontsize=8, color="white" if dark else "black")
    image = ax.imshow(grid, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(len(points)), [f"{p:g}" for p in points])
    ax.set_yticks(range(len(rows)), [f"{m} b{b}" for _, m, b in rows])
    ax.set(xlabel="horizon (fraction of the budget)",
           title=f"{get_metric(metric).label}: FLOPs to reach the baseline's {get_metric(metric).label}, masked / baseline")
    ax.figure.colorbar(image, ax=ax, label="log2 ratio (< 0: masking pays)")


def _cell_label(ratio: Ratio) -> str:
    """A heatmap cell's text: the ratio, and for a bound what kind it is."""
    if ratio.bound == ">":
        return f">{ratio.geomean:.2f}\n{ratio.not_reached}/{ratio.n} not reached"
    if ratio.bound == "<=":
        return f"<={ratio.geomean:.2f}\nat first point"
    return f"{ratio.geomean:.2f}"


def _curves(ax: Axes, cells: Sequence[Cell], metric: str, rows: list[tuple], limit: float) -> None:
    """Per model × batch, the ratio against the baseline's FLOPs at the horizon: values joined by a line,
    bounds as hollow triangles off it."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    for i, (params, model, batch) in enumerate(rows):
        color = f"C{i % 10}"  # a row keeps its colour on every metric
        line = sorted((c for c in cells if (c.params, c.model, c.batch_size) == (params, model, batch)
                       and metric in c.readings), key=lambda c: c.horizon_flops)
        xs = [c.horizon_flops for c in line]
        ratios = [c.readings[metric].ratio for c in line]
        ax.plot(xs, [math.nan if r.bound else r.geomean for r in ratios], marker="o", color=color,
                label=f"{model} b{batch}")
        for bound in (">", "<="):
            at = [(x, r.geomean) for x, r in zip(xs, ratios) if r.bound == bound]
            if at:
                ax.scatter(*zip(*at), marker=BOUND_MARKERS[bound], facecolors="none", edgecolors=color, s=45)
    ax.axhline(1.0, color="k", lw=0.8)
    margin = 2 ** (1.1 * limit)
    ax.set(xscale="log", yscale="log", ylim=(1 / margin, margin), xlabel="baseline train FLOPs at the horizon",
           ylabel="FLOPs ratio", title=f"{get_metric(metric).label}: ratio against compute (< 1: masking pays)")
    ax.yaxis.set_major_locator(LogLocator(base=2))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    horizons = [np.mean([c.horizon_flops for c in cells if c.point == p]) for p in sorted({c.point for c in cells})]
    ax.set_xticks(horizons, [f"{x:.3g}" for x in horizons])  # one tick per heatmap column
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3, which="major")


def _bound_key() -> list:
    """Legend handles for what a marker on the curves means."""
    from matplotlib.lines import Line2D

    meaning = {"": "estimate (geometric mean)", ">": "lower bound: not reached", "<=": "upper bound: at first point"}
    return [Line2D([], [], ls="", marker=BOUND_MARKERS[b], markerfacecolor="k" if not b else "none",
                   markeredgecolor="k", color="k", label=f"{b} {text}".strip()) for b, text in meaning.items()]
