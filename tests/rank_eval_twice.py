"""One rank of two 2-process evaluations run one after another (tests/rank_eval_worker.py's, twice), started
(twice, as ranks 0 and 1) by tests/test_rank_eval.py: two processes cost seconds of imports each, so the
evaluation that succeeds and the one whose rank 1 fails share them.

usage: rank_eval_twice.py OK_DIR FAIL_DIR -- OK_OVERRIDES... -- FAIL_OVERRIDES...
The first evaluation writes OK_DIR/rank-R.json and then OK_DIR/finished-R (this rank came through it); the
process group lives on into the second, whose rank 1 fails while scoring (--fail): each rank must then end on
its own, as after any failed evaluation.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from accelerate import Accelerator

from tests import rank_eval_worker


def main(ok: Path, fail: Path, ok_overrides: list[str], fail_overrides: list[str]) -> None:
    end_training = Accelerator.end_training
    Accelerator.end_training = lambda self: None  # the group is the second evaluation's too
    try:
        rank_eval_worker.main(ok, False, ok_overrides)
    finally:
        Accelerator.end_training = end_training
    (ok / f"finished-{os.environ['RANK']}").touch()
    rank_eval_worker.main(fail, True, fail_overrides)


if __name__ == "__main__":
    first, second = (i for i, arg in enumerate(sys.argv) if arg == "--")
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[first + 1:second], sys.argv[second + 1:])
