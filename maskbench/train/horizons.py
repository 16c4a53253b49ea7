"""Cooled horizons: every eval point before the last is a decay branch, run from the trunk and put back.

A run evaluated at several fractions of its budget should show at each what a run trained *to* that budget
would be, annealed (Hägele et al. 2024), not a snapshot of a longer run at a constant LR. So where a
horizon's own run would start to differ from the trunk (its LR decay, or a two-phase arm's last phase:
`schedule.Horizon.fork`), the trainer copies everything a branch changes, trains the branch to the horizon
on loaders of its own, evaluates it, and restores the trunk bit for bit. On the CPU a branch is
bit-identical to the standalone run of its budget (`tests/test_horizons.py`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from maskbench.data.loader import ShardLoader
from maskbench.train.schedule import Horizon

if TYPE_CHECKING:
    from maskbench.train.loop import Trainer

# Counters of the whole process, not of one horizon's run: they carry over when the trunk is restored.
RUN_COUNTERS = ("compile_seconds", "eval_seconds", "checkpoint_seconds", "resume_seconds")


def run_branch(trainer: Trainer, horizon: Horizon) -> bool:
    """Train a cooled horizon from the trunk's current step to its end, evaluate it, then put the trunk
    back exactly as it was. Returns True when a stop signal cut the branch short (nothing of it kept:
    the trunk checkpoint at the fork reruns it on resume).

    The branch reads its own loaders, opened at the trunk's current position, so the trunk's stream is
    untouched; from the fork on it is the standalone run of budget point × budget, step for step."""
    trunk = snapshot(trainer)
    trainer.branch = horizon
    loaders: list[ShardLoader] = trainer.make_loaders(trunk["positions"])
    batch_iters = [iter(loader) for loader in loaders]
    stopped = False
    with open(trainer.run.branch_metrics(horizon.point), "w") as log:
        while trainer.state.step < horizon.schedule.total_steps and not stopped:
            phase, flops = horizon.schedule.phase_at(trainer.state.step)
            stopped = trainer.step(phase, flops, batch_iters, loaders, log)["stop"]
    if not stopped:
        trainer.save_positions(loaders)
        trainer.reach_point(horizon.point)
    del batch_iters, loaders
    trainer.branch = None
    restore(trainer, trunk)
    return stopped


def snapshot(trainer: Trainer) -> dict:
    """Everything a branch changes, copied (the trunk resumes from it bit for bit)."""
    trainer.count_time(wait=True)  # the trunk's last steps are the trunk's
    repa = trainer.repa
    return {"model": copy.deepcopy(trainer.net.state_dict()),
            "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
            "scheduler": copy.deepcopy(trainer.scheduler.state_dict()), "ema": copy.deepcopy(trainer.ema.state_dict()),
            "state": copy.deepcopy(trainer.state.state_dict()), "positions": dict(trainer.state.loader_state),
            "repa": copy.deepcopy(repa.state_dict()) if repa is not None else None}


def restore(trainer: Trainer, trunk: dict) -> None:
    """The trunk as `snapshot` copied it, with the whole process's counters carried over from the branch."""
    state = trainer.state
    carried = {name: getattr(state, name) for name in RUN_COUNTERS}
    carried["branches_flops"] = trunk["state"]["branches_flops"] + state.branch_flops
    trainer.net.load_state_dict(trunk["model"])
    trainer.optimizer.load_state_dict(trunk["optimizer"])
    trainer.scheduler.load_state_dict(trunk["scheduler"])
    trainer.ema.load_state_dict(trunk["ema"])
    if trainer.repa is not None:
        trainer.repa.load_state_dict(trunk["repa"])
    state.load_state_dict({**trunk["state"], **carried})
