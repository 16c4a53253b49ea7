"""Several `maskbench` commands, one after another, in each process of one torchrun launch.

A torchrun launch costs seconds of imports per process before any work; tests that need several 2-process
commands run them in one launch. Each command is `maskbench.cli.main(argv)`, which starts the process group
(its trainer's accelerator does) and destroys it when done, as in a launch of its own. The first command's
group meets in torchrun's store; a later one's in a store of its own on a fresh port that rank 0 chose and
passed on through torchrun's store (meeting again in torchrun's store, beside the first group's keys, a second
group would hang).

usage: python -m torch.distributed.run --standalone --nproc_per_node 2 tests/launch_commands.py PLAN.json
PLAN.json: [{"argv": [...], "out": DIR, "skewed_clock": false}, ...]. Each process writes, for each command,
DIR/rank-R.out (what the command printed) and DIR/rank-R.rc (its exit code); the launch stops at the first
command that fails (a non-zero exit code, or an exception: its traceback on stderr, the launch fails).
With skewed_clock, rank 1 believes an hour passes between any two readings of the trainer's clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import maskbench.train.loop as loop
from maskbench.cli import main


@contextlib.contextmanager
def skewed_clock(rank: int):
    """Rank 1's trainer reads a monotonic clock an hour ahead at every reading; the other ranks' is true."""
    if rank != 1:
        yield
        return
    real, calls = time.monotonic, iter(range(10**9))
    loop.time = type("SkewedTime", (), {"perf_counter": staticmethod(time.perf_counter),
                                        "monotonic": staticmethod(lambda: real() + 3600 * next(calls))})
    try:
        yield
    finally:
        loop.time = time


def fresh_rendezvous(agent: dist.TCPStore, rank: int, index: int) -> None:
    """Point the next process group at a store of its own: a free port rank 0 picks, read by every rank from
    torchrun's store `agent` (env:// then starts a store on rank 0, as outside torchrun)."""
    key = f"launch_commands/port-{index}"
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            agent.set(key, str(probe.getsockname()[1]))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=agent.get(key).decode(), TORCHELASTIC_USE_AGENT_STORE="False")


def run_plan(plan: list[dict]) -> int:
    rank, agent, torchrun_store = int(os.environ["RANK"]), None, (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    for index, command in enumerate(plan):
        out = Path(command["out"])
        out.mkdir(parents=True, exist_ok=True)
        if index:
            agent = agent or dist.TCPStore(torchrun_store[0], int(torchrun_store[1]), is_master=False,
                                           timeout=timedelta(minutes=2))
            fresh_rendezvous(agent, rank, index)
        clock = skewed_clock(rank) if command.get("skewed_clock") else contextlib.nullcontext()
        with open(out / f"rank-{rank}.out", "w") as printed, contextlib.redirect_stdout(printed), clock:
            code = main(command["argv"])
        (out / f"rank-{rank}.rc").write_text(str(code))
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run_plan(json.loads(Path(sys.argv[1]).read_text())))
