"""Leaderboard statistics: confidence intervals, compute-to-target, Welch's test, summary tables.

The question maskbench answers is comparative (does an arm beat the unmasked baseline at equal
compute?), so every figure carries its uncertainty: means over seeds with Student-t intervals, a
two-sample test against the baseline, and the compute at which an arm matches the baseline's
final quality. `debiased_cosine` serves the gradient-fidelity probe (`maskbench probe gradfid`).
Lower is better for FID (and for the oracle Fréchet distance stored in `fid` on
synth, labelled by `fid_features`) and for val_loss; higher is better for CLIP score and alignment.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

from maskbench.results.leaderboard import Row

METRICS = ("fid", "clip_score", "val_loss", "align_acc")
LOWER_IS_BETTER = {"fid": True, "val_loss": True, "clip_score": False, "align_acc": False}
FORMATS = ("table", "markdown", "csv")

Estimate = tuple[float, float]  # (mean, confidence-interval half-width; NaN for one value)


def mean_ci(values: Sequence[float], level: float = 0.95) -> Estimate:
    """Mean and half-width of its two-sided Student-t confidence interval.

    half-width = t_{(1+level)/2, n-1} · s / √n, with s the sample standard deviation (ddof=1).
    With three seeds the t quantile (4.30 at 95%) is more than twice the normal 1.96: the honest
    width for so few runs. One value has no spread estimate, so its half-width is NaN.
    """
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("mean_ci needs at least one value")
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    if x.size == 1:
        return float(x[0]), math.nan
    quantile = scipy.stats.t.ppf((1 + level) / 2, df=x.size - 1)
    return float(x.mean()), float(quantile * scipy.stats.sem(x))


def compute_to_target(points: Sequence[tuple[float, float]], target: float,
                      higher_is_better: bool = False) -> float | None:
    """Compute (x) at which a curve of eval points first reaches a target value, or None.

    The curve joins the (x, value) points, sorted by x, with straight lines. If the first point
    already reaches the target (value <= target) its x is returned: nothing is known before it.
    Otherwise, for the first segment (x0, y0) -> (x1, y1) with y0 > target >= y1,
        x = x0 + (y0 - target) / (y0 - y1) · (x1 - x0).
    None means the target is not reached within the points. With higher_is_better the
    inequalities flip (CLIP score, alignment). On the leaderboard x is the arm's train_flops over
    the baseline's budget (or its GPU-hours over the baseline's final GPU-hours).
    """
    sign = -1.0 if higher_is_better else 1.0
    previous: tuple[float, float] | None = None
    for x, value in sorted(points):
        gap = sign * (value - target)  # > 0: not there yet
        if gap <= 0:
            if previous is None:
                return float(x)
            x0, gap0 = previous
            return float(x0 + gap0 / (gap0 - gap) * (x - x0))
        previous = (x, gap)
    return None


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """Two-sided Welch's t-test of mean(a) = mean(b): (t, p), or None with fewer than 2 values.

    t = (ā - b̄) / √(s_a²/n_a + s_b²/n_b), unequal variances, with Welch–Satterthwaite degrees of
    freedom df = (s_a²/n_a + s_b²/n_b)² / ((s_a²/n_a)²/(n_a-1) + (s_b²/n_b)²/(n_b-1)).
    """
    if len(a) < 2 or len(b) < 2:
        return None
    result = scipy.stats.ttest_ind(a, b, equal_var=False)
    return float(result.statistic), float(result.pvalue)


@dataclass(frozen=True)
class CosineEstimate:
    """cos(E[a], E[b]) debiased, its jackknife interval, and the naive mean per-batch cosine beside it."""
    cosine: float   # NaN when either expected gradient is below the noise (estimated |E a|² <= 0)
    ci_lo: float
    ci_hi: float
    naive: float
    n: int
    loo: tuple[float, ...] = ()  # the n leave-one-batch-out estimates (for intervals of derived quantities)


def jackknife_se(loo: np.ndarray) -> float:
    """The jackknife standard error from n leave-one-out estimates: √((n−1)/n · Σ_k (θ_k − θ̄)²)."""
    n = len(loo)
    return math.sqrt((n - 1) / n * np.sum((loo - loo.mean()) ** 2))


def debiased_cosine(gram_aa: np.ndarray, gram_bb: np.ndarray, gram_ab: np.ndarray,
                    level: float = 0.95) -> CosineEstimate:
    """cos(E[a], E[b]) from n paired gradients (a_i, b_i), each pair computed on the same batch i.

    The question is whether the *expected* gradients point the same way. The cosine of per-batch
    gradients answers another one: with noise, a_i·b_i / (|a_i||b_i|) shrinks towards 0 because the
    noise inflates the norms (|a_i|² = |E a|² + noise). Products of DISTINCT, independent batches are
    unbiased: E[a_i·b_j] = E[a]·E[b] for i != j. So with the U-statistics
        <E a, E b> ≈ Σ_{i≠j} a_i·b_j / (n(n−1)),   |E a|² ≈ Σ_{i≠j} a_i·a_j / (n(n−1)),   same for b,
    cosine = ab / √(aa·bb), NaN when aa or bb <= 0 (the signal is below the noise). Inputs are the n×n
    Gram matrices G_aa[i, j] = a_i·a_j, G_bb[i, j] = b_i·b_j, G_ab[i, j] = a_i·b_j, so a caller keeps
    n² numbers instead of the gradients. The n(n−1) factors cancel in the ratio.

    Interval: leave-one-batch-out jackknife, exact from the Gram matrices (dropping batch k removes row
    and column k), with the normal quantile: cosine ± z·√((n−1)/n · Σ_k (θ_k − θ̄)²). A bootstrap would
    pair a batch with its own copy and bring the noise bias back. NaN bounds when a leave-one-out
    estimate is NaN. Needs n >= 3 (each leave-one-out estimate needs two distinct batches).
    """
    grams = [np.asarray(g, dtype=np.float64) for g in (gram_aa, gram_bb, gram_ab)]
    n = grams[0].shape[0]
    if any(g.shape != (n, n) for g in grams) or n < 3:
        raise ValueError(f"debiased_cosine needs three n×n Gram matrices with n >= 3, got shapes "
                         f"{[g.shape for g in grams]}")
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    diagonals = [np.diag(g) for g in grams]                                        # 3×n
    off = [g.sum() - d.sum() for g, d in zip(grams, diagonals)]                    # Σ_{i≠j}, 3 scalars
    # Dropping batch k removes its off-diagonal row and column: S − rowsum_k − colsum_k + 2·G_kk.
    loo = [s - g.sum(1) - g.sum(0) + 2 * d for s, g, d in zip(off, grams, diagonals)]  # 3×n
    cosine = _cosine(*off)
    jack = _cosine(*loo)                                                           # n
    half = scipy.stats.norm.ppf((1 + level) / 2) * jackknife_se(jack)
    naive = float(np.mean(diagonals[2] / np.sqrt(diagonals[0] * diagonals[1])))
    return CosineEstimate(float(cosine), float(cosine - half), float(cosine + half), naive, n, tuple(jack.tolist()))


def _cosine(aa: np.ndarray, bb: np.ndarray, ab: np.ndarray) -> np.ndarray:
    """ab / √(aa·bb) elementwise, NaN wherever aa or bb is not positive."""
    valid = (aa > 0) & (bb > 0)
    return np.where(valid, ab / np.sqrt(np.where(valid, aa * bb, 1.0)), math.nan)


@dataclass
class Summary:
    """One leaderboard line: an arm at one eval point of a (dataset, model, budget) group, or a
    published reference row (non-empty `source`), which is never pooled with measured runs.

    The comparison fields are set on each arm's final eval point only, and only when the group
    has the baseline arm: `target` is the baseline's final mean of `target_metric`;
    `flops_to_target` / `hours_to_target` are the fractions of the baseline's budget / final
    GPU-hours at which this arm's mean curve reaches it (None with a target: not reached).
    """

    dataset: str | None
    model: str | None
    budget_flops: float | None
    arm: str
    point: float | None
    n: int
    metrics: dict[str, Estimate | None]
    train_flops: float | None
    gpu_hours: float | None
    fid_features: str
    target_metric: str
    target: float | None = None
    flops_to_target: float | None = None
    hours_to_target: float | None = None
    welch_p: float | None = None
    source: str = ""
    notes: tuple[str, ...] = ()

    @property
    def is_reference(self) -> bool:
        return bool(self.source)


def summarize(rows: Sequence[Row], baseline_arm: str = "mask0", metric: str = "fid",
              level: float = 0.95) -> list[Summary]:
    """Group measured rows by (dataset, model, budget_flops) and summarise each arm at each point.

    Per arm and point: seeds, mean ± CI of every metric, mean GPU-hours and train FLOPs. Per arm
    (at its final point): compute-to-target and Welch's p against the baseline's final point, on
    `metric`; if metric is "fid" and no row of a group has one, the group uses val_loss instead
    and says so in its notes. A point evaluated twice (same run_id and point) counts once, the
    later row winning. Reference rows follow, one record each.
    """
    if metric not in LOWER_IS_BETTER:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(LOWER_IS_BETTER)}")
    latest = {(row["run_id"], row["point"]): row for row in rows if not row["source"]}
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for row in latest.values():
        groups[row["dataset"], row["model"], row["budget_flops"]].append(row)
    summary: list[Summary] = []
    for key in sorted(groups):
        summary.extend(_summarize_group(groups[key], baseline_arm, metric, level))
    summary.extend(_reference(row, metric) for row in rows if row["source"])
    return summary


def _summarize_group(rows: list[Row], baseline_arm: str, metric: str, level: float) -> list[Summary]:
    """Records of one (dataset, model, budget) group, the baseline arm first."""
    notes = []
    target_metric = metric
    if metric == "fid" and all(row["fid"] is None for row in rows):
        target_metric = "val_loss"
        notes.append("no FID in this group: compute-to-target and Welch use val_loss")
    arms: dict[str, dict[float, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        arms[row["arm"]][row["point"]].append(row)
    if baseline_arm not in arms:
        notes.append(f"no {baseline_arm!r} runs in this group: no compute-to-target or Welch test")
    features = _fid_features(rows)
    curves = {arm: [_point(points[p], features, target_metric, level, tuple(notes))
                    for p in sorted(points)] for arm, points in arms.items()}
    if baseline_arm in arms:
        base_runs = arms[baseline_arm][max(arms[baseline_arm])]
        for arm, curve in curves.items():
            final_runs = arms[arm][max(arms[arm])]
            others = [] if arm == baseline_arm else base_runs  # no test of the baseline against itself
            _compare(curve, curves[baseline_arm][-1], final_runs, others)
    order = sorted(curves, key=lambda arm: (arm != baseline_arm, arm))
    return [record for arm in order for record in curves[arm]]


def _fid_features(rows: list[Row]) -> str:
    """The one feature space of a group's FIDs; Fréchet distances in different ones don't compare."""
    spaces = sorted({row["fid_features"] or "" for row in rows if row["fid"] is not None})
    if len(spaces) > 1:
        row = rows[0]
        raise ValueError(f"{row['dataset']}/{row['model']}/{row['budget_flops']:g} mixes FID features "
                         f"{', '.join(spaces)}; their FIDs are not comparable")
    return spaces[0] if spaces else ""


def _point(runs: list[Row], features: str, target_metric: str, level: float,
           notes: tuple[str, ...]) -> Summary:
    """The record of one arm at one eval point, pooling its seeds."""
    first = runs[0]
    return Summary(
        dataset=first["dataset"], model=first["model"], budget_flops=first["budget_flops"],
        arm=first["arm"], point=first["point"], n=len(runs),
        metrics={metric: _estimate(_values(runs, metric), level) for metric in METRICS},
        train_flops=_mean(_values(runs, "train_flops")), gpu_hours=_mean(_values(runs, "gpu_hours")),
        fid_features=features, target_metric=target_metric, notes=notes,
    )


def _compare(curve: list[Summary], base_final: Summary, final_runs: list[Row],
             base_runs: list[Row]) -> None:
    """Set the target, compute-to-target and Welch's p on the last record of an arm's curve."""
    final, metric = curve[-1], base_final.target_metric
    if base_final.metrics[metric] is None:
        return
    final.target = base_final.metrics[metric][0]
    final.flops_to_target = _reach(curve, metric, "train_flops", final.budget_flops, final.target)
    if base_final.gpu_hours:
        final.hours_to_target = _reach(curve, metric, "gpu_hours", base_final.gpu_hours, final.target)
    test = welch(_values(final_runs, metric), _values(base_runs, metric))
    final.welch_p = test[1] if test else None


def _reach(curve: list[Summary], metric: str, x_field: str, x_unit: float,
           target: float) -> float | None:
    """compute_to_target of an arm's mean curve, its x being x_field in units of x_unit."""
    points = [(getattr(r, x_field) / x_unit, r.metrics[metric][0]) for r in curve
              if getattr(r, x_field) is not None and r.metrics[metric] is not None]
    return compute_to_target(points, target, higher_is_better=not LOWER_IS_BETTER[metric])


