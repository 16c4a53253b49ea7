"""Leaderboard rows summarised: per group, arm and eval point over seeds, and each arm against the baseline.

Rows are grouped by (dataset, model, batch size, budget, where the runs started); per arm and eval
point the seeds are pooled (`Summary`), and each arm's final point is compared with the baseline's on
each compared metric (`Comparison`: paired by seed where the seeds pair, Welch's test otherwise, with
compute-to-target at each of the baseline's horizons). Runs pair only when they ran under the same
conditions (`CONDITIONS`: device, precision, draw scheme, number of processes); a seed whose runs did not is
left out of the comparison, and the notes say so. Lower is better for FD (and for the oracle
Fréchet distance stored in `fid` on synth, labelled by `fid_features`) and for val_loss; higher is
better for CLIP score and alignment (`maskbench.metrics`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.stats

from maskbench.metrics import CO_PRIMARY, compared_metrics, get_metric
from maskbench.results.estimators import (
    Difference,
    Estimate,
    mean_ci,
    paired_difference,
    ratio_summary,
    sampling_se,
    sampling_ses,
    welch_difference,
)
from maskbench.results.rows import Row, Value
from maskbench.results.targets import COMPUTE, Target, horizon_target, seed_pooled, seed_ratio

# What two runs of one seed must share to pair: the same numerics (device, precision) and the same random draws
# (draw scheme: common random numbers make the per-seed difference cancel the noise only when both runs draw alike;
# data_streams: each data stream reads its own samples and draws its own noise, so runs split into other stream
# counts train on other samples at the same global batch, whatever their process counts, docs/runs.md). An empty
# field (rows written before it existed) is "unknown", and pairs only with unknown; rows from before data_streams
# count their processes as their streams (every committed study ran train.grad_accum 1).
CONDITIONS = ("device", "precision", "draw_scheme", "data_streams")
# Why a condition's difference unpairs two runs, where its name alone does not say it.
WHY_UNPAIRED = {"data_streams": "runs split into other stream counts draw other samples"}
# A gap under this many combined sampling errors (the SE of Δ its rows' own sampling errors imply) is "not
# detected", whatever the test over seeds says: the evaluation alone could have made it (`detected_difference`).
DETECTED_SES = 2.0
# Two models compare as one size when their parameter counts differ by at most this share: an arm that adds
# capacity (blocks, a wider decoder) would mix its method's effect with the capacity's. `None` (the leaderboard's
# --allow-size-mismatch) pairs any sizes, and the note says that they differ.
SIZE_TOLERANCE = 0.05


def size_mismatch(row: Row, partner: Row, tolerance: float = SIZE_TOLERANCE) -> str:
    """'params (A vs B: +x%)' when two runs' parameter counts differ by more than `tolerance`; "" when they
    compare as one size, or when either row does not say (rows written before the column was filled)."""
    mine, theirs = row.get("params"), partner.get("params")
    if not mine or not theirs or abs(mine / theirs - 1) <= tolerance:
        return ""
    return f"params ({mine:,} vs {theirs:,}: {mine / theirs - 1:+.0%}, beyond ±{tolerance:.0%})"


def condition_mismatch(row: Row, partner: Row, size_tolerance: float | None = SIZE_TOLERANCE) -> list[str]:
    """The fields of CONDITIONS in which two runs differ, as 'field (this vs that)', and their sizes when they
    differ beyond `size_tolerance` (None: any size pairs); empty when they pair."""
    values = [(field, _condition(row, field), _condition(partner, field)) for field in CONDITIONS]
    differ = [f"{field} ({mine} vs {theirs})" for field, mine, theirs in values if mine != theirs]
    size = size_mismatch(row, partner, size_tolerance) if size_tolerance is not None else ""
    return differ + ([size] if size else [])


def _condition(row: Row, field: str) -> Value:
    """A row's value of a pairing condition; "unknown" where empty (a row from before its column). A row from
    before data_streams has the streams of its processes (train.grad_accum 1, as every committed study)."""
    if field == "data_streams" and not row.get(field):
        return row.get("n_devices") or "unknown"
    return row.get(field) or "unknown"


def paired_by_condition(arm_rows: Sequence[Row], base_rows: Sequence[Row], baseline_arm: str,
                        size_tolerance: float | None = SIZE_TOLERANCE) -> tuple[list[Row], list[Row], str]:
    """The arm's and the baseline's rows less the seeds whose runs differ in a condition (`CONDITIONS`) or in
    size (`size_mismatch`), and a one-line warning naming the fields ("" when every seed pairs). A seed is set
    aside on both sides: its difference would mix the arm's effect with the device's, the precision's, the
    draws' (another draw scheme or process count) or the extra capacity's. With `size_tolerance` None, sizes that
    differ still pair, and the warning says so."""
    base_by_seed = {row["seed"]: row for row in base_rows}
    partners = [(row, base_by_seed[row["seed"]]) for row in arm_rows if row["seed"] in base_by_seed]
    differ = {row["seed"]: condition_mismatch(row, partner, size_tolerance) for row, partner in partners}
    left_out = sorted(seed for seed, fields in differ.items() if fields)
    if not left_out:
        sizes = dict.fromkeys(size for row, partner in partners if (size := size_mismatch(row, partner)))
        allowed = f"compared with {baseline_arm} although {', '.join(sizes)} (--allow-size-mismatch)"
        return list(arm_rows), list(base_rows), allowed if sizes and size_tolerance is None else ""
    fields = ", ".join(dict.fromkeys(field for seed in left_out for field in differ[seed]))
    hint = " (--allow-size-mismatch compares them)" if any("params (" in f for s in left_out for f in differ[s]) else ""
    why = "".join(f": {reason}" for name, reason in WHY_UNPAIRED.items() if f"{name} (" in fields)
    warning = f"not paired with {baseline_arm} on seed(s) {_seeds(left_out)}: {fields} differ{why}{hint}"
    return ([row for row in arm_rows if row["seed"] not in left_out],
            [row for row in base_rows if row["seed"] not in left_out], warning)


@dataclass(frozen=True)
class Comparison:
    """An arm against the baseline on one metric: the difference at the final point and, when paired,
    compute-to-target at each of the baseline's horizons."""
    metric: str
    difference: Difference
    targets: tuple[Target, ...] = ()
    seeds: tuple[int, ...] = ()    # the paired seeds
    note: str = ""                 # why the runs were not paired
    baseline: str = ""


