"""A packed folder that stays true to its inputs: cut archives are reported, stale units repacked."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from maskbench.cli import main
from maskbench.data.pack import PackOptions, iter_tar_samples, pack
from maskbench.data.shards import shard_urls
from maskbench.data.sources.brushdata import plan_brushdata
from maskbench.data.sources.journeydb import plan_journeydb
from maskbench.data.verify import verify
from maskbench.manifest import read_manifest
from tests.fixtures_real import (
    brushdata_members,
    cut_after_member,
    image_bytes,
    make_brushdata,
    make_journeydb,
    write_tar,
)

PER_SAMPLE = len(brushdata_members("0", b"", b""))  # tar members per BrushData sample


def pack_cli(raw: Path, out: Path, capsys: pytest.CaptureFixture) -> list[str]:
    """Run `maskbench data pack brushdata RAW --out OUT` (2 samples a shard); its printed lines."""
    assert main(["data", "pack", "brushdata", str(raw), "--out", str(out), "--maxcount", "2", "--no-progress"]) == 0
    return capsys.readouterr().out.splitlines()


def packed_keys(out: Path) -> list[str]:
    return sorted(key for url in shard_urls(out) for key, _ in iter_tar_samples(Path(url)))


def replace_file(path: Path, data: bytes) -> None:
    """Write new contents with a later mtime, as a re-download would."""
    before = path.stat().st_mtime_ns
    path.write_bytes(data)
    os.utime(path, ns=(before + 10**9, before + 10**9))


@pytest.mark.parametrize("gz", [False, True])
def test_a_tar_without_its_end_of_archive_marker_is_truncated(tmp_path: Path, gz: bool) -> None:
    members = [m for i in range(3) for m in brushdata_members(f"00000000{i}", b"a caption", image_bytes(i))]
    tar = write_tar(tmp_path / "whole.tar", members)
    assert [key for key, _ in iter_tar_samples(tar)] == ["000000000", "000000001", "000000002"]
    cut_after_member(tar, 2 * PER_SAMPLE - 1)  # the last member of sample 1: a member boundary
    if gz:  # the marker is looked for in the decompressed stream
        (tmp_path / "cut.tgz").write_bytes(gzip.compress(tar.read_bytes()))
        tar = tmp_path / "cut.tgz"
    items = list(iter_tar_samples(tar))
    # The group being read when the archive stopped is dropped: its later fields may be cut off.
    assert [item[0] for item in items[:-1]] == ["000000000"] and items[-1].reason == "truncated_tar"


def test_pack_reports_a_tar_cut_at_a_member_boundary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_brushdata(tmp_path / "raw", shards=2, per_shard=3)
    cut_after_member(tmp_path / "raw" / "00201.tar", 2 * PER_SAMPLE - 1)
    lines = pack_cli(tmp_path / "raw", tmp_path / "out", capsys)
    manifest = read_manifest(tmp_path / "out")
    assert manifest["skipped"] == {"truncated_tar": 1} and manifest["total"] == 4  # 3 + the sample before the cut
    assert lines[-2] == f"packed 4 samples into 3 shards in {tmp_path / 'out'}; skipped: truncated_tar=1"
    assert lines[-1].startswith("warning: 1 input archive(s) not read to their end (truncated_tar=1)")


def test_a_replaced_archive_is_repacked_to_the_full_count(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    expected = make_brushdata(raw, shards=2, per_shard=3)
    whole = (raw / "00201.tar").read_bytes()
    cut_after_member(raw / "00201.tar", PER_SAMPLE - 1)
    pack_cli(raw, out, capsys)
    assert read_manifest(out)["total"] == 3
    replace_file(raw / "00201.tar", whole)  # downloaded again, complete this time
    lines = pack_cli(raw, out, capsys)
    assert lines[:2] == ["skipped 1 unit already packed (inputs unchanged)",
                         "repacking 1 unit: inputs changed since packed"]
    manifest = read_manifest(out)
    assert manifest["total"] == 6 and manifest["skipped"] == {}
    assert packed_keys(out) == sorted(expected) and verify(out).ok


def test_a_failed_archive_is_retried_and_a_shrunk_unit_leaves_no_stale_shards(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    make_brushdata(raw, shards=2, per_shard=3)
    (raw / "00202.tar").write_bytes(b"")  # counted bad_archive, packing still exits 0
    pack_cli(raw, out, capsys)
    assert sorted(p.name for p in out.glob("00201-*.tar")) == ["00201-000000.tar", "00201-000001.tar"]
    replace_file(raw / "00201.tar", write_tar(tmp_path / "small.tar", brushdata_members(
        "000001000", b"the one sample left", image_bytes(7))).read_bytes())
    lines = pack_cli(raw, out, capsys)
    assert lines[:3] == ["skipped 1 unit already packed (inputs unchanged)",
                         "repacking 1 unit: inputs changed since packed",
                         "repacking 1 unit: archive not read to its end last time (bad_archive/truncated_tar)"]
    assert not (out / "00201-000001.tar").exists()  # its old second shard is gone with its part
    assert read_manifest(out)["total"] == 4 and verify(out).ok


def test_a_rerun_with_unchanged_inputs_repacks_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    make_brushdata(raw, shards=2, per_shard=3)
    assert pack_cli(raw, out, capsys)[0] == "packing 2 units not packed before"
    written = {p.name: p.stat().st_mtime_ns for p in [*out.glob("*.tar"), *(out / ".parts").iterdir()]}
    lines = pack_cli(raw, out, capsys)
    assert lines == ["skipped 2 units already packed (inputs unchanged)",
                     f"packed 6 samples into 4 shards in {out}; skipped: none"]
    assert {p.name: p.stat().st_mtime_ns for p in [*out.glob("*.tar"), *(out / ".parts").iterdir()]} == written


def test_a_unit_packed_before_inputs_were_recorded_is_repacked(tmp_path: Path) -> None:
    make_brushdata(tmp_path / "raw", shards=1, per_shard=2)
    plan = plan_brushdata([tmp_path / "raw"])
    pack(tmp_path / "out", "brushdata", plan, PackOptions(), progress=False)
    part_file = tmp_path / "out" / ".parts" / "00200.json"
    part = json.loads(part_file.read_text())
    assert part["inputs"] == [{"name": "00200.tar", "size": (tmp_path / "raw" / "00200.tar").stat().st_size,
                               "mtime_ns": (tmp_path / "raw" / "00200.tar").stat().st_mtime_ns}]
    part_file.write_text(json.dumps({k: v for k, v in part.items() if k != "inputs"}))  # as the old packer wrote it
    lines: list[str] = []
    pack(tmp_path / "out", "brushdata", plan, PackOptions(), progress=False, log=lines.append)
    assert lines == ["repacking 1 unit: packed before inputs were recorded"]
    assert "inputs" in json.loads(part_file.read_text())


def test_an_image_rewritten_in_an_extracted_folder_is_repacked(tmp_path: Path) -> None:
    anno, imgs, expected = make_journeydb(tmp_path, extracted=("001",))
    plan = plan_journeydb([anno], imgs)
    pack(tmp_path / "out", "journeydb", plan, PackOptions(), progress=False)
    key = next(k for k in expected if k.startswith("001_"))
    new_image = image_bytes(5, (80, 60))
    replace_file(imgs / "001" / f"{key[4:]}.jpg", new_image)
    lines: list[str] = []
    pack(tmp_path / "out", "journeydb", plan, PackOptions(), progress=False, log=lines.append)
    assert lines == ["skipped 1 unit already packed (inputs unchanged)",
                     "repacking 1 unit: inputs changed since packed"]
    samples = {k: f for url in shard_urls(tmp_path / "out") for k, f in iter_tar_samples(Path(url))}
    assert samples[key]["jpg"] == new_image
