"""The step guard: which optimizer steps are skipped, how many, and the stop when a run trained too little.

A step is skipped when its loss or grad norm is non-finite, or when the guard refuses its global grad norm (before
clipping). `train.skip_step_grad_norm` is an absolute bound, as Skip-DiT's authors wrote theirs (0.02, for their
trained Latte); `train.skip_step_grad_ratio` is relative to the phase's own recent norms, so it means the same on
any model size, batch and loss scale (docs/arms.md). A skipped step still spends its FLOPs and its batch:
a run that skips many is trained on less than its FLOPs say. So the counts are in every step's log line, on the
progress line and in every row (`skipped_steps`), and a run that skipped more than `train.max_skipped_share` of its
steps, or of a phase's, stops with one line (exit 2) naming the guard and the norms it refused.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from maskbench.config import TrainConfig
from maskbench.errors import UserError
from maskbench.train.checkpoint import TrainState
from maskbench.train.schedule import ScheduledPhase

REFUSED_KEPT = 1000  # the latest refused norms a stop summarises (not a long run's every one)


class TooManySkipped(UserError):
    """A run skipped more of its steps than `train.max_skipped_share` allows: its rows would report FLOPs that
    never moved the weights. Bad input (exit 2): the guard, or the learning rate, is what to change."""


def guard_name(train: TrainConfig) -> str | None:
    """The step guard in force, as a user sets it, or None (only non-finite steps are skipped)."""
    if train.skip_step_grad_norm is not None:
        return f"train.skip_step_grad_norm={train.skip_step_grad_norm:g}"
    if train.skip_step_grad_ratio is not None:
        return (f"train.skip_step_grad_ratio={train.skip_step_grad_ratio:g} (× the median of the phase's last "
                f"{train.skip_step_window} norms)")
    return None


@dataclass(frozen=True)
class StepGuard:
    """One run's guard. What it remembers lives in the TrainState, so a checkpoint keeps it (a resumed run decides
    as the uninterrupted one) and a horizon's branch gives it back with the trunk."""

    train: TrainConfig

    def refuses(self, state: TrainState, phase: int, grad_norm: float) -> bool:
        """Whether the guard refuses a step of phase `phase` whose loss and grad norm are finite.

        The relative bound waits for a full window of the phase's own norms (its warm-up), and each phase has its
        own: Skip-DiT's first stage trains the skips alone, whose norms are of another size than the whole model's.
        The window holds refused norms too, so a lasting change of scale (norms that grow as a constant-LR run
        trains) is followed within half a window, where a window of accepted norms alone would lock: once it
        refuses the new scale, nothing of it would ever enter."""
        train = self.train
        if train.skip_step_grad_norm is not None:
            return grad_norm > train.skip_step_grad_norm
        window = state.recent_norms.get(phase, [])
        return (train.skip_step_grad_ratio is not None and len(window) >= train.skip_step_window
                and grad_norm > train.skip_step_grad_ratio * statistics.median(window))

    def count(self, state: TrainState, phase: int, grad_norm: float, finite: bool, stepped: bool) -> None:
        """A step's outcome in the counters, and a finite norm in the relative guard's window."""
        state.skipped_nonfinite += not finite
        if not stepped:
            state.phase_skipped[phase] = state.phase_skipped.get(phase, 0) + 1
        if finite and not stepped:
            state.skipped_grad_norm += 1
            state.refused_norms.append(grad_norm)
            del state.refused_norms[:-REFUSED_KEPT]
        if finite and self.train.skip_step_grad_ratio is not None:
            window = state.recent_norms.setdefault(phase, [])
            window.append(grad_norm)
            del window[:-self.train.skip_step_window]

    def after_step(self, state: TrainState, phase: ScheduledPhase) -> None:
        """`check` when this step ended `phase`, as the schedule in force plans it (a rule that fired shortened it)."""
        if state.step == phase.start + phase.steps:
            self.check(state, phase)

    def check(self, state: TrainState, phase: ScheduledPhase | None = None) -> None:
        """Stop (TooManySkipped) when more than `train.max_skipped_share` of `phase`'s steps (one that just ended),
        or of the run's steps so far, were skipped.

        Checked where a phase ends and before an eval point is recorded, not after every step: the share is then
        read over whole phases and over what a row reports, never over a phase's first few steps; it depends on step
        counts alone, so every rank and every rerun decides the same; and it costs a comparison a few times a run."""
        shares = [(state.skipped_steps, state.step, f"the run's {state.step} steps so far")]
        if phase is not None:
            last = phase.start + phase.steps - 1
            shares.insert(0, (state.phase_skipped.get(phase.index, 0), phase.steps,
                              f"phase {phase.index}'s {phase.steps} steps ({phase.start}-{last})"))
        for skipped, steps, what in shares:
            if steps and skipped / steps > self.train.max_skipped_share:
                raise TooManySkipped(self.stop_line(state, skipped / steps, f"{skipped} of {what}"))

    def stop_line(self, state: TrainState, share: float, what: str) -> str:
        """The one line a stop prints: how many steps were skipped, by what, and the grad norms the guard refused."""
        causes = []
        if state.skipped_grad_norm:
            norms = state.refused_norms
            causes.append(f"the step guard {guard_name(self.train)} refused {state.skipped_grad_norm} (grad norms "
                          f"min {min(norms):.3g}, median {statistics.median(norms):.3g}, max {max(norms):.3g})")
        if state.skipped_nonfinite:
            causes.append(f"{state.skipped_nonfinite} had a non-finite loss or grad norm")
        limit = self.train.max_skipped_share
        return (f"{what} skipped their optimizer step ({share:.0%}, above train.max_skipped_share={limit:g}), so the "
                f"weights barely trained: over the run, {' and '.join(causes)}; loosen the guard (docs/arms.md) or set "
                "train.max_skipped_share=1 to train on anyway")
