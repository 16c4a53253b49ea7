"""benchmarks/gpu_check.sh: one line and exit 0 without a GPU; its commands run at toy size with --cpu."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_0() -> None:
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert len(done.stdout.splitlines()) == 1 and "needs a CUDA GPU" in done.stdout


@pytest.mark.slow
def test_the_checks_commands_run_end_to_end_at_toy_size_on_the_cpu(tmp_path: Path) -> None:
    """The same user commands as on a GPU (stand-ins, synth, encode, reference, run, repro, report)."""
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path / "work"), "GPU_CHECK_RESULTS": str(tmp_path / "results"),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "results" / "gpu_check.json").read_text())
    assert report["all_passed"] and [s["name"] for s in report["steps"]] == [
        "standins", "synth", "encode_train", "encode_val", "reference", "run", "demote", "maskdit", "repro"]
    assert [p["point"] for p in report["eval_points"]] == [0.25, 1.0]
    assert all(p["fid"] is not None and p["fid_features"] == "standin-random-inception" and p["clip_score"] is not None
               for p in report["eval_points"])
    assert all(Path(grid).is_file() for grid in report["grids"]) and any("PASS" in line for line in report["repro"])
