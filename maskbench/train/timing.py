"""How long the training steps take, without making the device wait for the host to ask.

A step's seconds on a GPU are the time its kernels ran, which the host only learns by waiting for them:
a `torch.cuda.synchronize()` after every step stalls the queue at every step. `StepTimer` records a
CUDA event pair around each step instead and reads a pair once its end has passed (`Event.query()`),
normally one step later; `flush()` waits for the last one, where the counters must be exact (an eval
point's row, a checkpoint). On the CPU a step's work is done when it returns, so the host clock is read
at once.

Compilation is counted from what Dynamo reports it spent (`torch._dynamo.utils.compilation_time_metrics`),
not by guessing which step compiled: a graph compiled in the middle of a phase (a demotion route's new
batch size, a probe's forward) is charged to compilation, and the rest of that step to training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def dynamo_compile_seconds() -> float:
    """Every second Dynamo has spent compiling in this process so far (0 when nothing was compiled)."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return float(sum(sum(times) for times in metrics.values()))


@dataclass
class Timing:
    """Seconds measured since the last read, split into the steps' own time and compilation."""
    train: float = 0.0
    compile: float = 0.0


class StepTimer:
    """Times training steps on `device`: `start()` before a step, `stop()` after it, `read()` for what has
    been measured since the last read (on CUDA, the steps whose kernels have finished)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[object, object, float]] = []   # (start, end, compile seconds) not read yet
        self._ready = Timing()
        self._tick = 0.0
        self._compiled = 0.0

    def start(self) -> None:
        self._compiled = dynamo_compile_seconds()
        if self.cuda:
            self._tick = torch.cuda.Event(enable_timing=True)
            self._tick.record()
        else:
            self._tick = time.perf_counter()

    def stop(self) -> None:
        compiled = dynamo_compile_seconds() - self._compiled  # host time, inside the step's span
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._tick, end, compiled))
        else:
            self._add(time.perf_counter() - self._tick, compiled)

    def _add(self, seconds: float, compiled: float) -> None:
        self._ready.compile += compiled
        self._ready.train += max(seconds - compiled, 0.0)

    def read(self, wait: bool = False) -> Timing:
        """The time of every step finished since the last read; `wait`: wait for the steps still running."""
        while self._pending and (wait or self._pending[0][1].query()):
            start, end, compiled = self._pending.pop(0)
            end.synchronize()
            self._add(start.elapsed_time(end) / 1000, compiled)
        ready, self._ready = self._ready, Timing()
        return ready