@dataclass
class Summary:
    """One leaderboard line: an arm at one eval point of a (dataset, model, budget) group, or a
    published reference row (non-empty `source`), which is never pooled with measured runs.

    `comparisons` is set on each arm's final eval point only, and only when the group has the baseline
    arm: per compared metric (FD and val loss always, a plan's primary metrics too), the paired (or, when
    the seeds do not pair, Welch) comparison with the baseline, with compute-to-target at each of the
    baseline's horizons; empty for the baseline itself. `eval_only` names the metrics whose interval comes
    from the one row's own sampling error instead of seeds.
    """

    dataset: str | None
    model: str | None
    batch_size: int | None        # tokens per step change what masking buys: never pooled across batch sizes
    budget_flops: float | None
    arm: str
    point: float | None
    n: int
    metrics: dict[str, Estimate | None]
    train_flops: float | None
    gpu_hours: float | None
    fid_features: str
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    source: str = ""
    notes: tuple[str, ...] = ()
    started_from: str = ""        # `source_family` of the trained run these runs started from ("" from scratch)
    eval_only: tuple[str, ...] = ()
    device: str = ""              # what the hours were measured on (`device_kind`): CPU hours are not GPU hours

    @property
    def is_reference(self) -> bool:
        return bool(self.source)

    @property
    def group(self) -> tuple:
        return self.dataset, self.model, self.batch_size, self.budget_flops, self.started_from


