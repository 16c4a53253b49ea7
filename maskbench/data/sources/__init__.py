"""The raw datasets `maskbench data pack SOURCE` knows, and that command's arguments.

Each source is a module with `add_arguments(parser)` and `plan_from_args(args) -> SourceIndex`; the table
below lists them by name, imported plainly so the import graph shows them (the driver, `data.pack`, never
imports a source: sources import it).
"""

from __future__ import annotations

import argparse
from types import ModuleType

from maskbench.data.pack import ARCHIVE_FAILURES, IMAGE_FORMATS, PackOptions, pack
from maskbench.data.sources import brushdata, journeydb, sa1b
from maskbench.errors import ConfigError

SOURCES: dict[str, ModuleType] = {"brushdata": brushdata, "sa1b": sa1b, "journeydb": journeydb}


def add_pack_arguments(subparsers: argparse._SubParsersAction) -> None:
    """Add `pack <source> ...` to a `maskbench data` subparser group."""
    parser = subparsers.add_parser("pack", help="pack a raw dataset into canonical shards")
    sources = parser.add_subparsers(dest="source", required=True, metavar="SOURCE")
    for name, module in SOURCES.items():
        sub = sources.add_parser(name, help=module.__doc__.splitlines()[0])
        module.add_arguments(sub)
        sub.add_argument("--out", required=True, help="output folder for shards and manifest.json")
        sub.add_argument("--size", type=int, help="resize the shorter side to this many pixels")
        sub.add_argument("--no-crop", dest="crop", action="store_false", help="keep aspect ratio after --size")
        sub.add_argument("--min-side", type=int, default=0, help="skip images whose shorter side is smaller")
        sub.add_argument("--min-caption-chars", type=int, default=1)
        sub.add_argument("--max-caption-chars", type=int)
        sub.add_argument("--image-format", default="jpg", choices=sorted(IMAGE_FORMATS.values()))
        sub.add_argument("--maxcount", type=int, default=10_000, help="samples per output shard")
        sub.add_argument("--workers", type=int, default=1, help="worker processes (one input archive each)")
        sub.add_argument("--no-progress", dest="progress", action="store_false")
        sub.set_defaults(func=pack_command, plan_from_args=module.plan_from_args)


def pack_command(args: argparse.Namespace) -> int:
    """CLI handler: 0 on success; bad input raises ConfigError (`maskbench` prints it, exit 2)."""
    opts = PackOptions(
        size=args.size, crop=args.crop, min_side=args.min_side, min_caption_chars=args.min_caption_chars,
        max_caption_chars=args.max_caption_chars, image_format=args.image_format,
        maxcount=args.maxcount, workers=args.workers,
    )
    try:
        manifest = pack(args.out, args.source, args.plan_from_args(args), opts, progress=args.progress, log=print)
    except OSError as err:  # an input the user named that cannot be read (permissions, a folder, ...)
        raise ConfigError(f"cannot read {err.filename}: {err.strerror}") from None
    skipped = ", ".join(f"{k}={v}" for k, v in manifest["skipped"].items()) or "none"
    print(f"packed {manifest['total']} samples into {len(manifest['shards'])} shards in {args.out}; skipped: {skipped}")
    if failed := {k: v for k, v in manifest["skipped"].items() if k in ARCHIVE_FAILURES}:
        print(f"warning: {sum(failed.values())} input archive(s) not read to their end "
              f"({', '.join(f'{k}={v}' for k, v in failed.items())}); fetch them again and rerun "
              "(such units are repacked on every run)")
    return 0
