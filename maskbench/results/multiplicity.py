"""A study plan's family of tests: which readings are planned, and their p-values corrected together.

FD and validation loss are co-primary (`CO_PRIMARY`): every verdict is given on both. A study's plan
(`Family`) names the tests it reads verdicts from; `correct` adjusts their p-values together (Holm) and
every other reading is labelled exploratory.

A plan reads "pays" by one of two rules (`Family.rule`):

- `RATIO` (the older plans'): the tests are, per arm and planned metric, the difference at the final point
  and the isotonic compute-to-target ratio at each of the baseline's horizons; an arm pays where that ratio
  lies below 1 on every planned metric (`Family.pays`).
- `MULTIPLIER` (`pays.ratio: compute multiplier` in PLAN.md, results/fair/PLAN.md's): the tests are, per arm
  and planned metric, T1 the paired difference arm − baseline at B (the largest budget point) and T2 log M(B),
  the compute multiplier *measured* on the baseline's ladder (`multiplier.ArmMultiplier.at_budget`), against
  0, corrected together (`correct_study`); nothing else is tested and no fitted curve is read. An arm pays at
  B when, after the correction, M(B) lies above 1 on every planned metric and T1 points the same way (the arm
  better on every one, by a gap of at least 2 combined sampling errors); it does not pay when M(B) lies below
  1 on any; otherwise it is undecided, and its verdict says what each metric showed (`multiplier_verdicts`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from maskbench.metrics import CO_PRIMARY, get_metric
from maskbench.results.estimators import Difference, Ratio, holm
from maskbench.results.multiplier import ArmMultiplier
from maskbench.results.summary import Comparison, Summary, detected_difference
from maskbench.results.summary import gap_detected as _gap_detected

CORRECTIONS = ("holm", "none")
RATIO = "compute-to-target ratio"    # the older rule: isotonic ratios tested, pays below 1
MULTIPLIER = "compute multiplier"    # T1 + T2, pays when M(B) lies above 1 (results/fair/PLAN.md)
RULES = (RATIO, MULTIPLIER)
M_AXIS = "M"                         # `Family.planned`'s compute for T2, the compute multiplier at B


@dataclass(frozen=True)
class Family:
    """The tests a study's plan reads verdicts from, corrected together; every other reading explores.

    A test is planned when its metric is one of `metrics` and, under the `RATIO` rule, for a compute-to-target
    ratio, when it is on the `compute` axis: the family is every planned test a report prints (per arm or cell
    and planned metric: the paired difference, and the ratio at each target), across arms, horizons, cells
    and metrics, adjusted by `method` at `alpha`. Under the `MULTIPLIER` rule no ratio is planned: the family
    is the difference at B and M(B) (compute `M_AXIS`) per arm and planned metric (`correct_study`). Holm assumes nothing about how the tests depend on each
    other; correcting across the metrics too is cautious when "pays" needs every one of them, but keeps
    each metric's own verdict (better / worse) honest as well. `confirmatory` is True only when the plan
    was written before every row it reads; otherwise even its planned readings are exploratory. Without a
    plan (`EXPLORATORY`): no planned test, no correction, everything exploratory.
    """
    metrics: tuple[str, ...] = ()
    compute: str = "train_flops"
    method: str = "none"
    alpha: float = 0.05
    confirmatory: bool = False
    rule: str = RATIO

    def planned(self, metric: str, compute: str | None = None) -> bool:
        """Whether the family tests this reading: the difference (compute None), a ratio on `compute`
        (`RATIO` rule) or M(B) (compute `M_AXIS`, `MULTIPLIER` rule)."""
        axis = M_AXIS if self.rule == MULTIPLIER else self.compute
        return metric in self.metrics and compute in (None, axis)

    @property
    def tests_ratios(self) -> bool:
        """Whether compute-to-target ratios are tested (the `RATIO` rule) or only reported."""
        return self.rule == RATIO

    def reading(self, metric: str, compute: str | None = None) -> str:
        """The label of a reading: "confirmatory" (planned, plan before the data) or "exploratory"."""
        return "confirmatory" if self.confirmatory and self.planned(metric, compute) else "exploratory"

    def compared(self) -> tuple[str, ...]:
        """The metrics every verdict table shows: the planned ones, then FD and val loss (co-primary)."""
        return tuple(dict.fromkeys((*self.metrics, *CO_PRIMARY)))

    def pays(self, verdicts: dict[str, str]) -> str:
        """The plan's "pays" over metrics: pays on every planned one (every co-primary one without a plan),
        does not pay when one of them does not, undecided otherwise."""
        words = [verdicts.get(metric, "") for metric in (self.metrics or CO_PRIMARY)]
        if all(word == "pays" for word in words):
            return "pays"
        return "does not pay" if "does not pay" in words else "undecided"


EXPLORATORY = Family()


def adjust(pvalues: Sequence[float], family: Family) -> np.ndarray:
    """The family's p-values after its correction (Holm, or none: unchanged)."""
    return holm(pvalues) if family.method == "holm" else np.asarray(pvalues, dtype=float)


