"""Pack raw datasets into canonical shards: the driver every source adapter plugs into.

A source adapter turns its raw files into *units* (one input archive or folder each) and yields
each unit's samples as `Sample` (raw, unvalidated) or `Skip` (counted, never written). The driver
validates and normalises every sample in one place (caption text, image decodability, size limits,
resize / centre-crop), so the quirks of each source stay in its adapter and the rules stay here.

Packing is resumable and idempotent because it works per unit: a unit is written into a temporary
folder, its shards are renamed into place, and only then is its part manifest recorded under
`.parts/`, with the name, size and mtime of every input the unit was made from. A rerun skips a
unit only when its part manifest exists, its inputs are unchanged and its archive was read to the
end; it redoes the others (new, re-downloaded, or cut short last time), overwriting the same
deterministic shard names, so it neither duplicates samples nor leaves partial or stale shards.
`manifest.json` is rebuilt from all part manifests at the end, so a large dataset can also be
packed in batches of inputs into one folder.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import closing, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image, ImageOps
from tqdm import tqdm

from maskbench.data.shards import (
    PIL_FORMATS,
    BadSample,
    CanonicalShardWriter,
    Skip,
    build_manifest,
    group_samples,
)
from maskbench.errors import ConfigError
from maskbench.files import write_json_atomic
from maskbench.manifest import read_manifest

PACKER_VERSION = "1"
PARTS = ".parts"  # one committed unit's manifest per file
OPTIONS = ".options.json"  # what the folder was made with, so a rerun cannot mix settings
IMAGE_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
PICKLE_FIELDS = ("pyd", "pickle")
ARCHIVE_FAILURES = ("bad_archive", "truncated_tar")  # skips that mean an input was not read to its end
JSON_FORMAT = {"indent": 1, "sort_keys": True, "newline": False}  # how pack writes .options, parts, manifest.json
# data_filter only needs a destination to resolve member paths against; nothing is extracted.
_NOWHERE = "/maskbench-archive-root"
T = TypeVar("T")


@dataclass(frozen=True)
class Sample:
    """One sample as its source stores it; the driver validates every field before writing."""

    key: str
    image: bytes | None
    caption: bytes | str | None
    meta: dict[str, Any]
    extra: dict[str, bytes] = field(default_factory=dict)


Item = Sample | Skip


@dataclass(frozen=True)
class Unit:
    """The smallest piece of work that is packed, resumed or skipped whole: one input archive.

    `read` must be picklable (a functools.partial of a module-level function) so that worker
    processes can run it. `inputs` are the files or folders `read` draws on; a rerun repacks the
    unit when any of them changed since it was packed.
    """

    name: str
    read: Callable[[], Iterable[Item]]
    inputs: tuple[Path, ...] = ()


@dataclass(frozen=True)
class SourceIndex:
    """What a source adapter found: its units, what it skipped while indexing, and its options."""

    units: list[Unit]
    skipped: dict[str, int]
    filters: dict[str, Any]


@dataclass(frozen=True)
class PackOptions:
    """Normalisation applied to every source alike; all of it is recorded in the manifest."""

    size: int | None = None  # shorter side resized to this (bicubic), then centre-cropped if `crop`
    crop: bool = True
    min_side: int = 0  # images whose shorter side is smaller are skipped ("too_small")
    min_caption_chars: int = 1
    max_caption_chars: int | None = None
    image_format: str = "jpg"  # of resized images (others keep their bytes and format)
    quality: int = 95
    maxcount: int = 10_000  # samples per output shard
    workers: int = 1

    def __post_init__(self) -> None:
        if self.size is not None and self.size < 1:
            raise ConfigError(f"--size must be positive, got {self.size}")
        if self.image_format not in IMAGE_FORMATS.values():
            raise ConfigError(f"--image-format must be one of {sorted(IMAGE_FORMATS.values())}")
        if self.max_caption_chars is not None and self.max_caption_chars < self.min_caption_chars:
            raise ConfigError("--max-caption-chars is smaller than --min-caption-chars")
        if self.workers < 1 or self.maxcount < 1:
            raise ConfigError("--workers and --maxcount must be at least 1")

    def filters(self) -> dict[str, Any]:
        """The options that change what is written (not how fast)."""
        return {k: v for k, v in asdict(self).items() if k not in ("workers", "maxcount")}


# ---------------------------------------------------------------- validating one sample


def prepare_caption(raw: bytes | str | None, opts: PackOptions) -> str:
    """Decode and check a caption; rejects missing, non-UTF-8, empty and out-of-range text."""
    if raw is None:
        raise BadSample("missing_caption")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadSample("non_utf8_text") from None
    if not isinstance(raw, str):
        raise BadSample("missing_caption")
    text = raw.strip()
    if not text:
        raise BadSample("empty_caption")
    if len(text) < opts.min_caption_chars:
        raise BadSample("caption_too_short")
    if opts.max_caption_chars is not None and len(text) > opts.max_caption_chars:
        raise BadSample("caption_too_long")
    return text


def _open_image(data: bytes) -> Image.Image:
    """Fully decode untrusted bytes with only the JPEG/PNG/WebP decoders; PIL's bomb warning is an
    error here, not a log line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
            img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadSample("decompression_bomb") from None
    except (OSError, SyntaxError, ValueError, EOFError):  # UnidentifiedImageError and truncation are OSError
        raise BadSample("undecodable_image") from None
    return img


