"""A study's analysis plan: the front matter of its PLAN.md, parsed and checked, and how a report applies it.

A study folder `results/<study>/` holds its rows (`leaderboard.csv`) and its analysis plan (`PLAN.md`): a
front matter of YAML between `---` lines naming the primary metrics, the baseline arm, the targets, the
test, alpha, the multiplicity correction and what "pays" means (and, optionally, the rule by which a held-out
prediction of the compute curves fails, how far from B a crossover is read, the baseline's ladder CSV and when
the plan was amended), then prose. A report applies the plan it finds beside the CSV (or `--plan FILE`),
reads the ladder it names beside the rows, and labels every reading confirmatory or exploratory: without a
plan everything is exploratory, and so is everything a plan reads from rows written before it (or before its
amendment: the analysis did not exist when the data could still steer it).

"pays" is read one of two ways (`multiplicity.RULES`). `ratio: flops` (or `device_hours`) with `interval: below 1`:
the isotonic compute-to-target ratios are tested and an arm pays where they lie below 1 on every primary
metric. `ratio: compute multiplier` with `interval: above 1`: the tests are the difference at B and log M(B),
M measured on the baseline's ladder (`multiplier`), Holm across them, and the report ends with each arm's
verdict at B (`multiplicity.multiplier_verdicts`, `tables.render_verdicts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

import yaml

from maskbench.metrics import compared_metrics, get_metric
from maskbench.results.multiplicity import (
    CORRECTIONS,
    EXPLORATORY,
    MULTIPLIER,
    RATIO,
    Family,
)
from maskbench.results.rows import Row, read_rows
from maskbench.results.scaling import CROSSOVER_WITHIN, DEFAULT_RULE, FAILURE_RULES
from maskbench.results.targets import COMPUTE

PLAN_FILE = "PLAN.md"
PLAN_KEYS = ("study", "written", "primary_metrics", "baseline", "targets", "test", "alpha", "correction", "pays")
# the compute curves' held-out rule and k (defaults below); when the plan was amended (its readings confirm only rows
# written after that); the baseline's ladder, a CSV beside the plan read with the study's rows
PLAN_OPTIONAL = ("prediction_fails", "crossover_within", "amended", "ladder")
# What the report knows how to apply; a plan asking for anything else is refused, never silently misread.
TARGETS = "baseline horizons"      # the baseline's value at each of its eval points, per seed
TEST = "paired t over seeds"       # per-seed differences and log ratios (Welch only where seeds do not pair)
PAYS_RATIO = {"flops": "train_flops", "device_hours": "gpu_hours"}
PAYS_INTERVAL = "below 1"
PAYS_MULTIPLIER = MULTIPLIER       # pays.ratio: the compute multiplier M(B) of the compute curves ...
PAYS_MULTIPLIER_INTERVAL = "above 1"  # ... whose interval must lie above 1
PAYS_METRICS = "all primary"


@dataclass(frozen=True)
class StudyPlan:
    """A study's analysis plan, from the front matter of its PLAN.md."""

    path: Path
    study: str
    written: datetime            # when the plan was written: rows from before it are read as exploration
    primary: tuple[str, ...]     # the primary metrics, every one of which must pay
    baseline: str
    alpha: float
    correction: str              # "holm" or "none", across every test the plan reads (`Family`)
    pays: str                    # the compute axis of the compute-to-target ratios: "train_flops" or "gpu_hours"
    prediction_fails: str = DEFAULT_RULE        # a `scaling.FAILURE_RULES` name: when a held-out prediction fails
    crossover_within: float = CROSSOVER_WITHIN  # k: a crossover is read within [B/k, k·B]
    rule: str = RATIO            # how "pays" is read: the ratios (RATIO) or the compute multiplier (MULTIPLIER)
    amended: datetime | None = None  # when its analysis last changed: it confirms only rows written after that
    ladder: Path | None = None   # the baseline's ladder (a CSV), read beside the study's rows

    @property
    def since(self) -> datetime:
        """The time its readings date from: the amendment's, else the plan's."""
        return self.amended or self.written

    def family(self, rows: Sequence[Row]) -> Family:
        """The plan's tests; confirmatory only when every measured row was written after the plan (and after
        its amendment, if any: an analysis changed once rows were seen explores them)."""
        return Family(self.primary, self.pays, self.correction, self.alpha,
                      confirmatory=not _before(rows, self.since), rule=self.rule)

    def describe(self, rows: Sequence[Row], tests: int) -> str:
        """The line that says which plan was applied, how, and whether its readings confirm or explore."""
        early = _before(rows, self.since)
        measured = sum(not row["source"] for row in rows)
        when = f"written {self.written.isoformat()}" + (f", amended {self.amended.isoformat()}" if self.amended
                                                         else "")
        status = (f"{when}, after {len(early)} of these {measured} rows: its readings of them are exploratory"
                  if early else f"{when}, before every row: its planned readings are confirmatory")
        pays = (f"{COMPUTE[self.pays]} ratio {PAYS_INTERVAL} on every primary metric" if self.rule == RATIO else
                f"compute multiplier M(B), measured on the baseline's ladder, {PAYS_MULTIPLIER_INTERVAL} on every "
                f"primary metric and the difference at B agreeing (tests: the difference at B and log M(B) per arm "
                f"and primary metric; no fitted curve read)")
        return (f"plan {self.path} ({self.study}): primary {', '.join(self.primary)}; baseline {self.baseline}; "
                f"{TEST}, alpha {self.alpha:g}; {self.correction} across the {tests} tests it reads; pays: "
                f"{pays}; {status}")


