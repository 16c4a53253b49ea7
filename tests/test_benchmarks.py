"""Every benchmark script runs at toy size (`--smoke`), so none can rot unseen: their figures are measured
on demand, never asserted, but a script that no longer runs cannot remake its committed CSV."""

from __future__ import annotations

import csv
import os
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# script -> the CSVs its --smoke run writes beside --out (gpu_check.sh and its report: tests/test_gpu_check.py)
SMOKE_OUTPUTS = {
    "arm_step_time.py": ["out.csv"],
    "fd_floor.py": ["out.csv"],
    "kernels.py": ["out.csv"],
    "loader.py": ["out.csv", "out_workers.csv"],
    "step_time.py": ["out.csv"],
}
NOT_HERE = {"gpu_check_report.py", "results_csv.py", "stream.py"}  # run by gpu_check.sh's test; libraries


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {path.name for path in (REPO / "benchmarks").glob("*.py")}
    assert scripts - NOT_HERE == set(SMOKE_OUTPUTS)


@pytest.mark.parametrize("script", sorted(SMOKE_OUTPUTS))
def test_the_benchmark_runs_at_toy_size(tmp_path: Path, script: str, monkeypatch: pytest.MonkeyPatch):
    """`python benchmarks/SCRIPT --smoke --out ...`, run as that command runs it (as __main__, from the repository,
    benchmarks/ first on sys.path) but in this process, whose torch, timm and open_clip are imported already: a
    fresh interpreter spends most of a smoke run importing them. Whatever the script sets in os.environ (kernels.py:
    TRITON_INTERPRET) is undone after it."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{script}", "--smoke", "--out", str(tmp_path / "out.csv")])
    environ = dict(os.environ)
    try:
        runpy.run_path(f"benchmarks/{script}", run_name="__main__")
    except SystemExit as done:
        assert done.code in (None, 0), f"{script} exited with {done.code!r}"
    finally:
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
    for name in SMOKE_OUTPUTS[script]:
        with open(tmp_path / name) as f:
            assert list(csv.DictReader(f)), f"{script} wrote no rows to {name}"
