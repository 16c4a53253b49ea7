"""When a phase's rule ends it: Skip-DiT's stage 1 -> 2 switch, decided by a measurement instead of by eye.

Skip-DiT converts a trained DiT in two stages (train only the new skip layers, then everything) and
leaves the switch to the user, who is told to watch the skip Linear layers' weight and bias norms so as
not to over-train stage 1. A phase's `until` makes that a rule, checked every `until.every` steps of the
phase: the skip layers' weight-norm growth over a check interval fell below a fraction, or the
(EMA) fixed-t validation loss is back within a fraction of the source run's. The phase's `fraction` is
its cap; when the rule fires, the plan moves the rest of its budget to the next phase (`plan_phases`).
"""

from __future__ import annotations

import torch

from maskbench.config import Until
from maskbench.models.dit import DiT


def skip_weight_norm(model: DiT) -> float:
    """The L2 norm of all long-skip Linear weights together (what the growth rule watches)."""
    return torch.linalg.vector_norm(torch.stack([skip.proj.weight.detach().float().norm()
                                                 for skip in model.long_skips.values()])).item()


def watches_val_loss(until: Until) -> bool:
    return until.val_loss_within is not None


def crossed(until: Until, value: float, memory: dict, reference: float | None) -> bool:
    """Whether the rule fires at a check that measured `value` (`reference`: the source run's validation
    loss). `memory` carries what the next check needs, and is saved with the train state: the growth rule's
    last norm (the phase start's before its first check) and whether growth has yet reached the threshold.

    The growth rule fires where the growth per check interval *falls* below the threshold: at the start
    of a phase, under the LR warm-up, the skip weights barely move, and that is not the plateau Skip-DiT
    means by "stop stage 1 before it over-trains".
    """
    if watches_val_loss(until):
        return value <= (1 + until.val_loss_within) * reference
    previous, memory["previous"] = memory.get("previous"), value
    if previous is None:
        return False
    growth = (value - previous) / previous
    fired = memory.get("armed", False) and growth < until.skip_norm_growth_below
    memory["armed"] = memory.get("armed", False) or growth >= until.skip_norm_growth_below
    return fired
