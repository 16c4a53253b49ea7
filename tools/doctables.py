"""The tables of README.md and docs/*.md that read committed CSVs (and the config keys' page, which reads the
schema), made by code and never typed.

A generated table sits between two marker lines in the Markdown:

    <!-- table: NAME -->
    (the table, written by this module)
    <!-- /table -->

`TABLES` maps each NAME to the CSVs it reads and the function that renders it; each function reads the
rows the way `maskbench leaderboard` does (`analysis.analyse_rows` under the plan beside the CSV, if any), so a
ratio that is only a bound shows as one ("> 0.69": a seed never reached the target), a ratio read where an
arm's monotone fit pooled a rising stretch says so, and a gap under 2 combined sampling errors reads "not
detected". Counts, floors and ratios that prose quotes live in these tables.

    python -m tools.doctables            # check: exit 1 naming every stale or unknown table
    python -m tools.doctables --write    # rewrite every marked table from its CSVs
    python -m tools.doctables --list     # each table, the file it sits in and the CSVs it reads

`tests/test_doctables.py` regenerates every table and fails when the committed text differs. It lives beside
the repository's docs, not in the `maskbench` package: it names this repository's study CSVs and writes its
documentation, which a user who installs maskbench has no use for (their own studies read with `maskbench
leaderboard`, `--html` and `--plot`).
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import yaml

from maskbench.config.keys import config_keys
from maskbench.metrics import CO_PRIMARY, get_metric
from maskbench.results.analysis import Analysis, analyse_rows
from maskbench.results.estimators import Difference, Ratio, ratio_verdict
from maskbench.results.multiplicity import Family
from maskbench.results.multiplier import ArmMultiplier
from maskbench.results.rows import Row, read_rows
from maskbench.results.study_plan import applied_plan, with_ladder
from maskbench.results.summary import Summary, gap_in_ses, summarize
from maskbench.results.tables import headline, render, render_multipliers, render_scaling, render_verdicts
from maskbench.results.targets import Target
from maskbench.results.trajectory import STEPS

ROOT = Path(__file__).resolve().parents[1]
START = re.compile(r"^<!-- table: ([a-z0-9-]+) -->$")
END = "<!-- /table -->"
Z95 = 1.959963984540054  # a row's own 95% half-width: z · its sampling error


def documents(root: Path) -> list[Path]:
    """The Markdown files that may hold generated tables: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# ------------------------------------------------------------------------------------------- reading rows
@functools.cache
def _rows(root: Path, path: str) -> tuple[Row, ...]:
    return tuple(read_rows([str(root / path)], on_error="abort"))


@dataclass(frozen=True)
class StudyTables:
    """One CSV read as the leaderboard reads it: its rows, its plan's family and the corrected summary."""
    rows: tuple[Row, ...]
    family: Family
    summary: list[Summary]
    tests: int


@functools.cache
def _study(root: Path, path: str) -> StudyTables:
    """The rows of `path` summarised under the plan beside it (none: exploratory). Arms of other sizes than the
    baseline are compared (`--allow-size-mismatch`): these tables show the rows as they were read, with each
    arm's parameter count where it differs, so that the reader sees the confound."""
    rows = _rows(root, path)
    applied = applied_plan(list(rows), [str(root / path)], None, None)
    analysis = analyse_rows(list(rows), applied.plan, applied.baseline, applied.family, fits=False,
                            size_tolerance=None)
    return StudyTables(rows, applied.family, analysis.summary, analysis.tests)


def _records(study: StudyTables, model: str, budget: float, started: bool = False) -> dict[str, Summary]:
    """Each arm's record at its final point in one (model, budget) group; from scratch unless `started`."""
    found = [r for r in study.summary if r.model == model and r.budget_flops == budget and not r.is_reference
             and bool(r.started_from) == started]
    return {r.arm: r for r in found if r.point == max(x.point for x in found if x.arm == r.arm)}


def _final_rows(rows: Sequence[Row], model: str, budget: float) -> dict[str, list[Row]]:
    """Per arm, its runs' rows at their final point in one (model, budget) group, from scratch."""
    out: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        if row["model"] == model and row["budget_flops"] == budget and not row["init_from"] and row["point"] == 1.0:
            out[row["arm"]].append(row)
    return out


def _mean(rows: Sequence[Row], column: str) -> float:
    values = [row[column] for row in rows if row[column] is not None]
    return float(np.mean(values)) if values else math.nan


# ---------------------------------------------------------------------------------------------- formatting
def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in lines])


def _g(value: float) -> str:
    return f"{value:.3g}".replace("e+", "e")


def _signed(value: float, spec: str) -> str:
    return f"{value:+{spec}}".replace("-", "−")


def _pm(value: float, se: float | None, spec: str) -> str:
    """'value ± 95% half-width' from a row's own sampling error."""
    return f"{value:{spec}}" if se is None else f"{value:{spec}} ± {Z95 * se:{spec}}"


def _word(verdict: str) -> str:
    """A difference's verdict in a few words: better, worse, no difference detected (after Holm), not detected
    (a gap under 2 combined sampling errors), or not tested (one run a side)."""
    head = re.sub(r" \(uncorrected: \w+\)", "", verdict.split(";")[0]).replace("holm", "Holm")
    if head.startswith("not detected"):
        return "not detected (gap under 2 sampling errors)"
    return "not tested" if head.startswith("not tested") else head


def _difference(d: Difference, spec: str, tested: bool = True) -> str:
    """'Δ [lo, hi] (p, Holm p): verdict', or for one run a side 'Δ (k sampling errors: detected / not)'."""
    if math.isnan(d.lo):
        ses = gap_in_ses(d)
        gap = "" if math.isnan(ses) else f" ({ses:.2f} SE{': not detected' if ses < 2 else ''})"
        return _signed(d.mean, spec) + gap
    p = "" if not tested or math.isnan(d.p) else (
        f" (p {d.p:.2g}" + ("" if d.p_adj == d.p or math.isnan(d.p_adj) else f", Holm p {d.p_adj:.2g}") + ")")
    return f"{_signed(d.mean, spec)} [{_signed(d.lo, spec)}, {_signed(d.hi, spec)}]{p}: {_word(d.verdict)}"


