"""`maskbench repro`: a fresh run passes every check, and each kind of tampering fails the right one."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from maskbench.config import load_config
from maskbench.cli import main
from maskbench.runs.repro import repro_main
from maskbench.runs.launch import train
from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, synth_root) -> Path:
    """One tiny two-phase run (first eval point at step ~half), shared read-only by every test."""
    tmp = tmp_path_factory.mktemp("repro")
    return train(load_config(tiny_overrides(tmp, synth_root, "arm=mask75_then0")))


def copy_run(run_dir: Path, dst: Path) -> Path:
    """A private copy of the run and of its leaderboard CSV (config.yaml pointed at the copy)."""
    run = shutil.copytree(run_dir, dst / run_dir.name)
    config = yaml.safe_load((run / "config.yaml").read_text())
    board = shutil.copy(config["paths"]["leaderboard"], dst / "leaderboard.csv")
    config["paths"]["leaderboard"] = str(board)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return run


def table(output: str) -> dict[str, str]:
    """{check name: its PASS/FAIL line} from repro's printed table."""
    lines = [line.split(None, 1) for line in output.splitlines()]
    return {parts[0]: parts[1] for parts in lines
            if len(parts) == 2 and parts[0] in ("rerun", "resume", "metrics", "environment")}


def test_fresh_run_passes_all_four_checks(run_dir, capsys):
    assert repro_main(run_dir) == 0
    rows = table(capsys.readouterr().out)
    assert sorted(rows) == ["environment", "metrics", "rerun", "resume"]
    assert all(line.startswith("PASS") for line in rows.values()), rows
    assert "weights at point 0.5 match" in rows["rerun"]
    assert "eval.jsonl and leaderboard.csv" in rows["metrics"]


def test_tampered_point_weights_fail_rerun(run_dir, tmp_path, capsys):
    run = copy_run(run_dir, tmp_path)
    path = run / "checkpoints" / "point-0.5" / "model.safetensors"
    weights = load_file(path)
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-4
    save_file(weights, path, metadata={"format": "pt"})
    assert repro_main(run) == 1
    out = capsys.readouterr().out
    rows = table(out)
    assert rows["rerun"].startswith("FAIL") and name in rows["rerun"]
    assert rows["resume"].startswith("PASS") and rows["metrics"].startswith("PASS")
    assert out.rstrip().endswith("FAIL: rerun")


@pytest.mark.parametrize("where", ["leaderboard.csv", "eval.jsonl"])
def test_tampered_fid_fails_metrics(run_dir, tmp_path, capsys, where):
    run = copy_run(run_dir, tmp_path)
    if where == "eval.jsonl":
        records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
        records[0]["fid"] *= 1.001
        (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        with open(tmp_path / "leaderboard.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        rows[0]["fid"] = str(float(rows[0]["fid"]) * 1.001)
        with open(tmp_path / "leaderboard.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    assert repro_main(run, steps=2) == 1  # --steps 2: cheap reruns, loss trace only
    rows = table(capsys.readouterr().out)
    assert rows["metrics"].startswith("FAIL") and f"point 0.5 {where}: fid recorded" in rows["metrics"]
    assert rows["rerun"].startswith("PASS") and "weights not compared" in rows["rerun"]


def test_other_torch_version_fails_environment(run_dir, tmp_path, capsys):
    run = copy_run(run_dir, tmp_path)
    env = json.loads((run / "env.json").read_text())
    recorded = env["packages"]["torch"]
    env["packages"]["torch"] = "1.0.0"
    (run / "env.json").write_text(json.dumps(env))
    assert repro_main(run, steps=2) == 1
    rows = table(capsys.readouterr().out)
    assert rows["environment"].startswith("FAIL") and f"torch 1.0.0 -> {recorded}" in rows["environment"]
    assert rows["metrics"].startswith("PASS")


def test_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, capsys):
    assert main(["repro", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert repro_main(run_dir, steps=10_000) == 2
    err = capsys.readouterr().err
    assert "--steps must be between 2 and" in err and len(err.strip().splitlines()) == 1


def test_a_commit_during_a_sweep_does_not_relabel_its_later_rows(monkeypatch):
    """The sha is read once per process: later rows keep the commit of the code the process loaded."""
    from types import SimpleNamespace

    from maskbench.train import checkpoint

    loaded = checkpoint.git_sha()
    monkeypatch.setattr(checkpoint.subprocess, "run", lambda *args, **kwargs: SimpleNamespace(returncode=0, stdout="f" * 40))
    assert checkpoint.git_sha() == loaded
