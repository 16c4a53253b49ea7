"""What each test and each shared fixture cost when the suite was last measured (results/suite_durations.txt,
written by benchmarks/suite_durations.sh), and the quick subset (`-m "not slow"`, README) it defines.

A test's own line is not its cost alone: a fixture made once per test process (scope module or session) is charged
to the first test that needs it, and when the quick subset leaves that test out, the next one pays. So a test is
quick when it took at most QUICK_S seconds *and* every shared fixture it needs took at most QUICK_FIXTURE_S to make.
(A shared fixture is made once for all the tests that need it, so its bound is wider than one test's: the measured
ones fall either under 0.5 s, such as the synth data every training test reads, or over 1.5 s, a trained run.)

The hooks below are registered as a plugin by tests/conftest.py (`pytest_configure`), not defined there: a
subfolder's conftest sees the fixtures of its own modules, not the session's."""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "results" / "suite_durations.txt"
QUICK_S = 0.3
QUICK_FIXTURE_S = 1.0
# Where benchmarks/suite_durations.sh asks each test process to write what its shared fixtures cost.
FIXTURE_SECONDS_ENV = "MASKBENCH_FIXTURE_SECONDS"

# This process's seconds per shared fixture ("tests/test_x.py::name"; "tests::name" for tests/conftest.py's):
# its set-up, plus what a lazy fixture spends on first use (tests/paired_runs.py trains a run when first asked).
FIXTURE_SECONDS: dict[str, float] = defaultdict(float)


def fixture_key(baseid: str, name: str) -> str:
    """One shared fixture's name in results/suite_durations.txt: where it is defined, then its name."""
    return f"{baseid}::{name}"


class charged_to:
    """`with charged_to(key): ...` adds the block's seconds to that fixture's cost in this process."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *_) -> None:
        FIXTURE_SECONDS[self.key] += time.perf_counter() - self.start


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    """A shared fixture's set-up seconds, charged to it in this process."""
    if fixturedef.scope == "function":
        return (yield)
    with charged_to(fixture_key(fixturedef.baseid, fixturedef.argname)):
        return (yield)


def pytest_sessionfinish() -> None:
    """This process's FIXTURE_SECONDS as `SECONDS<TAB>KEY` lines in a file of its own under the folder the
    environment names (xdist's workers each make their own shared fixtures); nothing when it names none."""
    if (folder := os.environ.get(FIXTURE_SECONDS_ENV)) and FIXTURE_SECONDS:
        lines = "".join(f"{spent:.2f}\t{key}\n" for key, spent in sorted(FIXTURE_SECONDS.items()))
        (Path(folder) / f"{os.getpid()}.tsv").write_text(lines)


def recorded(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """(test node id -> its setup, call and teardown seconds summed; fixture key -> seconds to make) from the
    lines of results/suite_durations.txt."""
    tests: dict[str, float] = defaultdict(float)
    fixtures: dict[str, float] = {}
    for line in text.splitlines():
        if found := re.match(r"\s*([\d.]+)s (setup|call|teardown|fixture) +(\S.*)$", line):
            if found[2] == "fixture":
                fixtures[found[3]] = float(found[1])
            else:
                tests[found[3]] += float(found[1])
    return tests, fixtures


def is_slow(nodeid: str, shared_fixtures: Iterable[str], tests: dict[str, float], fixtures: dict[str, float]) -> bool:
    """Left out of the quick subset: the test itself took over QUICK_S, or a shared fixture it needs took over
    QUICK_FIXTURE_S to make."""
    return tests.get(nodeid, 0.0) > QUICK_S or any(fixtures.get(key, 0.0) > QUICK_FIXTURE_S for key in shared_fixtures)


def recorded_costs() -> tuple[dict[str, float], dict[str, float]]:
    """`recorded` of DURATIONS; both empty without the file."""
    return recorded(DURATIONS.read_text()) if DURATIONS.is_file() else ({}, {})