def _ratio(target: Target | None, axis: str, metric: str, family: Family | None = None) -> str:
    """A compute-to-target ratio: '0.86 [0.74, 1.00]', '> 0.69' where a seed never reached the target (a lower
    bound: a cost, not a saving), '≤ 0.99' where an arm was there at its first point; flagged where a seed's
    arm run reached it only on a pooled stretch of a rising curve; with its verdict when the plan tests it."""
    ratio = target.ratios.get(axis) if target else None
    if ratio is None:
        return "–"
    if ratio.bound == ">":
        missed = "not reached" if ratio.not_reached == ratio.n else f"{ratio.not_reached} of {ratio.n} not reached"
        text = f"> {ratio.geomean:.2f} ({missed})"
    elif ratio.bound == "<=":
        text = f"≤ {ratio.geomean:.2f} (at first point)"
    else:
        text = f"{ratio.geomean:.2f}" + ("" if math.isnan(ratio.lo) else f" [{ratio.lo:.2f}, {ratio.hi:.2f}]")
    pooled = target.pooled.get(axis, 0)
    if pooled:
        rising = "rising" if get_metric(metric).lower_is_better else "falling"
        text += f" (pooled over a {rising} curve{'' if ratio.n == 1 else f': {pooled} of {ratio.n}'})"
    if family is not None and family.tests_ratios and not ratio.bound and not math.isnan(ratio.lo):
        text += f" {_side(ratio_verdict(ratio, family.alpha))}"
    return text


def _side(verdict: str) -> str:
    """One metric's ratio verdict as where its interval lies: "pays" is the plan's word for every primary metric
    at once (`Family.pays`), never one metric's."""
    return {"pays": "below 1", "does not pay": "above 1"}.get(verdict, verdict)


def _final_target(record: Summary, metric: str) -> Target | None:
    c = record.comparisons.get(metric)
    return next((t for t in c.targets if t.point == 1.0), None) if c else None


def _params(record_rows: Sequence[Row], base_rows: Sequence[Row]) -> str:
    mine, base = record_rows[0]["params"], base_rows[0]["params"]
    if not mine or not base:
        return ""
    return f"{mine / 1e6:.2f}M" + ("" if mine == base else f" ({_signed(mine / base - 1, '.0%')})")


# ------------------------------------------------------------------------------------------------- tables
def fd_floor(root: Path) -> str:
    """results/fd_floor.csv: the oracle FD of fresh synth scenes (another generation seed) to the held-out ones."""
    with open(root / "results" / "fd_floor.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return _table(("reference: held-out scenes of", "fresh scenes of (another generation seed)", "samples",
                   "real-vs-real oracle FD"),
                  [[f"`{r['dataset']}` ({int(r['reference_n']):,})", f"`{r['fresh']}`", f"{int(r['fresh_n']):,}",
                    f"{float(r['fd_floor']):,.0f}"] for r in rows])


def _curve(rows: Sequence[Row], dataset: str, model: str) -> list[Row]:
    """One model's cooled-horizon curve: a row per horizon (budget × point), the one scored on the most samples
    where two runs share a horizon (a run's final point and the next run's half-way branch)."""
    best: dict[float, Row] = {}
    for row in rows:
        if row["dataset"] != dataset or row["model"] != model:
            continue
        horizon = row["budget_flops"] * row["point"]
        key = next((h for h in best if math.isclose(h, horizon, rel_tol=1e-6)), horizon)
        if key not in best or (row["fid_n"] or 0) > (best[key]["fid_n"] or 0):
            best[key] = row
    return [best[h] for h in sorted(best)]


def _drop(before: Row | None, row: Row) -> str:
    """The fall of val loss from the previous horizon, in % and in combined sampling errors."""
    if before is None:
        return ""
    drop = before["val_loss"] - row["val_loss"]
    ses = drop / math.hypot(before["val_loss_se"], row["val_loss_se"])
    return f"{_signed(-drop / before['val_loss'], '.1%')} ({ses:.0f} SE)"


def _fd_cell(row: Row) -> str:
    return f"{_pm(row['fid'], row['fid_se'], '.0f')} ({row['fid_n']:,})"


def plateau_micro_xs(root: Path) -> str:
    rows = _curve(_rows(root, "results/plateau/curve.csv"), "synth", "micro_xs")
    lines = [[_g(r["budget_flops"] * r["point"]), f"{r['step']:,}", _pm(r["val_loss"], r["val_loss_se"], ".4f"),
              _drop(rows[i - 1] if i else None, r), _fd_cell(r), f"{r['align_acc']:.2f}", f"{r['gpu_hours']:.3f}"]
             for i, r in enumerate(rows)]
    return _table(("cooled horizon (FLOPs)", "steps", "val loss (2,048 held-out)", "on the previous horizon",
                   "FD (samples)", "alignment", "CPU-hours"), lines)


def plateau_smaller(root: Path) -> str:
    rows = _rows(root, "results/plateau/curve.csv")
    lines = []
    for label, curve in (("`micro_xxs`, 1–3 objects", _curve(rows, "synth", "micro_xxs")),
                         ("`micro_xs`, one object", _curve(rows, "synth-o11", "micro_xs"))):
        lines += [[label, _g(r["budget_flops"] * r["point"]), _pm(r["val_loss"], r["val_loss_se"], ".4f"),
                   _drop(curve[i - 1] if i else None, r), _fd_cell(r), f"{r['align_acc']:.2f}"]
                  for i, r in enumerate(curve)]
    return _table(("model, scenes", "cooled horizon (FLOPs)", "val loss (2,048 held-out)", "on the previous horizon",
                   "FD (samples)", "alignment"), lines)


def powered_curve(root: Path) -> str:
    rows = sorted(_rows(root, "results/powered/learning_curve.csv"), key=lambda r: r["point"])
    return _table(("fraction of 6e13", "step", "FLOPs", "val loss", "oracle FD (256)", "alignment"),
                  [[f"{r['point']:g}", str(r["step"]), _g(r["train_flops"]), f"{r['val_loss']:.3f}",
                    f"{r['fid']:.0f}", f"{r['align_acc']:.2f}"] for r in rows])


POWERED = "results/powered/leaderboard.csv"


