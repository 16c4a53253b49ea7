"""SA-1B image tars joined with InternVL-SA-1B-Caption JSONL -> canonical samples.

SA-1B ships images without captions (`sa_000000.tar` holds `./sa_1.jpg` + `./sa_1.json`) and
InternVL ships captions without images (`{"image": "sa_000000/sa_1.jpg", "conversations":
[human, gpt]}`), so the join key is `<tar stem>/<file name>`. Images without a caption and
captions without an image (in the tars given) are skipped and counted. Only captions for the
tars being packed are held in memory, so the full set can be packed in batches of tars.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from maskbench.data.pack import (
    Captions,
    Item,
    Sample,
    Skip,
    SourceIndex,
    Unit,
    existing_paths,
    index_captions,
    tar_items,
)


def _gpt_caption(record: dict) -> str | None:
    """The assistant's turn of a conversation; None when the record has no such turn."""
    return next((turn.get("value") for turn in record["conversations"] if turn.get("from") == "gpt"), None)


def _record(record: dict, stems: set[str]) -> tuple[str, str, str | None] | None:
    """(tar stem, file name, caption) of one record; None for a tar not being packed."""
    stem, _, file_name = record["image"].partition("/")
    caption = _gpt_caption(record)
    return (stem, file_name, caption) if stem in stems else None


def _lines(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as lines:
            yield from lines


def read_captions(paths: list[Path], stems: set[str]) -> tuple[Captions, Counter]:
    """Captions by tar stem and file name, for the given stems; malformed records are counted."""
    return index_captions(_lines(paths), partial(_record, stems=stems), "bad_caption_record", "duplicate_caption")


def _image_id(data: bytes) -> int:
    """SA-1B's numeric image id from the per-image annotation JSON; raises on malformed JSON."""
    return int(json.loads(data)["image"]["image_id"])


def _item(name: str, fields: dict[str, bytes], unmatched: dict[str, str | None]) -> Item:
    """One SA-1B sample with its caption, taken out of `unmatched`, or the Skip saying why not."""
    key = os.path.basename(name)
    if "jpg" not in fields:
        return Skip("missing_image")
    if f"{key}.jpg" not in unmatched:
        return Skip("image_without_caption")
    caption = unmatched.pop(f"{key}.jpg")
    meta = {}
    if "json" in fields:
        try:
            meta["image_id"] = _image_id(fields["json"])
        except (ValueError, KeyError, TypeError):
            return Skip("bad_json")
    return Sample(key, fields["jpg"], caption, meta)


def read_sa1b_tar(path: Path, captions: dict[str, str | None]) -> Iterator[Item]:
    """Canonical samples of one SA-1B tar joined with that tar's captions."""
    unmatched = dict(captions)
    yield from tar_items(path, partial(_item, unmatched=unmatched))
    if unmatched:
        yield Skip("caption_without_image", len(unmatched))


def plan_sa1b(inputs: list[str | Path], captions: list[str | Path]) -> SourceIndex:
    """One unit per SA-1B tar; `captions` are InternVL-SA-1B-Caption JSONL files (inputs of every
    unit, since a re-downloaded caption file may caption images it left out before)."""
    tars = existing_paths(inputs, "sa_*.tar")
    caption_files = existing_paths(captions, "*.jsonl")
    by_stem, skipped = read_captions(caption_files, {p.stem for p in tars})
    units = [Unit(p.stem, partial(read_sa1b_tar, p, by_stem.get(p.stem, {})), (p, *caption_files)) for p in tars]
    return SourceIndex(units, dict(skipped), {"captions": sorted(p.name for p in caption_files)})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="SA-1B tars (sa_000000.tar ...) or folders of them")
    parser.add_argument("--captions", nargs="+", required=True,
                        help="InternVL-SA-1B-Caption JSONL file(s), e.g. internvl_sa1b_caption_11m_single_image_en.jsonl")


def plan_from_args(args: argparse.Namespace) -> SourceIndex:
    return plan_sa1b(args.inputs, args.captions)
