"""BrushData (TencentARC/BrushNet) webdataset tars -> canonical samples.

Each sample is `<9-digit key>.image` (JPEG bytes with no image extension, so the driver sniffs the
format), `.caption`, `.height`, `.width`, `.aesthetic_score`, `.original_key`, `.url` and
`.segmentation` (JSON `{"mask": [rle, ...]}` in BrushNet's own RLE, not COCO's; see
`decode_brushdata_rle`). The masks are only needed for inpainting, so they are kept on request.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from maskbench.data.pack import Item, Sample, Skip, SourceIndex, Unit, existing_paths, tar_items


def decode_brushdata_rle(rle: list[int], height: int, width: int) -> np.ndarray:
    """Decode one BrushData mask to a (height, width) bool array.

    The RLE is a flat `[start1, len1, start2, len2, ...]` with 1-based starts into the image
    flattened in column-major (Fortran) order; an empty list means the whole image.
    """
    if not rle:
        return np.ones((height, width), dtype=bool)
    runs = np.asarray(rle, dtype=np.int64)
    if runs.ndim != 1 or len(runs) % 2:
        raise ValueError(f"RLE must be a flat list of (start, length) pairs; got {len(runs)} numbers")
    starts, lengths = runs[0::2] - 1, runs[1::2]  # 1-based -> 0-based
    if (starts < 0).any() or (lengths < 0).any() or (starts + lengths > height * width).any():
        raise ValueError(f"RLE runs fall outside a {height}x{width} mask")
    edges = np.zeros(height * width + 1, dtype=np.int64)
    np.add.at(edges, starts, 1)  # +1 where a run opens, -1 where it closes: overlaps still count once
    np.add.at(edges, starts + lengths, -1)
    return (np.cumsum(edges[:-1]) > 0).reshape((height, width), order="F")


def _meta(fields: dict[str, bytes]) -> dict[str, Any]:
    """Source extras, typed; raises ValueError on a field that does not parse."""
    meta: dict[str, Any] = {}
    if "aesthetic_score" in fields:
        meta["aesthetic_score"] = float(fields["aesthetic_score"].decode("ascii"))
    for name in ("height", "width"):  # the original size, which the segmentation RLE refers to
        if name in fields:
            meta[f"orig_{name}"] = int(fields[name].decode("ascii"))
    for name in ("original_key", "url"):
        if name in fields:
            meta[name] = fields[name].decode("utf-8").strip()
    return meta


def _segmentation(data: bytes) -> bytes:
    """Validate the segmentation JSON shape and return it unchanged; raises ValueError if malformed."""
    masks = json.loads(data)["mask"]
    if not isinstance(masks, list) or not all(isinstance(m, list) for m in masks):
        raise ValueError("segmentation 'mask' must be a list of RLE lists")
    return data


def _item(name: str, fields: dict[str, bytes], keep_segmentation: bool) -> Item:
    """One BrushData sample as a canonical Sample, or the Skip saying why not."""
    try:
        meta = _meta(fields)
    except (ValueError, UnicodeDecodeError):
        return Skip("bad_meta")
    extra: dict[str, bytes] = {}
    if keep_segmentation and "segmentation" in fields:
        try:
            extra["segmentation.json"] = _segmentation(fields["segmentation"])
        except (ValueError, KeyError, TypeError):
            return Skip("bad_json")
    return Sample(os.path.basename(name), fields.get("image"), fields.get("caption"), meta, extra)


def read_brushdata_tar(path: Path, keep_segmentation: bool) -> Iterator[Item]:
    """Canonical samples of one BrushData tar, with bad members and samples as Skip."""
    return tar_items(path, partial(_item, keep_segmentation=keep_segmentation))


def plan_brushdata(inputs: list[str | Path], keep_segmentation: bool = False) -> SourceIndex:
    """One unit per tar; `inputs` are tar files or folders of them."""
    tars = existing_paths(inputs, "*.tar")
    units = [Unit(p.stem, partial(read_brushdata_tar, p, keep_segmentation), (p,)) for p in tars]
    return SourceIndex(units, {}, {"keep_segmentation": keep_segmentation})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="BrushData tar shards (00200.tar ...) or folders of them")
    parser.add_argument("--keep-segmentation", action="store_true", help="store the masks as KEY.segmentation.json")


def plan_from_args(args: argparse.Namespace) -> SourceIndex:
    return plan_brushdata(args.inputs, args.keep_segmentation)
