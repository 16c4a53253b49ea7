"""The mission arms' small paired runs that test_paired_draws, test_horizons, test_gradfid and test_convert share
(the session fixture `paired_runs` in tests/conftest.py): one run per arm and test process, not one per test."""

from __future__ import annotations

from pathlib import Path

from maskbench.config import load_config
from maskbench.runs.launch import train
from tests.conftest import SMALL_EVAL, tiny_overrides
from tests.suite_costs import charged_to, fixture_key

PAIRED_BUDGET = 1.25e9  # half the tiny default: mask0 8 steps, mask75 23, mask75_then0 17 + 2 unmasked


def paired_overrides(root: Path, synth_root: Path, arm: str, *extra: str) -> list[str]:
    """A mission arm's tiny run with seed 0, PAIRED_BUDGET and one eval point (the budget's end), `root` holding its
    runs and CSV."""
    return tiny_overrides(root, synth_root, f"arm={arm}", f"budget.flops={PAIRED_BUDGET}", "eval.points=[1.0]",
                          *SMALL_EVAL, *extra)


class PairedRuns:
    """arm -> run directory of that mission arm's `paired_overrides` run, trained at its first use in this process
    under its own root (so `leaderboard_of(run)` holds that run's rows only). Read only: copy a run to write to it."""

    def __init__(self, root: Path, synth_root: Path) -> None:
        self.root, self.synth_root, self.runs = root, synth_root, {}

    def __getitem__(self, arm: str) -> Path:
        if arm not in self.runs:
            with charged_to(fixture_key("tests", "paired_runs")):  # its cost, not the asking test's (suite_costs)
                self.runs[arm] = train(load_config(paired_overrides(self.root / arm, self.synth_root, arm)))
        return self.runs[arm]


def leaderboard_of(run_dir: Path) -> Path:
    """The leaderboard CSV a `tiny_overrides` run writes: ROOT/leaderboard.csv beside ROOT/runs/RUN."""
    return run_dir.parent.parent / "leaderboard.csv"
