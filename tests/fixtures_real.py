"""Tiny datasets in the real BrushData, SA-1B + InternVL and JourneyDB layouts, quirks included.

Each `make_*` writes a small clean dataset and returns what a correct packer must produce from
it, `{key: Expected}`; the tests add the broken inputs themselves with `write_tar` and friends,
so each quirk is visible where it is tested.
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class Expected:
    caption: str
    image: bytes
    meta: dict


def image_bytes(seed: int, size: tuple[int, int] = (64, 48), fmt: str = "JPEG") -> bytes:
    """A small random image, different per seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def bomb_png(side: int = 30_000) -> bytes:
    """A PNG whose header claims side×side pixels: PIL refuses it on open, before decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def write_tar(path: Path, members: list[tuple[str, bytes]], gz: bool = False) -> Path:
    """Write members in the given order (the order webdataset relies on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def add_symlink(path: Path, name: str, target: str) -> None:
    """Append a symlink member to an uncompressed tar."""
    with tarfile.open(path, "a") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, target
        tar.addfile(info)


def truncate(path: Path, fraction: float) -> None:
    """Cut a file to a fraction of its size, as an interrupted download would."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def cut_after_member(path: Path, index: int) -> None:
    """Cut an uncompressed tar right after member `index`'s (padded) data, as a download stopped
    between members leaves it: no later members and no end-of-archive blocks."""
    with tarfile.open(path) as tar:
        member = tar.getmembers()[index]
    end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    path.write_bytes(path.read_bytes()[:end])


# ---------------------------------------------------------------- BrushData


def brushdata_members(key: str, caption: bytes, image: bytes, size: tuple[int, int] = (64, 48),
                      segmentation: bytes = b'{"mask": [[1, 5], []]}') -> list[tuple[str, bytes]]:
    """One BrushData sample: the image has no extension, numbers are ASCII text."""
    width, height = size
    return [
        (f"{key}.image", image),
        (f"{key}.caption", caption),
        (f"{key}.height", str(height).encode()),
        (f"{key}.width", str(width).encode()),
        (f"{key}.aesthetic_score", b"5.25"),
        (f"{key}.original_key", key.encode()),
        (f"{key}.url", f"https://example.com/{key}.jpg".encode()),
        (f"{key}.segmentation", segmentation),
    ]


def make_brushdata(root: Path, shards: int = 2, per_shard: int = 3) -> dict[str, Expected]:
    """`00200.tar, 00201.tar, ...` with 9-digit keys."""
    expected = {}
    for s in range(shards):
        members = []
        for i in range(per_shard):
            key = f"{s * 1000 + i:09d}"
            caption, image = f"a photo number {key} of a red bird", image_bytes(s * 1000 + i)
            members += brushdata_members(key, caption.encode(), image)
            expected[key] = Expected(caption, image, {"aesthetic_score": 5.25, "orig_width": 64, "orig_height": 48})
        write_tar(root / f"{200 + s:05d}.tar", members)
    return expected


# ---------------------------------------------------------------- SA-1B + InternVL captions


def sa1b_members(image_id: int, image: bytes, size: tuple[int, int] = (64, 48)) -> list[tuple[str, bytes]]:
    """One SA-1B sample: `./sa_N.jpg` and its annotation JSON (one COCO-RLE mask)."""
    info = {
        "image": {"image_id": image_id, "width": size[0], "height": size[1], "file_name": f"sa_{image_id}.jpg"},
        "annotations": [{"id": 1, "segmentation": {"size": [size[1], size[0]], "counts": "PPYo0"},
                         "bbox": [0, 0, 4, 4], "area": 16, "predicted_iou": 0.9, "stability_score": 0.95,
                         "crop_box": [0, 0, size[0], size[1]], "point_coords": [[2.0, 2.0]]}],
    }
    return [(f"./sa_{image_id}.jpg", image), (f"./sa_{image_id}.json", json.dumps(info).encode())]


def internvl_record(stem: str, image_id: int, caption: str) -> dict:
    return {"id": image_id, "image": f"{stem}/sa_{image_id}.jpg", "width": 64, "height": 48,
            "conversations": [{"from": "human", "value": "<image>\nDescribe the image in detail."},
                              {"from": "gpt", "value": caption}]}


def write_jsonl(path: Path, records: list[dict | str]) -> Path:
    """Records as JSON lines; a str is written verbatim (for malformed lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def make_sa1b(root: Path, tars: int = 2, per_tar: int = 3) -> tuple[Path, Path, dict[str, Expected]]:
    """`root/tars/sa_00000N.tar` and `root/internvl.jsonl`; returns (tar folder, jsonl, expected)."""
    expected, records = {}, []
    for t in range(tars):
        stem, members = f"sa_{t:06d}", []
        for i in range(per_tar):
            image_id = t * 100 + i + 1
            image, caption = image_bytes(image_id), f"The image shows scene {image_id} with a blue car."
            members += sa1b_members(image_id, image)
            records.append(internvl_record(stem, image_id, caption))
            expected[f"sa_{image_id}"] = Expected(caption, image, {"image_id": image_id})
        write_tar(root / "tars" / f"{stem}.tar", members)
    return root / "tars", write_jsonl(root / "internvl_sa1b_caption_11m_single_image_en.jsonl", records), expected


# ---------------------------------------------------------------- JourneyDB


def journeydb_record(folder: str, name: str, prompt: str, caption: str | None) -> dict:
    record = {"img_path": f"./{folder}/{name}.jpg", "prompt": prompt,
              "Task1": {"Style": ["flat"], "Content": ["cat"], "Atmosphere": ["calm"], "Others": []},
              "Task3": {"Questions": ["What animal?"], "Answers": ["A cat"]}}
    if caption is not None:
        record["Task2"] = {"Caption": caption}
    return record


def make_journeydb(root: Path, folders: int = 2, per_folder: int = 3,
                   extracted: tuple[str, ...] = ()) -> tuple[Path, Path, dict[str, dict]]:
    """`root/train_anno_realease_repath.jsonl.tgz` and `root/imgs/NNN.tgz` (or `NNN/` if extracted).

    The last image of every folder has no Task2 (the real quirk). Returns (annotations, imgs,
    {key: {"prompt", "caption" (None if missing), "image"}}).
    """
    expected, records = {}, []
    for f in range(folders):
        folder, members = f"{f:03d}", []
        for i in range(per_folder):
            name = f"{f:02d}{i:02d}c0ffee{i}d15ea5e"
            image = image_bytes(f * 100 + i)
            prompt = f"a cat wearing hat number {i}, studio ghibli --ar 4:3"
            caption = None if i == per_folder - 1 else f"A cat with hat {i}."
            records.append(journeydb_record(folder, name, prompt, caption))
            members.append((f"{folder}/{name}.jpg", image))
            expected[f"{folder}_{name}"] = {"prompt": prompt, "caption": caption, "image": image}
        if folder in extracted:
            for member, data in members:
                (root / "imgs" / member).parent.mkdir(parents=True, exist_ok=True)
                (root / "imgs" / member).write_bytes(data)
        else:
            write_tar(root / "imgs" / f"{folder}.tgz", members, gz=True)
    jsonl = write_jsonl(root / "anno" / "train_anno_realease_repath.jsonl", records)
    anno = write_tar(root / "train_anno_realease_repath.jsonl.tgz", [(jsonl.name, jsonl.read_bytes())], gz=True)
    return anno, root / "imgs", expected
