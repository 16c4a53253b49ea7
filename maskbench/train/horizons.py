"""Cooled horizons: every eval point before the last is a decay branch, run from the trunk and put back.

A run evaluated at several fractions of its budget should show at each what a run trained *to* that budget
would be, annealed (Hägele et al. 2024), not a snapshot of a longer run at a constant LR. So where a
horizon's own run would start to differ from the trunk (its LR decay, or a two-phase arm's last phase:
`schedule.Horizon.fork`), the loop (`loop.Trainer.branch`) copies everything a branch changes (`snapshot`),
trains the branch to the horizon on loaders of its own, evaluates it, and restores the trunk bit for bit
(`restore`). On the CPU a branch is bit-identical to the standalone run of its budget (`tests/test_horizons.py`).
"""

from __future__ import annotations

import copy

from maskbench.train.build import Parts
from maskbench.train.progress import Progress

# Counters of the whole process, not of one horizon's run: they carry over when the trunk is restored.
RUN_COUNTERS = ("compile_seconds", "eval_seconds", "checkpoint_seconds", "resume_seconds")


def snapshot(parts: Parts, progress: Progress) -> dict:
    """Everything a branch changes, copied (the trunk resumes from it bit for bit); "positions" are where the
    trunk's loaders stand, where the branch's own loaders open."""
    repa, counters = parts.repa, progress.counters
    return {"model": copy.deepcopy(parts.net.state_dict()),
            "optimizer": copy.deepcopy(parts.optimizer.state_dict()),
            "scheduler": copy.deepcopy(parts.scheduler.state_dict()), "ema": copy.deepcopy(parts.ema.state_dict()),
            "state": copy.deepcopy(counters.state_dict()), "positions": dict(counters.loader_state),
            "repa": copy.deepcopy(repa.state_dict()) if repa is not None else None}


def restore(parts: Parts, progress: Progress, trunk: dict) -> None:
    """The trunk as `snapshot` copied it, with the whole process's counters carried over from the branch."""
    state = progress.counters
    carried = {name: getattr(state, name) for name in RUN_COUNTERS}
    carried["branches_flops"] = trunk["state"]["branches_flops"] + state.branch_flops
    parts.net.load_state_dict(trunk["model"])
    parts.optimizer.load_state_dict(trunk["optimizer"])
    parts.scheduler.load_state_dict(trunk["scheduler"])
    parts.ema.load_state_dict(trunk["ema"])
    if parts.repa is not None:
        parts.repa.load_state_dict(trunk["repa"])
    state.load_state_dict({**trunk["state"], **carried})
