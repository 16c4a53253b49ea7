"""The canonical webdataset shard format: the writer every packer uses, and how samples are read back.

A canonical sample is `KEY.{png,jpg,webp}` (image bytes), `KEY.txt` (UTF-8 caption) and `KEY.json`
(`source`, `id`, `width`, `height`, source extras), optionally with extra fields such as
`KEY.latent.npy`. Every shard directory has a `manifest.json`, written last and atomically, so a
directory without one is incomplete by definition.

Reading is the one rule of which tar members make a sample (`group_samples`) and decoders that
never trust shard contents: nothing is unpickled (webdataset's default decoders would), and a bad
sample raises `BadSample(reason)` for its reader (the loader, packing, verify) to skip and count.
The training loader is `maskbench.data.loader`.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from maskbench.data.demote import field_key
from maskbench.files import sha256_file, write_json_atomic
from maskbench.manifest import FORMAT, read_manifest

IMAGE_EXTS = ("png", "jpg", "webp")
PIL_FORMATS = ("PNG", "JPEG", "WEBP")  # the only decoders PIL may try on shard bytes
TAR_MTIME = 0  # fixed, so the same samples give byte-identical shards; an int (a float adds PAX headers)


# ----------------------------------------------------------------------------- writing


def shard_entry(path: Path, count: int) -> dict[str, Any]:
    """A finished shard as the manifest lists it: what `verify` checks the file against."""
    return {"name": path.name, "count": count, "sha256": sha256_file(path), "bytes": path.stat().st_size}


def build_manifest(header: Mapping[str, Any], shards: list[dict], skipped: Mapping[str, int]) -> dict[str, Any]:
    """The manifest of a shard directory, whoever writes it: the writer, or the merge of parts (pack, encode).

    `header` holds source, packer_version, filters (and, for latent shards, latent); the total is
    derived from the shard entries and the skip counts are sorted by reason, so the same shards and
    counts give the same manifest, apart from created_at.
    """
    return {
        "format": FORMAT,
        **header,
        "shards": shards,
        "total": sum(s["count"] for s in shards),
        "skipped": dict(sorted(skipped.items())),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


class CanonicalShardWriter:
    """Write canonical samples into `{prefix}-000000.tar, ...` and, on a clean close, `manifest.json`.

    Use it as a context manager: if the block raises, the shards are closed but no manifest is
    written, so the partial output is never mistaken for a complete one. The directory must not
    already hold a manifest or shards with this prefix (stale shards would be mixed in silently).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        source: str,
        packer_version: str,
        filters: dict,
        maxcount: int = 10_000,
        prefix: str = "shard",
    ) -> None:
        if maxcount < 1:
            raise ValueError(f"maxcount must be positive; got {maxcount}")
        self.out_dir = Path(out_dir)
        if (self.out_dir / "manifest.json").exists() or any(self.out_dir.glob(f"{prefix}-*.tar")):
            raise ValueError(f"{self.out_dir} already holds shards; remove them or write elsewhere")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.source, self.packer_version, self.filters = source, packer_version, filters
        self.shards: list[dict] = []
        self.skipped: Counter[str] = Counter()
        self._sink = wds.ShardWriter(
            str(self.out_dir / f"{prefix}-%06d.tar"),
            maxcount=maxcount,
            post=self._shard_done,
            verbose=0,
            encoder=False,
            mtime=TAR_MTIME,
        )

    def _shard_done(self, fname: str) -> None:
        """ShardWriter callback when a shard file is closed (its count is still readable)."""
        path = Path(fname)
        if self._sink.count == 0:  # ShardWriter opens its first file eagerly; drop it if unused
            path.unlink()
            return
        self.shards.append(shard_entry(path, self._sink.count))

    def write(
        self,
        key: str,
        image_bytes: bytes,
        image_ext: str,
        caption: str,
        meta: dict,
        extra: dict[str, bytes] | None = None,
    ) -> None:
        """Append one sample; meta must hold int `width` and `height` and becomes KEY.json with source/id."""
        if not key or "." in key or "/" in key:
            raise ValueError(f"sample key must be non-empty, without '.' or '/' (webdataset splits there); got {key!r}")
        if image_ext not in IMAGE_EXTS:
            raise ValueError(f"image_ext must be one of {IMAGE_EXTS}; got {image_ext!r}")
        if not caption.strip():
            raise ValueError(f"sample {key} has an empty caption; count it with skip('empty_caption') instead")
        if not all(isinstance(meta.get(k), int) for k in ("width", "height")):
            raise ValueError(f"sample {key}: meta needs int 'width' and 'height'; got {sorted(meta)}")
        if {"source", "id"} & meta.keys():
            raise ValueError(f"sample {key}: meta must not set 'source' or 'id' (the writer does)")
        extra = extra or {}
        if clash := {image_ext, "txt", "json"} & extra.keys():
            raise ValueError(f"sample {key}: extra fields {sorted(clash)} clash with the canonical ones")
        record = {"source": self.source, "id": key, **meta}
        self._sink.write(
            {
                "__key__": key,
                image_ext: image_bytes,
                "txt": caption.encode("utf-8"),
                "json": json.dumps(record).encode("utf-8"),
                **extra,
            }
        )

    def skip(self, reason: str, n: int = 1) -> None:
        """Count `n` input samples left out, by reason (recorded in the manifest)."""
        self.skipped[reason] += n

    def close(self) -> dict:
        """Finish the last shard and write manifest.json; returns the manifest."""
        self._sink.close()
        header = {"source": self.source, "packer_version": self.packer_version, "filters": self.filters}
        manifest = build_manifest(header, self.shards, self.skipped)
        write_json_atomic(self.out_dir / "manifest.json", manifest)
        return manifest

    def __enter__(self) -> CanonicalShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._sink.close()


