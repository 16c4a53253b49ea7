"""When a phase's rule ends it: Skip-DiT's stage 1 -> 2 switch, decided by a measurement instead of by eye.

Skip-DiT converts a trained DiT in two stages (train only the new skip layers, then everything) and
leaves the switch to the user, who is told to watch the skip Linear layers' weight and bias norms so as
not to over-train stage 1. A phase's `until` makes that a rule, checked every `until.every` steps of the
phase: the skip layers' weight-norm growth over a check interval fell below a fraction, or the
(EMA) fixed-t validation loss is back within a fraction of the source run's. The phase's `fraction` is
its cap; when the rule fires, the plan moves the rest of its budget to the next phase (`schedule_phases`).

The same machinery ends a masked phase when masking stops paying (issue 28's rule arm): every
`until.every` steps, the masked gradient's debiased cosine to the full-token gradient on the step's own
batch (the estimator of `maskbench probe gradfid`, on parts of the batch) fell below a threshold.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Sequence

import torch
from accelerate.utils import broadcast_object_list
from torch import nn

from maskbench.config import RunConfig, Trainable, Until
from maskbench.data.dataset import DatasetInfo
from maskbench.errors import ConfigError
from maskbench.models.dit import DiT
from maskbench.models.objective import flow_loss
from maskbench.train.ddp import Layout, phase_layout
from maskbench.train.progress import Progress
from maskbench.train.schedule import Schedule, ScheduledPhase, batch_step_flops, make_schedule, rule_checks
from maskbench.train.step import StepDraws, Stepper


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


def set_trainable(model: DiT, trainable: str, idle: Collection[str] = ()) -> None:
    """all: every parameter trains; skips: only the long-skip layers (Skip-DiT's stage 1); never the `idle`
    ones, which the phase's steps give no gradient. Frozen parameters get no gradient, so autograd skips their
    weight grads and the optimizer leaves them (and their Adam state) untouched."""
    skips = {id(param) for _, param in model.skip_parameters()}
    for name, param in model.named_parameters():
        param.requires_grad_((trainable == Trainable.all or id(param) in skips) and name not in idle)


class PhaseRules:
    """A run's phases as the loop steps through them: what each trains, where the first one ended, and
    the `until` rules that end a phase early (measured, decided and replanned here, so the loop only asks).
    Runs on every rank; a decision is rank 0's, broadcast. What changes is in the `Progress` each call reads."""

    def __init__(self, cfg: RunConfig, data: DatasetInfo, stepper: Stepper,
                 validation: Callable[[nn.Module], float] | None, reference: float | None) -> None:
        """validation(model): the fixed-t validation loss a `val_loss_within` rule checks, against `reference`,
        the init_from source's at its point (evaluation lives above training, so both are handed in)."""
        if any(p.until and watches_val_loss(p.until) for p in cfg.arm.phases) and (
                validation is None or reference is None):
            raise ConfigError("until.val_loss_within needs the source run's validation loss at its point "
                              "(an init_from source evaluated there)")
        self.cfg, self.data, self.stepper, self.parts = cfg, data, stepper, stepper.parts
        self.validation, self.reference = validation, reference
        self.layout: Layout = (Trainable.all, ())  # what the model trains now (`train.ddp`): all, as built

    def enter(self, progress: Progress, phase: ScheduledPhase) -> None:
        """Before a step: train only what the phase's steps give a gradient (and wrap the model for DDP again
        when that changed), note where the first phase ended, and take the baseline of a growth rule at the
        phase's first step."""
        model, state = self.parts.net, progress.counters
        layout = phase_layout(self.cfg, phase.trainable, phase.mask_ratio)
        if layout != self.layout:
            set_trainable(model, *layout)
            self.layout = layout
            self.parts.wrap_again()
        if phase.index > 0 and state.switch_step is None:
            state.switch_step = phase.start
            where = f"horizon {progress.branch.point:g}'s branch" if progress.branch is not None else "the trunk"
            self.parts.accelerator.print(f"{where}: phase {phase.index} from step {phase.start}")
        if phase.until is not None and phase.until.skip_norm_growth_below is not None and state.step == phase.start:
            state.rule = {"previous": skip_weight_norm(model)}

    def probes_now(self, progress: Progress, phase: ScheduledPhase) -> bool:
        """Whether this step of the phase holds a cosine rule's probe (the plan charged it here)."""
        return rule_checks(phase.until, progress.counters.step - phase.start + 1)

    def masked_share(self, phase: ScheduledPhase) -> float:
        """A masked step's FLOPs over a full step's, on this run's model and batch (`Until.per_flop`)."""
        return batch_step_flops(self.cfg, self.data, phase.mask_ratio) / batch_step_flops(self.cfg, self.data, 0.0)

    def probe_cosine(self, batches: list[dict], phase: ScheduledPhase, step: int) -> float:
        """The `grad_cosine_below` rule's measurement before the step's update: the debiased cosine between
        the phase's masked gradient and the full-token one, each stream's micro-batch in `probe_splits`
        parts with the step's own t, noise, dropout and mask (the plan charges one full and one masked pass
        of the batch). Pairs are formed within a rank and their sums added over ranks."""
        acc, net, splits = self.parts.accelerator, self.parts.net, phase.until.probe_splits
        products = torch.zeros(3, dtype=torch.float64, device=acc.device)
        for stream, batch in zip(self.stepper.streams.ids, batches):
            d = self.stepper.draws(batch, phase, stream, step)

            def part_losses(idx: torch.Tensor, d: StepDraws = d) -> tuple[torch.Tensor, torch.Tensor]:
                x0, noise, t, context, context_mask, drop = d.loss_args(idx)
                loss = functools.partial(flow_loss, net, x0, noise, t.to(acc.device), context, context_mask, drop,
                                         mae_weight=self.cfg.train.mae_weight)
                masked = d.inputs.rows(idx)
                with acc.autocast():
                    return loss(inputs=masked.unmasked()), loss(inputs=masked)

            parts = torch.arange(d.x0.shape[0], device=acc.device).tensor_split(splits)
            with self.parts.block_norms.paused():  # the probe's forwards are not the step's
                products += cross_products([functools.partial(part_losses, idx) for idx in parts], net)
        return cosine_from_products(acc.reduce(products, "sum").cpu())

    def check(self, progress: Progress, phase: ScheduledPhase, probed: float | None) -> tuple[dict, Schedule]:
        """After a trunk step of a rule phase, every `until.every` steps before its cap: measure (`probed`: the
        cosine rule's measurement, taken during the step), and if the rule fires, end the phase here and replan
        the rest of the budget. Returns what the step's log records and the trunk's schedule from now on."""
        until, state, acc = phase.until, progress.counters, self.parts.accelerator
        done = state.step - phase.start
        if until is None or done % until.every or done >= phase.steps:
            return ({"until": {"phase": phase.index, "value": None, "fired": False, "cosine": probed}}
                    if probed is not None else {}), progress.schedule  # the probe the plan charged at the phase's last step
        if watches_val_loss(until):
            value = self.validation(self.parts.ema.model)
        elif until.grad_cosine_below is not None:
            value = probed / self.masked_share(phase) if until.per_flop else probed
        else:
            value = skip_weight_norm(self.parts.net)
        fired = crossed(until, value, state.rule, self.reference)
        if acc.num_processes > 1:  # one decision for every rank
            fired = broadcast_object_list([fired])[0]
        record = {"until": {"phase": phase.index, "value": value, "fired": fired,
                            **({"cosine": probed} if probed is not None else {})}}
        if not fired:
            return record, progress.schedule
        state.phase_ends = {**state.phase_ends, phase.index: done}
        schedule = make_schedule(self.cfg, self.data, self.stepper.streams.count, state.phase_ends)
        acc.print(f"phase {phase.index}'s rule fired after {done} steps (step {state.step}); "
                  f"{schedule.total_steps - state.step} steps left")
        return record, schedule
