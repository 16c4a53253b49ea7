"""The leaderboard summary rendered: aligned text tables, Markdown tables or CSV, with their notes; the
compute curves (`scaling`) under their own heading; and, for a plan that reads "pays" off the compute
multiplier, its verdict per arm (`render_verdicts`).

Every verdict is printed with the interval it reads, labelled confirmatory or exploratory, and every
table is followed by notes that say how its figures were computed.

Text comes two ways. By default it fits a terminal of WIDTH columns: each group is a heading over its own
tables (the columns it shares move into the heading), the comparison and compute-to-target tables keep the
columns a verdict is read from, long cells wrap inside their column and notes wrap. With `details` every
column is printed, one line a row, however wide (the tables as Markdown and CSV carry them too).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import re
import textwrap
from collections.abc import Sequence

from maskbench.metrics import CO_PRIMARY, compared_metrics, get_metric
from maskbench.results.estimators import Estimate, Ratio, agreement, ratio_verdict
from maskbench.results.multiplicity import EXPLORATORY, MULTIPLIER, ArmVerdict, Family, MetricVerdict
from maskbench.results.multiplier import ArmMultiplier
from maskbench.results.scaling import FAILURE_RULES, ArmFit, Crossover, GroupFit, Interval, Prediction
from maskbench.results.summary import DETECTED_SES, Summary
from maskbench.results.targets import COMPUTE, Target

FORMATS = ("table", "markdown", "csv")
WIDTH = 120  # the compact text's widest line: a terminal's, not the details' one line per row
EVAL_SE = " (eval SE)"  # a value's interval from its one row's sampling error (EVAL_ONLY_NOTE)

# The summary table's columns around its metrics (`table_header`). "FD", not "FID": the column is Inception FID
# only where its features say inception (on synth it is the oracle's Fréchet distance); FD_NOTE says so.
GROUP_HEAD = ("dataset", "model", "batch", "budget")  # a group's columns: its heading in compact text
TABLE_HEAD = (*GROUP_HEAD, "arm", "point", "n")
TABLE_TAIL = ("device-h", "ref")  # hours of the device each row names (`Summary.device`): CPU hours say CPU
RATIO_PARTS = ("bound", "geomean", "lo", "hi", "p", "p_adj", "not_reached", "pooled")
CSV_HEADER = ("dataset", "model", "batch_size", "budget_flops", "started_from", "arm", "point", "n",
              *(f"{m}{suffix}" for m in compared_metrics() for suffix in ("", "_ci")), "eval_only",
              "train_flops", "gpu_hours", "fid_features")
CSV_PER_METRIC = ("test", "pairs", "diff", "diff_lo", "diff_hi", "p", "p_adj", "mde", "se", "eval_se", "verdict",
                  "target", "target_repeats",
                  *(f"{axis}_{part}" for axis in ("flops_ratio", "hours_ratio") for part in RATIO_PARTS),
                  "ratio_verdict")
CSV_TAIL = ("agreement", "pays", "ratio_agreement", "reading", "source", "notes")


FD_NOTE = ("FD: Fréchet distance in the features named beside it; Inception FID only for "
           "inception-2015-12-05-clean (oracle-synth-v1 is the synth oracle's, standin-random-inception a random "
           "network's)")
EVAL_ONLY_NOTE = ("(eval SE): one seed; its value ± z·SE from the row's own sampling error (bootstrap SD over eval "
                  "samples for FD and CLIP, standard error for val loss and align): eval noise only, not how "
                  "another seed would land")
COMPARISON_NOTE = (
    "Δ: arm − {baseline} on the metric named, at the final point. paired: runs of the same seed share initial "
    "weights, data order and evaluation noise, so Δ is the mean of per-seed differences with the paired "
    "t-interval; welch: the seeds do not pair, Δ is the difference of means with Welch's interval. verdict: "
    "better / worse only when the whole {pct} t-interval lies on one side of 0 (lower is better for FD and val "
    "loss, higher for CLIP and align) and p adj < {alpha:g}, and |Δ| is at least {ses:g} combined sampling errors "
    "where the rows carry them (the SE of Δ their own sampling errors imply; a smaller gap is 'not detected', the "
    "test's word after it; one run a side: no test, the gap in combined sampling errors only); inconclusive when "
    "every seed differs by the same "
    "amount (zero spread: no p, no test counted); otherwise no difference detected, and MDE is the "
    "smallest effect these runs detect with 80% power at two-sided {alpha:g}, (t + t_0.80)·SE, SE the larger of "
    "the seeds' and the eval noise's. p adj: p after the plan's correction ({method}). eval/seed SE: the SE of Δ "
    "that the rows' own sampling errors imply over the one the seeds' spread gives (near 1 or above: the seeds "
    "differ by no more than eval noise; empty: rows without sampling errors). metrics: whether the metrics' "
    "verdicts point the same way.")
TARGETS_NOTE = (
    "Compute to target: at each horizon (eval point) of {baseline}, per seed, the target is {baseline}'s value "
    "there read off the isotonic (monotone) fit of its run's curve, each point weighted by 1/SE² of its sampling "
    "error where the rows have one, and the ratio is the FLOPs (device-hours) the arm's run of that seed needs to reach "
    "it on its own monotone fit (straight lines between fitted points) over what {baseline}'s needs; geometric "
    "mean over seeds with the {pct} t-interval of the log ratios. target (= h): {baseline}'s fit pooled this "
    "horizon with horizon h on every seed, so its target and ratios are h's: one test, counted once. <=: an upper "
    "bound (some seed's arm was there at its first point); >: a lower bound (k/n not reached: k seeds never got "
    "there, their last point stands in); bounds are not tested. verdict and p adj are of the {axis} ratio: pays "
    "when below 1 with p adj < {alpha:g}, does not pay when above 1 likewise, undecided otherwise; a bound gets "
    "no verdict, only 'not reached (k/n)' or 'reached at first point', and counts as undecided in pays and "
    "metrics. pays: {pays}.")
TARGETS_REPORTED_NOTE = (
    "Compute to target: at each horizon (eval point) of {baseline}, per seed, the target is {baseline}'s value "
    "there read off the isotonic (monotone) fit of its run's curve, each point weighted by 1/SE² of its sampling "
    "error where the rows have one, and the ratio is the FLOPs (device-hours) the arm's run of that seed needs to reach "
    "it on its own monotone fit over what {baseline}'s needs; geometric mean over seeds with the {pct} t-interval "
    "of the log ratios. target (= h): {baseline}'s fit pooled this horizon with horizon h. <=: an upper bound, >: "
    "a lower bound (k/n not reached). Reported with their intervals, not tested: the plan reads \"pays\" off the "
    "compute multiplier M(B) and the difference at B (the verdict below), so these ratios carry no p adj and no "
    "verdict.")


POOLED = "pooled over a"
POOLED_WHY = (
    "on k of the n seeds the arm's run reaches the target only at a point its "
    "monotone fit pooled over a stretch where the measured curve rose (fell, where higher is better): the ratio "
    "rests on a value the run did not keep, so read it as a flag, not a saving; the run's own last values say "
    "where it ended.")
POOLED_NOTE = "pooled over a rising curve (k/n): " + POOLED_WHY
POOLED_MARK = "†"  # the compact text's short form of the pooled mark: "†k/n"
POOLED_SHORT_NOTE = f"{POOLED_MARK}k/n: pooled over a rising curve, " + POOLED_WHY
DETAILS_HINT = ("--details prints every column: test, p, MDE, eval/seed SE, targets, both compute axes' ratios, "
                "ratio verdicts")


SCALING_TITLE = ("Compute curves (exploratory; no verdict reads them): per seed, each arm's L(C) = E + A·(C/B)^−α fitted "
                 "on its own against training FLOPs C, B its largest horizon's FLOPs, horizons inside the warm-up rule "
                 "left out; shown only where the baseline's fit predicted its own ladder past B; {pct} t-intervals over "
                 "seeds")
SCALING_NOTE = (
    "Compute curves: E is an arm's floor, A its excess over E at B, α how fast it falls. The ladder check: "
    "{baseline}'s curve fitted per seed on its horizons up to B predicts its ladder's measured value past B; it "
    "holds when the t-interval over seeds of the error lies within ± the tolerance (3 sampling errors of a row "
    "there), so a biased and an imprecise prediction both fail. Where it did not hold the fits are not shown: "
    "no fitted M past the ladder, no C*. Where shown, M is the FLOPs {baseline}'s fitted curve needs to reach the "
    "value the arm's reaches with C, over C, per seed, geometric mean and {pct} t-interval over seeds; trend: the "
    "slope of log M against log C over [B/8, B]; C*: where that line crosses 1, read only when every seed's lies "
    "within [B/k, k·B], else 'none within k× of B'. Held out: the curves fitted on the horizons up to B/2 predict "
    "each arm's value at B; the prediction fails by the rule '{rule}': {meaning} Where an arm's prediction "
    "failed, its C* is not read.")
Table = tuple[str | None, Sequence[str] | None, list[list[str]]]  # (title, header, cells); no header: a title alone
M_COLUMNS = 3  # arms per table of M at each horizon


def render(summary: Sequence[Summary], fmt: str = "table", family: Family = EXPLORATORY,
           details: bool = False) -> str:
    """The summary as aligned text tables, Markdown tables, or CSV (full precision).

    Table and Markdown give one line per arm and eval point; then, per arm and compared metric (FD and
    val loss, side by side, and a plan's primary metrics), the comparison with the baseline at the final
    point; then, per arm and baseline horizon, compute-to-target on every compared metric with the
    plan's "pays"; then every place the metrics disagree, and the notes. Intervals are at 1 − alpha of
    the family (95% without a plan); every verdict is labelled confirmatory or exploratory (`Family`).
    Text fits WIDTH columns unless `details` asks for every column (the module's docstring); Markdown
    and CSV always carry every column. In CSV, one row per record, with the ratios at the record's own point.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    metrics = family.compared()
    if fmt == "csv":
        return _render_csv(summary, metrics, family)
    compact = fmt == "table" and not details
    sources = list(dict.fromkeys(r.source for r in summary if r.is_reference))
    tables = _summary_tables(summary, sources, compact)
    notes = list(dict.fromkeys(note for r in summary for note in _group_notes(r)))
    notes += [f"[{i}] {source}" for i, source in enumerate(sources, 1)]
    notes += [FD_NOTE] + ([EVAL_ONLY_NOTE] if any(r.eval_only for r in summary) else [])
    compared = [r for r in summary if r.comparisons]
    lines_of_disagreement = []
    if compared:
        baseline, pct = next(iter(compared[0].comparisons.values())).baseline, _pct(1 - family.alpha)
        tables += _comparison_tables(compared, family, baseline, pct, compact)
        lines_of_disagreement = _disagreements(compared, metrics, family)
        notes.append(COMPARISON_NOTE.format(baseline=baseline, pct=pct, alpha=family.alpha, method=family.method,
                                            ses=DETECTED_SES))
        if family.rule != MULTIPLIER:  # under it, the measured multiplier is this reading (`render_multipliers`)
            tables += _targets_tables(compared, family, baseline, pct, compact)
            notes += _targets_notes(compared, family, baseline, pct, compact)
    if fmt == "markdown":
        return "\n".join(layout(tables, fmt) + [f"- {line}" for line in (*lines_of_disagreement, *notes)])
    width = WIDTH if compact else None
    return "\n".join(layout(tables, fmt, width) + wrap_lines(lines_of_disagreement, width)
                     + ([""] if lines_of_disagreement else []) + wrap_lines(notes, width))


def _targets_notes(compared: Sequence[Summary], family: Family, baseline: str, pct: str, compact: bool) -> list[str]:
    """What the compute-to-target tables' columns mean, and the pooled mark where a ratio carries it."""
    notes = [TARGETS_NOTE.format(baseline=baseline, pct=pct, alpha=family.alpha, axis=COMPUTE[family.compute],
                                 pays=_pays_rule(family)) if family.tests_ratios else
             TARGETS_REPORTED_NOTE.format(baseline=baseline, pct=pct)]
    shown = [family.compute] if compact else list(COMPUTE)  # the compute axes whose ratios are printed
    if any(t.pooled.get(axis) for r in compared for c in r.comparisons.values() for t in c.targets for axis in shown):
        notes.append(POOLED_SHORT_NOTE if compact else POOLED_NOTE)
    return notes


def _summary_tables(summary: Sequence[Summary], sources: list[str], compact: bool) -> list[Table]:
    """The summary table; in compact text one per group, under a heading that names the group and the
    feature space its FD is in, then the published references in one table of their own (each reference is
    a group of one: a heading apiece would say less than their columns)."""
    header = table_header()
    if not compact:
        return [(None, header, [_table_cells(r, sources) for r in summary])]
    measured = [(r.group, _table_cells(r, sources)) for r in summary if not r.is_reference]
    features = [name for name in header if name.endswith(" features")]
    tables = _grouped(header, measured, header[len(GROUP_HEAD):], lift=features)
    references = [_table_cells(r, sources) for r in summary if r.is_reference]
    return tables + ([compact_table("Published references:", header, references, header)] if references else [])


def _comparison_tables(compared: Sequence[Summary], family: Family, baseline: str, pct: str,
                       compact: bool) -> list[Table]:
    """Each arm against the baseline at the final point; in compact text the columns a verdict is read from,
    the verdict in its short form (`short_verdict`), MDE, eval/seed SE and the metrics' agreement left to
    --details."""
    metrics, title, header = family.compared(), f"Against {baseline} at the final point:", _comparison_header(pct)
    rows = [(r.group, _comparison_cells(r, metric, metrics, family)) for r in compared for metric in metrics
            if metric in r.comparisons]
    if not compact:
        return [(title, header, [cells for _, cells in rows])]
    keep = ("arm", "metric", "n", f"Δ ({pct} CI)", "p adj", "verdict", "reading")
    return [(title, None, []), *_grouped(header, rows, keep, lift=("n", "reading"), short=("verdict",))]


def _targets_tables(compared: Sequence[Summary], family: Family, baseline: str, pct: str,
                    compact: bool) -> list[Table]:
    """Compute to target at each of the baseline's horizons; in compact text only the ratio on the plan's
    compute axis per metric and "pays" (`_compact_target_cells`)."""
    metrics, tested = family.compared(), family.tests_ratios
    title = (f"Compute to reach {baseline}'s value at each of its horizons" +
             ("" if tested else " (reported, not tested)") + ":")
    if not compact:
        return [(title, _targets_header(metrics, pct, tested),
                 [_target_cells(r, point, metrics, family) for r in compared for point in _horizons(r)])]
    axis = COMPUTE[family.compute]
    header = ("arm", "horizon", *(f"{get_metric(metric).label} {axis} ratio ({pct} CI)" for metric in metrics),
              *(("pays",) if tested else ()), "reading")
    rows = [(r.group, _compact_target_cells(r, point, metrics, family)) for r in compared for point in _horizons(r)]
    return [(title, None, []), *_grouped(header, rows, header, lift=("reading",))]


def render_scaling(fits: Sequence[GroupFit], fmt: str = "table", level: float = 0.95, details: bool = False) -> str:
    """The compute curves under their own heading, as text or Markdown tables ("" without any): per group and
    metric a title (B, seeds, E, how residuals were weighted), each arm's A, α and crossover, M at each
    horizon, and the held-out check; then the notes. Text fits WIDTH columns unless `details`."""
    if not fits:
        return ""
    pct = _pct(level)
    tables: list[Table] = [(SCALING_TITLE.format(pct=pct), None, [])]
    for fit in fits:
        tables += _scaling_tables(fit, pct)
    first = fits[0]
    notes = [SCALING_NOTE.format(baseline=first.baseline, pct=pct, rule=first.rule,
                                 meaning=" ".join((FAILURE_RULES[first.rule].__doc__ or "").split()))]
    notes += list(dict.fromkeys(f"{group_label(*fit.group)}: {note}" for fit in fits for note in fit.notes))
    if fmt == "markdown":
        return "\n".join(layout(tables, fmt) + [f"- {line}" for line in notes])
    width = None if details else WIDTH
    return "\n".join(layout(tables, fmt, width) + wrap_lines(notes, width))


MULTIPLIER_TITLE = ("The measured compute multiplier M(C): the {axis} {baseline} needs to reach the value an arm reaches "
                    "with C, read off the same seed's measured {baseline} curve (its ladder), over C; geometric mean "
                    "and {pct} t-interval over seeds")
MULTIPLIER_NOTE = (
    "M: above 1 the arm's compute buys what more of {baseline}'s would. '>x': some seeds' arm is better than "
    "their ladder's last horizon, so M is at least x there (bounds taken as values: a lower bound); '<=x': worse "
    "than its first (an upper bound). trend: per seed the slope of log M against log C over its horizons where M "
    "is a value, mean and t-interval (n: the seeds with two or more); below 0 the arm's advantage shrinks as "
    "compute grows. {baseline}'s own runs of a group other than its ladder are read on the ladder too: M should "
    "be 1 there. Nothing here is fitted: beyond the ladder's reach M is a bound.")
AXIS_WORDS = {"train_flops": "training FLOPs", "gpu_hours": "device-hours"}


def render_multipliers(measured: Sequence[ArmMultiplier], fmt: str = "table", level: float = 0.95) -> str:
    """The measured compute multipliers under their own heading ("" without any): per group and metric, M at
    each of the arms' horizons (at most M_COLUMNS arms a table) and each arm's trend; then the notes."""
    if not measured:
        return ""
    pct, first = _pct(level), measured[0]
    charged = " (auxiliary FLOPs charged to the arm)" if first.charged else ""
    tables: list[Table] = [(MULTIPLIER_TITLE.format(axis=AXIS_WORDS.get(first.axis, first.axis),
                                                    baseline=first.baseline, pct=pct) + charged, None, [])]
    by_key: dict[tuple, list[ArmMultiplier]] = {}
    for found in measured:
        by_key.setdefault((found.group, found.metric), []).append(found)
    for (group, metric), found in by_key.items():
        if arms := [a for a in found if a.points]:
            tables += _multiplier_tables(group, metric, arms, pct)
    notes = [MULTIPLIER_NOTE.format(baseline=first.baseline)]
    notes += list(dict.fromkeys(f"{group_label(*m.group)} {m.arm}: {note}" for m in measured for note in m.notes))
    if fmt == "markdown":
        return "\n".join(layout(tables, fmt) + [f"- {line}" for line in notes])
    width = WIDTH if fmt == "table" else None
    return "\n".join(layout(tables, fmt, width) + wrap_lines(notes, width))


def _multiplier_tables(group: tuple, metric: str, arms: Sequence[ArmMultiplier], pct: str) -> list[Table]:
    """One group's and metric's M at each horizon of its arms, then each arm's trend and ladder."""
    points = sorted({p for arm in arms for p in arm.points})
    title = f"{group_label(*group)}, {get_metric(metric).label}: M against {arms[0].baseline}'s ladder"
    tables: list[Table] = []
    for start in range(0, len(arms), M_COLUMNS):
        shown = arms[start:start + M_COLUMNS]
        tables.append((title if start == 0 else None, ("horizon", "C", *(f"M {a.arm} ({pct} CI)" for a in shown)),
                       [[f"{point:g}", _flops_at(shown, point), *(_multiplier_at(a, point) for a in shown)]
                        for point in points]))
    tables.append((None, ("arm", f"trend: d log M / d log C ({pct} CI)", "n", "seeds", "ladder reach"),
                   [[a.arm, _estimate_cell(a.trend), str(a.trend_seeds), str(len(a.seeds)), f"{a.reach:.3g}"]
                    for a in arms]))
    return tables


def _flops_at(arms: Sequence[ArmMultiplier], point: float) -> str:
    found = [a.flops[a.points.index(point)] for a in arms if point in a.points]
    return f"{found[0]:.3g}" if found else ""


def _multiplier_at(arm: ArmMultiplier, point: float) -> str:
    if point not in arm.points:
        return ""
    m = arm.multipliers[arm.points.index(point)]
    return _m_cell(m) if m is not None else "bounds both ways: not read"


def _m_cell(m: Ratio) -> str:
    """'[bound]M [lo, hi]', and how many seeds lie past the ladder (no interval when they all do: a bound alone)."""
    interval = "" if math.isnan(m.lo) or (m.bound and math.isnan(m.p)) else f" [{m.lo:.3g}, {m.hi:.3g}]"
    past = {">": f" ({m.not_reached}/{m.n} past the ladder)", "<=": " (seeds before its start)"}.get(m.bound, "")
    return f"{m.bound}{m.geomean:.3f}{interval}{past}"


VERDICT_TITLE = ("The plan's verdict at B (pays.ratio: compute multiplier): per arm and metric, T1 the paired difference "
                 "arm − {baseline} at B and T2 log M(B), M measured on {baseline}'s ladder, against 0, {method} across "
                 "them together; {pct} intervals")
VERDICT_NOTE = (
    "Verdict (the plan's rule): an arm pays at B when, after {method}, the measured M(B)'s interval lies above 1 "
    "(p adj < {alpha:g}, M above 1) on every one of {metrics} and T1 agrees in direction on every one (the arm "
    "lower than {baseline}: the sign of Δ at B, by a gap of at least {ses:g} combined sampling errors, i.e. {ses:g}× "
    "the SE of Δ its rows' sampling errors imply; a smaller gap is 'not detected'); it does not pay when M(B)'s "
    "interval lies below 1 after {method} on any of them; otherwise it is undecided, and the verdict line says what "
    "each metric showed. A bound on M (some seeds past the ladder's end: 'at least') may read above 1, never below "
    "(an upper bound the reverse). 'the metrics disagree' only where one metric points the arm's better way and "
    "another its worse one. No fitted curve enters a verdict; other horizons' M, the trend, alignment and "
    "device-hours are reported, not tested.")


def render_verdicts(verdicts: Sequence[ArmVerdict], fmt: str = "table", family: Family = EXPLORATORY,
                    details: bool = False) -> str:
    """The compute-multiplier plan's verdict (`multiplicity.multiplier_verdicts`): one line per arm and planned
    metric with T1 and T2 and their corrected p, the arm's verdict; then per arm its verdict and why, every
    place its metrics disagree, and the rule. Text or Markdown ("" without verdicts; CSV renders as text, in
    full: it goes beside a CSV, to stderr). Text fits WIDTH columns unless `details` (`_verdict_tables`)."""
    if not verdicts:
        return ""
    width = WIDTH if fmt == "table" and not details else None
    fmt = "table" if fmt == "csv" else fmt
    pct = _pct(1 - family.alpha)
    baseline = verdicts[0].baseline
    header = ("group", "arm", "metric", f"Δ at B ({pct} CI)", "Δ p", "Δ p adj", "T1", "T1 verdict",
              f"M(B) ({pct} CI)", "M p", "M p adj", "T2", "verdict", "reading")
    rows = [(a.group, [group_label(*a.group), a.arm, v.metric, *_t1_cells(v), *_t2_cells(v), a.verdict,
                       a.reading]) for a in verdicts for v in a.metrics]
    title = VERDICT_TITLE.format(baseline=baseline, method=family.method, pct=pct)
    tables = [(title, header, [cells for _, cells in rows])] if width is None else [
        (title, None, []), *_verdict_tables(header, rows)]
    lines = [f"verdict: {group_label(*a.group)} {a.arm}" + (f" at B = {a.budget:.3g} FLOPs" if a.budget else "")
             + f": {a.verdict}: {a.why}" for a in verdicts]
    lines += [f"disagree: {group_label(*a.group)} {a.arm}: {line}" for a in verdicts for line in a.disagreements]
    metrics = " and ".join(get_metric(m).label for m in (family.metrics or CO_PRIMARY))
    lines.append(VERDICT_NOTE.format(method=family.method, alpha=family.alpha, metrics=metrics, baseline=baseline,
                                     ses=DETECTED_SES))
    if fmt == "markdown":
        return "\n".join(layout(tables, fmt) + [f"- {line}" for line in lines])
    return "\n".join(layout(tables, fmt, width) + wrap_lines(lines, width))


def _verdict_tables(header: Sequence[str], rows: Sequence[tuple[tuple, list[str]]]) -> list[Table]:
    """The verdict table in compact text: per group, under its heading, T1's columns in one table and T2's
    with the arm's verdict in another, since the fourteen together overflow WIDTH."""
    t1, t2 = header.index("T1 verdict") + 1, header.index("verdict") + 1
    tables = []
    for group, cells in _by_group(rows).items():
        label = _heading(group)
        tables += [compact_table(f"{label}: T1, the difference at B", header, cells, ("arm", "metric", *header[3:t1]),
                                  short=("T1 verdict",)),
                   compact_table(f"{label}: T2, the measured M(B), and the arm's verdict", header, cells,
                                  ("arm", "metric", *header[t1:t2], "reading"), lift=("reading",))]
    return tables


def _t1_cells(v: MetricVerdict) -> list[str]:
    d = v.difference
    if d is None:
        return ["", "", "", "no comparison", ""]
    interval = "" if math.isnan(d.lo) else f" [{d.lo:.3g}, {d.hi:.3g}]"
    return [f"{d.mean:.4g}{interval}", _g(_finite(d.p)), _g(_finite(d.p_adj)), v.direction or "none",
            d.verdict.split(";")[0]]


def _t2_cells(v: MetricVerdict) -> list[str]:
    m = v.multiplier
    if m is None:
        return ["", "", "", v.side]
    return [_m_cell(m), _g(_finite(m.p)), _g(_finite(m.p_adj)), v.side]


def headline(verdicts: Sequence[ArmVerdict]) -> str:
    """One sentence from the compute-multiplier verdicts: per group, each arm's verdict at B, and where its
    metrics disagree ("" without verdicts)."""
    groups: dict[tuple, list[ArmVerdict]] = {}
    for verdict_ in verdicts:
        groups.setdefault(verdict_.group, []).append(verdict_)
    parts = []
    for group, found in groups.items():
        budget = next((a.budget for a in found if a.budget), None)
        arms = ", ".join(f"{a.arm} {a.verdict}" + (" (its metrics disagree)" if a.disagreements else "")
                         for a in found)
        parts.append(f"on {group_label(*group)}" + (f" at B = {budget:.3g} FLOPs" if budget else "") + f": {arms}")
    labels = sorted({a.reading for a in verdicts})
    return (f"By the plan's rule ({' and '.join(labels)}), " + "; ".join(parts) + ".") if parts else ""


def ratio_headline(summary: Sequence[Summary], family: Family = EXPLORATORY) -> str:
    """One sentence for a plan that tests compute-to-target ratios (or for no plan): per group, each arm's
    "pays" on the plan's compute axis at the baseline's last horizon, and where its metrics disagree ("" with
    no comparison)."""
    metrics = family.compared()
    groups: dict[tuple, list[str]] = {}
    for record in summary:
        horizons = _horizons(record)
        if not horizons:
            continue
        verdicts = _ratio_verdicts(record, horizons[-1], metrics, family)
        split = " (its metrics disagree)" if agreement(list(verdicts.values())) == "disagree" else ""
        groups.setdefault(record.group, []).append(f"{record.arm} {family.pays(verdicts)}{split}")
    if not groups:
        return ""
    labels = sorted({family.reading(m, family.compute) for m in (family.metrics or CO_PRIMARY)})
    rule = f"By the plan's rule ({' and '.join(labels)})" if family.metrics else "Without a plan (exploratory)"
    baseline = next(c.baseline for r in summary for c in r.comparisons.values())
    return (f"{rule}, on the {COMPUTE[family.compute]} to reach {baseline}'s value at its last horizon: "
            + "; ".join(f"on {group_label(*group)}: {', '.join(arms)}" for group, arms in groups.items()) + ".")


def _scaling_tables(fit: GroupFit, pct: str) -> list[Table]:
    """One group's and metric's compute curves: the ladder check first; only where it held, each arm's
    parameters, M at each horizon (at most M_COLUMNS arms a table, to keep within ~120 columns), each arm's
    crossover and the held-out check."""
    label = get_metric(fit.metric).label
    check = _ladder_tables(fit, pct)
    if fit.ladder_held is not True:
        why = (f"the fit of {fit.baseline} on its horizons up to B missed its own ladder past B" if fit.ladder_held
               is False else f"{fit.baseline}'s ladder does not reach past B on two or more seeds: nothing checks it")
        return [(f"{group_label(*fit.group)}, {label}: fitted curves not shown: {why}; no fitted M past the ladder "
                 "and no C*", None, []), *check]
    weights = (f"residuals over sampling errors: χ²/dof {fit.chi2_dof:.3g} (median over seeds)" if fit.weighted else
               "residuals over the values (relative errors: the rows have no sampling errors)")
    title = f"{group_label(*fit.group)}, {label}: B = {fit.budget:.3g} FLOPs, {len(fit.fits)} seed(s)\n{weights}"
    tables: list[Table] = [*check, (title, ("arm", f"E ({pct} CI)", f"A ({pct} CI)", f"α ({pct} CI)"),
                                    [[_arm_cell(arm.arm, arm.seeds, len(fit.fits)), _estimate_cell(arm.floor),
                                      _estimate_cell(arm.amplitude), _estimate_cell(arm.exponent)]
                                     for arm in fit.arms])]
    arms = [arm for arm in fit.arms if arm.multipliers]
    for start in range(0, len(arms), M_COLUMNS):
        shown = arms[start:start + M_COLUMNS]
        tables.append((None, ("horizon", "FLOPs", *(f"M {arm.arm} ({pct} CI)" for arm in shown)),
                       [[f"{point:g}", f"{flops:.3g}", *(_ratio(arm.multipliers[i]) for arm in shown)]
                        for i, (point, flops) in enumerate(zip(fit.points, fit.horizons))]))
    if arms:
        tables.append((None, ("arm", f"trend: d log M / d log C ({pct} CI)", f"crossover C*: M = 1 ({pct} CI)"),
                       [[arm.arm, _estimate_cell(arm.trend), crossover_reading(fit, arm)] for arm in arms]))
    if fit.held_out:
        early = fit.held_out_points
        tables.append((f"held out: fitted on horizons {early[0]:g} to {early[-1]:g}, predicting {fit.points[-1]:g} (B)",
                       ("arm", "figure at B", f"predicted ({pct} CI)", f"measured ({pct} CI)", "prediction"),
                       [_prediction_cells(p, label) for p in fit.held_out]))
    return tables


def _ladder_tables(fit: GroupFit, pct: str) -> list[Table]:
    """The ladder check's table: per horizon past B, the baseline's predicted and measured value, the error's
    interval against the tolerance, and whether it held."""
    if not fit.ladder:
        return []
    verdict = {None: "not judged: one seed", True: "held", False: "failed"}
    return [(f"{group_label(*fit.group)}, {get_metric(fit.metric).label}: the ladder check ({fit.baseline} fitted on "
             "horizons up to B, past the warm-up)",
             ("C", f"predicted ({pct} CI)", f"measured ({pct} CI)", f"error ({pct} CI)", "tolerance", "check"),
             [[f"{p.flops:.3g}", _interval_cell(p.predicted), _interval_cell(p.measured), _interval_cell(p.error),
               f"±{p.tolerance:.3g}", verdict[p.held]] for p in fit.ladder])]


def _arm_cell(arm: str, seeds: int, of: int) -> str:
    return arm if seeds == of else f"{arm} ({seeds} of {of} seeds)"


def _estimate_cell(estimate: Estimate | None) -> str:
    if estimate is None:
        return ""
    mean, half = estimate
    return _interval_cell(Interval(mean, mean - half, mean + half))


def _interval_cell(interval: Interval, spec: str = ".4g") -> str:
    value, lo, hi = interval
    return f"{value:{spec}}" if math.isnan(lo) else f"{value:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def crossover_reading(fit: GroupFit, arm: ArmFit) -> str:
    """An arm's crossover C* as the tables read it: 'C* [lo, hi]', 'none within k× of B (...)', or not read where
    its held-out prediction failed (a curve that missed B is not extrapolated further)."""
    return ("not read: its held-out prediction failed" if fit.failed(arm.arm) else
            _crossover_cell(arm.crossover, fit.within))


def _crossover_cell(crossover: Crossover, within: float) -> str:
    """'C* [lo, hi]', or 'none within k× of B (j of n seeds cross there)'."""
    if crossover.flops is None:
        return f"none within {within:g}× of B ({crossover.crossing} of {crossover.seeds} seeds cross there)"
    return _interval_cell(Interval(crossover.flops, crossover.lo, crossover.hi), ".3g")


def _prediction_cells(prediction: Prediction, label: str) -> list[str]:
    verdict = {None: "not judged: no interval", True: "failed", False: "held"}[prediction.failed]
    figure = "M" if prediction.quantity == "M" else label
    return [prediction.arm, figure, _interval_cell(prediction.predicted), _interval_cell(prediction.measured),
            verdict]


def layout(tables: Sequence[Table], fmt: str, width: int | None = None) -> list[str]:
    """Tables one after another, each under its title, a blank line after each; Markdown puts a title in a
    paragraph of its own so that it is not read into the table. With a width, text titles wrap and text
    tables narrow to it (`_text_table`)."""
    lines = []
    for title, header, cells in tables:
        lines += ([title, ""] if fmt == "markdown" else wrap_lines([title], width)) if title else []
        if header is not None:
            lines += (_markdown_table(header, cells) if fmt == "markdown" else _text_table(header, cells, width)) + [""]
        elif fmt != "markdown":
            lines.append("")
    return lines


def wrap_lines(lines: Sequence[str], width: int | None) -> list[str]:
    """Each line (a note, a 'disagree:' line, a title's every line) on lines of at most `width`, continuations
    indented two spaces, so that nothing is cut; the lines as they are without a width (--details)."""
    if width is None:
        return list(lines)
    return [part for line in lines for piece in line.split("\n")
            for part in textwrap.wrap(piece, width, subsequent_indent="  ", break_on_hyphens=False) or [piece]]


def _grouped(header: Sequence[str], rows: Sequence[tuple[tuple, list[str]]], keep: Sequence[str],
             lift: Sequence[str] = (), short: Sequence[str] = ()) -> list[Table]:
    """Rows of (group, cells) as one compact table per group under its heading (`_compact_table`)."""
    return [compact_table(_heading(group), header, cells, keep, lift, short) for group, cells in _by_group(rows).items()]


def _by_group(rows: Sequence[tuple[tuple, list[str]]]) -> dict[tuple, list[list[str]]]:
    """The cells of each group, groups in the order they first appear."""
    groups: dict[tuple, list[list[str]]] = {}
    for group, cells in rows:
        groups.setdefault(group, []).append(cells)
    return groups


def _heading(group: tuple) -> str:
    """A group's name over its compact tables: `group_label`, less the slashes around fields it lacks."""
    return group_label(*group).strip("/")


def compact_table(heading: str, header: Sequence[str], cells: list[list[str]], keep: Sequence[str],
                   lift: Sequence[str] = (), short: Sequence[str] = ()) -> Table:
    """The columns of `keep` that hold a value in some row, each column of `lift` that holds one value in every
    row moved into the heading as "(name: value)", and the verdicts of the columns in `short` shortened
    (`short_verdict`): a table that says, in fewer columns, all that its rows differ in. A suffix on every
    value of a column (EVAL_SE) moves to its header."""
    columns = [(name, [row[header.index(name)] for row in cells]) for name in keep]
    columns = [(name, [short_verdict(v) for v in values] if name in short else values)
               for name, values in columns if any(values)]
    uniform = {name for name, values in columns if name in lift and len(set(values)) == 1}
    said = "; ".join(f"{name}: {values[0]}" for name, values in columns if name in uniform)
    shown = [_suffix_to_header(name, values) for name, values in columns if name not in uniform]
    return (f"{heading} ({said})" if said else heading, [name for name, _ in shown],
            [list(row) for row in zip(*(values for _, values in shown), strict=True)])


def _suffix_to_header(name: str, values: list[str]) -> tuple[str, list[str]]:
    """EVAL_SE once in the header when every value of the column carries it, else on the values."""
    filled = [value for value in values if value]
    if not filled or not all(value.endswith(EVAL_SE) for value in filled):
        return name, values
    return name + EVAL_SE, [value.removesuffix(EVAL_SE) for value in values]


SHORT_VERDICT = (  # (pattern, replacement): a verdict's words in compact text; its figures and explanations are
    # --details' (the MDE) and the notes'. A verdict none of them matches is kept whole (its column wraps).
    (r"; an effect larger than \S+ would have been detected", ""),
    (r"^not tested: no interval from fewer than 2 runs", "not tested (one run a side)"),
    (r"\|Δ\| is (\S+) combined sampling errors: ", r"|Δ| \1 SE: "),
    (r", not against seed noise$", " only"),
    (r"^not detected: \|Δ\| \S+ is under (\S+) combined sampling errors \(\S+\)", r"not detected: |Δ| under \1 SE"),
    (r"^inconclusive: zero spread over seeds, so no interval width and no p$", "inconclusive: zero spread, no p"),
)


def short_verdict(verdict_: str) -> str:
    """A difference's verdict with every word that decides it (better, worse, no difference detected after
    holm (uncorrected: better), not detected, not tested, detected against eval noise only, inconclusive) and
    without the MDE, which --details prints in its own column."""
    for pattern, replacement in SHORT_VERDICT:
        verdict_ = re.sub(pattern, replacement, verdict_)
    return verdict_


def _pct(level: float) -> str:
    return f"{100 * level:g}%"


def _comparison_header(pct: str) -> tuple[str, ...]:
    return (*GROUP_HEAD, "arm", "metric", "test", "n", f"Δ ({pct} CI)", "p", "p adj",
            "MDE", "eval/seed SE", "verdict", "metrics", "reading")


def _targets_header(metrics: Sequence[str], pct: str, tested: bool = True) -> tuple[str, ...]:
    """Compute to target's columns; without the tests' (p adj, verdict, pays, metrics) where ratios are only
    reported (`Family.tests_ratios`)."""
    per_metric = ("target", f"FLOPs ratio ({pct} CI)", f"device-h ratio ({pct} CI)", *(("p adj", "verdict") * tested))
    return (*GROUP_HEAD, "arm", "horizon",
            *(f"{get_metric(metric).label} {column}" for metric in metrics for column in per_metric),
            *(("pays", "metrics") * tested), "reading")


def _pays_rule(family: Family) -> str:
    metrics = " and ".join(get_metric(m).label for m in (family.metrics or CO_PRIMARY))
    return f"the {COMPUTE[family.compute]} ratio pays on every one of {metrics}"


def _text_table(header: Sequence[str], cells: list[list[str]], width: int | None = None) -> list[str]:
    """Columns two spaces apart, each as wide as its widest cell; with a width, the widest columns narrow
    (`_fitted`) and a cell longer than its column wraps onto continuation lines of the row, so none is cut."""
    natural = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    widths = natural if width is None else _fitted(natural, width)
    return [line for row in [header, ["-" * w for w in widths], *cells] for line in _row_lines(row, widths)]


def _row_lines(row: Sequence[str], widths: Sequence[int]) -> list[str]:
    """One table row: one line, or more where a cell wraps within its column."""
    parts = [[cell] if len(cell) <= w else textwrap.wrap(cell, w, break_on_hyphens=False) for cell, w in zip(row, widths)]
    return ["  ".join(part.ljust(w) for part, w in zip(line, widths)).rstrip()
            for line in itertools.zip_longest(*parts, fillvalue="")]


def _fitted(widths: Sequence[int], limit: int, floor: int = 8) -> list[int]:
    """Column widths whose rows (columns two spaces apart) fit `limit`: the widest column narrows first, to the
    next widest, then those two together, and so on, none below `floor` (a table of many columns that
    overflows even then stays wider)."""
    widths = list(widths)
    excess = sum(widths) + 2 * (len(widths) - 1) - limit
    while excess > 0 and max(widths) > floor:
        i = widths.index(max(widths))
        cut = min(excess, max(1, widths[i] - max([floor, *widths[:i], *widths[i + 1:]])))
        widths[i] -= cut
        excess -= cut
    return widths


def _markdown_table(header: Sequence[str], cells: list[list[str]]) -> list[str]:
    return [_markdown_line(header), _markdown_line(["---"] * len(header)), *(_markdown_line(row) for row in cells)]


def _group_cells(record: Summary) -> list[str]:
    return [record.dataset or "", _model_cell(record), _int(record.batch_size), _g(record.budget_flops), record.arm]


def _comparison_cells(record: Summary, metric: str, metrics: Sequence[str], family: Family) -> list[str]:
    """Display strings of one comparison, in `_comparison_header` order."""
    c = record.comparisons[metric]
    d = c.difference
    n = f"{d.n} pairs" if d.test == "paired" else f"{d.n} vs {d.n_base}"
    interval = "" if math.isnan(d.lo) else f" [{d.lo:.3g}, {d.hi:.3g}]"
    return [*_group_cells(record), metric, d.test, n, f"{d.mean:.4g}{interval}", _g(_finite(d.p)),
            _g(_finite(d.p_adj)), _g(_finite(d.mde)), _g(_finite(d.eval_share)), d.verdict,
            agreement(_final_verdicts(record, metrics)), family.reading(metric)]


def _final_verdicts(record: Summary, metrics: Sequence[str]) -> list[str]:
    return [record.comparisons[m].difference.verdict for m in metrics if m in record.comparisons]


def _horizons(record: Summary) -> list[float]:
    """The baseline horizons an arm's comparisons read compute-to-target at."""
    return sorted({t.point for c in record.comparisons.values() for t in c.targets})


def _target_at(record: Summary, metric: str, point: float) -> Target | None:
    c = record.comparisons.get(metric)
    return next((t for t in c.targets if t.point == point), None) if c else None


def _ratio_verdicts(record: Summary, point: float, metrics: Sequence[str], family: Family) -> dict[str, str]:
    """Per metric with a reading at this horizon, the verdict on its ratio on the plan's compute axis."""
    targets = {metric: _target_at(record, metric, point) for metric in metrics}
    return {metric: ratio_verdict(t.ratios[family.compute], family.alpha) for metric, t in targets.items() if t}


def _target_cells(record: Summary, point: float, metrics: Sequence[str], family: Family) -> list[str]:
    """Display strings of one arm at one baseline horizon, in `_targets_header` order."""
    cells = [*_group_cells(record), _g(point)]
    for metric in metrics:
        t = _target_at(record, metric, point)
        planned = t and t.ratios[family.compute]
        tests = [_g(_finite(planned.p_adj) if planned else None), ratio_verdict(planned, family.alpha)] if t else ["", ""]
        cells += ["", "", ""] if t is None else [
            f"{t.value:.4g}" + _repeats(t), *(_ratio(t.ratios[axis]) + pooled_mark(t, axis, metric) for axis in COMPUTE)]
        cells += tests if family.tests_ratios else []
    return [*cells, *_target_tail(record, point, metrics, family)]


def _compact_target_cells(record: Summary, point: float, metrics: Sequence[str], family: Family) -> list[str]:
    """One arm at one baseline horizon in compact text: arm, horizon, per metric the ratio on the plan's
    compute axis (its bound, the seeds that never reached, the short pooled mark and the horizon a repeated
    target is), then pays where ratios are tested, and the reading."""
    tail = _target_tail(record, point, metrics, family)
    ratios = [_compact_ratio(_target_at(record, metric, point), family.compute, metric) for metric in metrics]
    return [record.arm, _g(point), *ratios, *(tail[:1] if family.tests_ratios else []), tail[-1]]


def _compact_ratio(target: Target | None, axis: str, metric: str) -> str:
    """A ratio in compact text: `_ratio`, the short pooled mark, and the horizon whose target it repeats."""
    if target is None:
        return ""
    return _ratio(target.ratios[axis]) + pooled_mark(target, axis, metric, short=True) + _repeats(target)


def _target_tail(record: Summary, point: float, metrics: Sequence[str], family: Family) -> list[str]:
    """pays, the metrics' agreement and the reading of one arm at one horizon; where ratios are only reported
    (`Family.tests_ratios`), "reported, not tested" alone."""
    if not family.tests_ratios:
        return ["reported, not tested"]
    verdicts = _ratio_verdicts(record, point, metrics, family)
    return [family.pays(verdicts), agreement(list(verdicts.values())), _reading(family, list(verdicts), family.compute)]


def _repeats(target: Target) -> str:
    """' (= h)' where the baseline's fit pooled this horizon with horizon h, whose target and ratios these are."""
    return "" if target.repeats is None else f" (= {target.repeats:g})"


def _reading(family: Family, metrics: Sequence[str], compute: str | None = None) -> str:
    """One label when the metrics' readings share it, else each metric's."""
    labels = {metric: family.reading(metric, compute) for metric in metrics}
    if len(set(labels.values())) <= 1:
        return next(iter(labels.values()), "")
    return ", ".join(f"{get_metric(metric).label} {label}" for metric, label in labels.items())


def _disagreements(compared: Sequence[Summary], metrics: Sequence[str], family: Family) -> list[str]:
    """One line per arm and reading (the final point, a horizon's ratio) where the metrics disagree."""
    lines = []
    for record in compared:
        where = f"disagree: {group_label(*record.group)} {record.arm}"
        final = {m: record.comparisons[m].difference.verdict for m in metrics if m in record.comparisons}
        readings = [("at the final point", final)]
        readings += [(f"{COMPUTE[family.compute]} ratio at horizon {point:g}",
                      _ratio_verdicts(record, point, metrics, family)) for point in _horizons(record)
                     if family.tests_ratios]
        lines += [f"{where} {at}: " + ", ".join(f"{get_metric(m).label} {v.split(';')[0]}" for m, v in verdicts.items())
                  for at, verdicts in readings if agreement(list(verdicts.values())) == "disagree"]
    return lines


def pooled_mark(target: Target, axis: str, metric: str, short: bool = False) -> str:
    """' (pooled over a rising curve: k/n)' when k of the n seeds' arm runs reach the target only at a point
    their monotone fit pooled over a stretch where the run went the wrong way (`targets.seed_pooled`; "falling"
    for a metric where higher is better); with `short`, ' †k/n' (POOLED_SHORT_NOTE says the rest); "" otherwise."""
    ratio, k = target.ratios.get(axis), target.pooled.get(axis, 0)
    if not k or ratio is None:
        return ""
    if short:
        return f" {POOLED_MARK}{k}/{ratio.n}"
    return f" ({POOLED} {'rising' if get_metric(metric).lower_is_better else 'falling'} curve: {k}/{ratio.n})"


def _ratio(ratio: Ratio | None) -> str:
    """'[bound]geomean [lo, hi]', and how many seeds never reached the target."""
    if ratio is None:
        return ""
    interval = "" if math.isnan(ratio.lo) else f" [{ratio.lo:.3g}, {ratio.hi:.3g}]"
    missed = f" ({ratio.not_reached}/{ratio.n} not reached)" if ratio.not_reached else ""
    return f"{ratio.bound}{ratio.geomean:.3f}{interval}{missed}"


def group_label(dataset: str | None, model: str | None, batch_size: int | None, budget_flops: float | None,
                started_from: str = "") -> str:
    """dataset/model[ from SOURCE][/bBATCH]/budget: a group's name in notes (the batch when rows record one)."""
    start = f" from {started_from}" if started_from else ""
    batch = f"/b{batch_size}" if batch_size else ""
    return f"{dataset}/{model}{start}{batch}/{_g(budget_flops)}"


def _group_notes(record: Summary) -> list[str]:
    """A record's group notes, prefixed with its group so they read on their own under a table."""
    group = group_label(*record.group)
    extra = [f"{record.arm}: {c.note}" for c in record.comparisons.values() if c.note]
    return [f"{group}: {note}" for note in dict.fromkeys((*record.notes, *extra))]


def table_header() -> tuple[str, ...]:
    """The summary table's columns: each compared metric of the registry (and the feature space it is measured
    in, where it names one) between the group's columns and the compute's."""
    metrics = [get_metric(name) for name in compared_metrics()]
    return (*TABLE_HEAD, *(label for m in metrics for label in (m.label, *((f"{m.label} features",) if m.features else ()))),
            *TABLE_TAIL)


def _table_cells(record: Summary, sources: list[str]) -> list[str]:
    """Display strings of one record, in `table_header` order."""
    def cells(metric: str) -> list[str]:
        value = _pm(record.metrics[metric]) + (EVAL_SE if metric in record.eval_only else "")
        features = get_metric(metric).features
        return [value, getattr(record, features) or ""] if features else [value]

    return [
        *_group_cells(record), _g(record.point), str(record.n), *(c for m in compared_metrics() for c in cells(m)),
        f"{_g(record.gpu_hours)} {record.device}".strip(), f"[{sources.index(record.source) + 1}]" if record.is_reference else "",
    ]


def _pm(estimate: Estimate | None) -> str:
    """'mean ± half-width' to 4 significant digits; the mean alone when there is no interval."""
    if estimate is None:
        return ""
    mean, half = estimate
    return f"{mean:.4g}" if math.isnan(half) else f"{mean:.4g} ± {half:.2g}"


def _g(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _model_cell(record: Summary) -> str:
    """The model, and the trained run its group started from (`init_from`), if any."""
    return (record.model or "") + (f" from {record.started_from}" if record.started_from else "")


def _int(value: int | None) -> str:
    return "" if value is None else str(value)


def _markdown_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _render_csv(summary: Sequence[Summary], metrics: Sequence[str], family: Family) -> str:
    """Full precision, one row per record; no value (or no interval) is an empty cell. Per compared metric:
    the comparison at the final point on the arm's final record, and on each arm's record the ratios at the
    baseline horizon of the same point."""
    finals = {(r.group, r.arm): r for r in summary if r.comparisons}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow((*CSV_HEADER, *(f"{m}_{column}" for m in metrics for column in CSV_PER_METRIC), *CSV_TAIL))
    for r in summary:
        final = finals.get((r.group, r.arm))
        estimates = [x for m in compared_metrics() for x in (r.metrics[m] or (None, None))]
        blocks = [x for m in metrics for x in _csv_metric(r, final, m, family)]
        verdicts = _ratio_verdicts(final, r.point, metrics, family) if final and family.tests_ratios else {}
        shown = [m for m in metrics if m in r.comparisons] or list(verdicts)
        values = (r.dataset, r.model, r.batch_size, r.budget_flops, r.started_from, r.arm, r.point, r.n, *estimates,
                  ";".join(r.eval_only), r.train_flops, r.gpu_hours, r.fid_features, *blocks,
                  agreement(_final_verdicts(r, metrics)), family.pays(verdicts) if verdicts else None,
                  agreement(list(verdicts.values())), _reading(family, shown), r.source,
                  "; ".join(_group_notes(r)))
        writer.writerow(["" if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values])
    return buffer.getvalue()


def _csv_metric(record: Summary, final: Summary | None, metric: str, family: Family) -> tuple:
    """One metric's CSV cells (test ... ratio_verdict): the difference where the record holds the comparison,
    the ratios where the arm's comparison has a target at the record's point; empty otherwise."""
    c = record.comparisons.get(metric)
    d = c.difference if c else None
    difference = (None,) * 11 if d is None else (
        d.test, d.n if d.test == "paired" else None, d.mean, d.lo, d.hi, d.p, d.p_adj, d.mde, d.se, d.eval_se,
        d.verdict)
    t = _target_at(final, metric, record.point) if final else None
    if t is None:
        return (*difference, *(None,) * (3 + 2 * len(RATIO_PARTS)))
    ratios = [x for axis in COMPUTE for r in [t.ratios[axis]]  # p adj only where the family tests the ratio
              for x in ((r.bound, r.geomean, r.lo, r.hi, r.p, r.p_adj if family.tests_ratios else None, r.not_reached,
                         t.pooled.get(axis, 0)) if r else (None,) * len(RATIO_PARTS))]
    verdict_ = ratio_verdict(t.ratios[family.compute], family.alpha) if family.tests_ratios else "not tested"
    return (*difference, t.value, t.repeats, *ratios, verdict_)