def _reference(row: Row, metric: str) -> Summary:
    """A published row as its own record: one value per metric, no interval, its citation kept."""
    return Summary(
        dataset=row["dataset"], model=row["model"], budget_flops=row["budget_flops"], arm=row["arm"],
        point=row["point"], n=1,
        metrics={m: (row[m], math.nan) if row[m] is not None else None for m in METRICS},
        train_flops=row["train_flops"], gpu_hours=row["gpu_hours"],
        fid_features=row["fid_features"] or "", target_metric=metric, source=row["source"],
    )


def _values(runs: list[Row], column: str) -> list[float]:
    return [row[column] for row in runs if row[column] is not None]


def _estimate(values: list[float], level: float) -> Estimate | None:
    return mean_ci(values, level) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


# "FD", not "FID": the column is Inception FID only where its features say inception (on synth it is the
# oracle's Fréchet distance); `fd_note` says so under every table.
TABLE_HEADER = ("dataset", "model", "budget", "arm", "point", "n", "FD", "FD features", "CLIP",
                "val loss", "align", "GPU-h", "FLOPs to target", "GPU-h to target", "Welch p", "ref")
CSV_HEADER = ("dataset", "model", "budget_flops", "arm", "point", "n",
              *(f"{m}{suffix}" for m in METRICS for suffix in ("", "_ci")),
              "train_flops", "gpu_hours", "fid_features", "target_metric", "target",
              "flops_to_target", "hours_to_target", "welch_p", "source", "notes")


