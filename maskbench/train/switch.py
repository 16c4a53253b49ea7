"""When a phase's rule ends it: Skip-DiT's stage 1 -> 2 switch, decided by a measurement instead of by eye.

Skip-DiT converts a trained DiT in two stages (train only the new skip layers, then everything) and
leaves the switch to the user, who is told to watch the skip Linear layers' weight and bias norms so as
not to over-train stage 1. A phase's `until` makes that a rule, checked every `until.every` steps of the
phase: the skip layers' weight-norm growth over a check interval fell below a fraction, or the
(EMA) fixed-t validation loss is back within a fraction of the source run's. The phase's `fraction` is
its cap; when the rule fires, the plan moves the rest of its budget to the next phase (`plan_phases`).

The same machinery ends a masked phase when masking stops paying (issue 28's rule arm): every
`until.every` steps, the masked gradient's debiased cosine to the full-token gradient on the step's own
batch (the estimator of `maskbench probe gradfid`, on parts of the batch) fell below a threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from maskbench.config import Until
from maskbench.models.dit import DiT


def skip_weight_norm(model: DiT) -> float:
    """The L2 norm of all long-skip Linear weights together (what the growth rule watches)."""
    return torch.linalg.vector_norm(torch.stack([skip.proj.weight.detach().float().norm()
                                                 for skip in model.long_skips.values()])).item()


def flat_grad(model: DiT, loss: torch.Tensor) -> torch.Tensor:
    """Every trainable parameter's gradient as one fp32 vector on the model's device (zeros for parameters a
    route skips). `autograd.grad` leaves `.grad` alone, so a probe between a step's backward and its update
    is harmless."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return torch.cat([g.reshape(-1) for g in grads]).float()                      # P


def cross_products(losses: Sequence[Callable[[], tuple[torch.Tensor, torch.Tensor]]], model: DiT) -> torch.Tensor:
    """The U-statistic sums of the debiased cosine (`results.estimators.debiased_cosine`) over n parts.

    losses[i]() is part i's (full-token loss, masked loss) on the same samples, noise and t; with a_i, b_i
    their gradients, returns fp64 [Σ_{i≠j} a_i·a_j, Σ_{i≠j} b_i·b_j, Σ_{i≠j} a_i·b_j]. Products of distinct,
    independent parts are unbiased for the expected gradients' products, so sums from several ranks add.
    One pass on the device: Σ_{i≠j} x_i·y_j = (Σ_i x_i)·(Σ_j y_j) − Σ_i x_i·y_i, so only the two running sums
    and one part's pair of gradients are held (3 vectors of P, not 2n, and none on the host).
    """
    sum_a = sum_b = None
    same = torch.zeros(3, dtype=torch.float64)                                     # Σ_i a_i·a_i, b_i·b_i, a_i·b_i
    for pair in losses:
        full, masked = pair()
        a, b = flat_grad(model, full).double(), flat_grad(model, masked).double()  # P each
        same = same.to(a.device) + torch.stack([a @ a, b @ b, a @ b])
        sum_a = a if sum_a is None else sum_a + a
        sum_b = b if sum_b is None else sum_b + b
    return torch.stack([sum_a @ sum_a, sum_b @ sum_b, sum_a @ sum_b]) - same        # 3


def cosine_from_products(products: torch.Tensor) -> float:
    """ab / √(aa·bb) from `cross_products`; NaN when the signal is below the noise (aa or bb <= 0)."""
    aa, bb, ab = products.tolist()
    return ab / math.sqrt(aa * bb) if aa > 0 and bb > 0 else math.nan


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
    if until.grad_cosine_below is not None:
        return value < until.grad_cosine_below  # NaN (no measurable signal) never fires
    previous, memory["previous"] = memory.get("previous"), value
    if previous is None:
        return False
    growth = (value - previous) / previous
    fired = memory.get("armed", False) and growth < until.skip_norm_growth_below
    memory["armed"] = memory.get("armed", False) or growth >= until.skip_norm_growth_below
    return fired
