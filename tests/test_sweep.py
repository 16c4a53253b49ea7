"""`maskbench sweep`: grid expansion, validation before any run, launch lines, running a grid here, skipping
done cells (an interrupted sweep reruns only the missing ones), `--status`, and named studies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter

import pytest

from maskbench import cli
from maskbench.cli import main
from maskbench.config import config_hash, run_id
from maskbench.errors import ConfigError
from maskbench.results.rows import append_rows, read_rows
from maskbench.runs import launch
from maskbench.runs.sweep import cell_states, csv_paths, expand_grid, plan_sweep, with_study
from tests.conftest import FAST, tiny_overrides
from tests.test_cli_imports import CHILD, REPO


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
    empty = f"paths.leaderboard={tmp_path / 'empty.csv'}"  # no cell is done (the repository's CSV has some)
    assert main(["sweep", "arm=mask0,mask75_then0", "seed=0,1", empty, "--emit", "torchrun", "--nproc", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    assert lines[0] == f"torchrun --nproc_per_node 4 -m maskbench run arm=mask0 seed=0 {empty}"
    assert main(["sweep", "arm=mask0,mask75", "eval.points=[0.5,1.0]", empty, "--emit", "slurm"]) == 0
    script = tmp_path / "sweep.sbatch"
    script.write_text(capsys.readouterr().out)
    header = script.read_text()
    assert "#SBATCH --job-name=maskbench-sweep --array=0-1" in header
    assert "--gpus-per-node=8 --cpus-per-task=64" in header  # CPUs for the loader workers of 8 processes
    assert "#SBATCH --time=24:00:00 --signal=TERM@300 --requeue" in header  # a save before the limit, then resume
    # Run the script with a stand-in srun that prints its arguments: task 1 gets the second run's
    # overrides as separate, unglobbed words.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    (fake / "srun").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "1"}
    *out, last = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                                check=True).stdout.splitlines()
    assert out[-3:] == ["arm=mask75", "eval.points=[0.5,1.0]", empty] and out[:2] == ["accelerate", "launch"]
    assert last == "maskbench: exit 0: finished, not requeued"  # tests/test_slurm.py: when it requeues


def test_sweep_runs_the_grid_here(tmp_path, synth_root):
    assert main(["sweep", *tiny_overrides(tmp_path, synth_root, "arm=mask0,mask75", "seed=0,1", "eval.points=[1.0]",
                                          "budget.flops=5e8", *FAST)]) == 0  # the rows are what is read
    rows = read_rows([tmp_path / "leaderboard.csv"])
    assert sorted((r["arm"], r["seed"]) for r in rows) == [("mask0", 0), ("mask0", 1), ("mask75", 0), ("mask75", 1)]


# ------------------------------------------------------------------------------------- done cells
def test_an_interrupted_sweep_reruns_only_the_missing_cells(tmp_path, synth_root, monkeypatch, capsys):
    """Three cells; a SIGTERM right after the second cell's first eval point stops the sweep (as a
    preempted job). The rerun skips the done cell, resumes the partial one from its checkpoint and
    trains the missing one; each (run, point) row is in the CSV once."""
    grid = tiny_overrides(tmp_path, synth_root, "arm=mask0,mask75,mask75_then0", "seed=0", "budget.flops=1.5e9",
                          *FAST)
    original = launch.PointRecorder.__call__

    def preempted(self, trainer, point):
        original(self, trainer, point)
        if trainer.cfg.arm.name == "mask75" and point == 0.5:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler checkpoints and stops after this step

    with monkeypatch.context() as patch:
        patch.setattr(launch.PointRecorder, "__call__", preempted)
        assert main(["sweep", *grid]) == 130
    capsys.readouterr()

    assert main(["sweep", *grid, "--status"]) == 0
    status = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in status[:3]] == ["done", "partial", "missing"]
    assert "1/2 points" in status[1] and "resumes from its checkpoint" in status[1]
    assert status[3].startswith("1 done, 1 partial, 1 missing of 3 cells")

    trained = []
    real = cli.train_one

    def spy(cfg):
        trained.append(cfg.arm.name)
        return real(cfg)

    monkeypatch.setattr(cli, "train_one", spy)
    assert main(["sweep", *grid]) == 0
    out = capsys.readouterr().out
    assert trained == ["mask75", "mask75_then0"]
    assert "[1/3] done (rows in the leaderboard CSV), skipped: maskbench run" in out
    assert "resuming mask75-synth-tiny-s0-" in out
    rows = read_rows([tmp_path / "leaderboard.csv"], on_error="abort")
    assert sorted(Counter((r["arm"], r["point"]) for r in rows).items()) == [
        ((arm, point), 1) for arm in ("mask0", "mask75", "mask75_then0") for point in (0.5, 1.0)]

    assert main(["sweep", *grid, "--status"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("3 done, 0 partial, 0 missing of 3 cells")
    assert main(["sweep", *grid, "--emit", "slurm"]) == 0
    emitted = capsys.readouterr()
    assert emitted.out == "" and "3 of 3 cells are done" in emitted.err
    trained.clear()
    assert main(["sweep", *grid]) == 0 and trained == []


def test_status_reads_other_machines_csvs_and_emit_leaves_done_cells_out(tmp_path, capsys):
    """A cell is done by its config hash and eval points alone, in its own CSV or a --csv one."""
    runs = plan_sweep(["arm=mask0,mask75", "seed=0,1", f"paths.leaderboard={tmp_path / 'mine.csv'}",
                       f"paths.runs={tmp_path / 'runs'}", "eval.points=[0.5,1.0]"])
    (_, done), (_, half) = runs[0], runs[3]
    theirs = tmp_path / "theirs.csv"
    append_rows(theirs, [_row(done, 0.5), _row(done, 1.0)])
    append_rows(tmp_path / "mine.csv", [_row(half, 0.5), {**_row(half, 1.0), "config_hash": "0" * 64}])
    paths = csv_paths(runs, [str(theirs)])
    assert paths == sorted([str(tmp_path / "mine.csv"), str(theirs)])
    cells = cell_states(runs, read_rows(paths))
    assert [(c.status, c.points_done) for c in cells] == [("done", 2), ("missing", 0), ("missing", 0),
                                                           ("partial", 1)]
    assert cell_states(runs, read_rows(csv_paths(runs)))[0].status == "missing"  # without the other machine's CSV
    with pytest.raises(ConfigError, match="no such leaderboard CSV"):
        csv_paths(runs, [str(tmp_path / "nope.csv")])
    overrides = ["arm=mask0,mask75", "seed=0,1", f"paths.leaderboard={tmp_path / 'mine.csv'}",
                 f"paths.runs={tmp_path / 'runs'}", "eval.points=[0.5,1.0]"]
    assert main(["sweep", *overrides, "--csv", str(theirs), "--emit", "torchrun"]) == 0
    emitted = capsys.readouterr()
    assert len(emitted.out.splitlines()) == 3 and "arm=mask0 seed=0 " not in emitted.out
    assert "1 of 4 cells are done" in emitted.err
    assert main(["sweep", *overrides, "--csv", str(tmp_path / "nope.csv"), "--status"]) == 2


def _row(cfg, point: float) -> dict:
    return {"run_id": run_id(cfg), "arm": cfg.arm.name, "dataset": "synth", "model": "tiny",
            "budget_flops": cfg.budget.flops, "point": point, "seed": cfg.seed, "val_loss": 0.5,
            "config_hash": config_hash(cfg)}


# ---------------------------------------------------------------------------------------- studies
def test_a_study_expands_and_the_command_line_replaces_its_axes(tmp_path):
    study, grid = with_study(["study=example"])
    assert study.name == "example" and study.description and grid == list(study.grid)
    assert with_study(["study=example", "seed=0,1,2,3", "model=dit_s2"])[1] == [
        "arm=mask0,mask75", "seed=0,1,2,3", "model=dit_s2"]
    assert with_study(["arm=mask0"]) == (None, ["arm=mask0"])
    path = tmp_path / "crossover.yaml"
    path.write_text("description: a user's study\ngrid:\n  - arm=mask0,mask75_then0\n  - seed=0,1,2\n"
                    "  - eval.points=[0.5,1.0]\n")
    study, grid = with_study([f"study={path}", "arm=mask75"])
    assert study.name == "crossover" and grid == ["arm=mask75", "seed=0,1,2", "eval.points=[0.5,1.0]"]
    assert len(expand_grid(grid)) == 3


@pytest.mark.parametrize(("text", "message"), [
    ("description: no grid\n", "needs `grid:`"),
    ("grid: arm=mask0\n", "needs `grid:`"),
    ("grid: [arm]\n", "needs `grid:`"),
    ("grid: [study=example]\n", "cannot name another study"),
    ("grid: [': :']\n", "needs `grid:`"),
    ("grid: [\n", "not valid YAML"),
])
def test_bad_study_files_are_refused_in_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        with_study([f"study={path}"])


def test_study_errors_and_listing_on_the_command_line(capsys):
    assert main(["sweep", "study=nope"]) == 2
    assert "unknown study 'nope'; shipped studies: crossover, example, fair, fair_ladder, literature, plateau_curve, plateau_curve_one, plateau_curve_xxs, powered" in capsys.readouterr().err
    assert main(["sweep", "study=example,other"]) == 2
    assert "one study at a time" in capsys.readouterr().err
    assert main(["sweep", "study=missing/file.yaml"]) == 2
    assert "study file not found" in capsys.readouterr().err
    assert main(["sweep", "--list-studies"]) == 0
    listing = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(listing) if line.startswith("example "))
    assert listing[at + 1].split() == ["arm=mask0,mask75", "seed=0,1"]
    assert main(["sweep", "study=example", "seed=3", "--emit", "torchrun", "--nproc", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == [  # seed 3 is in no CSV; the study's baseline runs to 4 B
        "torchrun --nproc_per_node 1 -m maskbench run arm=mask0 seed=3 budget.flops=4e+13 "
        "'eval.points=[0.0625,0.125,0.1875,0.25,0.5,1]'",
        "torchrun --nproc_per_node 1 -m maskbench run arm=mask75 seed=3"]


@pytest.mark.parametrize("argv", [["sweep", "arm=mask0,mask75", "seed=0,1", "--status"],
                                  ["sweep", "--list-studies"], ["sweep", "study=example", "--emit", "slurm"]])
def test_status_and_studies_do_not_import_torch(argv):
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["0", "False", "False"], done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize(("study", "cells"), [("powered", 15), ("crossover", 36)])
def test_the_shipped_studies_are_valid_grids_with_their_own_csv(study, cells):
    """Every cell of the committed studies composes (a typo would waste the sittings before it), and each study
    writes its own CSV; a cluster user replaces axes without editing the file."""
    from maskbench.runs.sweep import plan_sweep, with_study
    runs = plan_sweep(with_study([f"study={study}"])[1])
    # rerun.csv: the committed leaderboard.csv holds rows of the code before common noise and cooled horizons
    assert len(runs) == cells and {cfg.paths.leaderboard for _, cfg in runs} == {f"results/{study}/rerun.csv"}
    assert len({cfg.seed for _, cfg in runs}) >= 3 and {cfg.model.mixer_depth for _, cfg in runs} == {1}
    scaled = plan_sweep(with_study([f"study={study}", "model=dit_b2", "seed=0"])[1])
    assert {cfg.model.name for _, cfg in scaled} == {"dit_b2"} and len(scaled) * 3 <= cells


def test_a_baseline_ladder_runs_the_baseline_past_b_on_the_same_grid_and_says_what_it_adds(capsys):
    """baseline=mask0 baseline.reach=4: mask0's cells run to 4 B, their eval points the grid's divided by 4 and
    then 2 B and 4 B (a cooled horizon is the standalone run of its budget, so the first four are the arms'
    horizons); mask75 stays at B. A study that names its baseline gets reach 4; reach 1 turns it off; a reach
    without a baseline is refused."""
    from maskbench.runs.sweep import Study, ladder_summary, plan_sweep, with_ladder

    ladder, rest = with_ladder(["arm=mask0,mask75", "budget.flops=1e12", "eval.points=[0.5,1.0]",
                                "baseline=mask0", "baseline.reach=4"])
    runs = plan_sweep(rest, ladder)
    by_arm = {cfg.arm.name: cfg for _, cfg in runs}
    assert by_arm["mask0"].budget.flops == 4e12 and list(by_arm["mask0"].eval.points) == [0.125, 0.25, 0.5, 1.0]
    assert by_arm["mask75"].budget.flops == 1e12 and list(by_arm["mask75"].eval.points) == [0.5, 1.0]
    assert ladder_summary(runs, ladder) == ("baseline ladder: mask0 to 4·B in 1 cell(s): +3e+12 FLOPs of trunk, "
                                            "+150% on the grid's 2e+12 without it")
    study = Study("s", "", ("arm=mask0,mask75",), baseline="mask0")
    assert with_ladder([], study)[0].reach == 4 and with_ladder(["baseline.reach=1"], study)[0] is None
    with pytest.raises(ConfigError, match="baseline.reach needs a baseline"):
        with_ladder(["baseline.reach=4"])
