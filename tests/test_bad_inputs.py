"""Every bad input is refused with one line and exit code 2, before any data is made or run directory written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from maskbench.cli import main
from maskbench.config import load_config, to_dict
from maskbench.data.sources import sa1b
from tests.fixtures_real import make_brushdata, make_sa1b

BAD_OVERRIDES = {
    "train.batch_size=0": "train.batch_size must be at least 1",
    "train.batch_size=-4": "train.batch_size must be at least 1",
    "eval.n_samples=-1": "eval.n_samples must be at least 2",
    "model.depth=0": "model.depth must be at least 1",
    "train.ema_decay=1.5": "train.ema_decay must be in [0, 1)",
    "eval.sampler_steps=0": "eval.sampler_steps must be at least 1",
    "train.caption_dropout=2": "train.caption_dropout must be in [0, 1]",
    "train.downscale_factor=3": "does nothing without train.downscale_window",
    "model.width=130": "must be divisible by 4",
    "model.patch_size=3": "model.patch_size=3 does not divide the 32-pixel input",
    "model.heads=5": "model.width=128 is not divisible by model.heads=5",
    "eval.val_t=[0.5,1.0]": "eval.val_t must be times in (0, 1)",
    "train.lr=0": "train.lr and train.grad_clip must be positive",
}
BAD_ARM_FILES = {
    "name: only_a_name\n": "has no `phases` list",
    "phases: [{mask_ratio: 0.5, fraction: 1.0}\n": "is not valid YAML",
    "phases: [{mask_ratio: 0.5, fraction: 1.0}]\nphase_typo: 1\n": "phase_typo",
    "phases: [{mask: 0.5, fraction: 1.0}]\n": "mask",
    "arm:\n  name: x\nmodel:\n  long_skip: concat\n": "has no `phases` list",
    "- just a list\n": "must be a mapping",
}


def refused(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run the CLI; assert exit 2, a single stderr line, and nothing written; return that line."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()
    return err


def paths(tmp_path: Path) -> list[str]:
    return [f"paths.runs={tmp_path / 'runs'}", f"paths.data={tmp_path / 'data'}",
            f"paths.leaderboard={tmp_path / 'lb.csv'}"]


@pytest.mark.parametrize("override", BAD_OVERRIDES)
def test_a_bad_override_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, override: str) -> None:
    assert BAD_OVERRIDES[override] in refused(tmp_path, capsys, ["run", override, *paths(tmp_path)])


@pytest.mark.parametrize("text", BAD_ARM_FILES)
def test_a_bad_arm_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, text: str) -> None:
    arm = tmp_path / "my_arm.yaml"
    arm.write_text(text)
    assert BAD_ARM_FILES[text] in refused(tmp_path, capsys, ["run", f"arm={arm}", *paths(tmp_path)])


def test_a_bad_patch_size_on_latent_data_is_refused_once_its_size_is_known(
        tmp_path: Path, capsys: pytest.CaptureFixture, synth_root: Path) -> None:
    """The size of data.path shards is read from their manifest; 32 px synth shards here."""
    err = refused(tmp_path, capsys, ["run", f"data.path={synth_root}", "model.patch_size=5", *paths(tmp_path)])
    assert "model.patch_size=5 does not divide the 32-pixel input" in err


def test_eval_refuses_an_unknown_key_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "some_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(paths(tmp_path)))))
    err = refused(tmp_path, capsys, ["eval", str(run_dir), "eval.no_such_key=1"])
    assert "no_such_key" in err


def test_pack_refuses_a_file_as_its_output_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_brushdata(tmp_path / "raw", shards=1, per_shard=2)
    (tmp_path / "out").write_text("not a folder")
    err = refused(tmp_path, capsys, ["data", "pack", "brushdata", str(tmp_path / "raw"), "--out", str(tmp_path / "out"),
                                     "--no-progress"])
    assert "is a file; give a folder" in err


def test_pack_refuses_an_unreadable_captions_file(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tars, captions, _ = make_sa1b(tmp_path / "raw")

    def denied(path, *args, **kwargs):  # root reads through chmod 000, so the refusal is made here
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(sa1b, "open", denied, raising=False)
    err = refused(tmp_path, capsys, ["data", "pack", "sa1b", str(tars), "--captions", str(captions),
                                     "--out", str(tmp_path / "out"), "--no-progress"])
    assert "cannot read" in err and "Permission denied" in err


@pytest.mark.parametrize(("content", "message"), [(b"", "no leaderboard rows"),
                                                  (b"\xff\xfe\x00binary\xdf\x00", "is not a text CSV")])
def test_leaderboard_of_an_empty_or_binary_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    board = tmp_path / "board.csv"
    board.write_bytes(content)
    assert message in refused(tmp_path, capsys, ["leaderboard", str(board)])
    assert board.read_bytes() == content


def test_eval_of_a_run_killed_while_being_created_is_one_line_and_exit_2(tmp_path, capsys):
    """Only config.yaml exists: refused before the data is generated or a network loaded."""
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    cfg = load_config(paths(tmp_path))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    assert "has no env.json" in refused(tmp_path, capsys, ["eval", str(run_dir)])
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]