def corrected_difference(difference: Difference, p_adj: float, family: Family) -> Difference:
    """A difference with its corrected p; a verdict the corrected p no longer carries is withdrawn."""
    word = difference.verdict
    if word in ("better", "worse") and not p_adj < family.alpha:
        word = (f"no difference detected after {family.method} (uncorrected: {word}); an effect larger than "
                f"{difference.mde:.3g} would have been detected")
    return replace(difference, p_adj=float(p_adj), verdict=word)


def correct(summary: Sequence[Summary], family: Family) -> tuple[list[Summary], int]:
    """The summary with the p-values of the family's tests adjusted together (`adjust`), each difference's
    verdict re-read at the corrected p, and the number of tests in the family: for every arm and planned
    metric, the difference at the final point and the ratio on the planned compute axis at each target,
    a target that repeats an earlier horizon's (`Target.repeats`) counted once."""
    planned = [c for record in summary for metric, c in record.comparisons.items() if family.planned(metric)]
    pvalues = [p for c in planned for p in _planned_ps(c, family.compute)]
    adjusted = iter(adjust(pvalues, family))
    out = [replace(record, comparisons={metric: _adjusted(c, adjusted, family) if family.planned(metric) else c
                                        for metric, c in record.comparisons.items()}) for record in summary]
    return out, int(np.sum(~np.isnan(np.asarray(pvalues, dtype=float))))


def _planned_ps(c: Comparison, compute: str) -> list[float]:
    """A comparison's planned p-values: its difference's, then its ratio's on `compute` at each target (NaN,
    out of the family, where the target repeats an earlier horizon's: that test is already in it)."""
    return [c.difference.p, *(t.ratios[compute].p if t.ratios.get(compute) and t.repeats is None else math.nan
                              for t in c.targets)]


def _adjusted(c: Comparison, p_adj: Iterator[float], family: Family) -> Comparison:
    """The comparison with its planned tests' corrected p-values, taken from p_adj in `_planned_ps` order; a
    repeated target takes the corrected p of the horizon it repeats."""
    difference = corrected_difference(c.difference, next(p_adj), family)
    targets, corrected = [], {}
    for target in c.targets:
        ratio, p = target.ratios.get(family.compute), float(next(p_adj))
        p = corrected[target.point] = corrected.get(target.repeats, p)
        targets.append(replace(target, ratios={**target.ratios, family.compute: ratio and replace(ratio, p_adj=p)}))
    return replace(c, difference=difference, targets=tuple(targets))


