"""The progress bar's ETA during `maskbench run`: it counts the trunk's training steps only, so a cooled
horizon's branch and its evaluation never make it promise more than about twice the time the run really has
left. Before the bar paused over them, the ETA after an evaluation read 3-5 hours on a run of minutes.

The bar reads a clock the test drives, so the check is exact and does not depend on how busy the machine is:
a training step takes time in proportion to its FLOPs (the bar counts FLOPs: an unmasked step costs more than a
masked one), about a second on average here, and the horizon's evaluation takes a minute."""

from __future__ import annotations

import io
import re

import tqdm.std

from maskbench import cli
from maskbench.runs.record import PointRecorder
from maskbench.train import loop
from tests.conftest import tiny_overrides

FLOP_RATE, EVAL_S = 6e7, 60.0  # ~1 s per step of this toy run; the horizon's evaluation as long as many steps


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Clocked(io.StringIO):
    """A terminal that notes the clock at each refresh of the bar."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.writes = clock, []

    def write(self, text: str) -> int:
        self.writes.append((self.clock(), text))
        return len(text)


def seconds(clock: str) -> float:
    """tqdm's [H:]MM:SS as seconds."""
    return sum(int(part) * 60 ** i for i, part in enumerate(reversed(clock.split(":"))))


def etas(writes: list[tuple[float, str]]) -> list[tuple[float, float]]:
    """(when, the ETA it showed) of every refresh that showed one."""
    return [(when, seconds(match[1])) for when, text in writes for match in re.finditer(r"<(\d+(?::\d+)+)", text)]


def test_the_eta_never_exceeds_twice_the_real_remaining_time(tmp_path, synth_root, monkeypatch):
    clock = Clock()
    terminal = Clocked(clock)
    monkeypatch.setattr(tqdm.std, "time", clock)  # each bar reads its clock from here when it is made
    monkeypatch.setattr(loop, "tqdm", lambda *args, **kw: tqdm.std.tqdm(*args, **kw, file=terminal, mininterval=0))
    step, evaluate = loop.Trainer.step, PointRecorder.__call__

    def timed_step(self, phase, flops, *args, **kwargs):
        out = step(self, phase, flops, *args, **kwargs)
        clock.now += flops / FLOP_RATE
        return out

    def timed_evaluation(self, trainer, point):
        clock.now += EVAL_S if point < 1 else 0.0  # the horizon's, mid-run; the last one ends the run
        return evaluate(self, trainer, point)

    monkeypatch.setattr(loop.Trainer, "step", timed_step)
    monkeypatch.setattr(PointRecorder, "__call__", timed_evaluation)
    assert cli.main(["run", *tiny_overrides(tmp_path, synth_root, "arm=mask75_then0")]) == 0
    shown, done = etas(terminal.writes), clock.now
    assert len(shown) >= 8 and any(when > EVAL_S for when, _ in shown)  # refreshes on both sides of the pause
    over = [(eta, done - when) for when, eta in shown if eta > 2 * (done - when)]
    assert over == [], "(ETA shown, seconds the run really had left)"