def _resize(img: Image.Image, size: int, crop: bool) -> Image.Image:
    if crop:
        return ImageOps.fit(img, (size, size), Image.Resampling.BICUBIC)
    scale = size / min(img.size)
    new = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
    return img.resize(new, Image.Resampling.BICUBIC)


def prepare_image(data: bytes | None, opts: PackOptions) -> tuple[bytes, str, int, int]:
    """Return (bytes, ext, width, height); original bytes are kept unless a resize is asked for."""
    if not data:
        raise BadSample("missing_image")
    img = _open_image(data)
    if min(img.size) < opts.min_side:
        raise BadSample("too_small")
    if opts.size is None:
        return data, IMAGE_FORMATS[img.format], img.width, img.height
    img = img.convert("RGB")
    if opts.size is not None:
        img = _resize(img, opts.size, opts.crop)
    out = io.BytesIO()
    pil_format = {v: k for k, v in IMAGE_FORMATS.items()}[opts.image_format]
    img.save(out, format=pil_format, quality=opts.quality)
    return out.getvalue(), opts.image_format, img.width, img.height


# ---------------------------------------------------------------- reading raw archives safely


def _split_name(name: str) -> tuple[str, str]:
    """webdataset's rule: the key is the path up to the basename's first dot, the rest the field."""
    folder, base = os.path.split(name)
    stem, _, fieldname = base.partition(".")
    return os.path.normpath(os.path.join(folder, stem)), fieldname.lower()


def _member_problem(member: tarfile.TarInfo) -> str | None:
    """Why a member must not be read: a path leaving the extraction folder (tarfile's "data"
    filter), a link or device, or a pickle field (never unpickled, so never read)."""
    try:
        tarfile.data_filter(member, _NOWHERE)
    except tarfile.FilterError:
        return "unsafe_path"
    if not member.isfile():
        return "unsafe_member"
    if _split_name(member.name)[1] in PICKLE_FIELDS:
        return "pickle_member"
    return None


class _EndCheckedTarInfo(tarfile.TarInfo):
    """TarInfo whose archive ends only at the end-of-archive marker (a block of zeros).

    tarfile quietly ends an archive at any block that is not a header: the marker, but also no
    block at all (a file cut at a member boundary, as an interrupted download leaves it), a partial
    block or garbage. Those are read errors here. The check is on the blocks tarfile reads, that is
    on the decompressed stream of a .tgz; one zero block is enough (tar writes two).
    """

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.EOFHeaderError:  # a full zero block: the marker
            raise
        except tarfile.HeaderError as err:
            raise tarfile.ReadError(f"no end-of-archive marker: {err}") from None


