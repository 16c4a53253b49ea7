"""JourneyDB annotations + image archives (or their extracted folders) -> canonical samples.

Annotations are JSONL (`train_anno_realease_repath.jsonl`, "realease" sic, or
`valid_anno_repath.jsonl`), plain or inside the `.jsonl.tgz` they ship as; each record has
`img_path` (`./000/<hash>.jpg`, relative to `imgs/`), `prompt` (the Midjourney prompt) and
`Task2.Caption`, which may be missing. Images are in `imgs/000.tgz ...` or the folders these
extract to; a folder is preferred over its archive when both exist. Pack one split at a time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

from maskbench.data.pack import (
    IMAGE_FORMATS,
    Captions,
    Item,
    Sample,
    Skip,
    SourceIndex,
    Unit,
    index_captions,
    tar_items,
)
from maskbench.data.shards import BadSample
from maskbench.errors import ConfigError

CAPTION_FIELDS = ("prompt", "caption")
IMAGE_EXTS = tuple(IMAGE_FORMATS.values())


def _annotation_lines(path: Path) -> Iterator[bytes]:
    """Lines of a .jsonl file, or of the .jsonl member of a .tgz, read as a stream."""
    if not path.name.endswith((".tgz", ".tar.gz")):
        with open(path, "rb") as f:
            yield from f
        return
    try:
        with tarfile.open(path, "r|gz") as tar:
            member = next((m for m in tar if m.isfile() and m.name.endswith(".jsonl")), None)
            if member is None:
                raise ConfigError(f"{path} holds no .jsonl file")
            yield from tar.extractfile(member)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ConfigError(f"cannot read annotations {path}: {err}") from None


def _caption(record: dict, caption_field: str) -> str | None:
    if caption_field == "prompt":
        return record.get("prompt")
    task2 = record.get("Task2")
    return task2.get("Caption") if isinstance(task2, dict) else None


def _annotation(record: dict, caption_field: str) -> tuple[str, str, str | None]:
    """(folder, file name, caption) of one record; a path that would read outside imgs/<folder>/ is refused."""
    img_path = os.path.normpath(record["img_path"])  # "./000/x.jpg" -> "000/x.jpg"
    caption = _caption(record, caption_field)
    folder, _, file_name = img_path.partition("/")
    if not folder or folder == ".." or not file_name or "/" in file_name:
        raise BadSample("unsafe_path")
    return folder, file_name, caption


def read_annotations(paths: Iterable[Path], caption_field: str) -> tuple[Captions, Counter]:
    """Captions by image folder (`000`) and file name; malformed or unsafe records are counted."""
    lines = itertools.chain.from_iterable(map(_annotation_lines, paths))
    return index_captions(lines, partial(_annotation, caption_field=caption_field), "bad_json", "duplicate_key")


def _sample(folder: str, file_name: str, image: bytes, caption: str | None) -> Sample:
    stem = file_name.partition(".")[0]
    return Sample(f"{folder}_{stem}", image, caption, {"img_path": f"./{folder}/{file_name}"})


def _archive_item(name: str, fields: dict[str, bytes], folder: str, unmatched: dict[str, str | None]) -> Item:
    """One archived image with its caption, taken out of `unmatched`, or Skip when it has none."""
    ext = next((e for e in IMAGE_EXTS if e in fields), None)
    file_name = f"{os.path.basename(name)}.{ext}"
    if ext is None or os.path.dirname(name) != folder or file_name not in unmatched:
        return Skip("image_without_caption")
    return _sample(folder, file_name, fields[ext], unmatched.pop(file_name))


def read_journeydb_archive(path: Path, folder: str, captions: dict[str, str | None]) -> Iterator[Item]:
    """Samples of one `imgs/NNN.tgz`, read as a stream (never extracted)."""
    unmatched = dict(captions)
    yield from tar_items(path, partial(_archive_item, folder=folder, unmatched=unmatched))
    if unmatched:
        yield Skip("caption_without_image", len(unmatched))


def read_journeydb_folder(path: Path, captions: dict[str, str | None]) -> Iterator[Item]:
    """Samples of one extracted `imgs/NNN/` folder, in annotation order by file name."""
    for file_name, caption in sorted(captions.items()):
        file = path / file_name
        if file.is_symlink():
            yield Skip("unsafe_member")
        elif not file.is_file():
            yield Skip("caption_without_image")
        else:
            yield _sample(path.name, file_name, file.read_bytes(), caption)
    strays = [f for f in path.iterdir() if f.is_file() and f.name not in captions]
    if strays:
        yield Skip("image_without_caption", len(strays))


def plan_journeydb(annotations: list[str | Path], imgs: str | Path, caption_field: str = "prompt") -> SourceIndex:
    """One unit per image archive or folder in `imgs` (folders win over archives of the same name)."""
    if caption_field not in CAPTION_FIELDS:
        raise ConfigError(f"--caption-field must be one of {CAPTION_FIELDS}, got {caption_field!r}")
    anno_paths = [Path(p) for p in annotations]
    for p in anno_paths + [Path(imgs)]:
        if not p.exists():
            raise ConfigError(f"input not found: {p}")
    captions, skipped = read_annotations(anno_paths, caption_field)
    imgs = Path(imgs)
    folders = {p.name: p for p in imgs.iterdir() if p.is_dir() and p.name.isdigit()}
    archives = {p.name.removesuffix(".tgz"): p for p in imgs.glob("*.tgz") if p.name[:-4].isdigit()}
    if not folders and not archives:
        raise ConfigError(f"no NNN.tgz archives or NNN/ folders in {imgs}")
    units = []
    for name in sorted(folders.keys() | archives.keys()):
        if name in folders:
            path, read = folders[name], partial(read_journeydb_folder, folders[name], captions.get(name, {}))
        else:
            path, read = archives[name], partial(read_journeydb_archive, archives[name], name, captions.get(name, {}))
        units.append(Unit(name, read, (path, *anno_paths)))  # annotations too: they decide what is packed
    filters = {"caption_field": caption_field, "annotations": sorted(p.name for p in anno_paths)}
    return SourceIndex(units, dict(skipped), filters)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--annotations", nargs="+", required=True,
                        help="train_anno_realease_repath.jsonl[.tgz] or valid_anno_repath.jsonl[.tgz]")
    parser.add_argument("--imgs", required=True, help="the split's imgs/ folder (NNN.tgz archives or NNN/ folders)")
    parser.add_argument("--caption-field", default="prompt", choices=CAPTION_FIELDS,
                        help="prompt: the Midjourney prompt (as MicroDiT); caption: Task2.Caption")


def plan_from_args(args: argparse.Namespace) -> SourceIndex:
    return plan_journeydb(args.annotations, args.imgs, args.caption_field)
