"""What changes while a run trains, in one object the loop hands to the parts that read it.

The counters (step, FLOPs, seconds, skips: `checkpoint.TrainState`, what a checkpoint saves), the trunk's schedule
(a phase rule that fires replans it: `switch.PhaseRules.check` returns the new one), and the cooled horizon whose
branch is training (`horizons`). The phase rule, the horizons' copy and the step log take a `Progress` and
read it; none of them reaches into the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from maskbench.train.checkpoint import TrainState
from maskbench.train.schedule import Horizon, Schedule


@dataclass
class Progress:
    counters: TrainState            # one object for the whole run: accelerate saves and loads it in place
    schedule: Schedule              # the trunk's plan, as the rules that fired so far left it
    branch: Horizon | None = None   # the cooled horizon being trained, if any
    stop_signal: int | None = None  # SIGINT/SIGTERM received: checkpoint and stop at the end of the step

    @property
    def active(self) -> Schedule:
        """The schedule the current step follows: a horizon's branch, or the trunk (its LR reads this)."""
        return self.branch.schedule if self.branch is not None else self.schedule