def powered_final(root: Path) -> str:
    study = _study(root, POWERED)
    lines = []
    for arm, r in _records(study, "micro_s", 4e13).items():
        for metric, spec in (("fid", ".0f"), ("val_loss", ".4f")):
            label, c = get_metric(metric).label, r.comparisons.get(metric)
            if c is None:
                continue
            d, target = c.difference, _final_target(r, metric)
            lines.append([f"`{arm}`", label, f"{_signed(d.mean, spec)} [{_signed(d.lo, spec)}, {_signed(d.hi, spec)}]",
                          f"{d.p:.2g} ({d.p_adj:.2g})", _word(d.verdict), _ratio(target, "train_flops", metric, study.family),
                          _ratio(target, "gpu_hours", metric)])
    return _table(("arm", "metric", "Δ [95% CI]", "p (Holm p)", "verdict", "FLOPs to mask0's final value",
                   "device-hours to it"), lines)


def powered_horizons(root: Path) -> str:
    study = _study(root, POWERED)
    lines = []
    for arm, r in _records(study, "micro_s", 4e13).items():
        for point in sorted({t.point for c in r.comparisons.values() for t in c.targets}):
            targets = {m: next((t for t in r.comparisons[m].targets if t.point == point), None)
                       for m in ("fid", "val_loss")}
            p_adj = targets["val_loss"].ratios["train_flops"].p_adj if targets["val_loss"] else math.nan
            verdicts = {m: ratio_verdict(t.ratios["train_flops"], study.family.alpha) for m, t in targets.items() if t}
            lines.append([f"`{arm}`", f"{point:g}", _ratio(targets["fid"], "train_flops", "fid", study.family),
                          _ratio(targets["val_loss"], "train_flops", "val_loss", study.family)
                          + ("" if math.isnan(p_adj) else f" (Holm p {p_adj:.2g})"),
                          study.family.pays(verdicts), _ratio(targets["val_loss"], "gpu_hours", "val_loss")])
    return _table(("arm", "mask0's horizon", "FLOPs ratio: FD", "FLOPs ratio: val loss", "pays (both)",
                   "device-hours ratio: val loss"), lines)


CROSSOVER = "results/crossover/leaderboard.csv"


@functools.cache
def _crossover(root: Path) -> tuple[list, Family, int]:
    from maskbench.results.crossover import correct_cells, crossover_cells

    rows = list(_rows(root, CROSSOVER))
    applied = applied_plan(rows, [str(root / CROSSOVER)], None, None)
    family = applied.family
    cells = crossover_cells(rows, arm="mask75", baseline=applied.baseline, metrics=family.compared(),
                            level=1 - family.alpha, size_tolerance=None)
    cells, tests = correct_cells(cells, family)
    return cells, family, tests


def _steps(rows: Sequence[Row], model: str, batch: int, point: float) -> int:
    return round(_mean([r for r in rows if r["arm"] == "mask0" and r["model"] == model and r["batch_size"] == batch
                        and math.isclose(r["point"], point)], "step"))


def crossover_design(root: Path) -> str:
    rows = _rows(root, CROSSOVER)
    cells, family, tests = _crossover(root)
    runs = {row["run_id"]: row for row in rows}
    seeds = sorted({row["seed"] for row in runs.values()})
    settings = sorted({(row["model"], row["batch_size"]) for row in runs.values()})
    return _table(("seeds", "runs", "runs per seed", "arms", "(model, batch) settings", "horizons", "cells",
                   "tests Holm corrects"),
                  [[str(len(seeds)), str(len(runs)), " / ".join(str(sum(r["seed"] == s for r in runs.values()))
                                                              for s in seeds),
                    ", ".join(f"`{a}`" for a in sorted({r["arm"] for r in runs.values()})), str(len(settings)),
                    ", ".join(f"{p:g}" for p in sorted({c.point for c in cells})), str(len(cells)), str(tests)]])


def crossover_final(root: Path) -> str:
    rows = _rows(root, CROSSOVER)
    cells, family, _ = _crossover(root)
    lines = []
    for cell in sorted((c for c in cells if c.point == 1.0), key=lambda c: (c.params, c.batch_size)):
        setting = [f"`{cell.model}` ({cell.params / 1e6:.2f}M), {cell.batch_size}",
                   str(_steps(rows, cell.model, cell.batch_size, 1.0))]
        for metric, spec in (("fid", ".0f"), ("val_loss", ".3f")):
            label, reading = get_metric(metric).label, cell.readings[metric]
            d = reading.difference
            lines.append([*setting, label, _cell_ratio(reading, family),
                          f"{_signed(d.mean, spec)} [{_signed(d.lo, spec)}, {_signed(d.hi, spec)}]", _word(d.verdict)])
            setting = ["", ""]
    return _table(("model, batch", "mask0 steps", "metric", "FLOPs ratio [95% CI] (Holm p)", "Δ [95% CI]",
                   "Δ's verdict"), lines)


def _cell_ratio(reading, family: Family) -> str:
    r = reading.ratio
    if r.bound:
        return f"{'>' if r.bound == '>' else '≤'} {r.geomean:.2f} ({r.lo:.2f}–{r.hi:.2f})"
    verdict = _side(ratio_verdict(r, family.alpha))
    return f"{r.geomean:.2f} [{r.lo:.2f}, {r.hi:.2f}] (Holm p {r.p_adj:.2g})" + (f": {verdict}" if verdict != "undecided" else "")


