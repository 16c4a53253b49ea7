"""Leaderboard plots: a metric's curve against GPU-hours and against training FLOPs, one line per arm.

Both axes are drawn because they can disagree: a masked step does less arithmetic but not
proportionally less time (norms, gathers, the optimiser), so an arm can win at equal FLOPs and
lose at equal wall-clock. The error bar is each point's confidence interval over seeds (for one seed,
from the row's own sampling error: `summary.Summary.eval_only`). `plot_leaderboard` draws FD for
`maskbench leaderboard --plot`, and `plot_fits` the compute curves' fits beside it (val loss and FD against
FLOPs); `group_curves` draws every measured metric per group for a study page.
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
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure
from matplotlib.ticker import NullFormatter

from maskbench.metrics import compared_metrics, get_metric
from maskbench.results.rows import Row
from maskbench.results.scaling import GroupFit
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


def plot_fits(fits: Sequence[GroupFit], summary: Sequence[Summary], png: str | os.PathLike) -> Path:
    """Write the compute curves beside `png` (its name with `_fits`) and return the path: per group a row of two
    panels, val loss and FD against FLOPs (log-log), each arm's means with their intervals over seeds and its
    fitted curve (the mean over seeds of the per-seed fits), solid up to B and dashed on to k·B, where the
    crossover is looked for (not for an arm whose held-out prediction failed)."""
    by_group: dict[tuple, dict[str, GroupFit]] = defaultdict(dict)
    for fit in fits:
        by_group[fit.group][fit.metric] = fit
    records = _groups(summary, [fit.metric for fit in fits])
    colors = _colors(records)
    fig = plt.figure(figsize=(11, 4.2 * len(by_group)), layout="constrained")
    for subfig, (group, found) in zip(fig.subfigures(len(by_group), 1, squeeze=False)[:, 0], by_group.items()):
        subfig.suptitle(f"{_group_title(group)}: fitted L(C) = E + A·(C/B)^−α, dashed past B")
        for ax, metric in zip(subfig.subplots(1, 2, squeeze=False)[0], ("val_loss", "fid")):
            if metric in found:
                _draw_fit(ax, found[metric], records[group], colors)
            ax.set(xlabel="training FLOPs (fwd+bwd)", ylabel=_ylabel(metric, records[group][0].fid_features),
                   xscale="log", yscale="log")
            ax.grid(alpha=0.3)
    path = Path(png)
    path = path.with_name(f"{path.stem}_fits{path.suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_fit(ax: Axes, fit: GroupFit, records: list[Summary], colors: dict[str, str]) -> None:
    """A group's measured means of one metric and each arm's fitted curve, on one panel; not past B for an arm
    whose held-out prediction failed."""
    for arm in fit.arms:
        _draw(ax, [r for r in records if r.arm == arm.arm], fit.metric, "train_flops", arm.arm, colors[arm.arm],
              joined=False)
        beyond = () if fit.failed(arm.arm) else ((fit.budget, fit.within * fit.budget, "--"),)
        for lo, hi, style in ((fit.horizons[0], fit.budget, "-"), *beyond):
            flops = np.geomspace(lo, hi, 64)
            ax.plot(flops, fit.curve(arm.arm, flops), style, color=colors[arm.arm], linewidth=1)
    ax.legend(fontsize="small")


def _group_title(group: tuple) -> str:
    """A (dataset, model, batch size, budget, source) group as a figure title."""
    dataset, model, batch, budget, started_from = group
    start = f" from {started_from}" if started_from else ""
    return f"{dataset} / {model}{start} / batch {batch} / budget {budget:.3g} FLOPs"


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
    fig.suptitle(f"{_group_title(group)} (mean, {100 * level:g}% CI over seeds)")
    arms: dict[str, list[Summary]] = defaultdict(list)
    for record in records:
        arms[record.arm].append(record)
    for (ax_hours, ax_flops), metric in zip(fig.subplots(len(metrics), 2, squeeze=False), metrics):
        for arm, curve in arms.items():
            _draw(ax_hours, curve, metric, "gpu_hours", arm, colors[arm])
            _draw(ax_flops, curve, metric, "train_flops", arm, colors[arm])
        ylabel = _ylabel(metric, records[0].fid_features)
        for ax, xlabel in ((ax_hours, "device-hours (the rows' device column)"), (ax_flops, "training FLOPs (fwd+bwd)")):
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


def _draw(ax: Axes, records: list[Summary], metric: str, x_field: str, label: str, color: str,
          joined: bool = True) -> None:
    """One arm's mean curve of `metric` against x_field, with its CI as error bars where there is one; its
    points not joined where a fitted line is drawn through them."""
    points = sorted((getattr(r, x_field), *r.metrics[metric])  # (x, mean, half-width; NaN: no interval)
                    for r in records if getattr(r, x_field) is not None and r.metrics[metric] is not None)
    if not points:
        return
    xs, means, halves = zip(*points)
    ax.errorbar(xs, means, yerr=halves, marker="o", markersize=4, capsize=3, color=color, label=label,
                linestyle="-" if joined else "none")