def summarize(rows: Sequence[Row], baseline_arm: str = "mask0", metrics: Sequence[str] = CO_PRIMARY,
              level: float = 0.95, size_tolerance: float | None = SIZE_TOLERANCE) -> list[Summary]:
    """Group measured rows by (dataset, model, batch size, budget) and summarise each arm at each point.

    Per arm and point: seeds, mean ± CI of every metric, mean GPU-hours and train FLOPs. Per arm (at its
    final point), against the baseline, on each of `metrics` the rows measure: the `Comparison` (paired by
    seed when the seeds pair, with per-seed compute-to-target ratios at each baseline horizon; Welch's
    otherwise, saying why; an arm whose size differs from the baseline's beyond `size_tolerance` is not
    compared unless it is None); a group without FID says so in its notes. A point evaluated twice (same run_id
    and point) counts once, the later row winning. Reference rows follow, one record each.
    """
    known = compared_metrics()
    unknown = [metric for metric in metrics if metric not in known]
    if unknown or not metrics:
        raise ValueError(f"unknown metric(s) {unknown or 'none given'}; choose from {', '.join(known)}")
    summary: list[Summary] = []
    for rows_of_group in measured_groups(rows).values():
        summary.extend(_summarize_group(rows_of_group, baseline_arm, tuple(metrics), level, size_tolerance))
    summary.extend(_reference(row) for row in rows if row["source"])
    return summary


def measured_groups(rows: Sequence[Row]) -> dict[tuple, list[Row]]:
    """Measured rows by (dataset, model, batch_size, budget_flops, source_family), in sorted order; a
    point evaluated twice (same run_id and point) counts once, the later row winning."""
    latest = {(row["run_id"], row["point"]): row for row in rows if not row["source"]}
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for row in latest.values():
        key = (row["dataset"], row["model"], row["batch_size"] or 0, row["budget_flops"], source_family(row))
        groups[key].append(row)
    return {key: groups[key] for key in sorted(groups)}


def source_family(row: Row) -> str:
    """Where a run started: "" from scratch, else its `init_from` source's arm-data-model (run id less its
    seed and hash). Runs that continue trained weights are never pooled with runs from scratch, and the
    runs of one seed started from the same seed's source, so they still pair by seed."""
    source = (row.get("init_from") or "").partition("@")[0]
    return source.rsplit("-", 2)[0] if source else ""


def encoder_cost(arm: str, rows: Sequence[Row]) -> str:
    """A note for an arm that aligns to a pretrained encoder: what training that encoder cost, apart from the
    budget (train_flops counts the encoder's forward passes in the run, not its own training), as papers report
    it; "" for arms without one."""
    spent = {row["encoder_flops"] for row in rows if row.get("encoder_flops")}
    if not spent:
        return ""
    budget = rows[0]["budget_flops"]
    shares = ", ".join(f"{flops:.3g} FLOPs ({flops / budget:.0%} of the budget)" for flops in sorted(spent))
    return f"{arm}: its frozen encoder's pretraining cost {shares}, not counted in train_flops"


