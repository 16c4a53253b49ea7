"""`maskbench sweep` and `maskbench repro` under torchrun (2 CPU processes, gloo) finish.

A sweep trains its cells one after another in one launch: the process group must outlive each cell (destroyed
after the first, the second cell stopped at "Default process group has not been initialized"). repro retrains a
run in a temporary folder that every process must share (a folder per process left rank 1 looking for the run
files only rank 0 writes: FileNotFoundError).

Both commands run in one torchrun launch, the sweep and then the repro of one of its runs, each starting its own
process group (tests/launch_commands.py): a launch costs seconds of imports per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from maskbench.config import load_config, run_id
from maskbench.results.leaderboard import read_rows
from tests.conftest import tiny_overrides

LAUNCH = Path(__file__).with_name("launch_commands.py")
CHECKS = ("rerun", "resume", "metrics", "environment", "digests")


@pytest.fixture(scope="module")
def launched(tmp_path_factory, synth_root) -> dict:
    """Two cells (mask0, mask75) swept on 2 processes, a few steps each, eval points 0.5 and 1; then, in the same
    launch, `maskbench repro` of the mask75 run. mask0's point 0.5 is a cooled branch forked at that very step: a
    rerun stopped there (train.stop_at_step) ends before the fork, on one process as on two (a trainer matter)."""
    tmp = tmp_path_factory.mktemp("sweep")
    overrides = tiny_overrides(tmp, synth_root, "budget.flops=1e9", "data.shuffle_buffer=32")
    mask75 = tmp / "runs" / run_id(load_config([*overrides, "arm=mask75"]))
    plan = [{"argv": ["sweep", "arm=mask0,mask75", *overrides], "out": str(tmp / "sweep")},
            {"argv": ["repro", str(mask75)], "out": str(tmp / "repro")}]
    (tmp / "plan.json").write_text(json.dumps(plan))
    scratch = tmp / "tmpdir"  # the launch's temporary folders: repro's shared one is made here
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(LAUNCH), str(tmp / "plan.json")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)})
    return {"tmp": tmp, "done": done, "mask75": mask75, "scratch": scratch}


def _printed(launched: dict, command: str) -> list[str]:
    """What each process printed running `command`, once both ran it to exit code 0."""
    out = launched["tmp"] / command
    codes = [(out / f"rank-{rank}.rc").read_text() if (out / f"rank-{rank}.rc").exists() else None for rank in (0, 1)]
    assert codes == ["0", "0"], (codes, launched["done"].stdout[-2000:] + launched["done"].stderr[-3000:])
    return [(out / f"rank-{rank}.out").read_text() for rank in (0, 1)]


def test_a_sweep_of_two_cells_finishes_on_two_processes(launched):
    assert "sweep: 2 cells trained, 0 skipped as done" in _printed(launched, "sweep")[0]
    swept = launched["tmp"]
    rows = read_rows([swept / "leaderboard.csv"])
    assert [(r["arm"], r["point"]) for r in rows] == [("mask0", 0.5), ("mask0", 1.0), ("mask75", 0.5), ("mask75", 1.0)]
    assert all(r["n_devices"] == 2 for r in rows)                   # each cell trained on both processes
    assert all((run / "done.json").is_file() for run in (swept / "runs").iterdir())


def test_repro_of_a_two_process_run_passes_on_two_processes(launched):
    assert [launched["mask75"]] == list((launched["tmp"] / "runs").glob("mask75-*"))
    tables = [[line for line in printed.splitlines() if line.split()[:1] in [[check] for check in CHECKS]]
              for printed in _printed(launched, "repro")]
    table = tables[0]
    assert len(table) == 5 and all(line.split()[1] == "PASS" for line in table), table
    assert tables[1] == []                                           # printed once, by rank 0
    assert "n_devices 2" in next(line for line in table if line.startswith("environment"))
    assert list(launched["scratch"].glob("maskbench-repro-*")) == []  # the shared folder is gone