def crossover_counts(root: Path) -> str:
    """What the prose of the map counts, counted: cells whose ratio pays after Holm, cells where the metrics'
    verdicts disagree, and, past 300 mask0 steps, cells whose uncorrected ratio interval lies below 1."""
    from maskbench.results.crossover import _agreement, cell_verdicts

    rows = _rows(root, CROSSOVER)
    cells, family, _ = _crossover(root)

    def where(found) -> str:
        return "; ".join(f"`{c.model}` b{c.batch_size} at {c.point:g} ({_steps(rows, c.model, c.batch_size, c.point):,} "
                         "steps)" for c in found)

    def below(c, m) -> bool:
        r = c.readings[m].ratio
        return not r.bound and r.hi < 1

    late = [c for c in cells if _steps(rows, c.model, c.batch_size, c.point) > 300]
    counts = []
    for metric, label in ((m, get_metric(m).label) for m in CO_PRIMARY):
        below_1 = [c for c in cells if ratio_verdict(c.readings[metric].ratio, family.alpha) == "pays"]
        counts.append([f"{label} ratio below 1 after Holm", f"{len(below_1)} of {len(cells)}", where(below_1)])
    pays = [c for c in cells if family.pays(cell_verdicts(c, family.alpha)) == "pays"]
    counts.append(["pays (both ratios below 1 after Holm: the plan's rule)", f"{len(pays)} of {len(cells)}", where(pays)])
    counts.append(["the metrics' verdicts disagree", f"{sum('disagree' in _agreement(c, family.alpha) for c in cells)} "
                   f"of {len(cells)}", ""])
    for metric, label in ((m, get_metric(m).label) for m in CO_PRIMARY):
        found = [c for c in late if below(c, metric)]
        counts.append([f"past 300 mask0 steps, {label} ratio's uncorrected interval below 1",
                       f"{len(found)} of {len(late)}", where(found)])
    return _table(("reading", "cells", "where"), counts)


PRE_CRN = "results/pre_crn/leaderboard.csv"


def _two_seed_lines(root: Path, arms: Sequence[str] | None, exclude: Sequence[str] = ()) -> list[list[str]]:
    study = _study(root, PRE_CRN)
    records = _records(study, "tiny", 1e13)
    finals = _final_rows(study.rows, "tiny", 1e13)
    chosen = arms or sorted((a for a in records if a not in exclude),
                            key=lambda a: records[a].metrics["fid"][0])
    lines = []
    for arm in chosen:
        r = records[arm]
        fd = r.comparisons.get("fid")
        lines.append([f"`{arm}`", _params(finals[arm], finals["mask0"]), f"{_mean(finals[arm], 'step'):.0f}",
                      f"{r.metrics['fid'][0]:.0f}",
                      f"{r.metrics['val_loss'][0]:.3f}", f"{r.metrics['align_acc'][0]:.3f}", f"{r.gpu_hours:.4f}",
                      _ratio(_final_target(r, "fid"), "train_flops", "fid") if fd else "1",
                      _ratio(_final_target(r, "fid"), "gpu_hours", "fid") if fd else "1",
                      f"{fd.difference.p:.2f}" if fd else ""])
    return lines


TWO_SEED_HEADER = ("arm", "params", "steps", "oracle FD", "val loss", "alignment", "device-hours", "FLOPs to mask0's final FD",
                   "hours to it", "paired p (FD)")


def tiny_mission(root: Path) -> str:
    return _table(TWO_SEED_HEADER, _two_seed_lines(root, ("mask0", "mask75", "mask75_then0")))


def tiny_literature(root: Path) -> str:
    return _table(TWO_SEED_HEADER, _two_seed_lines(root, None, exclude=("mask0", "mask75", "mask75_then0")))


def _one_seed_finals(root: Path, path: str, model: str, order: Callable[[str], object]
                     ) -> Iterator[tuple[str, Summary, Row, dict[str, list[Row]]]]:
    """A one-seed study's arms at 1e13 FLOPs on `model`, in `order`: each with its record, its final row, and
    every arm's final rows (for the baseline's)."""
    study = _study(root, path)
    records, finals = _records(study, model, 1e13), _final_rows(study.rows, model, 1e13)
    for arm in sorted(records, key=order):
        (row,) = finals[arm]
        yield arm, records[arm], row, finals


def literature_first_look(root: Path) -> str:
    lines = []
    for arm, r, row, finals in _one_seed_finals(root, "results/literature/first_look/leaderboard.csv", "tiny",
                                                lambda a: (a != "mask0", a)):
        fd, loss = r.comparisons.get("fid"), r.comparisons.get("val_loss")
        lines.append([f"`{arm}`", _params(finals[arm], finals["mask0"]), str(row["step"]),
                      _pm(row["fid"], row["fid_se"] / Z95, ".0f"), _difference(fd.difference, ".0f") if fd else "",
                      _pm(row["val_loss"], row["val_loss_se"] / Z95, ".4f"),
                      _difference(loss.difference, ".4f") if loss else "", f"{row['align_acc']:.3f}",
                      f"{row['gpu_hours']:.4f}",
                      " / ".join(_ratio(_final_target(r, m), "train_flops", m) for m in ("fid", "val_loss"))
                      if fd else "1 / 1"])
    return _table(("arm", "params", "steps", "oracle FD ± SE", "Δ FD (in SEs)", "val loss ± SE", "Δ val loss (in SEs)",
                   "alignment", "device-hours", "FLOPs to mask0's final FD / val loss"), lines)


LONGSKIP_ARMS = {  # arm: what it fuses, as docs/arms.md names it
    "mask0": "", "lsc": " (Skip-DiT's concat → LayerNorm)", "lsc_uvit": " (U-ViT's concat, λ = 1)",
    "lsc_const": " (λ = 1/√2)", "lsc_scalelong": " (CS, κ = 0.5)", "lsc_scalelong_ls": " (LS, shared gate)",
}


def longskip(root: Path) -> str:
    lines = []
    for arm, r, row, _ in _one_seed_finals(root, "results/longskip/leaderboard.csv", "tiny_deep",
                                           lambda a: (list(LONGSKIP_ARMS).index(a) if a in LONGSKIP_ARMS else 99, a)):
        fd, loss = r.comparisons.get("fid"), r.comparisons.get("val_loss")
        lines.append([f"`{arm}`{LONGSKIP_ARMS.get(arm, '')}", str(row["step"]), _pm(row["fid"], row["fid_se"], ".0f"),
                      _gap(fd.difference, ".0f") if fd else "", _pm(row["val_loss"], row["val_loss_se"], ".4f"),
                      _gap(loss.difference, ".3f") if loss else "",
                      " / ".join(_ratio(_final_target(r, m), "train_flops", m) for m in ("fid", "val_loss"))
                      if fd else "1 / 1", f"{row['gpu_hours']:.3f}"])
    return _table(("arm on `tiny_deep`", "steps", "oracle FD", "Δ FD", "val loss", "Δ val loss",
                   "FLOPs to mask0's FD / val loss", "device-hours"), lines)


