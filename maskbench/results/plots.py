"""Leaderboard plots: FID against GPU-hours and against training FLOPs, one line per arm.

Both axes are drawn because they can disagree: a masked step does less arithmetic but not
proportionally less time (norms, gathers, the optimiser), so an arm can win at equal FLOPs and
lose at equal wall-clock. The band is each point's 95% confidence interval over seeds.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import SubFigure
from matplotlib.ticker import NullFormatter

from maskbench.results.leaderboard import Row
from maskbench.results.stats import Summary, summarize


def plot_leaderboard(summary_or_rows: Sequence[Summary] | Sequence[Row],
                     out_path: str | os.PathLike) -> Path:
    """Write a PNG of FID vs GPU-hours and FID vs train FLOPs (log x) per group; return its path.

    Accepts `summarize` output or raw leaderboard rows (summarised with the defaults). Each
    (dataset, model, budget) group is one row of two panels, one line per arm. Reference rows are
    left out: their FIDs are on other data, other feature spaces and mostly lack FLOPs.
    """
    is_rows = bool(summary_or_rows) and isinstance(summary_or_rows[0], dict)
    summary = summarize(summary_or_rows) if is_rows else summary_or_rows
    groups = _groups(summary)
    if not groups:
        raise ValueError("nothing to plot: no measured leaderboard row has an FID")
    arms = sorted({record.arm for records in groups.values() for record in records})
    colors = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}  # an arm keeps its colour in every group
    fig = plt.figure(figsize=(11, 4.2 * len(groups)), layout="constrained")
    subfigs = fig.subfigures(len(groups), 1, squeeze=False)[:, 0]
    for subfig, (group, records) in zip(subfigs, groups.items()):
        _plot_group(subfig, group, records, colors)
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_group(subfig: SubFigure, group: tuple, records: list[Summary], colors: dict[str, str]) -> None:
    """The two panels of one (dataset, model, batch size, budget, source) group, one line per arm."""
    dataset, model, batch, budget, started_from = group
    start = f" from {started_from}" if started_from else ""
    subfig.suptitle(f"{dataset} / {model}{start} / batch {batch} / budget {budget:.3g} FLOPs (mean, 95% CI over seeds)")
    ax_hours, ax_flops = subfig.subplots(1, 2)
    arms: dict[str, list[Summary]] = defaultdict(list)
    for record in records:
        arms[record.arm].append(record)
    for arm, curve in arms.items():
        _draw(ax_hours, curve, "gpu_hours", arm, colors[arm])
        _draw(ax_flops, curve, "train_flops", arm, colors[arm])
    from maskbench.eval.fid import INCEPTION_FEATURES_NAME  # torch: only when a plot is drawn

    features = records[0].fid_features
    ylabel = "FID (Inception)" if features == INCEPTION_FEATURES_NAME else f"Fréchet distance ({features or '?'})"
    for ax, xlabel in ((ax_hours, "GPU-hours"), (ax_flops, "training FLOPs (fwd+bwd)")):
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
    ax_flops.set_xscale("log")
    ax_flops.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap within a decade
    handles = {label: handle for ax in (ax_hours, ax_flops)
               for handle, label in zip(*ax.get_legend_handles_labels())}
    ax_flops.legend(handles.values(), handles.keys(), fontsize="small")


def _groups(summary: Sequence[Summary]) -> dict[tuple, list[Summary]]:
    """Measured records with an FID, by (dataset, model, batch size, budget, source) group, in summary order."""
    groups: dict[tuple, list[Summary]] = defaultdict(list)
    for r in summary:
        if not r.is_reference and r.metrics["fid"] is not None:
            groups[r.dataset, r.model, r.batch_size, r.budget_flops, r.started_from].append(r)
    return groups


def _draw(ax: Axes, records: list[Summary], x_field: str, label: str, color: str) -> None:
    """One arm's mean FID line against x_field, with its CI band where seeds give one."""
    points = sorted((getattr(r, x_field), *r.metrics["fid"])  # (x, mean, half-width)
                    for r in records if getattr(r, x_field) is not None)
    if not points:
        return
    xs, means, halves = zip(*points)
    ax.plot(xs, means, marker="o", color=color, label=label)
    if any(not math.isnan(h) for h in halves):
        lower = [m - h for m, h in zip(means, halves)]
        upper = [m + h for m, h in zip(means, halves)]
        ax.fill_between(xs, lower, upper, color=color, alpha=0.2, linewidth=0)