def shard_urls(shard_dir: str | os.PathLike) -> list[str]:
    """Paths of the shards listed in the manifest, in order."""
    return [str(Path(shard_dir) / s["name"]) for s in read_manifest(shard_dir)["shards"]]


# ----------------------------------------------------------------------------- grouping tar members


@dataclass(frozen=True)
class Skip:
    """Samples (or archives) left out, counted under `reason` (in a manifest, or by the loader)."""

    reason: str
    n: int = 1


def _finished(key: str | None, fields: dict[str, bytes], seen: set[str]) -> Iterator[tuple[str, dict] | Skip]:
    """Emit a completed group once; a key seen before in the archive is a duplicate."""
    if key is None:
        return
    if key in seen:
        yield Skip("duplicate_key")
    else:
        seen.add(key)
        yield key, fields


def group_samples(
    members: Iterable[tuple[str | None, str, bytes | Callable[[], bytes]] | Skip],
) -> Iterator[tuple[str, dict[str, bytes]] | Skip]:
    """Group a tar's members, (key, field, data) in archive order, into (key, {field: bytes}).

    The one rule of what a sample is, for both tar readers (the loader's and `pack.iter_tar_samples`):
    a new key, or a field already in the group, starts a new group; a key seen before in the
    archive is Skip("duplicate_key"), so the first occurrence wins. A None key (a name without a
    field) is dropped; Skip members pass through in order. A group is emitted only once the next
    one starts or the members end, so an error raised by `members` drops the group being read
    (its last fields may be the ones cut off). `data` may be a function reading the bytes: it is
    called only once the group before is emitted, so a tar cut inside a member still gives that one.
    """
    seen: set[str] = set()
    key: str | None = None
    fields: dict[str, bytes] = {}
    for member in members:
        if isinstance(member, Skip):
            yield member
            continue
        member_key, fieldname, data = member
        if member_key != key or fieldname in fields:
            yield from _finished(key, fields, seen)
            key, fields = member_key, {}
        fields[fieldname] = data() if callable(data) else data
    yield from _finished(key, fields, seen)


# ----------------------------------------------------------------------------- decoding


class BadSample(Exception):
    """A sample (or record) skipped and counted under `reason` by the loader, packing or verify; never a bug."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode_image(data: bytes) -> Image.Image:
    """PNG/JPEG/WebP bytes -> RGB image, refusing anything larger than PIL's MAX_IMAGE_PIXELS."""
    try:
        with Image.open(io.BytesIO(data), formats=PIL_FORMATS) as image:
            if image.width * image.height > Image.MAX_IMAGE_PIXELS:  # checked on the header, before decoding
                raise BadSample("image_too_large")
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as error:
        raise BadSample("undecodable_image") from error


def decode_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadSample("non_utf8_text") from error


def decode_json(data: bytes) -> dict:
    try:
        return json.loads(data)
    except ValueError as error:
        raise BadSample("bad_json") from error


def encode_npy(array: np.ndarray) -> bytes:
    """array -> .npy bytes (no pickles), the inverse of decode_npy."""
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def decode_npy(data: bytes) -> np.ndarray:
    """.npy bytes -> array; object arrays are refused because loading them would unpickle."""
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise BadSample("bad_npy") from error


def decode_image_caption(sample: dict) -> dict:
    """Default decode for canonical shards: {"image": 3×H×W float in [-1, 1], "caption": str, "key": str}."""
    image_field = next((ext for ext in IMAGE_EXTS if ext in sample), None)
    if image_field is None:
        raise BadSample("missing_image")
    if "txt" not in sample:
        raise BadSample("missing_caption")
    caption = decode_text(sample["txt"]).strip()
    if not caption:
        raise BadSample("empty_caption")
    # numpy, not torch: per-sample torch ops wake torch's thread pool, which on a busy machine costs
    # more than the arithmetic (JPEG loading was ~10x slower with 0 workers; benchmarks/loader.py)
    pixels = np.asarray(decode_image(sample[image_field]), dtype=np.float32) / 127.5 - 1.0  # H×W×3
    return {"image": torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))),     # 3×H×W
            "caption": caption, "key": sample["__key__"]}


def decode_latent_text(sample: dict) -> dict:
    """Decode for latent shards (`maskbench data encode`): the latent takes the image's place.

    {"image": C×h×w float latent, "txtemb": T×D as stored (fp16), "txtmask": T bool (True up to the caption's
    token count, so padding after the end token is not attended), "caption": str, "key": str}, and
    "demoted": {ratio: C×s×s float} when the shards hold demoted latents (`latent_RATIO.npy`, `--demote`).
    """
    if "latent.npy" not in sample or "txtemb.npy" not in sample:
        raise BadSample("missing_latent")
    latent = torch.from_numpy(decode_npy(sample["latent.npy"]).astype(np.float32))   # C×h×w
    # Text stays as stored (fp16 from `data encode`), half the host memory and copy of fp32; the
    # model's device casts it (`batch_context`).
    text = torch.from_numpy(decode_npy(sample["txtemb.npy"]))                          # T×D
    meta = decode_json(sample["json"]) if "json" in sample else {}
    n_tokens = int(meta.get("text_tokens", text.shape[0]))
    caption = decode_text(sample["txt"]).strip() if "txt" in sample else ""
    decoded = {"image": latent, "txtemb": text, "txtmask": torch.from_numpy(np.arange(text.shape[0]) < max(n_tokens, 1)),
               "caption": caption, "key": sample["__key__"]}
    demoted = {key: torch.from_numpy(decode_npy(data).astype(np.float32))                # C×s×s each
               for name, data in sample.items() if (key := field_key(name)) is not None}
    return {**decoded, "demoted": demoted} if demoted else decoded

