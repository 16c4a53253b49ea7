"""The trajectory summary reads what a run folder's metrics.jsonl says: the spike, its step, values at fixed steps."""

import csv
import io
import json

import pytest
import yaml

from maskbench.results import trajectory


def _run(root, name, arm, seed, norms, losses=None, grads=None):
    """A run folder as the trainer leaves it: config.yaml and one metrics.jsonl line per step."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"arm": {"name": arm}, "seed": seed}))
    losses = losses or [1.0] * len(norms)
    grads = grads or [0.5] * len(norms)
    with (folder / "metrics.jsonl").open("w") as log:
        for step, (norm, loss, grad) in enumerate(zip(norms, losses, grads)):
            blocks = {"block.0": norm / 2, "block.1": norm, "decoder.0": 1.0}   # the largest block is read
            log.write(json.dumps({"step": step, "loss": loss, "grad_norm": grad, "block_norm": blocks}) + "\n")
    return folder


def test_the_spike_its_step_and_the_values_at_fixed_steps(tmp_path):
    norms = [10.0] * 1200
    norms[40] = 300.0
    norms[100], norms[300], norms[500] = 50.0, 20.0, 12.0
    losses = [1.2] * 76 + [0.4] * 25 + [0.2] * 1099         # the 25 steps ending at step 100 average 0.4
    grads = [0.1 if 100 <= step <= 500 else 0.9 for step in range(1200)]   # the whole run's median is 0.9
    got = trajectory.read_trajectory(_run(tmp_path, "r", "maskdit50", 1, norms, losses, grads))
    assert (got.arm, got.seed, got.steps) == ("maskdit50", 1, 1200)
    assert (got.peak_block_norm, got.peak_step) == (300.0, 40)
    assert (got.block_norm_100, got.block_norm_300, got.block_norm_500) == (50.0, 20.0, 12.0)
    assert got.objective_100 == pytest.approx(0.4) and got.objective_500 == pytest.approx(0.2)
    assert got.grad_norm_median_100_500 == pytest.approx(0.1)


def test_a_run_shorter_than_a_step_leaves_that_cell_empty(tmp_path):
    got = trajectory.read_trajectory(_run(tmp_path, "r", "mask0", 0, [5.0] * 200))
    assert got.block_norm_100 == 5.0 and got.block_norm_300 is None and got.objective_500 is None
    out = io.StringIO()
    trajectory.write_csv([got], out)
    row = next(csv.DictReader(io.StringIO(out.getvalue())))
    assert row["block_norm_300"] == "" and row["steps"] == "200"


def test_the_command_writes_one_row_per_run_ordered_by_arm_and_seed(tmp_path):
    for arm, seed in (("tread50", 0), ("mask0", 1), ("mask0", 0)):
        _run(tmp_path / "runs", f"{arm}-s{seed}", arm, seed, [1.0] * 120)
    out = tmp_path / "trajectories.csv"
    assert trajectory.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(row["arm"], row["seed"]) for row in rows] == [("mask0", "0"), ("mask0", "1"), ("tread50", "0")]


def test_no_run_folders_or_no_block_norms_is_a_clear_error(tmp_path, capsys):
    assert trajectory.main([str(tmp_path)]) == 2
    assert "no run folders" in capsys.readouterr().err
    folder = _run(tmp_path, "old", "mask0", 0, [1.0] * 3)
    lines = [{k: v for k, v in json.loads(line).items() if k != "block_norm"}
             for line in (folder / "metrics.jsonl").read_text().splitlines()]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert trajectory.main([str(folder)]) == 2
    assert "no block norms" in capsys.readouterr().err
