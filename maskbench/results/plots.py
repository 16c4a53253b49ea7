"""Leaderboard plots: a metric's curve against GPU-hours and against training FLOPs, one line per arm.

Both axes are drawn because they can disagree: a masked step does less arithmetic but not
proportionally less time (norms, gathers, the optimiser), so an arm can win at equal FLOPs and
lose at equal wall-clock. The error bar is each point's confidence interval over seeds (for one seed,
from the row's own sampling error: `summary.Summary.eval_only`). `plot_leaderboard` draws FD for
`maskbench leaderboard --plot`; `group_curves` draws every measured metric per group for a study page.
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure
from matplotlib.ticker import NullFormatter

from maskbench.metrics import compared_metrics, get_metric
from maskbench.results.leaderboard import Row
from maskbench.results.summary import Summary, summarize


def plot_leaderboard(summary_or_rows: Sequence[Summary] | Sequence[Row],
                     out_path: str | os.PathLike) -> Path:
    """Write a PNG of FID vs GPU-hours and FID vs train FLOPs (log x) per group; return its path.

    Accepts `summarize` output or raw leaderboard rows (summarised with the defaults). Each
    (dataset, model, budget) group is one row of two panels, one line per arm. Reference rows are
    left out: their FIDs are on other data, other feature spaces and mostly lack FLOPs.
    """
    is_rows = bool(summary_or_rows) and isinstance(summary_or_rows[0], dict)
    summary = summarize(summary_or_rows) if is_rows else summary_or_rows
    groups = _groups(summary, ("fid",))
    if not groups:
        raise ValueError("nothing to plot: no measured leaderboard row has an FID")
    colors = _colors(groups)
    fig = plt.figure(figsize=(11, 4.2 * len(groups)), layout="constrained")
    subfigs = fig.subfigures(len(groups), 1, squeeze=False)[:, 0]
    for subfig, (group, records) in zip(subfigs, groups.items()):
        _plot_group(subfig, group, records, colors, ("fid",))
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def group_curves(summary: Sequence[Summary], metrics: Sequence[str] | None = None, level: float = 0.95,
                 dpi: int = 80) -> dict[tuple, bytes]:
    """One PNG per (dataset, model, batch size, budget, source) group: a row of two panels (GPU-hours, FLOPs)
    per metric of `metrics` (default: the registry's compared metrics) the group measures, one line per arm
    with its `level` CI as error bars."""
    metrics = compared_metrics() if metrics is None else metrics
    groups = _groups(summary, metrics)
    colors = _colors(groups)
    pngs = {}
    for group, records in groups.items():
        drawn = [m for m in metrics if any(r.metrics[m] is not None for r in records)]
        fig = plt.figure(figsize=(11, 0.6 + 3.2 * len(drawn)), layout="constrained")
        _plot_group(fig, group, records, colors, drawn, level)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=dpi)
        plt.close(fig)
        pngs[group] = buffer.getvalue()
    return pngs


def _colors(groups: dict[tuple, list[Summary]]) -> dict[str, str]:
    """An arm keeps its colour in every group."""
    arms = sorted({record.arm for records in groups.values() for record in records})
    return {arm: f"C{i % 10}" for i, arm in enumerate(arms)}


def _plot_group(fig: Figure | SubFigure, group: tuple, records: list[Summary], colors: dict[str, str],
                metrics: Sequence[str], level: float = 0.95) -> None:
    """The panels of one (dataset, model, batch size, budget, source) group: per metric, against GPU-hours
    and against FLOPs, one line per arm."""
    dataset, model, batch, budget, started_from = group
    start = f" from {started_from}" if started_from else ""
    fig.suptitle(f"{dataset} / {model}{start} / batch {batch} / budget {budget:.3g} FLOPs "
                 f"(mean, {100 * level:g}% CI over seeds)")
    arms: dict[str, list[Summary]] = defaultdict(list)
    for record in records:
        arms[record.arm].append(record)
    for (ax_hours, ax_flops), metric in zip(fig.subplots(len(metrics), 2, squeeze=False), metrics):
        for arm, curve in arms.items():
            _draw(ax_hours, curve, metric, "gpu_hours", arm, colors[arm])
            _draw(ax_flops, curve, metric, "train_flops", arm, colors[arm])
        ylabel = _ylabel(metric, records[0].fid_features)
        for ax, xlabel in ((ax_hours, "GPU-hours"), (ax_flops, "training FLOPs (fwd+bwd)")):
            ax.set(xlabel=xlabel, ylabel=ylabel, yscale="log" if get_metric(metric).log_axis else "linear")
            ax.grid(alpha=0.3)
        ax_flops.set_xscale("log")
        ax_flops.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap within a decade
        handles = {label: handle for ax in (ax_hours, ax_flops)
                   for handle, label in zip(*ax.get_legend_handles_labels())}
        ax_flops.legend(handles.values(), handles.keys(), fontsize="small")


def _ylabel(metric: str, fid_features: str) -> str:
    """FD is Inception FID only in Inception's features (on synth it is the oracle's Fréchet distance)."""
    if metric != "fid":
        return get_metric(metric).label
    from maskbench.eval.fid import INCEPTION_FEATURES_NAME  # torch: only when a plot is drawn

    return "FID (Inception)" if fid_features == INCEPTION_FEATURES_NAME else f"Fréchet distance ({fid_features or '?'})"


def _groups(summary: Sequence[Summary], metrics: Sequence[str]) -> dict[tuple, list[Summary]]:
    """Measured records with a value of any of `metrics`, by (dataset, model, batch size, budget, source)
    group, in summary order."""
    groups: dict[tuple, list[Summary]] = defaultdict(list)
    for r in summary:
        if not r.is_reference and any(r.metrics[m] is not None for m in metrics):
            groups[r.group].append(r)
    return groups


def _draw(ax: Axes, records: list[Summary], metric: str, x_field: str, label: str, color: str) -> None:
    """One arm's mean curve of `metric` against x_field, with its CI as error bars where there is one."""
    points = sorted((getattr(r, x_field), *r.metrics[metric])  # (x, mean, half-width; NaN: no interval)
                    for r in records if getattr(r, x_field) is not None and r.metrics[metric] is not None)
    if not points:
        return
    xs, means, halves = zip(*points)
    ax.errorbar(xs, means, yerr=halves, marker="o", markersize=4, capsize=3, color=color, label=label)