def _gap(d: Difference, spec: str) -> str:
    """Δ ± 1.96 combined sampling errors, and how many of them the gap is."""
    ses = gap_in_ses(d)
    return f"{_signed(d.mean, spec)} ± {Z95 * d.eval_se:{spec}} ({ses:.1f} SE)"


def conversion(root: Path) -> str:
    """The source (`mask0` from scratch on `tiny_deep`) and the two runs that start from it, each at its final point,
    with its first eval point beside it."""
    rows = [r for r in _rows(root, PRE_CRN) if r["model"] == "tiny_deep" and r["budget_flops"] == 1e13]
    source = [r for r in rows if r["arm"] == "mask0" and not r["init_from"]]
    started = [r for r in rows if r["init_from"]]
    lines = []
    for label, run in [("`mask0`: the source, from scratch", source),
                       ("`mask0`, continued", [r for r in started if r["arm"] == "mask0"]),
                       *((f"`{arm}`", [r for r in started if r["arm"] == arm])
                         for arm in sorted({r["arm"] for r in started} - {"mask0"}))]:
        first, final = min(run, key=lambda r: r["point"]), max(run, key=lambda r: r["point"])
        lines.append([label, str(final["step"]), str(final["switch_step"] or "–"), f"{final['fid']:.0f}",
                      f"{final['val_loss']:.3f}", f"{final['align_acc']:.3f}",
                      f"{first['val_loss']:.3f} (step {first['step']})"])
    return _table(("`tiny_deep`, 1e13 FLOPs", "steps", "switch step", "oracle FD", "val loss", "alignment",
                   "val loss at the first eval point"), lines)


def downscale_routes(root: Path) -> str:
    finals = _final_rows(_rows(root, PRE_CRN), "micro_s", 1e13)
    (base,) = finals["mask0"]
    lines = []
    for arm in ("mask0", "downscale_routes"):
        (r,) = finals[arm]
        lines.append([f"`{arm}`", f"{r['step']} ({r['step'] / base['step']:.2f}×)", f"{r['fid']:.0f}",
                      f"{r['val_loss']:.3f}", f"{r['align_acc']:.3f}",
                      f"{r['gpu_hours']:.3f} ({r['gpu_hours'] / base['gpu_hours']:.2f}×)"])
    return _table(("`micro_s`, 1e13 FLOPs", "steps (× mask0's)", "oracle FD", "val loss", "alignment",
                   "device-hours (× mask0's)"), lines)


def arm_step_time(root: Path) -> str:
    with open(root / "results" / "arm_step_time.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return _table(("arm", "mask ratio of the step", "params", "median step (s)", "GFLOP a step",
                   "time per FLOP, × mask0's"),
                  [[f"`{r['arm']}`", f"{float(r['mask_ratio']):g}", f"{int(r['params']):,}",
                    f"{float(r['median_step_s']):.3f}", f"{float(r['train_gflop']):.1f}",
                    f"{float(r['time_per_flop_vs_mask0']):.2f}"] for r in rows])


def config_key_table(root: Path) -> str:
    """Every config key, its default (what a run with no override uses) and its meaning, from the schema."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    lines = [f"| `{key.key}` | `{cell(key.default)}` | {cell(key.meaning)} |" for key in config_keys()]
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *lines])


FAIR = "results/fair/leaderboard.csv"
LITERATURE = "results/literature/leaderboard.csv"
TRAJECTORIES = "results/literature/trajectories.csv"
SEED1_CHECK = "results/literature/seed1_check/leaderboard.csv"
LADDER = "results/fair/ladder.csv"  # mask0's ladder to 4 B (results/fair/PLAN.md's amendment), read by both studies


def _grid_axis(root: Path, study: str, key: str) -> list[str]:
    """The values of one `key=a,b,...` axis of a shipped study's grid (maskbench/conf/study/STUDY.yaml)."""
    grid = yaml.safe_load((root / "maskbench" / "conf" / "study" / f"{study}.yaml").read_text())["grid"]
    return next(line.partition("=")[2].split(",") for line in grid if line.partition("=")[0] == key)


@dataclass(frozen=True)
class Cells:
    """A shipped study's grid of cells (arm x seed, conf/study/STUDY.yaml) and how many horizons of each have a
    row in its CSV."""
    arms: list[str]
    seeds: list[str]
    horizons: int
    done: dict[tuple[str, str], int]

    @property
    def finished(self) -> int:
        return sum(self.done.get((arm, seed), 0) == self.horizons for arm in self.arms for seed in self.seeds)

    @property
    def total(self) -> int:
        return len(self.arms) * len(self.seeds)


def _cells(root: Path, study: str, csv_path: str) -> Cells:
    arms, seeds, points = (_grid_axis(root, study, key) for key in ("arm", "seed", "eval.points"))
    done: dict[tuple[str, str], int] = defaultdict(int)
    for row in _rows(root, csv_path) if (root / csv_path).exists() else ():  # none before a study's first row
        done[row["arm"], str(row["seed"])] += 1
    return Cells(arms, seeds, len(points), dict(done))  # eval.points=[a,b,...] splits on its commas as well


def study_progress(root: Path, study: str, csv_path: str) -> str:
    """A pinned study's cells (arm x seed, conf/study/STUDY.yaml): how many of each one's horizons have a row.
    Rows land while the study runs: commit them with this table rewritten (`--write`)."""
    cells = _cells(root, study, csv_path)
    lines = [[f"`{arm}`", *(f"{cells.done[arm, seed]}/{cells.horizons}" if (arm, seed) in cells.done else "–"
                            for seed in cells.seeds)] for arm in cells.arms]
    return _table(("arm", *(f"seed {seed}" for seed in cells.seeds)), lines) + \
        f"\n\n{cells.finished} of {cells.total} cells finished."