FD_NOTE = ("FD: Fréchet distance in the features named beside it; Inception FID only for "
           "inception-2015-12-05-clean (oracle-synth-v1 is the synth oracle's, standin-random-inception a random "
           "network's)")


def render(summary: Sequence[Summary], fmt: str = "table") -> str:
    """The summary as an aligned text table, a Markdown table, or CSV (full precision).

    Table and Markdown cite each reference row by number under the table, with the notes of the
    groups. In CSV, `flops_to_target` empty while `target` is set means "not reached".
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "csv":
        return _render_csv(summary)
    sources = list(dict.fromkeys(r.source for r in summary if r.is_reference))
    cells = [_table_cells(r, sources) for r in summary]
    notes = list(dict.fromkeys(note for r in summary for note in _group_notes(r)))
    notes += [f"[{i}] {source}" for i, source in enumerate(sources, 1)]
    notes.append(FD_NOTE)
    if fmt == "markdown":
        lines = [_markdown_line(TABLE_HEADER), _markdown_line(["---"] * len(TABLE_HEADER))]
        lines += [_markdown_line(row) for row in cells]
        return "\n".join(lines + [""] + [f"- {note}" for note in notes])
    widths = [max(len(row[i]) for row in [TABLE_HEADER, *cells]) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in [TABLE_HEADER, ["-" * width for width in widths], *cells]]
    return "\n".join(lines + ([""] + notes if notes else []))


def _group_notes(record: Summary) -> list[str]:
    """A record's group notes, prefixed with its group so they read on their own under a table."""
    group = f"{record.dataset}/{record.model}/{_g(record.budget_flops)}"
    return [f"{group}: {note}" for note in record.notes]


