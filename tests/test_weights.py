"""Weights set once: the registry, `maskbench weights [check DIR]`, and paths.weights feeding every metric.

Real weights cannot be downloaded here, so the checked files are the stand-ins of
`maskbench.eval.standins`, registered with their own sizes and checksums.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from maskbench.cli import main
from maskbench.config import load_config, with_eval_overrides
from maskbench.data.dataset import resolve_dataset
from maskbench.errors import UserError
from maskbench.eval import standins
from maskbench.eval.evaluate import check_eval_inputs
from maskbench.eval.fid import MissingWeights
from maskbench.files import sha256_file
from maskbench.weights import ENV, PINS, REGISTRY, WeightFile, check, pin
from tests.test_latent_run import latent_root, run_overrides  # noqa: F401 (latent_root is a fixture)


def pinned(folder: Path, name: str, file: str, needed: bool = True) -> WeightFile:
    """A registry entry for a file already in `folder`, with its own size and sha256."""
    path = folder / file
    return WeightFile(name, file, "stand-in", "tests", path.stat().st_size, sha256_file(path), needed=needed)


@pytest.fixture
def standin_registry(tmp_path: Path) -> tuple[Path, tuple[WeightFile, ...]]:
    folder = tmp_path / "weights"
    folder.mkdir()
    standins.write_inception(folder / "standin-inception.pt")
    standins.write_clip(folder / "standin-clip")
    return folder, (pinned(folder, "inception", "standin-inception.pt"),
                    pinned(folder, "clip", "standin-clip/open_clip_pytorch_model.bin"))


def test_the_listing_names_every_file_and_each_unpinned_checksum(capsys: pytest.CaptureFixture) -> None:
    assert main(["weights"]) == 0
    out = capsys.readouterr().out
    for entry in REGISTRY:
        assert entry.file in out and entry.url in out and entry.used_by in out
    assert out.count("unpinned") == sum(entry.sha256 is None for entry in REGISTRY)


def test_check_passes_files_matching_their_checksums(standin_registry, capsys: pytest.CaptureFixture) -> None:
    folder, registry = standin_registry
    assert check(folder, registry)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("ok") and "sha256 matches" in line for line in lines), lines


def test_a_wrong_checksum_or_size_fails_naming_the_file(standin_registry, capsys: pytest.CaptureFixture) -> None:
    folder, (inception, clip) = standin_registry
    capsys.readouterr()
    assert not check(folder, (dataclasses.replace(inception, sha256="0" * 64), clip))
    failed, passed = capsys.readouterr().out.strip().splitlines()
    assert failed.startswith("FAIL") and str(folder / "standin-inception.pt") in failed and "0" * 64 in failed
    assert passed.startswith("ok")
    assert not check(folder, (dataclasses.replace(clip, size=clip.size + 1),))
    assert "FAIL" in (line := capsys.readouterr().out) and "open_clip_pytorch_model.bin" in line


def test_pin_records_a_folders_copies_once_and_check_then_catches_a_changed_byte(
        standin_registry, capsys: pytest.CaptureFixture) -> None:
    """Unpinned entries (as the real registry's are): `pin` writes SHA256SUMS in sha256sum's format; `check`
    then verifies each copy against it, and a copy with one byte changed fails, naming the file."""
    folder, entries = standin_registry
    unpinned = tuple(dataclasses.replace(entry, size=None, sha256=None) for entry in entries)
    lines = pin(folder, unpinned)
    assert (folder / PINS).read_text().splitlines() == lines
    assert [line.split("  ") for line in lines] == [[sha256_file(folder / e.file), e.file] for e in unpinned]
    capsys.readouterr()
    assert check(folder, unpinned)
    assert all(line.endswith(f"sha256 matches {PINS}'s") for line in capsys.readouterr().out.strip().splitlines())
    inception = folder / unpinned[0].file
    data = bytearray(inception.read_bytes())
    data[-1] ^= 1
    inception.write_bytes(bytes(data))
    assert not check(folder, unpinned)
    failed = capsys.readouterr().out.splitlines()[0]
    assert failed.startswith("FAIL") and str(inception) in failed and f"({PINS}'s)" in failed


def test_pin_refuses_a_folder_without_registry_files_and_a_malformed_sums_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="holds none of the registry's files"):
        pin(tmp_path)
    (tmp_path / PINS).write_text("not a checksum line\n")
    with pytest.raises(UserError, match=f"{PINS}:1 is not a"):
        check(tmp_path)
    assert main(["weights", "pin", str(tmp_path / "absent")]) == 2


def test_missing_files_fail_when_needed_and_unpinned_ones_pass_on_presence(
        standin_registry, capsys: pytest.CaptureFixture) -> None:
    folder, (inception, _) = standin_registry
    optional = WeightFile("extra", "absent.pt", "stand-in", "tests", needed=False)
    unpinned = dataclasses.replace(inception, size=None, sha256=None)
    capsys.readouterr()
    assert check(folder, (unpinned, optional))
    present, absent = capsys.readouterr().out.strip().splitlines()
    assert present.startswith("ok") and "unpinned" in present and absent.startswith("absent")
    assert not check(folder, (dataclasses.replace(optional, needed=True),))
    assert capsys.readouterr().out.startswith("MISSING")


def test_the_check_command_exits_2_on_a_folder_without_the_weights(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    assert main(["weights", "check", str(tmp_path)]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(REGISTRY) and all(str(tmp_path) in line for line in lines)
    assert main(["weights", "check", str(tmp_path / "nowhere")]) == 2


def test_paths_weights_fills_the_unset_options(tmp_path: Path, latent_root: Path, monkeypatch) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "vit_large_patch14_dinov2.lvd142m.safetensors").touch()
    expected = {entry.fills: str(folder / entry.file) for entry in REGISTRY if entry.fills}
    cfg = load_config(run_overrides(tmp_path, latent_root, f"paths.weights={folder}", "eval.clip_model=ViT-H-14")).eval
    assert (cfg.inception_weights, cfg.clip_weights, cfg.dinov2_weights) == (
        expected["inception_weights"], expected["clip_weights"], expected["dinov2_weights"])
    monkeypatch.setenv(ENV, str(folder))
    given = load_config(run_overrides(tmp_path, latent_root, "eval.inception_weights=/given.pt")).eval
    assert given.inception_weights == "/given.pt"                    # a set option wins over the folder
    assert given.clip_weights is None                                # no CLIP model: no CLIP weights
    other = load_config(run_overrides(tmp_path, latent_root, "eval.dinov2_model=vit_small_patch14_dinov2.lvd142m"))
    assert other.eval.dinov2_weights is None and other.paths.weights == str(folder)  # ViT-L's file, not ViT-S's


def test_the_loaders_open_the_file_from_the_weights_folder(tmp_path: Path, latent_root: Path, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    folder = tmp_path / "weights"
    folder.mkdir()
    standins.write_inception(folder / "inception-2015-12-05.pt")
    assert main(["eval", "reference", str(latent_root / "val"), f"paths.weights={folder}"]) == 0  # set once
    cfg = load_config(run_overrides(tmp_path, latent_root))
    data = resolve_dataset(cfg.data, cfg.paths.data)
    with pytest.raises(MissingWeights, match="not configured"):
        check_eval_inputs(data, cfg.eval)
    check_eval_inputs(data, load_config(run_overrides(tmp_path, latent_root, f"paths.weights={folder}")).eval)
    check_eval_inputs(data, with_eval_overrides(cfg, [f"paths.weights={folder}"]).eval)  # re-evaluation too
    with pytest.raises(MissingWeights, match=re.escape(str(tmp_path / "inception-2015-12-05.pt"))):
        check_eval_inputs(data, with_eval_overrides(cfg, [f"paths.weights={tmp_path}"]).eval)
