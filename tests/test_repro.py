"""`maskbench repro`: a fresh run passes every check, and each kind of tampering fails the right one."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from maskbench.cli import main
from maskbench.config import load_config, load_run_config
from maskbench.files import folder_change, sha256_json, write_folder_digests
from maskbench.results.rows import ADDED_COLUMNS
from maskbench.runs.launch import train
from maskbench.runs.repro import check_digests, repro_main, run_records
from maskbench.train.checkpoint import EMA_FILE, MODEL_FILE, RunDir
from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, synth_root) -> Path:
    """One tiny two-phase run (first eval point at step ~half, a cooled branch), shared read-only by every test.
    Its loader reads in the training process (data.num_workers=0, recorded, so the reruns' too): a worker process
    started for each of a test's reruns costs more than its steps."""
    tmp = tmp_path_factory.mktemp("repro")
    return train(load_config(tiny_overrides(tmp, synth_root, "arm=mask75_then0", "budget.flops=1.4e9",
                                            "data.num_workers=0")))


def copy_run(run_dir: Path, dst: Path) -> Path:
    """A private copy of the run and of its leaderboard CSV (config.yaml pointed at the copy)."""
    run = shutil.copytree(run_dir, dst / run_dir.name)
    config = yaml.safe_load((run / "config.yaml").read_text())
    board = shutil.copy(config["paths"]["leaderboard"], dst / "leaderboard.csv")
    config["paths"]["leaderboard"] = str(board)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return run


CHECKS = ("rerun", "resume", "metrics", "environment", "digests")


def table(output: str) -> dict[str, str]:
    """{check name: its PASS/FAIL line} from repro's printed table."""
    lines = [line.split(None, 1) for line in output.splitlines()]
    return {parts[0]: parts[1] for parts in lines if len(parts) == 2 and parts[0] in CHECKS}


def scale_recorded(run: Path, where: str, index: int, column: str, factor: float) -> None:
    """Multiply one recorded value, in eval.jsonl or in the run's copy of the leaderboard CSV, by `factor`."""
    if where == "eval.jsonl":
        records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
        records[index][column] *= factor
        (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return
    board = run.parent / "leaderboard.csv"
    with open(board, newline="") as f:
        rows = list(csv.DictReader(f))
    rows[index][column] = str(float(rows[index][column]) * factor)
    with open(board, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def flip_middle_byte(path: Path) -> None:
    """One bit pattern changed where a reader does not look: the file still loads, with other values."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


def test_fresh_run_passes_all_five_checks(run_dir, capsys):
    assert repro_main(run_dir) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert sorted(rows) == sorted(CHECKS)
    assert all(line.startswith("PASS") for line in rows.values()), rows
    assert "weights at point 0.5 match" in rows["rerun"]
    assert "eval.jsonl and leaderboard.csv" in rows["metrics"]
    folders = len(list(run_dir.glob("checkpoints/*/"))) + len(list(run_dir.glob("samples/point-*/")))
    assert f"{folders} folders and the eval.jsonl lines and leaderboard rows of 2 points match" in rows["digests"]
    assert "rerun re-derives steps 0.." in out and "= eval point 0.5 of 0.5, 1;" in out


def test_through_last_reruns_to_the_last_point(run_dir, capsys):
    assert main(["repro", str(run_dir), "--through", "last"]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert all(line.startswith("PASS") for line in rows.values()), rows
    assert "raw and EMA weights at points 0.5, 1 match" in rows["rerun"]
    assert "= eval point 1 of 0.5, 1;" in out


@pytest.mark.parametrize("name", [MODEL_FILE, EMA_FILE, "optimizer.bin"])
def test_a_flipped_byte_in_the_last_checkpoint_fails_digests(run_dir, tmp_path, capsys, name):
    """The finding of issue 24: the rerun stops at the first point and the metrics read only the EMA weights,
    so a changed byte in the last point's checkpoint is seen by its digest alone."""
    run = copy_run(run_dir, tmp_path)
    flip_middle_byte(run / "checkpoints" / "point-1" / name)
    assert repro_main(run, steps=2) == 1
    out = capsys.readouterr().out
    assert table(out)["digests"].startswith(f"FAIL  checkpoints/point-1: {name} changed (sha256 ")
    if name != EMA_FILE:  # the EMA weights are what the metrics are recomputed from: that check may see it too
        assert out.rstrip().endswith("FAIL: digests")


def test_an_edited_record_fails_digests(run_dir, tmp_path, capsys):
    """train_flops is no metric: only the digest of the last point's record can tell it changed (its eval.jsonl line
    and its leaderboard row, both edited: each is named)."""
    run = copy_run(run_dir, tmp_path)
    for where in ("eval.jsonl", "leaderboard"):
        scale_recorded(run, where, -1, "train_flops", 2.0)
    assert repro_main(run, steps=2) == 1
    out = capsys.readouterr().out
    assert table(out)["digests"] == ("FAIL  eval.jsonl point 1: record 1 of 1 changed since it was signed; "
                                     "leaderboard point 1: record 1 of 1 changed since it was signed")
    assert out.rstrip().endswith("FAIL: digests")


def set_column(run: Path, column: str, cell: str) -> None:
    """Every cell of one column of the run's copy of the leaderboard CSV set to `cell` ("" for empty)."""
    board = run.parent / "leaderboard.csv"
    with open(board, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(board, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows([{**row, column: cell} for row in rows])


def test_a_row_signed_before_a_column_was_added_still_verifies(run_dir, tmp_path):
    """The regression of skipped_steps: the rows of runs signed before a column was added read back with it, empty,
    and repro called each "changed since it was signed". Here the run's rows are made rows of before the newest
    column (its cells empty, as a file's padding leaves them; the ledger's digests taken without it): they pass.
    Filled, that column's cells fail, since no row written before the column could hold one."""
    run = copy_run(run_dir, tmp_path)
    column, cfg = ADDED_COLUMNS[-1], load_run_config(run)
    set_column(run, column, "")
    then = {row["point"]: sha256_json({k: v for k, v in row.items() if k != column})
            for row in run_records(RunDir(run), cfg)["leaderboard"]}
    ledger = [json.loads(line) for line in (run / "digests.jsonl").read_text().splitlines()]
    signed = [dict(entry, sha256=then[entry["point"]]) if entry.get("record") == "leaderboard" else entry
              for entry in ledger]
    (run / "digests.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in signed))
    assert check_digests(RunDir(run), cfg).ok, check_digests(RunDir(run), cfg).detail
    set_column(run, column, "0")
    found = check_digests(RunDir(run), cfg)
    assert not found.ok and "leaderboard point 1: record 1 of 1 changed since it was signed" in found.detail


def test_a_run_written_before_signing_is_not_signed_rather_than_failed(run_dir, tmp_path, capsys):
    run = copy_run(run_dir, tmp_path)
    (run / "digests.jsonl").unlink()
    for digests in run.rglob("digests.json"):
        digests.unlink()
    assert repro_main(run, steps=2) == 0
    line = table(capsys.readouterr().out)["digests"]
    assert line.startswith("----  not signed (older run): "), line
    assert all(f"{name}," in line for name in ("checkpoints/point-1", "samples/point-1", "eval.jsonl point 1"))


def test_a_deleted_digests_file_is_not_mistaken_for_an_older_run(run_dir, tmp_path, capsys):
    run = copy_run(run_dir, tmp_path)
    (run / "checkpoints" / "point-1" / "digests.json").unlink()
    assert repro_main(run, steps=2) == 1
    assert table(capsys.readouterr().out)["digests"] == "FAIL  checkpoints/point-1: digests.json is missing"


def test_folder_change_names_a_changed_a_missing_and_an_unsigned_file(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("a.bin", "b.bin", "sub/c.bin"):
        (tmp_path / name).write_bytes(name.encode())
    write_folder_digests(tmp_path)
    assert folder_change(tmp_path) is None
    (tmp_path / "sub" / "c.bin").write_bytes(b"other")
    assert folder_change(tmp_path).startswith("sub/c.bin changed (sha256 ")
    (tmp_path / "sub" / "c.bin").write_bytes(b"sub/c.bin")
    (tmp_path / "b.bin").unlink()
    assert folder_change(tmp_path) == "b.bin is missing"
    (tmp_path / "b.bin").write_bytes(b"b.bin")
    (tmp_path / "extra.pkl").write_bytes(b"")
    assert folder_change(tmp_path) == "extra.pkl is not signed"


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
    assert rows["digests"].startswith(f"FAIL  checkpoints/point-0.5: {MODEL_FILE} changed")
    assert out.rstrip().endswith("FAIL: rerun, digests")


def test_tampered_fid_fails_metrics(run_dir, tmp_path, capsys):
    """The FID of point 0.5, changed in the leaderboard row and in the eval.jsonl line: each is named."""
    run = copy_run(run_dir, tmp_path)
    for where in ("leaderboard.csv", "eval.jsonl"):
        scale_recorded(run, where, 0, "fid", 1.001)
    assert repro_main(run, steps=2) == 1  # --steps 2: cheap reruns, loss trace only
    rows = table(capsys.readouterr().out)
    assert rows["metrics"].startswith("FAIL")
    assert all(f"point 0.5 {where}: fid recorded" in rows["metrics"] for where in ("leaderboard.csv", "eval.jsonl"))
    assert rows["digests"].startswith("FAIL")
    assert all(f"{where} point 0.5: record 1 of 1 changed since" in rows["digests"] for where in ("eval.jsonl", "leaderboard"))
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
    assert repro_main(run_dir, through="0.3") == 2
    assert "--through must be last or an eval point with a checkpoint (0.5, 1), got 0.3" in capsys.readouterr().err


def test_a_commit_during_a_sweep_does_not_relabel_its_later_rows(monkeypatch):
    """The sha is read once per process: later rows keep the commit of the code the process loaded."""
    from types import SimpleNamespace

    from maskbench.train import checkpoint

    loaded = checkpoint.git_sha()
    monkeypatch.setattr(checkpoint.subprocess, "run", lambda *args, **kwargs: SimpleNamespace(returncode=0, stdout="f" * 40))
    assert checkpoint.git_sha() == loaded
