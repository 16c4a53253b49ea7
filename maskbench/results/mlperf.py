"""`maskbench leaderboard --mlperf`: MLPerf Training's scoring, for those who run >= 10 seeds per arm.

MLPerf Training (training_rules.adoc of mlcommons/training_policies, "Benchmark Results" and
"Reference Convergence Points") scores a system by the time its runs take to reach a quality target:
each benchmark result drops the fastest and the slowest of N runs (N = 10 for text-to-image) and
averages the rest (the "olympic" mean), one run that never reaches the target may be the one
dropped as slowest, and a second makes the result invalid. Reference Convergence Points (RCPs) keep a
submission from converging in fewer epochs than the reference's runs allow: from the reference's
olympic mean and standard deviation of epochs to converge, a one-sided two-sample Student's t-test
(similar variances, p = 0.05) gives the smallest acceptable olympic mean of the submission's epochs;
a submission below it is rejected, and one between it and the RCP mean has its score normalised by
RCP mean / its mean (it gets no credit for converging faster within the noise).

A run's clock stops at its first evaluation that reaches the target (the rules' "Run Results": the clock
may stop as soon as the system determines the target is reached; "Quality measure": with checkpoints
evaluated off the clock, at the first checkpoint that passes). No curve is fitted and nothing is
interpolated between evaluations, so a run that reaches the target once and then falls back has reached
it there.

Here, per (dataset, model, budget) group: a run's result is its device-hours (and FLOPs) at its first
evaluation that reaches the target (`first_reach`), the target is the loosest final value the baseline
reaches in every one of its runs (its worst final value of the compared metric), an arm is a "system",
and the baseline's runs are the reference whose FLOPs to the target are the convergence points (FLOPs
where MLPerf counts epochs: at equal compute, FLOPs are the work). An arm "faster than RCP" reaches the
target with significantly fewer FLOPs than the baseline: MLPerf's closed division would reject it; here
that is the finding.
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

from maskbench.metrics import get_metric
from maskbench.results.rows import Row
from maskbench.results.summary import measured_groups
from maskbench.results.tables import group_label

MIN_RUNS = 10   # MLPerf's minimum for text-to-image (and most benchmarks); its references provide 2N
ALPHA = 0.05    # the RCP test's one-sided p-value


def first_reach(points: Sequence[tuple[float, float]], target: float,
                higher_is_better: bool = False) -> float | None:
    """x of the first point, in x order, whose value reaches the target (value <= target; >= with
    higher_is_better), or None when no point does: MLPerf's stopped clock, read at evaluations only."""
    sign = -1.0 if higher_is_better else 1.0
    return next((float(x) for x, value in sorted(points) if sign * (value - target) <= 0), None)


def compared_metric(rows: Sequence[Row], metric: str) -> str:
    """The metric a group is scored on: `metric`, or val_loss when it is fid and no row has an FID."""
    return "val_loss" if metric == "fid" and all(row["fid"] is None for row in rows) else metric


def olympic_mean(values: Sequence[float | None]) -> float | None:
    """Mean after dropping the smallest and the largest value, None (a run that never reached the
    target) counting as the largest; None when more than one run is None (an invalid result) or
    fewer than 3 values."""
    missed = sum(v is None for v in values)
    if missed > 1 or len(values) < 3:
        return None
    ordered = sorted(v for v in values if v is not None) + [math.inf] * missed
    return float(np.mean(ordered[1:-1]))


@dataclass(frozen=True)
class RCP:
    """A reference's convergence points: olympic mean, standard deviation of the same runs (ddof 0,
    as in the rules' worked example), and the smallest olympic mean acceptable from n_submission runs."""
    mean: float
    stdev: float
    min_mean: float


