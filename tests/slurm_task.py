"""One task of `maskbench sweep --emit slurm`'s script, run here by tests/test_slurm.py's stand-in `srun`:
`maskbench run ARGS`, which on the task's first start (SLURM_RESTART_COUNT 0 or unset) gets the time-limit signal
(SIGTERM, as `--signal=TERM@300` sends it) right after its first eval point, and runs undisturbed once requeued."""

from __future__ import annotations

import os
import signal
import sys

from maskbench.cli import main
from maskbench.runs import launch


def signal_after_the_first_point() -> None:
    """SIGTERM to this process once the first eval point is recorded: the trainer saves and stops after that step."""
    record = launch.PointRecorder.__call__

    def recorded_then_signalled(self, trainer, point):
        record(self, trainer, point)
        if trainer.cfg.eval.points.index(point) == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    launch.PointRecorder.__call__ = recorded_then_signalled


if __name__ == "__main__":
    if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        signal_after_the_first_point()
    sys.exit(main(sys.argv[1:]))