# ------------------------------------------------------------------------ the compute-multiplier rule
def correct_study(summary: Sequence[Summary], measured: Sequence[ArmMultiplier],
                  family: Family) -> tuple[list[Summary], list[ArmMultiplier], int]:
    """The summary and the measured multipliers with the family's tests corrected together, and how many.

    Under the `RATIO` rule this is `correct` (the multipliers carry no test). Under `MULTIPLIER` the family is,
    per arm and planned metric, T1 the difference at the final point (B) and T2 log M(B), the *measured*
    multiplier read off the baseline's ladder (`multiplier.ArmMultiplier.at_budget`), adjusted together (Holm
    across T1 and T2); nothing else is tested. Each difference's verdict is re-read at its corrected p
    (`corrected_difference`) and then, where its gap is under DETECTED_SES combined sampling errors, said to be
    not detected (`detected_difference`); M(B) takes its corrected p as `p_adj`. The baseline's own shorter
    runs, read on its ladder as a check, are not tested."""
    if family.rule != MULTIPLIER:
        corrected, tests = correct(summary, family)
        return corrected, list(measured), tests
    first = [(i, metric) for i, record in enumerate(summary) for metric in record.comparisons
             if family.planned(metric)]
    second = [j for j, found in enumerate(measured) if family.planned(found.metric, M_AXIS)
              and found.arm != found.baseline and found.at_budget is not None]
    pvalues = ([summary[i].comparisons[metric].difference.p for i, metric in first]
               + [measured[j].at_budget.p for j in second])
    adjusted = adjust(pvalues, family)
    records = list(summary)
    for (i, metric), p in zip(first, adjusted[:len(first)]):
        c = records[i].comparisons[metric]
        difference = detected_difference(corrected_difference(c.difference, float(p), family))
        records[i] = replace(records[i], comparisons={**records[i].comparisons,
                                                      metric: replace(c, difference=difference)})
    out = list(measured)
    for j, p in zip(second, adjusted[len(first):]):
        found = out[j]
        out[j] = replace(found, multipliers=(*found.multipliers[:-1], replace(found.at_budget, p_adj=float(p))))
    return records, out, int(np.sum(~np.isnan(np.asarray(pvalues, dtype=float))))


@dataclass(frozen=True)
class MetricVerdict:
    """One arm's reading on one planned metric under the `MULTIPLIER` rule."""
    metric: str
    difference: Difference | None  # T1, corrected (None: no comparison with the baseline)
    multiplier: Ratio | None       # T2: the measured M(B) with its corrected p (None: not read)
    direction: str                 # T1's sign: "lower", "higher", "not detected" (gap under 2 SEs), "" (none)
    side: str                      # M(B): "above 1", "below 1" (after the correction), "undecided", "not read"

    @property
    def agrees(self) -> bool:
        """T1 points the arm's better way (lower, for FD and val loss)."""
        return self.direction == ("lower" if get_metric(self.metric).lower_is_better else "higher")

    @property
    def t1_word(self) -> str:
        """T1 as its corrected test reads it: "better", "worse" or "" (nothing detected, or no comparison)."""
        verdict_ = self.difference.verdict if self.difference else ""
        return "better" if verdict_.startswith("better") else "worse" if verdict_.startswith("worse") else ""

    @property
    def leaning(self) -> int:
        """Where this metric points, from what its tests detected: +1 the arm better (M above 1, or T1 better
        with M not against it), −1 worse, 0 neither (nothing detected, or M and T1 at odds)."""
        m = {"above 1": 1, "below 1": -1}.get(self.side, 0)
        t = {"better": 1, "worse": -1}.get(self.t1_word, 0)
        return (m or t) if m * t >= 0 else 0

    def reading(self) -> str:
        """What this metric shows, in words: T1 at B as its corrected test reads it, and M(B)'s side."""
        label = get_metric(self.metric).label
        t1 = (f"{self.t1_word} at B" if self.t1_word else
              "no difference at B" if self.difference is None else "no difference detected at B")
        m = self.multiplier
        if m is None:
            return f"{label}: {t1}; M(B) not read"
        bound = {">": "at least ", "<=": "at most "}.get(m.bound, "")
        p = "" if math.isnan(m.p_adj) else f", p adj {m.p_adj:.2g}"
        return f"{label}: {t1}; M(B) {bound}{m.geomean:.3g}{p}: {self.side}"


@dataclass(frozen=True)
class ArmVerdict:
    """One arm's verdict at B under the `MULTIPLIER` rule: pays, does not pay or undecided, why, and whether
    its metrics point opposite ways."""
    group: tuple
    arm: str
    baseline: str
    budget: float | None           # B, the arm's largest horizon's FLOPs (None without a measured M)
    verdict: str
    why: str
    metrics: tuple[MetricVerdict, ...]
    disagreements: tuple[str, ...]
    reading: str                   # confirmatory or exploratory