def rcp(points: Sequence[float], n_submission: int, alpha: float = ALPHA) -> RCP:
    """The RCP of the reference's convergence points for a submission of n_submission runs.

    Dropping the extremes leaves n_r = len(points) − 2 reference and n_s = n_submission − 2 submission
    runs; with mean M and standard deviation s of the kept reference runs, the smallest acceptable
    submission mean is the one a one-sided equal-variance t-test at p = alpha does not reject:
        min_mean = M − t_{1−alpha, n_r+n_s−2} · s · √(1/n_r + 1/n_s).
    (MLPerf's rcp_checker finds the same bound by bisection; the rules' example, reference
    [16, 14, 16, 17, 16, 16, 15, 16, 15, 16] and 5 submission runs, gives 15.21.)
    """
    if len(points) < 3 or n_submission < 3:
        raise ValueError("an RCP needs at least 3 reference and 3 submission runs")
    kept = np.sort(np.asarray(points, dtype=float))[1:-1]
    n_r, n_s = kept.size, n_submission - 2
    mean, stdev = float(kept.mean()), float(kept.std())
    margin = scipy.stats.t.ppf(1 - alpha, n_r + n_s - 2) * stdev * math.sqrt(1 / n_r + 1 / n_s)
    return RCP(mean, stdev, mean - margin)


@dataclass
class Score:
    """One arm's MLPerf-style result in a group."""
    dataset: str | None
    model: str | None
    budget_flops: float | None
    arm: str
    runs: int
    metric: str
    target: float
    reached: int                       # runs that reached the target
    hours: float | None                # olympic mean device-hours to the target (None: invalid)
    flops: float | None                # olympic mean FLOPs to the target
    rcp: str = ""                      # reference, passes, normalised, faster than RCP, or why none
    score_hours: float | None = None   # hours, normalised when the RCP rule says so
    speedup: float | None = None       # the baseline's score_hours / this arm's (higher is better)


def mlperf_summary(rows: Sequence[Row], baseline_arm: str = "mask0",
                   metric: str = "fid") -> tuple[list[Score], list[str]]:
    """MLPerf-style scores of every arm with >= MIN_RUNS finished runs, and notes (arms left out, why)."""
    scores: list[Score] = []
    notes: list[str] = []
    for (dataset, model, batch, budget, started_from), group in measured_groups(rows).items():
        name = group_label(dataset, model, batch, budget, started_from)
        compared = compared_metric(group, metric)
        finals = _final_runs(group, compared)
        counts = ", ".join(f"{arm} {len(runs)}" for arm, runs in sorted(finals.items()))
        short = [arm for arm, runs in finals.items() if len(runs) < MIN_RUNS]
        if short:
            notes.append(f"{name}: MLPerf scoring needs >= {MIN_RUNS} finished runs per arm; runs with a "
                         f"final {compared}: {counts}")
        if baseline_arm not in finals or baseline_arm in short:
            if finals and len(short) < len(finals):
                notes.append(f"{name}: no {baseline_arm} arm with >= {MIN_RUNS} runs: no target")
            continue
        lower = get_metric(compared).lower_is_better
        target = (max if lower else min)(final for final, _ in finals[baseline_arm])
        group_scores = [_score(dataset, model, budget, arm, runs, compared, target)
                        for arm, runs in sorted(finals.items(), key=lambda item: (item[0] != baseline_arm, item[0]))
                        if arm not in short]
        _apply_rcp(group_scores, {arm: runs for arm, runs in finals.items() if arm not in short}, target, compared)
        scores.extend(group_scores)
    return scores, notes