@functools.cache
def _pinned_analysis(root: Path, study: str, csv_path: str, baseline: str | None = None,
                     arms: tuple[str, ...] | None = None) -> tuple[str, Analysis, Family] | None:
    """A pinned study read as `maskbench leaderboard CSV [--baseline B]` reads it under its plan (its plan line,
    the corrected analysis with the measured multipliers and the compute curves, the family), with the baseline's
    ladder the plan names, on `arms` only if given; None until every cell and every seed of the ladder is in,
    since the plan reads nothing before. A baseline other than the plan's reads it exploratory."""
    if _waiting(root, study, csv_path):
        return None
    rows = [row for row in _rows(root, csv_path) if arms is None or row["arm"] in arms]
    applied = applied_plan(rows, [str(root / csv_path)], None, baseline)
    rows = with_ladder(rows, applied)
    analysis = analyse_rows(rows, applied.rules, applied.baseline, applied.family)
    plan_line = applied.describe(rows, analysis.tests).replace(f"{root}/", "")  # the same text in any checkout
    return plan_line, analysis, applied.family


def _waiting(root: Path, study: str, csv_path: str) -> str:
    """Why a pinned study is not read yet ("" when it is): cells of its grid, or seeds of the ladder, missing."""
    cells = _cells(root, study, csv_path)
    if cells.finished < cells.total:
        return (f"Not read yet: {cells.finished} of {cells.total} cells are in, and results/{study}/PLAN.md reads "
                "nothing before every cell is.")
    ladder = _cells(root, "fair_ladder", LADDER)
    if ladder.finished < ladder.total:
        return (f"Not read yet: the baseline's ladder (`{LADDER}`, `mask0` to 4 B) has {ladder.finished} of "
                f"{ladder.total} seeds in, and "
                "results/fair/PLAN.md's amendment reads the measured multiplier off every seed's ladder, so nothing "
                "is read before all five are (`bash results/fair/ladder.sh` runs or resumes it).")
    return ""


def literature_mask0_reproduced(root: Path) -> str:
    """The plan's reproducibility check: this study's `mask0` rows against the fair study's of the same seed and
    horizon (same code path and draws, another CPU), each metric's difference in the two rows' sampling errors in
    quadrature."""
    fair = {(r["seed"], r["point"]): r for r in _rows(root, FAIR) if r["arm"] == "mask0"}
    lines = []
    for row in sorted((r for r in _rows(root, LITERATURE) if r["arm"] == "mask0"), key=lambda r: (r["seed"], r["point"])):
        if (before := fair.get((row["seed"], row["point"]))) is None:
            continue
        cells = []
        for metric, spec in (("val_loss", ".4f"), ("fid", ".0f")):
            combined = math.hypot(row[f"{metric}_se"], before[f"{metric}_se"])
            delta = row[metric] - before[metric]
            cells.append(f"{row[metric]:{spec}} / {before[metric]:{spec}} ({_signed(delta / combined, '.2f')} SE)")
        lines.append([str(row["seed"]), str(Fraction(row["point"]).limit_denominator()), str(row["step"]), *cells])
    return _table(("seed", "horizon (of B)", "step", "val loss: here / fair study (Δ in SEs)",
                   "oracle FD: here / fair study (Δ in SEs)"), lines) + _rerun_here(root)


def _rerun_here(root: Path) -> str:
    """results/literature/seed1_check: the fair study's commit rerun on this study's machine, each of its rows set
    against this study's row of the same seed and horizon, exactly (to find which of two differing rows is odd)."""
    here = {(r["seed"], r["point"]): r for r in _rows(root, LITERATURE) if r["arm"] == "mask0"}
    found = []
    for row in _rows(root, SEED1_CHECK):
        other = here[(row["seed"], row["point"])]
        same = all(row[m] == other[m] for m in ("val_loss", "fid"))
        found.append(f"seed {row['seed']} at {Fraction(row['point']).limit_denominator()} of B, val loss "
                     f"{row['val_loss']!r}, FD {row['fid']!r}: " + ("equal to this study's row bit for bit" if same
                     else f"this study's: {other['val_loss']!r}, {other['fid']!r}"))
    return "\n\nThe fair study's commit rerun on this study's machine (`" + SEED1_CHECK + "`): " + "; ".join(found) + "."


def literature_trajectories(root: Path) -> str:
    """results/literature/trajectories.csv (`python -m maskbench.results.trajectory`): each run's early block-norm
    spike, its objective and grad norm through it. Exploratory diagnostics, not the plan's metrics."""
    with (root / TRAJECTORIES).open(newline="") as f:
        runs = list(csv.DictReader(f))

    def cell(run: dict, column: str) -> str:
        return _g(float(run[column])) if run[column] else "–"

    at = " / ".join(map(str, STEPS))
    return _table(("arm", "seed", "peak block norm (step)", f"block norm at step {at}", f"objective at step {at}",
                   f"median grad norm, steps {STEPS[0]}-{STEPS[-1]}"),
                  [[f"`{run['arm']}`", run["seed"], f"{cell(run, 'peak_block_norm')} ({run['peak_step']})",
                    " / ".join(cell(run, f"block_norm_{step}") for step in STEPS),
                    " / ".join(cell(run, f"objective_{step}") for step in STEPS),
                    cell(run, "grad_norm_median_100_500")] for run in runs])


def differences_at_b(root: Path, csv_path: str) -> str:
    """A pinned study's measured differences at B, arm − mask0, FD and validation loss side by side: the paired
    t-interval over seeds, uncorrected (the plan's Holm family includes M(B), read once the ladder is in), and
    whether the gap clears 2 combined sampling errors. Measurements, not a fit: they stand with or without it."""
    summary = summarize(list(_rows(root, csv_path)), "mask0", CO_PRIMARY)
    final = [r for r in summary if r.comparisons and r.point == 1.0]
    return _table(("arm", "seeds", "FD at B: arm − mask0 (95% CI, uncorrected)",
                   "val loss at B: arm − mask0 (95% CI, uncorrected)"),
                  [[f"`{r.arm}`", str(r.n), *(_difference(r.comparisons[m].difference, spec, tested=True)
                                               for m, spec in (("fid", ",.0f"), ("val_loss", ".4f")))]
                   for r in final])