def _safe_members(tar: tarfile.TarFile) -> Iterator[tuple[str, str, Callable[[], bytes]] | Skip]:
    """(key path, field, read) per file member, refused members as Skip (unread); folders are ignored."""
    for member in tar:
        if member.isdir():
            continue
        if problem := _member_problem(member):
            yield Skip(problem)
            continue
        key, fieldname = _split_name(member.name)
        yield key, fieldname, tar.extractfile(member).read


def iter_tar_samples(path: Path) -> Iterator[tuple[str, dict[str, bytes]] | Skip]:
    """A tar's samples, (key path, {field: bytes}), grouped by `group_samples` as webdataset groups them.

    Not webdataset's tar_file_iterator (the loader's reader): that one ends quietly at a tar cut at a
    member boundary, skips links unseen and passes unsafe paths and pickle fields on, where packing
    untrusted archives must refuse and count each. The tar is read as a stream and nothing is
    extracted to disk. A broken archive, including one that stops without its end-of-archive
    marker, ends the stream with one Skip and drops the group being read: "bad_archive" if it fails
    while opening (which reads the first header, so nothing was read), "truncated_tar" after.
    """
    try:
        tar = tarfile.open(path, "r|*", tarinfo=_EndCheckedTarInfo)
    except (tarfile.TarError, EOFError, OSError):
        yield Skip("bad_archive")
        return
    try:
        with tar:
            yield from group_samples(_safe_members(tar))
    except (tarfile.TarError, EOFError, OSError):
        yield Skip("truncated_tar")


def is_archive(path: Path) -> bool:
    """Whether `path` opens as a tar, as `iter_tar_samples` opens it. Packing refuses inputs of which none
    does (empty, text or binary files named .tar) before writing anything; one broken archive among
    good ones is counted instead (`bad_archive`), as it will be in a download of thousands."""
    with closing(iter_tar_samples(path)) as items:
        first = next(items, None)
    return not (isinstance(first, Skip) and first.reason == "bad_archive")


def tar_items(path: Path, to_item: Callable[[str, dict[str, bytes]], Item]) -> Iterator[Item]:
    """A tar's samples as items, `to_item(key path, fields)`; its Skips (refused members, a cut
    archive) pass through, so that a source adapter only handles samples."""
    for item in iter_tar_samples(path):
        yield item if isinstance(item, Skip) else to_item(*item)


def existing_paths(paths: Iterable[str | Path], pattern: str) -> list[Path]:
    """Expand folders to their files matching `pattern`; a path that does not exist is refused."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found.extend(sorted(p.glob(pattern)))
        elif p.is_file():
            found.append(p)
        else:
            raise ConfigError(f"input not found: {p}")
    if not found:
        raise ConfigError(f"no {pattern} inputs found in {', '.join(map(str, paths))}")
    return found


Captions = dict[str, dict[str, str | None]]  # group (an archive stem or folder) -> file name -> caption


def index_captions(
    lines: Iterable[bytes], parse: Callable[[Any], tuple[str, str, str | None] | None], bad: str, duplicate: str
) -> tuple[Captions, Counter]:
    """Captions by group and file name from JSON lines, for sources that ship captions apart from images.

    `parse` turns a record into (group, file name, caption), returns None for one not wanted here
    (not counted), or raises BadSample(reason). A line that is not JSON, or a record `parse` cannot
    read (ValueError, KeyError, TypeError, AttributeError), counts under `bad`; a file name seen
    before in its group counts under `duplicate`, and the first one stays. Blank lines are ignored.
    """
    captions: Captions = defaultdict(dict)
    skipped: Counter = Counter()
    for line in lines:
        if not line.strip():
            continue
        try:
            entry = parse(json.loads(line))
        except BadSample as refused:
            skipped[refused.reason] += 1
            continue
        except (ValueError, KeyError, TypeError, AttributeError):
            skipped[bad] += 1
            continue
        if entry is None:
            continue
        group, file_name, caption = entry
        if file_name in captions[group]:
            skipped[duplicate] += 1
            continue
        captions[group][file_name] = caption
    return captions, skipped


# ---------------------------------------------------------------- resumable per-unit output


def _part_path(out_dir: Path, name: str) -> Path:
    return out_dir / PARTS / f"{name}.json"


def claim_output(out_dir: Path, header: dict[str, Any]) -> None:
    """Record what this folder holds; refuse to mix in output made with other options."""
    path = out_dir / OPTIONS
    if path.exists():
        before = json.loads(path.read_text())
        if before != json.loads(json.dumps(header)):
            raise ConfigError(f"{out_dir} holds output made with other options ({before}); use a new folder")
    else:
        write_json_atomic(path, header, **JSON_FORMAT)


def unit_done(out_dir: Path, name: str) -> bool:
    return _part_path(out_dir, name).exists()


def read_part(out_dir: Path, name: str) -> dict[str, Any] | None:
    """A committed unit's part manifest, or None when the unit was never committed."""
    path = _part_path(out_dir, name)
    return json.loads(path.read_text()) if path.exists() else None


