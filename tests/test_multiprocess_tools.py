"""`maskbench sweep` and `maskbench repro` under torchrun (2 CPU processes, gloo) finish.

A sweep trains its cells one after another in one launch: the process group must outlive each cell (destroyed
after the first, the second cell stopped at "Default process group has not been initialized"). repro retrains a
run in a temporary folder that every process must share (a folder per process left rank 1 looking for the run
files only rank 0 writes: FileNotFoundError).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maskbench.results.leaderboard import read_rows
from tests.conftest import tiny_overrides

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "maskbench"]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def swept(tmp_path_factory, synth_root) -> Path:
    """Two cells (mask0, mask75) swept on 2 processes: a few steps each, eval points 0.5 and 1."""
    tmp = tmp_path_factory.mktemp("sweep")
    done = _torchrun("sweep", "arm=mask0,mask75", *tiny_overrides(tmp, synth_root, "budget.flops=1e9",
                                                                  "data.shuffle_buffer=32"))
    assert "sweep: 2 cells trained, 0 skipped as done" in done.stdout
    return tmp


def test_a_sweep_of_two_cells_finishes_on_two_processes(swept):
    rows = read_rows([swept / "leaderboard.csv"])
    assert [(r["arm"], r["point"]) for r in rows] == [("mask0", 0.5), ("mask0", 1.0), ("mask75", 0.5), ("mask75", 1.0)]
    assert all(r["n_devices"] == 2 for r in rows)                   # each cell trained on both processes
    assert all((run / "done.json").is_file() for run in (swept / "runs").iterdir())


def test_repro_of_a_two_process_run_passes_on_two_processes(swept):
    [run] = (swept / "runs").glob("mask75-*")  # mask0's point 0.5 is a cooled branch forked at that very step: a
    # rerun stopped there (train.stop_at_step) ends before the fork, on one process as on two (a trainer matter)
    scratch = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("maskbench-repro-*"))
    done = _torchrun("repro", str(run))
    table = [line for line in done.stdout.splitlines() if line.split()[:1] in (["rerun"], ["resume"], ["metrics"],
                                                                               ["environment"], ["digests"])]
    assert len(table) == 5 and all(line.split()[1] == "PASS" for line in table), table  # printed once, by rank 0
    assert "n_devices 2" in next(line for line in table if line.startswith("environment"))
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("maskbench-repro-*")) == scratch  # the shared folder is gone
