"""`maskbench sweep`: grid expansion, validation before any run, launch lines, and running a grid here."""

from __future__ import annotations

import subprocess

from maskbench.cli import main
from maskbench.results.leaderboard import read_rows
from maskbench.train.sweep import expand_grid
from tests.conftest import tiny_overrides


def test_grid_expands_swept_keys_and_keeps_bracketed_lists_whole():
    grid = expand_grid(["arm=mask0,mask75", "seed=0,1,2", "eval.points=[0.5,1.0]"])
    assert len(grid) == 6
    assert grid[0] == ["arm=mask0", "seed=0", "eval.points=[0.5,1.0]"]
    assert grid[-1] == ["arm=mask75", "seed=2", "eval.points=[0.5,1.0]"]


def test_a_bad_combination_is_refused_before_any_run(tmp_path, synth_root, capsys):
    assert main(["sweep", *tiny_overrides(tmp_path, synth_root, "arm=mask0,nope")]) == 2
    assert "unknown arm 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_emit_prints_one_launch_line_per_run_and_a_valid_slurm_script(capsys, tmp_path):
    assert main(["sweep", "arm=mask0,mask75_then0", "seed=0,1", "--emit", "torchrun", "--nproc", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    assert lines[0] == "torchrun --nproc_per_node 4 -m maskbench run arm=mask0 seed=0"
    assert main(["sweep", "arm=mask0,mask75", "eval.points=[0.5,1.0]", "--emit", "slurm"]) == 0
    script = tmp_path / "sweep.sbatch"
    script.write_text(capsys.readouterr().out)
    assert "#SBATCH --job-name=maskbench-sweep --array=0-1" in script.read_text()
    # Run the script with a stand-in srun that prints its arguments: task 1 gets the second run's
    # overrides as separate, unglobbed words.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    (fake / "srun").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "1"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["arm=mask75", "eval.points=[0.5,1.0]"] and out[:2] == ["accelerate", "launch"]


def test_sweep_runs_the_grid_here(tmp_path, synth_root):
    assert main(["sweep", *tiny_overrides(tmp_path, synth_root, "arm=mask0,mask75", "seed=0,1",
                                          "eval.points=[1.0]")]) == 0
    rows = read_rows([tmp_path / "leaderboard.csv"])
    assert sorted((r["arm"], r["seed"]) for r in rows) == [("mask0", 0), ("mask0", 1), ("mask75", 0), ("mask75", 1)]
