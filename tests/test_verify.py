"""`verify` passes on freshly packed shards and names every kind of damage."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from maskbench.cli import main
from maskbench.data.pack import PackOptions, pack
from maskbench.data.sources.brushdata import plan_brushdata
from maskbench.data.verify import verify
from tests.fixtures_real import make_brushdata


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    make_brushdata(tmp_path / "raw", shards=2, per_shard=2)
    pack(tmp_path / "out", "brushdata", plan_brushdata([tmp_path / "raw"]), PackOptions(), progress=False)
    return tmp_path / "out"


def run_cli(directory: Path) -> int:
    return main(["data", "verify", str(directory)])


def test_fresh_shards_pass(shards: Path) -> None:
    report = verify(shards)
    assert report.ok, report.summary()
    assert (report.shards, report.samples) == (2, 4)
    assert run_cli(shards) == 0


def test_tampered_shard_fails(shards: Path, capsys: pytest.CaptureFixture) -> None:
    """Re-write one shard with a caption changed: same count, different bytes."""
    path = shards / "00200-000000.tar"
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w") as tar:
        for member, data in members:
            data = b"a tampered caption" if member.name.endswith(".txt") else data
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    assert run_cli(shards) == 1
    assert "00200-000000.tar: sha256/size differ from the manifest" in capsys.readouterr().out


def test_missing_truncated_and_unlisted_shards_fail(shards: Path) -> None:
    (shards / "00201-000000.tar").unlink()
    data = (shards / "00200-000000.tar").read_bytes()
    (shards / "00200-000000.tar").write_bytes(data[:1500])  # inside the first image
    (shards / "stray-000000.tar").write_bytes(data)
    problems = verify(shards).problems
    assert "00201-000000.tar: missing" in problems
    assert "00200-000000.tar: truncated_tar" in problems
    assert "00200-000000.tar: 0 samples, manifest says 2" in problems
    assert "stray-000000.tar: not in the manifest" in problems


def test_wrong_count_in_manifest_fails(shards: Path) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["shards"][0]["count"] += 1
    (shards / "manifest.json").write_text(json.dumps(manifest))
    assert not verify(shards).ok


def test_no_manifest_is_exit_2(tmp_path: Path) -> None:
    assert run_cli(tmp_path) == 2