def switch_steps(root: Path, csv_path: str) -> str:
    """Where each two-phase arm of a study switched phase, per seed (the rows' `switch_step`): what a rule arm did
    is read off it (a switch at the step its plan caps phase 0, the same on every seed, is the cap, not the rule)."""
    found: dict[str, dict[int, int]] = defaultdict(dict)
    for row in _rows(root, csv_path):
        if row["switch_step"] is not None:
            found[row["arm"]][row["seed"]] = row["switch_step"]
    seeds = sorted({seed for by_seed in found.values() for seed in by_seed})
    return _table(("arm", *(f"seed {seed}" for seed in seeds)),
                  [[f"`{arm}`", *(f"{by_seed[s]:,}" if s in by_seed else "–" for s in seeds)]
                   for arm, by_seed in sorted(found.items())])


def fair_headline(root: Path) -> str:
    """The fair study's answer for the README: each masked arm's verdict at B by the plan's rule in one sentence
    and where the gap goes as compute grows, read off the measured multiplier; the verdict table itself (the
    difference at B, the measured M(B), FD and validation loss side by side) is docs/studies.md's, in
    `study_answer`."""
    read = _pinned_analysis(root, "fair", FAIR)
    if read is None:
        return _waiting(root, "fair", FAIR)
    _, analysis, _ = read
    return "\n\n".join([headline(analysis.verdicts),
                         "Each verdict's tests (the difference at B, the measured M(B), Holm) are in "
                         "[docs/studies.md](docs/studies.md#where-the-answer-stands).",
                         "Where the gap goes as compute grows (the measured M; reported, not tested):",
                         "\n".join(_gap_trend(analysis.measured, metric) for metric in ("fid", "val_loss"))])


def literature_headline(root: Path) -> str:
    """The literature re-run's verdicts in one sentence for the README, pointing to its reading."""
    read = _pinned_analysis(root, "literature", LITERATURE)
    if read is None:
        return _waiting(root, "literature", LITERATURE)
    _, analysis, _ = read
    return (f"{headline(analysis.verdicts)} The tests, FD and validation loss side by side, and REPA against its "
            "control: [docs/studies.md](docs/studies.md#the-literature-arms-at-the-baselines-size-3-seeds).")


def _gap_trend(measured: Sequence[ArmMultiplier], metric: str) -> str:
    """One metric's measured multipliers in a line: each arm's M from its first horizon to B (a bound marked),
    and how many arms' M rises or falls with compute (the trend's interval wholly above or below 0): the words
    the README's prose may use, read off the rows, not off a fit."""
    arms = [m for m in measured if m.metric == metric and m.arm != m.baseline]
    moves = ", ".join(f"`{m.arm}` {_m(m.multipliers[0])} → {_m(m.at_budget)}" for m in arms)
    trends = [m.trend for m in arms if m.trend is not None]
    rising = sum(mean - half > 0 for mean, half in trends)
    falling = sum(mean + half < 0 for mean, half in trends)
    first = Fraction(arms[0].points[0]).limit_denominator() if arms else ""
    return (f"- {get_metric(metric).label}: M from {first} of B to B: {moves}; M rises with compute for {rising} of "
            f"{len(arms)} arms and falls for {falling} (the trend's interval above or below 0; {len(arms) - len(trends)} "
            "without a trend).")


def _m(ratio: Ratio | None) -> str:
    """M as prose quotes it: its value, with '>' or '<=' where it is a bound."""
    return "–" if ratio is None else f"{ratio.bound}{_g(ratio.geomean)}"


def study_answer(root: Path, study: str, csv_path: str, baseline: str | None = None,
                 arms: tuple[str, ...] | None = None) -> str:
    """A pinned study in full, as `maskbench leaderboard CSV [--baseline B] --format markdown` prints it: the plan
    applied (or set aside), each arm against the baseline at every horizon with its sampling errors, the measured
    compute multiplier at every horizon with its trend, the compute curves where their ladder check held (else
    the check and why they are not shown), and the verdicts where the plan reads them."""
    read = _pinned_analysis(root, study, csv_path, baseline, arms)
    if read is None:
        return _waiting(root, study, csv_path)
    plan_line, analysis, family = read
    parts = [plan_line, render(analysis.summary, "markdown", family),
             *(render_multipliers(m, "markdown", 1 - family.alpha) for m in (analysis.measured, *analysis.also)),
             render_scaling(analysis.fits, "markdown", 1 - family.alpha)]
    return "\n\n".join(parts + ([render_verdicts(analysis.verdicts, "markdown", family)] if analysis.verdicts else []))


SUITE_LINE = re.compile(r"^# (?P<command>.+?)(?: --durations=0)? at (?P<commit>\w+), (?P<date>[\d-]+)T[\d:]+Z, "
                        r"(?P<cpus>\d+) CPUs: (?P<summary>.+?) in (?P<seconds>[\d.]+)s.*?"
                        r"(?:; runs: (?P<runs>[^;]+); median [\d.]+ s)?$")


def suite_time(root: Path) -> str:
    """results/suite_durations.txt's '#' lines (benchmarks/suite_durations.sh): the suite's and the quick subset's
    time on this machine, alone, with `-n auto`: the median of the runs the line lists, or its one run."""
    lines = (root / "results" / "suite_durations.txt").read_text().splitlines()
    found = [match for line in lines if line.startswith("#") and (match := SUITE_LINE.match(line))]

    def time(m: re.Match) -> str:
        runs = [f"{float(t.removesuffix(' s')):.0f}" for t in m["runs"].split(", ")] if m["runs"] else []
        return f"{float(m['seconds']):.0f} s" + (f" (median of {', '.join(runs)} s)" if len(runs) > 1 else "")

    return _table(("command", "tests", "time", "measured"),
                  [[f"`{m['command']}`", re.sub(r"(\d{4,})", lambda n: f"{int(n[1]):,}", m["summary"]), time(m),
                    f"{m['date']}, {m['commit']}, {m['cpus']} CPUs, alone"] for m in found])


@dataclass(frozen=True)
class DocTable:
    """A generated table: the CSVs it reads and the function that renders it from the repository root."""
    csvs: tuple[str, ...]
    render: Callable[[Path], str]