def _table_cells(record: Summary, sources: list[str]) -> list[str]:
    """Display strings of one record, in TABLE_HEADER order."""
    return [
        record.dataset or "", record.model or "", _g(record.budget_flops), record.arm,
        _g(record.point), str(record.n), _pm(record.metrics["fid"]), record.fid_features,
        _pm(record.metrics["clip_score"]), _pm(record.metrics["val_loss"]),
        _pm(record.metrics["align_acc"]), _g(record.gpu_hours),
        _to_target(record, record.flops_to_target), _to_target(record, record.hours_to_target),
        _g(record.welch_p), f"[{sources.index(record.source) + 1}]" if record.is_reference else "",
    ]


def _to_target(record: Summary, fraction: float | None) -> str:
    if record.target is None:
        return ""
    return "not reached" if fraction is None else f"{fraction:.3f}"


def _pm(estimate: Estimate | None) -> str:
    """'mean ± half-width' to 4 significant digits; the mean alone when there is no interval."""
    if estimate is None:
        return ""
    mean, half = estimate
    return f"{mean:.4g}" if math.isnan(half) else f"{mean:.4g} ± {half:.2g}"


def _g(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _markdown_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _render_csv(summary: Sequence[Summary]) -> str:
    """Full precision, one CSV_HEADER row per record; no value (or no interval) is an empty cell."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for r in summary:
        estimates = [x for m in METRICS for x in (r.metrics[m] or (None, None))]
        values = (r.dataset, r.model, r.budget_flops, r.arm, r.point, r.n, *estimates, r.train_flops,
                  r.gpu_hours, r.fid_features, r.target_metric, r.target, r.flops_to_target,
                  r.hours_to_target, r.welch_p, r.source, "; ".join(r.notes))
        writer.writerow(["" if v is None or (isinstance(v, float) and math.isnan(v)) else v
                         for v in values])
    return buffer.getvalue()
