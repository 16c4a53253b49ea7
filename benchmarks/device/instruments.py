"""What the device check measures around maskbench's own code, without changing it: Dynamo's graph, graph-break
and recompile counts, the peak GPU memory, the compile backend, and two processes sharing one GPU over gloo.

Used by benchmarks/device/wrap.py (one maskbench command) and benchmarks/device/arms_check.py (every arm in one
process). Nothing here is imported by maskbench.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter

import torch


class DynamoCounts(logging.Handler):
    """Counts Dynamo's recompiles (and hits of its recompile limit, after which a frame silently runs eagerly) from
    its `recompiles` log, beside the graph and graph-break counters it keeps itself."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.recompiles: list[str] = []
        self.limit_hits: list[str] = []
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Recompiling function" in message:
            lines = [line.strip() for line in message.splitlines()]
            reason = next((line for line in lines if line.startswith("- ") and "stack" not in line), lines[0])
            self.recompiles.append(f"{lines[0].removeprefix('Recompiling function ')}: {reason[2:]}"[:300])
        elif "recompile_limit" in message or "cache_size_limit" in message:
            self.limit_hits.append(message.splitlines()[0][:300])

    def reset(self) -> None:
        """Start counting afresh (and forget every compiled frame: a new model compiles anew)."""
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        self.recompiles, self.limit_hits = [], []

    def summary(self) -> dict:
        from torch._dynamo.utils import counters

        breaks = Counter({reason.splitlines()[0][:200]: n for reason, n in counters["graph_break"].items()})
        return {"frames": counters["frames"]["total"], "frames_ok": counters["frames"]["ok"],
                "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(breaks.values()),
                "graph_break_reasons": [f"{n}x {reason}" for reason, n in breaks.most_common(3)],
                "recompiles": len(self.recompiles), "recompile_reasons": self.recompiles[:3],
                "recompile_limit_hits": len(self.limit_hits)}


def peak_memory_gib(reset: bool = False) -> float | None:
    """The most GPU memory torch allocated since the last reset (torch.cuda.max_memory_allocated), in GiB; None on a
    machine without CUDA, where it is not measured. `reset`: start a new peak (before the next arm)."""
    if not torch.cuda.is_available():
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def use_backend(backend: str) -> None:
    """Make every `torch.compile(...)` that names no backend use `backend` (the trainer names none: Inductor)."""
    if backend != "inductor":
        torch.compile = functools.partial(torch.compile, backend=backend)


def gloo_on_one_gpu() -> None:
    """Under torchrun on a machine with one GPU: open the process group over gloo before accelerate does. accelerate
    then keeps it (it opens one only when none is open) and puts rank r on cuda:(r mod the device count), so both
    ranks share cuda:0 and DDP all-reduces through gloo (NCCL refuses two ranks on one GPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