def _final_runs(group: list[Row], metric: str) -> dict[str, list[tuple[float, list[Row]]]]:
    """Per arm, (final value, the run's rows) of each run with a row at the arm's final point."""
    runs: dict[str, dict[str, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in group:
        runs[row["arm"]][row["run_id"]].append(row)
    finals = {}
    for arm, by_run in runs.items():
        last = max(row["point"] for rows in by_run.values() for row in rows)
        finished = [(next(r[metric] for r in rows if r["point"] == last), rows) for rows in by_run.values()
                    if any(r["point"] == last and r[metric] is not None for r in rows)]
        if finished:
            finals[arm] = finished
    return finals


def _reach(rows: list[Row], metric: str, x_field: str, target: float) -> float | None:
    """A run's x_field (device-hours or FLOPs) at its first evaluation that reaches the target."""
    points = [(r[x_field], r[metric]) for r in rows if r[x_field] is not None and r[metric] is not None]
    return first_reach(points, target, higher_is_better=not get_metric(metric).lower_is_better)


def _score(dataset, model, budget, arm: str, runs: list[tuple[float, list[Row]]], metric: str,
           target: float) -> Score:
    hours = [_reach(rows, metric, "gpu_hours", target) for _, rows in runs]
    flops = [_reach(rows, metric, "train_flops", target) for _, rows in runs]
    return Score(dataset, model, budget, arm, len(runs), metric, target, sum(h is not None for h in flops),
                 olympic_mean(hours), olympic_mean(flops))


def _apply_rcp(scores: list[Score], finals: dict, target: float, metric: str) -> None:
    """The RCP rule on FLOPs to the target, the baseline (scores[0]) being the reference."""
    reference = scores[0]
    points = [_reach(rows, metric, "train_flops", target) for _, rows in finals[reference.arm]]
    for score in scores:
        score.score_hours = score.hours
        if score is reference:
            score.rcp = "reference"
        elif score.flops is None or score.hours is None:
            score.rcp = "invalid: more than one run did not reach the target"
        else:
            bound = rcp(points, score.runs)
            if score.flops < bound.min_mean:
                score.rcp = "faster than RCP"
            elif score.flops < bound.mean:
                score.rcp = "normalised"
                score.score_hours = score.hours * bound.mean / score.flops
            else:
                score.rcp = "passes"
    for score in scores:
        if score.score_hours and reference.score_hours:
            score.speedup = reference.score_hours / score.score_hours


HEADER = ("dataset", "model", "budget", "arm", "runs", "metric", "target", "reached", "GPU-h to target",
          "FLOPs to target", "RCP", "score GPU-h", "speed-up")
CSV_HEADER = ("dataset", "model", "budget_flops", "arm", "runs", "metric", "target", "reached",
              "hours_to_target", "flops_to_target", "rcp", "score_hours", "speedup")
NOTE = ("MLPerf-style (training_rules.adoc, Benchmark Results and RCPs): per run, device-hours and FLOPs "
        "at its first evaluation that reaches the target (the baseline's worst final value, so that every "
        "baseline run reaches it; no fit, no interpolation between evaluations); olympic "
        "mean over the runs (fastest and slowest dropped, one run that never reaches the target dropped as "
        "slowest, two make the result invalid). RCP: the baseline's FLOPs to the target are the reference "
        "convergence points; 'faster than RCP' = significantly fewer FLOPs than the baseline (one-sided "
        "t-test, p = 0.05; MLPerf's closed division would reject it), 'normalised' = fewer but within the "
        "noise, so its score is its GPU-h times RCP mean / its FLOPs. speed-up = the baseline's score / "
        "the arm's.")


def render_mlperf(scores: Sequence[Score], notes: Sequence[str], fmt: str = "table") -> str:
    """The scores as an aligned table, Markdown, or CSV (full precision), notes under the tables."""
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(CSV_HEADER)
        for s in scores:
            writer.writerow(["" if v is None else v for v in (
                s.dataset, s.model, s.budget_flops, s.arm, s.runs, s.metric, s.target, s.reached, s.hours,
                s.flops, s.rcp, s.score_hours, s.speedup)])
        return buffer.getvalue()
    cells = [[s.dataset or "", s.model or "", _g(s.budget_flops), s.arm, str(s.runs), s.metric, f"{s.target:.4g}",
              f"{s.reached}/{s.runs}", _g(s.hours), _g(s.flops), s.rcp, _g(s.score_hours), _g(s.speedup)]
             for s in scores]
    all_notes = [*notes, NOTE]
    if fmt == "markdown":
        lines = [_md(HEADER), _md(["---"] * len(HEADER)), *(_md(row) for row in cells)]
        return "\n".join(lines + [""] + [f"- {note}" for note in all_notes])
    widths = [max(len(row[i]) for row in [HEADER, *cells]) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in [HEADER, ["-" * width for width in widths], *cells]]
    return "\n".join(lines + [""] + all_notes)


def _g(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _md(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