def commit_unit(out_dir: Path, name: str, tmp: Path, part: dict[str, Any]) -> None:
    """Move a finished unit's shards into place, then record it: the part file is the commit.

    A unit packed again may now have fewer shards; its old ones beyond them are removed first, so
    the folder never holds shards no manifest lists. Until the new part is written the old one
    still stands, and with it the reason the unit is being repacked, so a crash here is redone.
    """
    new = {shard["name"] for shard in part["shards"]}
    for shard in (read_part(out_dir, name) or {"shards": []})["shards"]:
        if shard["name"] not in new:
            (out_dir / shard["name"]).unlink(missing_ok=True)
    for shard in part["shards"]:
        os.replace(tmp / shard["name"], out_dir / shard["name"])
    (out_dir / PARTS).mkdir(parents=True, exist_ok=True)
    write_json_atomic(_part_path(out_dir, name), part, **JSON_FORMAT)
    shutil.rmtree(tmp)


def input_stamps(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Name, size and mtime of each input, what a part is checked against on rerun.

    A folder is stamped by its files' count, total size and newest mtime (its own counts too, so a
    removed file shows), which is enough to see a re-download without reading the data again.
    """
    stamps = []
    for path in paths:
        if path.is_dir():
            stats = [f.stat() for f in path.iterdir() if f.is_file()]
            stamps.append({"name": path.name, "files": len(stats), "size": sum(s.st_size for s in stats),
                           "mtime_ns": max([path.stat().st_mtime_ns, *(s.st_mtime_ns for s in stats)])})
        else:
            stat = path.stat()
            stamps.append({"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return stamps


def merge_parts(out_dir: Path, header: dict[str, Any], skipped: dict[str, int]) -> dict[str, Any]:
    """Write manifest.json from every committed part (sorted by unit) plus indexing-time skips."""
    parts = [json.loads(p.read_text()) for p in sorted((out_dir / PARTS).glob("*.json"))]
    counts = Counter(skipped)
    for part in parts:
        counts.update(part["skipped"])
    manifest = build_manifest(header, [s for part in parts for s in part["shards"]], counts)
    write_json_atomic(out_dir / "manifest.json", manifest, **JSON_FORMAT)
    return manifest


def run_units(items: list[T], work: Callable[[T], dict], workers: int, desc: str, progress: bool) -> None:
    """Run `work(item)` for each item, in worker processes when asked, with a progress bar."""
    samples = 0
    with tqdm(total=len(items), desc=desc, unit="unit", disable=not progress) as bar, \
            (ProcessPoolExecutor(workers) if workers > 1 else nullcontext()) as pool:
        for part in (pool.map(work, items) if pool else map(work, items)):
            samples += part["total"]
            bar.update(1)
            bar.set_postfix(samples=samples)


# ---------------------------------------------------------------- the packing driver


@dataclass(frozen=True)
class _UnitPacker:
    """Packs one unit into its own shards; a picklable callable for worker processes."""

    out_dir: Path
    source: str
    opts: PackOptions
    filters: dict[str, Any]

    def __call__(self, unit: Unit) -> dict[str, Any]:
        inputs = input_stamps(unit.inputs)  # before reading: a change during the read shows next time
        tmp = self.out_dir / f".tmp-{unit.name}"
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
        with CanonicalShardWriter(
            tmp, source=self.source, packer_version=PACKER_VERSION, filters=self.filters,
            maxcount=self.opts.maxcount, prefix=unit.name,
        ) as writer:
            for item in unit.read():
                if isinstance(item, Skip):
                    writer.skip(item.reason, item.n)
                    continue
                try:
                    caption = prepare_caption(item.caption, self.opts)
                    image, ext, width, height = prepare_image(item.image, self.opts)
                except BadSample as bad:
                    writer.skip(bad.reason)
                    continue
                meta = {**item.meta, "width": width, "height": height}  # the writer adds source and id
                writer.write(item.key, image, ext, caption, meta, item.extra or None)
        part = {**read_manifest(tmp), "inputs": inputs}
        commit_unit(self.out_dir, unit.name, tmp, part)
        return part


# Why a unit is (re)packed, or "kept" when it is not, and the summary line for each decision.
RESUME_LINES = {
    "kept": "skipped {n} already packed (inputs unchanged)",
    "new": "packing {n} not packed before",
    "inputs_changed": "repacking {n}: inputs changed since packed",
    "archive_failed": "repacking {n}: archive not read to its end last time (bad_archive/truncated_tar)",
    "unrecorded": "repacking {n}: packed before inputs were recorded",
}


def _resume_decision(part: dict[str, Any] | None, unit: Unit) -> str:
    """A key of RESUME_LINES: a part is trusted only if it records the very inputs there are now
    and no archive-level failure, since a re-download or a retry may yield what was lost."""
    if part is None:
        return "new"
    if "inputs" not in part:
        return "unrecorded"
    if part["inputs"] != input_stamps(unit.inputs):
        return "inputs_changed"
    if any(part["skipped"].get(reason) for reason in ARCHIVE_FAILURES):
        return "archive_failed"
    return "kept"


def _resume_summary(decisions: Counter[str]) -> list[str]:
    """One line per kind of decision taken, in RESUME_LINES order."""
    return [line.format(n=f"{decisions[kind]} unit{'s' * (decisions[kind] != 1)}")
            for kind, line in RESUME_LINES.items() if decisions[kind]]


def pack(out_dir: str | Path, source: str, plan: SourceIndex, opts: PackOptions, progress: bool = True,
         log: Callable[[str], None] | None = None) -> dict:
    """Pack every unit of `plan` not packed yet, or whose part is stale, into `out_dir`.

    `log` is told, before packing, what is skipped and what is (re)packed and why, one line each.
    Returns the merged manifest.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file; give a folder for the shards and manifest.json")
    names = [u.name for u in plan.units]
    if len(set(names)) != len(names):
        raise ConfigError(f"two inputs share a name: {sorted(n for n, c in Counter(names).items() if c > 1)}")
    if plan.units and not any(is_archive(unit.inputs[0]) for unit in plan.units):
        raise ConfigError(f"none of the {len(plan.units)} inputs opens as a tar archive "
                          f"(e.g. {plan.units[0].inputs[0]}): nothing to pack")
    filters = {**opts.filters(), **plan.filters}
    header = {"source": source, "packer_version": PACKER_VERSION, "filters": filters}
    out_dir.mkdir(parents=True, exist_ok=True)
    claim_output(out_dir, header)
    decisions = [_resume_decision(read_part(out_dir, unit.name), unit) for unit in plan.units]
    if log is not None:
        for line in _resume_summary(Counter(decisions)):
            log(line)
    todo = [unit for unit, decision in zip(plan.units, decisions) if decision != "kept"]
    packer = _UnitPacker(out_dir, source, opts, filters)
    run_units(todo, packer, min(opts.workers, max(1, len(todo))), f"pack {source}", progress)
    return merge_parts(out_dir, header, plan.skipped)