def _summarize_group(rows: list[Row], baseline_arm: str, metrics: tuple[str, ...], level: float,
                     size_tolerance: float | None) -> list[Summary]:
    """Records of one (dataset, model, budget) group, the baseline arm first."""
    notes = []
    if "fid" in metrics and all(row["fid"] is None for row in rows):
        notes.append("no FID in this group: no FD comparison")
    arms: dict[str, dict[float, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        arms[row["arm"]][row["point"]].append(row)
    if baseline_arm not in arms:
        notes.append(f"no {baseline_arm!r} runs in this group: no compute-to-target or comparison")
    features = _fid_features(rows)
    curves = {arm: [_point(points[p], features, level, tuple(notes)) for p in sorted(points)]
              for arm, points in arms.items()}
    for arm, curve in curves.items():
        if cost := encoder_cost(arm, [row for runs in arms[arm].values() for row in runs]):
            curve[-1].notes += (cost,)
    if baseline_arm in arms:
        for arm, curve in curves.items():
            if arm == baseline_arm:  # no test of the baseline against itself
                continue
            final_runs, base_runs, warning = paired_by_condition(arms[arm][max(arms[arm])],
                                                                 arms[baseline_arm][max(arms[baseline_arm])],
                                                                 baseline_arm, size_tolerance)
            found = {metric: _comparison(final_runs, base_runs, rows, metric, baseline_arm, level)
                     for metric in metrics}
            curve[-1].comparisons = {metric: c for metric, c in found.items() if c is not None}
            curve[-1].notes += (f"{arm}: {warning}",) if warning else ()
    order = sorted(curves, key=lambda arm: (arm != baseline_arm, arm))
    return [record for arm in order for record in curves[arm]]


def _comparison(final_runs: list[Row], base_runs: list[Row], rows: list[Row], metric: str,
                baseline_arm: str, level: float) -> Comparison | None:
    """An arm's final rows against the baseline's on one metric: paired by seed when every arm seed has
    exactly one baseline partner (and each side one run per seed), Welch's unpaired test otherwise."""
    lower = get_metric(metric).lower_is_better
    arm_final = [row for row in final_runs if row[metric] is not None]
    base_final = [row for row in base_runs if row[metric] is not None]
    if not arm_final or not base_final:
        return None
    by_seed = {side: defaultdict(list) for side in ("arm", "base")}
    for side, finals in (("arm", arm_final), ("base", base_final)):
        for row in finals:
            by_seed[side][row["seed"]].append(row)
    repeated = sorted({seed for side in by_seed.values() for seed, found in side.items() if len(found) > 1})
    unpaired = sorted(set(by_seed["arm"]) - set(by_seed["base"]))
    if repeated or unpaired:
        why = (f"seed(s) {_seeds(repeated)} appear in more than one run of an arm" if repeated else
               f"seed(s) {_seeds(unpaired)} have no {baseline_arm} partner")
        difference = detected_difference(welch_difference(
            _values(arm_final, metric), _values(base_final, metric), lower, level,
            arm_se=sampling_ses(arm_final, metric), base_se=sampling_ses(base_final, metric)))
        return Comparison(metric, difference, note=f"unpaired (Welch): {why}", baseline=baseline_arm)
    seeds = sorted(by_seed["arm"])
    arm_rows = [by_seed["arm"][seed][0] for seed in seeds]
    base_rows = [by_seed["base"][seed][0] for seed in seeds]
    difference = detected_difference(paired_difference(
        _values(arm_rows, metric), _values(base_rows, metric), lower, level,
        arm_se=sampling_ses(arm_rows, metric), base_se=sampling_ses(base_rows, metric)))
    runs = defaultdict(list)
    for row in rows:
        runs[row["run_id"]].append(row)
    pairs = [(runs[a["run_id"]], runs[b["run_id"]]) for a, b in zip(arm_rows, base_rows)]
    return Comparison(metric, difference, _targets(pairs, metric, level), tuple(seeds), baseline=baseline_arm)


def gap_in_ses(difference: Difference) -> float:
    """|Δ| in combined sampling errors: over the SE of Δ that the rows' own sampling errors imply
    (`Difference.eval_se`); NaN where the rows carry none."""
    se = difference.eval_se
    return abs(difference.mean) / se if se > 0 else math.nan


def gap_detected(difference: Difference) -> bool:
    """|Δ| at least DETECTED_SES combined sampling errors (True where the rows carry none)."""
    return math.isnan(difference.eval_se) or abs(difference.mean) >= DETECTED_SES * difference.eval_se


def detected_difference(difference: Difference) -> Difference:
    """What the gap itself allows, beside the test. A better / worse verdict that rests on a gap under
    DETECTED_SES combined sampling errors (the SE of Δ the rows' own sampling errors imply,
    `Difference.eval_se`) reads "not detected", the test's word kept after it; a difference with no test (one
    run a side) says how many combined sampling errors its gap is: "not detected" under DETECTED_SES, over it
    "detected against eval noise", which says nothing of how another seed would land. Unchanged without
    sampling errors, and when already read."""
    word, ses = difference.verdict, gap_in_ses(difference)
    if math.isnan(ses) or "combined sampling errors" in word:
        return difference
    if word in ("better", "worse") and ses < DETECTED_SES:
        word = (f"not detected: |Δ| {abs(difference.mean):.3g} is under {DETECTED_SES:g} combined sampling errors "
                f"({DETECTED_SES * difference.eval_se:.3g}); the test alone: {word}")
    elif math.isnan(difference.lo):
        word += (f"; |Δ| is {ses:.2f} combined sampling errors: " +
                 ("not detected" if ses < DETECTED_SES else "detected against eval noise, not against seed noise"))
    return replace(difference, verdict=word)


def _targets(pairs: list[tuple[list[Row], list[Row]]], metric: str, level: float) -> tuple[Target, ...]:
    """Compute-to-target at each horizon of the baseline that every paired seed's baseline run evaluated:
    per seed the baseline run's fitted value there, reached by both runs of that seed. A horizon whose
    per-seed targets are all an earlier one's (the baseline's fit pooled them) repeats that one."""
    horizons = set.intersection(*({row["point"] for row in base if row[metric] is not None} for _, base in pairs))
    targets: list[Target] = []
    for point in sorted(horizons):
        values = tuple(horizon_target(base, metric, point) for _, base in pairs)
        earlier = targets[-1] if targets else None
        if earlier and earlier.values == values:
            first = earlier.point if earlier.repeats is None else earlier.repeats
            targets.append(Target(point, earlier.value, earlier.ratios, values, first, earlier.pooled))
            continue
        ratios, pooled = {}, {}
        for x in COMPUTE:
            readings = [seed_ratio(arm, base, metric, x, value) for (arm, base), value in zip(pairs, values)]
            ratios[x] = ratio_summary([r for r, _ in readings], level, [bound for _, bound in readings])
            pooled[x] = sum(seed_pooled(arm, metric, x, value) for (arm, _), value in zip(pairs, values))
        targets.append(Target(point, float(np.mean(values)), ratios, values, pooled=pooled))
    return tuple(targets)


def _seeds(seeds: list[int]) -> str:
    return ", ".join(str(seed) for seed in seeds)


def _fid_features(rows: list[Row]) -> str:
    """The one feature space of a group's FIDs; Fréchet distances in different ones don't compare."""
    spaces = sorted({row["fid_features"] or "" for row in rows if row["fid"] is not None})
    if len(spaces) > 1:
        row = rows[0]
        raise ValueError(f"{row['dataset']}/{row['model']}/{row['budget_flops']:g} mixes FID features "
                         f"{', '.join(spaces)}; their FIDs are not comparable")
    return spaces[0] if spaces else ""


def _point(runs: list[Row], features: str, level: float, notes: tuple[str, ...]) -> Summary:
    """The record of one arm at one eval point, pooling its seeds."""
    first = runs[0]
    estimates = {metric: _estimate(runs, metric, level) for metric in compared_metrics()}
    return Summary(
        dataset=first["dataset"], model=first["model"], batch_size=first["batch_size"],
        budget_flops=first["budget_flops"], arm=first["arm"], point=first["point"], n=len(runs),
        started_from=source_family(first),
        metrics={metric: estimate for metric, (estimate, _) in estimates.items()},
        eval_only=tuple(metric for metric, (_, eval_only) in estimates.items() if eval_only),
        train_flops=_mean(_values(runs, "train_flops")), gpu_hours=_mean(_values(runs, "gpu_hours")),
        fid_features=features, notes=notes, device=device_kind(runs),
    )


def device_kind(runs: Sequence[Row]) -> str:
    """The kind of device the runs' hours were measured on: "CPU", the GPU's name, "mixed", or "" (not recorded)."""
    kinds = {"CPU" if device.startswith("cpu") else device for row in runs if (device := row.get("device"))}
    return kinds.pop() if len(kinds) == 1 else "mixed" if kinds else ""


def _estimate(runs: list[Row], metric: str, level: float) -> tuple[Estimate | None, bool]:
    """Mean ± t-interval over the seeds, and False. One seed has no spread to show: when its row has a
    sampling error, its value ± z_{(1+level)/2} · SE, and True: an interval from eval noise alone, which
    says nothing of how another seed would land."""
    values = _values(runs, metric)
    if not values:
        return None, False
    if len(values) == 1:
        se = sampling_se(next(row for row in runs if row[metric] is not None), metric)
        if se is not None:
            return (values[0], float(scipy.stats.norm.ppf((1 + level) / 2) * se)), True
    return mean_ci(values, level), False


def _reference(row: Row) -> Summary:
    """A published row as its own record: one value per metric, no interval, its citation kept."""
    return Summary(
        dataset=row["dataset"], model=row["model"], batch_size=row["batch_size"],
        budget_flops=row["budget_flops"], arm=row["arm"], point=row["point"], n=1,
        metrics={m: (row[m], math.nan) if row[m] is not None else None for m in compared_metrics()},
        train_flops=row["train_flops"], gpu_hours=row["gpu_hours"],
        fid_features=row["fid_features"] or "", source=row["source"],
    )


def _values(runs: Sequence[Row], column: str) -> list[float]:
    return [row[column] for row in runs if row[column] is not None]


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None
