"""What a report reads off a study's rows under its plan's family of tests: the corrected summary, the measured
compute multipliers, the fitted compute curves (exploratory) and the verdicts. One function, so the
`leaderboard` command, the HTML page and the repository's documentation tables read the rows alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from maskbench.metrics import CO_PRIMARY, get_metric
from maskbench.results.multiplicity import (
    RATIO,
    ArmVerdict,
    Family,
    correct_study,
    multiplier_verdicts,
)
from maskbench.results.multiplier import ArmMultiplier, Reading, measured_multipliers
from maskbench.results.rows import Row, auxiliary_flops
from maskbench.results.scaling import CROSSOVER_WITHIN, DEFAULT_RULE, GroupFit, fit_groups
from maskbench.results.study_plan import StudyPlan
from maskbench.results.summary import SIZE_TOLERANCE, Summary, summarize


@dataclass(frozen=True)
class Analysis:
    """What the report reads off the rows under a family: the corrected summary, the measured compute
    multipliers (M(B) corrected too under the compute-multiplier rule), the fitted curves (exploratory,
    shown only where their ladder check held), the verdicts of that rule, and the family's size."""
    summary: list[Summary]
    measured: list[ArmMultiplier]
    fits: list[GroupFit]
    verdicts: list[ArmVerdict]
    tests: int
    also: tuple[list[ArmMultiplier], ...] = ()  # M on device-hours, and with auxiliary FLOPs charged (reported)


def analyse_rows(rows: Sequence[Row], plan: StudyPlan | None, baseline: str, family: Family,
                 fits: bool = True, size_tolerance: float | None = SIZE_TOLERANCE) -> Analysis:
    """Summarise, read the measured compute multipliers off the baseline's ladder (`multiplier`), fit the
    compute curves when `fits` (exploratory: no verdict reads them), correct the family's tests together
    (`multiplicity.correct_study`) and read the verdicts. M and the curves are read for the metrics that fall
    towards a floor: FD and val loss, and a plan's lower-is-better primary metrics."""
    summary = summarize(rows, baseline, family.compared(), 1 - family.alpha, size_tolerance)
    metrics = (CO_PRIMARY if family.rule == RATIO else
               tuple(m for m in family.compared() if get_metric(m).lower_is_better))
    measured = measured_multipliers(rows, baseline, metrics, 1 - family.alpha, size_tolerance)
    also = tuple(found for how in _other_readings(rows)
                 if (found := measured_multipliers(rows, baseline, metrics, 1 - family.alpha, size_tolerance, how)))
    found = fit_groups(rows, baseline, metrics, level=1 - family.alpha,
                       within=plan.crossover_within if plan else CROSSOVER_WITHIN,
                       rule=plan.prediction_fails if plan else DEFAULT_RULE,
                       size_tolerance=size_tolerance) if fits else []
    summary, measured, tests = correct_study(summary, measured, family)
    return Analysis(summary, measured, found, multiplier_verdicts(summary, measured, family), tests, also)


def _other_readings(rows: Sequence[Row]) -> list[Reading]:
    """The readings of M reported beside the FLOPs one: on device-hours (only between rows of one device model),
    and, where an arm spent FLOPs outside its steps (`rows.auxiliary_flops`), with them charged to it."""
    readings = [Reading(axis="gpu_hours")]
    return readings + ([Reading(charged=True)] if any(auxiliary_flops(row) for row in rows) else [])
