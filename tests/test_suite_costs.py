"""The quick subset leaves out what is slow to make, not only what is slow to run (tests/suite_costs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.suite_costs import QUICK_FIXTURE_S, QUICK_S, is_slow, recorded

TABLE = """\
# python -m pytest -q -n auto --durations=0 at abc1234, ...
# python -m pytest -q -n auto -m "not slow" at abc1234, ...
2.00s call     tests/test_a.py::test_long
0.20s setup    tests/test_a.py::test_builds_the_world
0.05s call     tests/test_a.py::test_builds_the_world
0.01s call     tests/test_a.py::test_reads_the_world
9.50s fixture  tests/test_a.py::world
0.40s fixture  tests::synth_root
"""


def test_a_table_gives_each_tests_seconds_and_each_shared_fixtures():
    tests, fixtures = recorded(TABLE)
    assert tests == {"tests/test_a.py::test_long": 2.0, "tests/test_a.py::test_builds_the_world": 0.25,
                     "tests/test_a.py::test_reads_the_world": 0.01}
    assert fixtures == {"tests/test_a.py::world": 9.5, "tests::synth_root": 0.4}


def test_a_quick_test_that_needs_a_costly_fixture_is_slow():
    """test_reads_the_world took 0.01 s because test_builds_the_world (0.25 s) had made the world for it; with
    either left out of the quick subset, the other would pay the 9.5 s. The synth data (0.4 s, over one test's
    bound but under a shared fixture's) keeps its tests quick."""
    assert QUICK_S < 0.4 < QUICK_FIXTURE_S < 9.5
    tests, fixtures = recorded(TABLE)
    assert is_slow("tests/test_a.py::test_long", [], tests, fixtures)
    assert is_slow("tests/test_a.py::test_reads_the_world", ["tests/test_a.py::world"], tests, fixtures)
    assert is_slow("tests/test_a.py::test_builds_the_world", ["tests::synth_root", "tests/test_a.py::world"], tests,
                   fixtures)
    assert not is_slow("tests/test_a.py::test_builds_the_world", ["tests::synth_root"], tests, fixtures)
    assert not is_slow("tests/test_new.py::test_not_measured_yet", [], tests, fixtures)


def test_each_test_process_writes_what_its_shared_fixtures_cost(tmp_path: Path):
    """A suite run under MASKBENCH_FIXTURE_SECONDS (benchmarks/suite_durations.sh) leaves one file per process:
    the set-up of a module fixture and of a conftest's session fixture (which a conftest's own hook would not
    see), and the lazy cost charged to a fixture on first use, under their keys; function-scoped fixtures are
    the test's own line and are not written."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "conftest.py").write_text(textwrap.dedent(f"""
        import time
        import pytest
        from tests import suite_costs

        def pytest_configure(config):
            config.pluginmanager.register(suite_costs, "suite_costs")

        @pytest.fixture(scope="session")
        def made_once():
            time.sleep({QUICK_S * 2})
    """))
    (project / "tests" / "test_made.py").write_text(textwrap.dedent(f"""
        import time
        import pytest
        from tests.suite_costs import charged_to, fixture_key

        @pytest.fixture(scope="module")
        def world():
            time.sleep({QUICK_S * 2})
            return 1

        @pytest.fixture
        def per_test():
            return 2

        def test_uses(world, per_test, made_once):
            with charged_to(fixture_key("tests", "lazy")):
                time.sleep({QUICK_S * 2})
    """))
    folder = tmp_path / "seconds"
    folder.mkdir()
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MASKBENCH_FIXTURE_SECONDS": str(folder), "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--rootdir", str(project), str(project / "tests" / "test_made.py")],
                          cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    [written] = folder.iterdir()
    seconds = {key: float(spent) for spent, key in (line.split("\t") for line in written.read_text().splitlines())}
    assert set(seconds) == {"tests/test_made.py::world", "tests::made_once", "tests::lazy"}
    assert all(spent >= QUICK_S * 2 for spent in seconds.values())