def multiplier_verdicts(summary: Sequence[Summary], measured: Sequence[ArmMultiplier],
                        family: Family) -> list[ArmVerdict]:
    """Each compared arm's verdict at B by the `MULTIPLIER` rule, from the corrected summary and measured
    multipliers (`correct_study`): pays when the measured M(B) lies above 1 after the correction on every
    planned metric and T1 is better on every one by a detected gap; does not pay when M(B) lies below 1
    after the correction on any; undecided otherwise, with what each metric shows. No fit is read. [] under
    the `RATIO` rule."""
    if family.rule != MULTIPLIER:
        return []
    metrics = family.metrics or CO_PRIMARY
    records = {(r.group, r.arm): r for r in summary if r.comparisons}
    readings = {(m.group, m.arm, m.metric): m for m in measured if m.arm != m.baseline}
    arms = dict.fromkeys([*records, *((group, arm) for group, arm, _ in readings)])
    out = []
    for group, arm in arms:
        record = records.get((group, arm))
        found = tuple(_metric_verdict(record, readings.get((group, arm, metric)), metric, family.alpha)
                      for metric in metrics)
        budgets = [m.flops[-1] for metric in metrics if (m := readings.get((group, arm, metric)))]
        baselines = [c.baseline for c in (record.comparisons.values() if record else ())]
        baselines += [m.baseline for metric in metrics if (m := readings.get((group, arm, metric)))]
        verdict, why = _arm_verdict(found)
        labels = {family.reading(m, M_AXIS) for m in metrics}
        out.append(ArmVerdict(group, arm, baselines[0], budgets[0] if budgets else None, verdict, why, found,
                              _metric_disagreements(found), labels.pop() if len(labels) == 1 else "exploratory"))
    return out


def _metric_verdict(record: Summary | None, measured: ArmMultiplier | None, metric: str,
                    alpha: float) -> MetricVerdict:
    c = record.comparisons.get(metric) if record else None
    difference = c.difference if c else None
    direction = ""
    if difference is not None and difference.mean != 0:
        direction = "not detected" if not _gap_detected(difference) else "lower" if difference.mean < 0 else "higher"
    multiplier = measured.at_budget if measured else None
    return MetricVerdict(metric, difference, multiplier, direction, _side(multiplier, alpha))


def _side(m: Ratio | None, alpha: float) -> str:
    """M(B)'s side after the correction. A lower bound (some seeds beat the ladder's end) can only understate
    M, so it may read "above 1" and never "below 1"; an upper bound the reverse; bounds on every seed, no test
    ("past the ladder")."""
    if m is None:
        return "not read"
    if m.bound and math.isnan(m.p):
        return "past the ladder" if m.bound == ">" else "before the ladder"
    if not m.p_adj < alpha:
        return "undecided"
    side = "above 1" if m.geomean > 1 else "below 1"
    against = {">": "below 1", "<=": "above 1"}.get(m.bound)
    return "undecided" if side == against else side


def _arm_verdict(found: Sequence[MetricVerdict]) -> tuple[str, str]:
    """The verdict and why: each metric's reading, in words."""
    below = [v for v in found if v.side == "below 1"]
    if below:
        return "does not pay", "; ".join(v.reading() for v in found)
    if all(v.side == "above 1" and v.agrees for v in found):
        return "pays", "; ".join(v.reading() for v in found)
    return "undecided", "; ".join(v.reading() for v in found)


def _metric_disagreements(found: Sequence[MetricVerdict]) -> tuple[str, ...]:
    """"the metrics disagree" only where one metric points the arm's better way and another its worse one."""
    leanings = {v.leaning for v in found}
    if {1, -1} <= leanings:
        words = {1: "better", -1: "worse", 0: "neither"}
        return ("the metrics disagree: " + ", ".join(f"{words[v.leaning]} on {get_metric(v.metric).label}"
                                                     for v in found),)
    return ()
