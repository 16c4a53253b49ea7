"""Packing BrushData, SA-1B + InternVL and JourneyDB fixtures into canonical shards."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from maskbench.cli import main
from maskbench.data.pack import PackOptions, iter_tar_samples, pack
from maskbench.data.shards import shard_urls
from maskbench.data.sources.brushdata import decode_brushdata_rle, plan_brushdata
from maskbench.data.sources.journeydb import plan_journeydb
from maskbench.data.sources.sa1b import plan_sa1b
from maskbench.manifest import read_manifest
from tests.fixtures_real import (
    add_symlink,
    bomb_png,
    brushdata_members,
    image_bytes,
    internvl_record,
    journeydb_record,
    make_brushdata,
    make_journeydb,
    make_sa1b,
    sa1b_members,
    truncate,
    write_jsonl,
    write_tar,
)

QUIET = PackOptions(maxcount=2)


def packed(out: Path) -> dict[str, dict[str, bytes]]:
    """Every sample of a packed folder, by key, checking keys are unique across shards."""
    samples: dict[str, dict[str, bytes]] = {}
    for url in shard_urls(out):
        for key, fields in iter_tar_samples(Path(url)):
            assert key not in samples, f"duplicate key {key}"
            samples[key] = fields
    assert len(samples) == read_manifest(out)["total"]
    return samples


def test_decode_brushdata_rle_is_one_based_column_major() -> None:
    mask = decode_brushdata_rle([2, 2, 6, 1], height=3, width=2)
    # column-major flat index 1, 2 -> rows 1, 2 of column 0; index 5 -> row 2 of column 1
    np.testing.assert_array_equal(mask, [[False, False], [True, False], [True, True]])
    assert decode_brushdata_rle([], 3, 2).all()
    with pytest.raises(ValueError, match="pairs"):
        decode_brushdata_rle([1, 2, 3], 3, 2)
    with pytest.raises(ValueError, match="outside"):
        decode_brushdata_rle([6, 2], 3, 2)


def test_brushdata_packs_what_the_fixture_holds(tmp_path: Path) -> None:
    expected = make_brushdata(tmp_path / "raw")
    manifest = pack(tmp_path / "out", "brushdata", plan_brushdata([tmp_path / "raw"], keep_segmentation=True),
                    QUIET, progress=False)
    samples = packed(tmp_path / "out")
    assert manifest["total"] == len(expected) == 6 and manifest["skipped"] == {}
    assert [s["name"] for s in manifest["shards"]] == ["00200-000000.tar", "00200-000001.tar",
                                                       "00201-000000.tar", "00201-000001.tar"]
    for key, want in expected.items():
        meta = json.loads(samples[key]["json"])
        assert samples[key]["txt"].decode() == want.caption
        assert samples[key]["jpg"] == want.image  # no resize asked: original bytes, extension sniffed
        assert meta == {"source": "brushdata", "id": key, "width": 64, "height": 48,
                        "original_key": key, "url": f"https://example.com/{key}.jpg", **want.meta}
        masks = json.loads(samples[key]["segmentation.json"])["mask"]
        assert decode_brushdata_rle(masks[0], 48, 64).sum() == 5 and decode_brushdata_rle(masks[1], 48, 64).all()


def test_bad_inputs_are_skipped_and_counted(tmp_path: Path) -> None:
    raw, good = tmp_path / "raw", image_bytes(0)
    members = (
        brushdata_members("000000001", b"a good one", good)
        + brushdata_members("000000002", b"broken image", b"\xff\xd8 not a jpeg")
        + brushdata_members("000000003", b"a bomb", bomb_png())
        + [m for m in brushdata_members("000000004", b"", good) if not m[0].endswith(".caption")]
        + brushdata_members("000000005", b"  \n", good)
        + brushdata_members("000000006", b"caf\xe9 latin-1", good)
        + brushdata_members("000000007", b"bad mask", good, segmentation=b"{not json")
        + brushdata_members("000000001", b"a duplicate", good)
        + [("000000008.pyd", b"cos\nsystem\n(S'echo pwned'\ntR."), ("../../evil.image", good)]
    )
    write_tar(raw / "00001.tar", members)
    add_symlink(raw / "00001.tar", "000000009.image", "/etc/passwd")  # leaves the folder: unsafe_path
    add_symlink(raw / "00001.tar", "000000010.image", "000000001.image")  # links are never followed
    write_tar(raw / "00002.tar", brushdata_members("000000012", b"before the cut", good)
              + brushdata_members("000000011", b"lost", image_bytes(1, (256, 256))))
    truncate(raw / "00002.tar", 0.5)
    (raw / "00003.tar").write_bytes(b"")

    manifest = pack(tmp_path / "out", "brushdata", plan_brushdata([raw], keep_segmentation=True), QUIET,
                    progress=False)
    assert sorted(packed(tmp_path / "out")) == ["000000001", "000000012"]
    assert packed(tmp_path / "out")["000000001"]["txt"] == b"a good one"
    assert manifest["skipped"] == {
        "bad_archive": 1, "non_utf8_text": 1, "undecodable_image": 1, "bad_json": 1, "decompression_bomb": 1,
        "duplicate_key": 1, "empty_caption": 1, "missing_caption": 1, "pickle_member": 1,
        "truncated_tar": 1, "unsafe_member": 1, "unsafe_path": 2,
    }
    assert not (tmp_path / "evil.image").exists() and not any(tmp_path.rglob("*.pyd"))


def test_cli_refuses_a_missing_input_and_packs_a_real_one(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["data", "pack", "brushdata", str(tmp_path / "nope.tar"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"maskbench: error: input not found: {tmp_path / 'nope.tar'}"
    make_brushdata(tmp_path / "raw", shards=1, per_shard=2)
    assert main(["data", "pack", "brushdata", str(tmp_path / "raw"), "--out", str(tmp_path / "o"), "--size", "32",
                 "--no-progress"]) == 0
    assert read_manifest(tmp_path / "o")["total"] == 2


def test_packing_resumes_without_duplicates_or_partial_shards(tmp_path: Path) -> None:
    make_brushdata(tmp_path / "raw", shards=3, per_shard=3)
    plan = plan_brushdata([tmp_path / "raw"])
    first = pack(tmp_path / "out", "brushdata", plan, QUIET, progress=False)
    # Simulate a crash while unit 00201 was being written: its part record is gone, a temporary
    # folder and a half-written shard are left behind.
    (tmp_path / "out" / ".parts" / "00201.json").unlink()
    (tmp_path / "out" / ".tmp-00201").mkdir()
    (tmp_path / "out" / ".tmp-00201" / "00201-000000.tar").write_bytes(b"half")
    truncate(tmp_path / "out" / "00201-000001.tar", 0.3)
    again = pack(tmp_path / "out", "brushdata", plan, QUIET, progress=False)
    assert again["shards"] == first["shards"] and again["total"] == 9  # byte-identical shards, no duplicates
    assert len(packed(tmp_path / "out")) == 9 and not (tmp_path / "out" / ".tmp-00201").exists()
    assert pack(tmp_path / "out", "brushdata", plan, QUIET, progress=False)["shards"] == first["shards"]
    with pytest.raises(ValueError, match="other options"):
        pack(tmp_path / "out", "brushdata", plan, PackOptions(size=32), progress=False)


def test_resize_filters_and_workers(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write_tar(raw / "00001.tar", brushdata_members("000000001", b"wide image", image_bytes(1, (80, 40)))
              + brushdata_members("000000002", b"tiny image", image_bytes(2, (16, 16)))
              + brushdata_members("000000003", b"a caption that is far too long", image_bytes(3)))
    write_tar(raw / "00002.tar", brushdata_members("000000004", b"png one", image_bytes(4, fmt="PNG")))
    opts = PackOptions(size=32, min_side=20, max_caption_chars=20, workers=2)
    manifest = pack(tmp_path / "out", "brushdata", plan_brushdata([raw]), opts, progress=False)
    assert manifest["skipped"] == {"caption_too_long": 1, "too_small": 1}
    assert manifest["filters"]["size"] == 32 and manifest["filters"]["min_side"] == 20
    samples = packed(tmp_path / "out")
    for key in ("000000001", "000000004"):
        assert Image.open(io.BytesIO(samples[key]["jpg"])).size == (32, 32)
        assert json.loads(samples[key]["json"])["width"] == 32
    serial = pack(tmp_path / "serial", "brushdata", plan_brushdata([raw]), PackOptions(size=32, min_side=20,
                  max_caption_chars=20), progress=False)
    assert [s["sha256"] for s in serial["shards"]] == [s["sha256"] for s in manifest["shards"]]


def test_sa1b_joins_images_with_internvl_captions(tmp_path: Path) -> None:
    tars, jsonl, expected = make_sa1b(tmp_path)
    write_tar(tars / "sa_000009.tar", sa1b_members(901, image_bytes(901)) + sa1b_members(902, image_bytes(902))
              + [("./sa_903.jpg", image_bytes(903)), ("./sa_903.json", b"{oops")])
    with open(jsonl, "a") as f:
        for image_id in (902, 903, 904):  # 904 has no image; 901 has no caption
            f.write(json.dumps(internvl_record("sa_000009", image_id, f"caption {image_id}")) + "\n")
        f.write(json.dumps(internvl_record("sa_000009", 902, "a second caption")) + "\n")  # the first one stays
        f.write('{"image": "sa_000009/sa_905.jpg"\n')
    manifest = pack(tmp_path / "out", "sa1b", plan_sa1b([tars], [jsonl]), QUIET, progress=False)
    samples = packed(tmp_path / "out")
    assert sorted(samples) == sorted([*expected, "sa_902"]) and samples["sa_902"]["txt"] == b"caption 902"
    for key, want in expected.items():
        assert samples[key]["txt"].decode() == want.caption and samples[key]["jpg"] == want.image
        assert json.loads(samples[key]["json"])["image_id"] == want.meta["image_id"]
    assert manifest["skipped"] == {"bad_caption_record": 1, "bad_json": 1, "caption_without_image": 1,
                                   "duplicate_caption": 1, "image_without_caption": 1}


@pytest.mark.parametrize("extracted", [(), ("001",)])
def test_journeydb_prompt_field_from_archives_or_folders(tmp_path: Path, extracted: tuple[str, ...]) -> None:
    anno, imgs, expected = make_journeydb(tmp_path, extracted=extracted)
    manifest = pack(tmp_path / "out", "journeydb", plan_journeydb([anno], imgs, "prompt"), QUIET, progress=False)
    samples = packed(tmp_path / "out")
    assert manifest["total"] == len(expected) == 6 and manifest["skipped"] == {}
    for key, want in expected.items():
        assert samples[key]["txt"].decode() == want["prompt"] and samples[key]["jpg"] == want["image"]
        assert json.loads(samples[key]["json"])["img_path"] == f"./{key[:3]}/{key[4:]}.jpg"


def test_journeydb_caption_field_counts_missing_task2_and_bad_records(tmp_path: Path) -> None:
    anno, imgs, expected = make_journeydb(tmp_path, extracted=("000",))
    (imgs / "000" / "stray.jpg").write_bytes(image_bytes(99))
    extra = write_jsonl(tmp_path / "extra.jsonl", [
        journeydb_record("000", "../../../etc/passwd", "escape", "escape"),  # normalises out of imgs/
        journeydb_record("001", "gone", "no image", "no image"),
        "{broken",
    ])
    write_tar(imgs / "002.tgz", [("../002/evil.jpg", image_bytes(5)), ("002/x.jpg", image_bytes(6))], gz=True)
    manifest = pack(tmp_path / "out", "journeydb", plan_journeydb([anno, extra], imgs, "caption"), QUIET,
                    progress=False)
    samples = packed(tmp_path / "out")
    with_caption = {k: v for k, v in expected.items() if v["caption"] is not None}
    assert sorted(samples) == sorted(with_caption)
    assert all(samples[k]["txt"].decode() == v["caption"] for k, v in with_caption.items())
    assert manifest["skipped"] == {"bad_json": 1, "caption_without_image": 1, "image_without_caption": 2,
                                   "missing_caption": 2, "unsafe_path": 2}
    assert manifest["filters"]["caption_field"] == "caption"
    shutil.rmtree(tmp_path / "out")
    with pytest.raises(ValueError, match="caption-field"):
        plan_journeydb([anno], imgs, "Task2")