NO_PLAN = (f"no plan: exploratory (no {PLAN_FILE} beside the CSV and no --plan; verdicts uncorrected for "
           "multiple comparisons)")


def load_plan(path: str | Path) -> StudyPlan:
    """Parse a PLAN.md's front matter; any problem is a ValueError of one line naming the file."""
    path = Path(path)
    try:
        front = _front_matter(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read plan {path}: {err.strerror}") from None
    except (ValueError, yaml.YAMLError) as err:
        problem = getattr(err, "problem", None) or str(err)
        mark = getattr(err, "problem_mark", None)
        where = f" (front matter line {mark.line + 1})" if mark else ""
        raise ValueError(f"plan {path}: {problem}{where}") from None
    try:
        return _plan(path, front)
    except (TypeError, ValueError) as err:
        raise ValueError(f"plan {path}: {err}") from None


def _front_matter(text: str) -> dict:
    """The YAML mapping between the first line `---` and the next `---` line."""
    lines = text.splitlines()
    ends = [i for i, line in enumerate(lines) if line.strip() == "---"]
    if len(ends) < 2 or ends[0] != 0:
        raise ValueError("no front matter: the file must open with a '---' line, the YAML, and a closing '---'")
    front = yaml.safe_load("\n".join(lines[1:ends[1]]))
    if not isinstance(front, dict):
        raise ValueError("the front matter is not a YAML mapping of keys to values")
    return front


def _plan(path: Path, front: dict) -> StudyPlan:
    """Check every key of a front matter against what the report can apply."""
    unknown = sorted(set(front) - set(PLAN_KEYS) - set(PLAN_OPTIONAL))
    missing = [key for key in PLAN_KEYS if key not in front]
    if unknown or missing:
        raise ValueError(f"front matter keys: missing {missing or 'none'}, unknown {unknown or 'none'}")
    primary = front["primary_metrics"]
    if not isinstance(primary, list) or not primary or any(m not in compared_metrics() for m in primary):
        raise ValueError(f"primary_metrics must be a non-empty list of {', '.join(compared_metrics())}, got {primary!r}")
    _expect("targets", front["targets"], TARGETS)
    _expect("test", front["test"], TEST)
    if not isinstance(front["alpha"], float) or not 0 < front["alpha"] < 1:
        raise ValueError(f"alpha must be a number in (0, 1), got {front['alpha']!r}")
    if front["correction"] not in CORRECTIONS:
        raise ValueError(f"correction must be one of {', '.join(CORRECTIONS)}, got {front['correction']!r}")
    pays = front["pays"]
    if not isinstance(pays, dict) or set(pays) != {"ratio", "interval", "metrics"}:
        raise ValueError(f"pays must map ratio, interval and metrics, got {pays!r}")
    if pays["ratio"] not in (*PAYS_RATIO, PAYS_MULTIPLIER):
        raise ValueError(f"pays.ratio must be one of {', '.join((*PAYS_RATIO, PAYS_MULTIPLIER))}, "
                         f"got {pays['ratio']!r}")
    multiplier = pays["ratio"] == PAYS_MULTIPLIER
    _expect("pays.interval", pays["interval"], PAYS_MULTIPLIER_INTERVAL if multiplier else PAYS_INTERVAL)
    _expect("pays.metrics", pays["metrics"], PAYS_METRICS)
    rising = [m for m in primary if not get_metric(m).lower_is_better]
    if multiplier and rising:
        raise ValueError(f"pays.ratio {PAYS_MULTIPLIER!r} reads fitted curves that fall towards a floor: primary "
                         f"metric(s) {', '.join(rising)} rise as training goes on")
    rule = front.get("prediction_fails", DEFAULT_RULE)
    if rule not in FAILURE_RULES:
        raise ValueError(f"prediction_fails must be one of {', '.join(map(repr, FAILURE_RULES))}, got {rule!r}")
    within = front.get("crossover_within", CROSSOVER_WITHIN)
    if isinstance(within, bool) or not isinstance(within, int | float) or not within > 1:
        raise ValueError(f"crossover_within must be a number above 1 (k: read a crossover within [B/k, k·B]), "
                         f"got {within!r}")
    ladder = path.parent / str(front["ladder"]) if "ladder" in front else None
    if ladder is not None and not ladder.is_file():
        raise ValueError(f"ladder: no such CSV {ladder}")
    return StudyPlan(path=path, study=str(front["study"]), written=_timestamp(front["written"]), primary=tuple(primary),
                baseline=str(front["baseline"]), alpha=front["alpha"], correction=front["correction"],
                pays=PAYS_RATIO.get(pays["ratio"], "train_flops"), prediction_fails=rule,
                crossover_within=float(within), rule=MULTIPLIER if multiplier else RATIO,
                amended=_timestamp(front["amended"], "amended") if "amended" in front else None, ladder=ladder)


def _expect(key: str, value: object, supported: str) -> None:
    if value != supported:
        raise ValueError(f"{key}: this report applies {supported!r} only, got {value!r}")


def _timestamp(value: object, key: str = "written") -> datetime:
    """An ISO 8601 date-time with its time zone (YAML may have parsed it already)."""
    try:
        written = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    except ValueError:
        written = None
    if written is None or written.tzinfo is None:
        raise ValueError(f"{key} must be a date-time with a time zone, e.g. 2026-12-02T08:00:00+00:00, "
                         f"got {value!r}")
    return written


def _before(rows: Sequence[Row], written: datetime) -> list[Row]:
    """The measured rows not shown to be written after the plan (created_at before it, missing or unreadable;
    a time without a zone is read as UTC, as maskbench writes it)."""
    def after(row: Row) -> bool:
        try:
            created = datetime.fromisoformat(row["created_at"] or "")
        except ValueError:
            return False
        return (created if created.tzinfo else created.replace(tzinfo=UTC)) > written

    return [row for row in rows if not row["source"] and not after(row)]


def find_plan(paths: Sequence[str]) -> Path | None:
    """The PLAN.md beside the CSVs, if any; CSVs of studies with different plans need --plan."""
    plans = sorted({str(Path(path).parent / PLAN_FILE) for path in paths if (Path(path).parent / PLAN_FILE).is_file()})
    if len(plans) > 1:
        raise ValueError(f"the CSVs sit beside different plans ({', '.join(plans)}): pass --plan FILE")
    return Path(plans[0]) if plans else None


class AppliedPlan(NamedTuple):
    """How a report reads its rows: the plan applied (None: exploratory), the baseline, the family of tests,
    and `set_aside`, the plan beside the rows when `--baseline` names another arm than its own. A plan's
    tests are about its own baseline, so against any other arm every reading is exploratory (a study's own
    plan may name such a comparison as exploratory: `--baseline repa_random` in results/literature/PLAN.md)."""

    plan: StudyPlan | None
    baseline: str
    family: Family
    set_aside: StudyPlan | None = None

    @property
    def rules(self) -> StudyPlan | None:
        """The plan whose fixed rules (held-out rule, crossover window, ladder) every table uses, set aside or
        not: an exploratory reading is still read by the plan's rules, never by looser defaults."""
        return self.plan or self.set_aside

    def describe(self, rows: Sequence[Row], tests: int) -> str:
        """The report's first line: the plan applied, set aside, or none."""
        if self.plan:
            return self.plan.describe(rows, tests)
        if self.set_aside:
            return (f"plan {self.set_aside.path} ({self.set_aside.study}) set aside: its baseline is "
                    f"{self.set_aside.baseline}, and against --baseline {self.baseline} every reading is "
                    "exploratory (verdicts uncorrected for multiple comparisons)")
        return NO_PLAN


def applied_plan(rows: list[dict], paths: Sequence[str], plan: str | None, baseline: str | None) -> AppliedPlan:
    """The plan that applies to these rows (--plan, else PLAN.md beside them), the baseline it names, and its
    family of tests (none: exploratory); a --baseline other than the plan's sets the plan aside."""
    found = _plan_for(paths, plan)
    if found and baseline and baseline != found.baseline:
        return AppliedPlan(None, baseline, EXPLORATORY, set_aside=found)
    return AppliedPlan(found, found.baseline if found else baseline or "mask0",
                       found.family(rows) if found else EXPLORATORY)


def with_ladder(rows: list[Row], applied: AppliedPlan) -> list[Row]:
    """The rows, and the baseline's ladder the plan names beside them (its rows are the baseline's runs to
    beyond the arms' budget: `multiplier` reads every arm on them)."""
    ladder = applied.rules.ladder if applied.rules else None
    return rows + read_rows([ladder], "abort") if ladder else rows


def _plan_for(paths: Sequence[str], plan: str | None) -> StudyPlan | None:
    """The plan to apply: --plan FILE, else the PLAN.md beside the CSVs, else none."""
    path = Path(plan) if plan else find_plan(paths)
    return load_plan(path) if path else None