TABLES: dict[str, DocTable] = {
    "fd-floor": DocTable(("results/fd_floor.csv",), fd_floor),
    "plateau-micro-xs": DocTable(("results/plateau/curve.csv",), plateau_micro_xs),
    "plateau-smaller": DocTable(("results/plateau/curve.csv",), plateau_smaller),
    "powered-curve": DocTable(("results/powered/learning_curve.csv",), powered_curve),
    "powered-final": DocTable((POWERED,), powered_final),
    "powered-horizons": DocTable((POWERED,), powered_horizons),
    "crossover-design": DocTable((CROSSOVER,), crossover_design),
    "crossover-final": DocTable((CROSSOVER,), crossover_final),
    "crossover-counts": DocTable((CROSSOVER,), crossover_counts),
    "tiny-mission": DocTable((PRE_CRN,), tiny_mission),
    "literature-first-look": DocTable(("results/literature/first_look/leaderboard.csv",), literature_first_look),
    "tiny-literature": DocTable((PRE_CRN,), tiny_literature),
    "arm-step-time": DocTable(("results/arm_step_time.csv",), arm_step_time),
    "longskip": DocTable(("results/longskip/leaderboard.csv",), longskip),
    "conversion": DocTable((PRE_CRN,), conversion),
    "downscale-routes": DocTable((PRE_CRN,), downscale_routes),
    "fair-progress": DocTable((FAIR,), functools.partial(study_progress, study="fair", csv_path=FAIR)),
    "literature-progress": DocTable((LITERATURE,), functools.partial(study_progress, study="literature",
                                                                     csv_path=LITERATURE)),
    "fair-ladder-progress": DocTable((LADDER,), functools.partial(study_progress, study="fair_ladder",
                                                                  csv_path=LADDER)),
    "fair-headline": DocTable((FAIR, LADDER), fair_headline),
    "fair-differences": DocTable((FAIR,), functools.partial(differences_at_b, csv_path=FAIR)),
    "fair-switch": DocTable((FAIR,), functools.partial(switch_steps, csv_path=FAIR)),
    "literature-differences": DocTable((LITERATURE,), functools.partial(differences_at_b, csv_path=LITERATURE)),
    "fair-answer": DocTable((FAIR, LADDER), functools.partial(study_answer, study="fair", csv_path=FAIR)),
    "literature-answer": DocTable((LITERATURE, LADDER), functools.partial(study_answer, study="literature",
                                                                          csv_path=LITERATURE)),
    "literature-mask0-reproduced": DocTable((LITERATURE, FAIR, SEED1_CHECK), literature_mask0_reproduced),
    "literature-headline": DocTable((LITERATURE, LADDER), literature_headline),
    "literature-trajectories": DocTable((TRAJECTORIES,), literature_trajectories),
    "literature-repa-control": DocTable((LITERATURE, LADDER), functools.partial(
        study_answer, study="literature", csv_path=LITERATURE, baseline="repa_random", arms=("repa", "repa_random"))),
    "suite-time": DocTable(("results/suite_durations.txt",), suite_time),
    "config-keys": DocTable((), config_key_table),  # from the schema (maskbench/config/keys.py), no CSV
}


# ------------------------------------------------------------------------------------- markers in the docs
@dataclass(frozen=True)
class Marked:
    """One marked table in a document: its name, the file, the lines (0-based) of its start and end markers and
    the text between them."""
    name: str
    path: Path
    start: int
    end: int
    text: str

    @property
    def line(self) -> int:
        """The start marker's line number, 1-based, as an editor shows it."""
        return self.start + 1


def marked(path: Path) -> list[Marked]:
    """The marked tables of one Markdown file; a ValueError for a start marker without its end."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        start = START.match(lines[i])
        if start:
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == END), None)
            if end is None or any(START.match(line) for line in lines[i + 1:end]):
                raise ValueError(f"{path}:{i + 1}: table {start[1]!r} has no {END} line before the next table")
            found.append(Marked(start[1], path, i, end, "\n".join(lines[i + 1:end])))
            i = end
        i += 1
    return found


def generated(name: str, root: Path = ROOT) -> str:
    """The text between a table's markers: a blank line, the table, a blank line."""
    return f"\n{TABLES[name].render(root)}\n"


def check(root: Path = ROOT) -> list[str]:
    """One line per problem: a marked table that differs from what its CSVs give, a marker naming no table, a
    table marked twice or not at all."""
    problems, seen = [], defaultdict(list)
    for path in documents(root):
        for table in marked(path):
            where = f"{path.relative_to(root)}:{table.line}"
            seen[table.name].append(where)
            if table.name not in TABLES:
                problems.append(f"{where}: no generated table named {table.name!r}")
            elif table.text != generated(table.name, root):
                problems.append(f"{where}: table {table.name!r} differs from what {', '.join(TABLES[table.name].csvs)} "
                                f"give: run `python -m tools.doctables --write`")
    problems += [f"table {name!r} is marked {len(places)} times ({', '.join(places)})"
                 for name, places in seen.items() if len(places) > 1]
    problems += [f"table {name!r} is marked nowhere in README.md or docs/" for name in TABLES if name not in seen]
    return problems


def write(root: Path = ROOT) -> list[Path]:
    """Rewrite every marked table from its CSVs; the files that changed."""
    changed = []
    for path in documents(root):
        tables = marked(path)
        if not tables:
            continue
        lines = path.read_text(encoding="utf-8").split("\n")
        for table in reversed(tables):  # from the end, so earlier line numbers hold
            if table.name not in TABLES:
                raise ValueError(f"{path}:{table.line}: no generated table named {table.name!r}")
            lines[table.start + 1:table.end] = generated(table.name, root).split("\n")
        text = "\n".join(lines)
        if text != path.read_text(encoding="utf-8"):
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.doctables", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The tables of README.md and docs/*.md that read committed CSVs, between <!-- table: NAME --> "
                    "and <!-- /table --> lines. Without options: check that each matches what its CSVs give (exit "
                    "1, naming every stale or unknown table).")
    parser.add_argument("--write", action="store_true", help="rewrite every marked table from its CSVs")
    parser.add_argument("--list", action="store_true", help="list each table with the file it sits in and its CSVs")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.list:
            places = {t.name: f"{t.path.relative_to(root)}:{t.line}" for p in documents(root) for t in marked(p)}
            for name, table in TABLES.items():
                print(f"{name:24} {places.get(name, 'not marked'):24} {', '.join(table.csvs)}")
            return 0
        if args.write:
            for path in write(root):
                print(f"rewrote {path.relative_to(root)}")
        problems = check(root)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
