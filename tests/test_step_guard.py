"""Skipped optimizer steps: the step guard's two rules, their counts, and the stop (exit 2, one line) of a run that
skipped more of its steps, or of a phase's, than `train.max_skipped_share` allows."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from maskbench import cli
from maskbench.config import TrainConfig, load_config
from maskbench.errors import ConfigError
from maskbench.train.checkpoint import TrainState
from maskbench.train.guard import StepGuard, TooManySkipped
from maskbench.train.schedule import ScheduledPhase
from tests.conftest import FAST, tiny_overrides


def _steps(guard: StepGuard, state: TrainState, norms: list[float], phase: int = 0) -> list[bool]:
    """Each grad norm as one step of `phase` through the guard, as the trainer takes it (NaN: a non-finite step);
    whether the guard refused each."""
    refused = []
    for norm in norms:
        finite = math.isfinite(norm)
        stepped = finite and not guard.refuses(state, phase, norm)
        guard.count(state, phase, norm, finite, stepped)
        state.step += 1
        refused.append(finite and not stepped)
    return refused


def _phase(index: int, start: int, steps: int) -> ScheduledPhase:
    return ScheduledPhase(0.0, (1,) * steps, index=index, start=start)


def test_the_relative_guard_refuses_a_spike_after_its_warm_up_and_follows_a_lasting_change() -> None:
    guard, state = StepGuard(TrainConfig(skip_step_grad_ratio=4, skip_step_window=5)), TrainState()
    # Its warm-up (a window of 5 norms) refuses nothing, however large; then a spike above 4 × the median is refused.
    assert _steps(guard, state, [1.0, 9.0, 1.0, 1.0, 1.0, 4.5, 3.9, 1.0, 1.0, 1.0]) == [False] * 5 + [True] + [False] * 4
    # A lasting change of scale is refused until the median follows it (refused norms enter the window), then trained.
    assert _steps(guard, state, [10.0] * 5) == [True, True, True, False, False]
    # A new phase (Skip-DiT's second stage: every weight, not the skips alone) has its own window and warm-up.
    assert _steps(guard, state, [100.0] * 5, phase=1) == [False] * 5
    assert _steps(guard, state, [float("nan")], phase=1) == [False]  # non-finite: skipped, counted apart
    assert (state.skipped_grad_norm, state.skipped_nonfinite, state.skipped_steps) == (4, 1, 5)
    assert state.phase_skipped == {0: 4, 1: 1} and state.refused_norms == [4.5, 10.0, 10.0, 10.0]


def test_the_absolute_guard_refuses_every_step_above_its_bound_from_the_first() -> None:
    guard, state = StepGuard(TrainConfig(skip_step_grad_norm=0.02)), TrainState()
    assert _steps(guard, state, [2.8, 0.01, 3.9]) == [True, False, True]


def test_more_than_the_share_of_a_phase_or_of_the_run_skipped_stops_with_the_guard_and_its_norms() -> None:
    train = TrainConfig(skip_step_grad_norm=0.5)
    guard, state = StepGuard(train), TrainState()
    _steps(guard, state, [0.1] * 9)
    _steps(guard, state, [0.9, 0.7, 0.8], phase=1)  # every step of phase 1; the run's share is 3 of 12
    guard.check(state)
    message = (r"^3 of phase 1's 3 steps \(9-11\) skipped their optimizer step \(100%, above train.max_skipped_share"
               r"=0.5\), .*: over the run, the step guard train.skip_step_grad_norm=0.5 refused 3 \(grad norms min 0.7, "
               r"median 0.8, max 0.9\); .*train.max_skipped_share=1 to train on anyway$")
    with pytest.raises(TooManySkipped, match=message):
        guard.after_step(state, _phase(1, 9, 3))
    guard.after_step(state, _phase(1, 9, 4))  # not its end yet: nothing checked
    StepGuard(dataclasses.replace(train, max_skipped_share=1.0)).check(state, _phase(1, 9, 3))  # asked for
    _steps(guard, state, [float("nan")] * 6, phase=1)  # 9 of the run's 18 steps: half is not above half
    guard.check(state)
    _steps(guard, state, [float("nan")], phase=1)
    with pytest.raises(TooManySkipped, match=r"^10 of the run's 19 steps so far .* and 7 had a non-finite loss"):
        guard.check(state)


def test_a_guard_that_refuses_every_step_stops_the_run_with_exit_2_and_one_line(tmp_path, synth_root, capsys):
    overrides = tiny_overrides(tmp_path, synth_root, "arm=mask0", "train.skip_step_grad_norm=1e-9", "budget.flops=1e9",
                               "eval.points=[1.0]", *FAST)
    assert cli.main(["run", *overrides]) == 2
    err = capsys.readouterr().err
    assert re.search(r"step \d+/\d+ mask 0 loss [\d.]+ skipped \d+\]", err)  # the progress line counts them
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("maskbench: error: "), errors
    assert "skipped their optimizer step (100%" in errors[0]
    assert "the step guard train.skip_step_grad_norm=1e-09 refused" in errors[0] and "grad norms min" in errors[0]
    assert not (tmp_path / "leaderboard.csv").exists()  # stopped before its eval point: no row of an untrained run


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.skip_step_grad_norm=0.02", "train.skip_step_grad_ratio=4"], "two step guards: set one"),
    (["train.skip_step_grad_ratio=1"], "must be above 1"),
    (["train.max_skipped_share=1.5"], r"train.max_skipped_share must be in \[0, 1\]"),
])
def test_a_guard_or_a_share_out_of_its_range_is_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(["arm=mask0", *overrides])
