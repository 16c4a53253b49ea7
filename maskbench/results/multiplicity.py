"""A study plan's family of tests: which readings are planned, and their p-values corrected together.

FD and validation loss are co-primary (`CO_PRIMARY`): every verdict is given on both. A study's plan
(`Family`) names the tests it reads verdicts from; `correct` adjusts their p-values together (Holm) and
every other reading is labelled exploratory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from maskbench.metrics import CO_PRIMARY
from maskbench.results.estimators import Difference, holm
from maskbench.results.summary import Comparison, Summary

CORRECTIONS = ("holm", "none")


@dataclass(frozen=True)
class Family:
    """The tests a study's plan reads verdicts from, corrected together; every other reading explores.

    A test is planned when its metric is one of `metrics` (and, for a compute-to-target ratio, when it
    is on the `compute` axis); the family is every planned test a report prints (per arm or cell and
    planned metric: the paired difference, and the ratio at each target), across arms, horizons, cells
    and metrics, adjusted by `method` at `alpha`. Holm assumes nothing about how the tests depend on each
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

    def planned(self, metric: str, compute: str | None = None) -> bool:
        return metric in self.metrics and compute in (None, self.compute)

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
    metric, the difference at the final point and the ratio on the planned compute axis at each target."""
    planned = [c for record in summary for metric, c in record.comparisons.items() if family.planned(metric)]
    pvalues = [p for c in planned for p in _planned_ps(c, family.compute)]
    adjusted = iter(adjust(pvalues, family))
    out = [replace(record, comparisons={metric: _adjusted(c, adjusted, family) if family.planned(metric) else c
                                        for metric, c in record.comparisons.items()}) for record in summary]
    return out, int(np.sum(~np.isnan(np.asarray(pvalues, dtype=float))))


def _planned_ps(c: Comparison, compute: str) -> list[float]:
    """A comparison's planned p-values: its difference's, then its ratio's on `compute` at each target."""
    return [c.difference.p, *(t.ratios[compute].p if t.ratios.get(compute) else math.nan for t in c.targets)]


def _adjusted(c: Comparison, p_adj: Iterator[float], family: Family) -> Comparison:
    """The comparison with its planned tests' corrected p-values, taken from p_adj in `_planned_ps` order."""
    difference = corrected_difference(c.difference, next(p_adj), family)
    targets = []
    for target in c.targets:
        ratio, p = target.ratios.get(family.compute), float(next(p_adj))
        targets.append(replace(target, ratios={**target.ratios, family.compute: ratio and replace(ratio, p_adj=p)}))
    return replace(c, difference=difference, targets=tuple(targets))
