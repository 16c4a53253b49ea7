"""Check a shard folder against its manifest: every shard present, unaltered, and readable.

A manifest is a promise (names, counts, sha256, sizes); `verify` re-reads everything to check it,
decoding each sample the way training will (image or latents, caption, metadata), so a bad
download or a tampered shard is found before a long run rather than during it. Latent shards are
also checked against the shapes and dtype their manifest declares.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from maskbench.data.demote import latent_field
from maskbench.data.pack import iter_tar_samples
from maskbench.data.shards import (
    IMAGE_EXTS,
    BadSample,
    Skip,
    decode_image,
    decode_json,
    decode_npy,
    decode_text,
)
from maskbench.files import sha256_file
from maskbench.manifest import read_manifest


@dataclass
class VerifyReport:
    """What was checked and every mismatch found; `ok` only when there is none."""

    directory: str
    shards: int = 0
    samples: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = f"{'PASS' if self.ok else 'FAIL'} {self.directory}: {self.shards} shards, {self.samples} samples"
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def _expected_arrays(manifest: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Field -> (shape, dtype) that a latent manifest promises; empty for image shards."""
    latent = manifest.get("latent")
    if latent is None:
        return {}
    return {
        "latent.npy": ((latent["channels"], latent["size"], latent["size"]), latent["dtype"]),
        "txtemb.npy": ((latent["text_len"], latent["text_dim"]), latent["dtype"]),
        **{latent_field(key): ((latent["channels"], side, side), latent["dtype"])
           for key, side in latent.get("demote", {}).items()},                     # `encode --demote`
    }


def _check_sample(fields: dict[str, bytes], arrays: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Decode one sample as training would; raises BadSample with the reason."""
    if not decode_text(fields.get("txt", b"")).strip():
        raise BadSample("empty_caption")
    decode_json(fields.get("json", b""))
    for name, (shape, dtype) in arrays.items():
        if name not in fields:
            raise BadSample(f"missing_{name}")
        array = decode_npy(fields[name])
        if array.shape != shape or array.dtype != np.dtype(dtype):
            raise BadSample(f"{name} is {array.dtype}{list(array.shape)}, manifest says {dtype}{list(shape)}")
    if not arrays:
        image_field = next((ext for ext in IMAGE_EXTS if ext in fields), None)
        if image_field is None:
            raise BadSample("missing_image")
        decode_image(fields[image_field])


def _check_shard(path: Path, entry: dict, arrays: dict, report: VerifyReport) -> None:
    if not path.is_file():
        report.problems.append(f"{entry['name']}: missing")
        return
    if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
        report.problems.append(f"{entry['name']}: sha256/size differ from the manifest")
    count = 0
    for item in iter_tar_samples(path):
        if isinstance(item, Skip):
            report.problems.append(f"{entry['name']}: {item.reason}")
            continue
        key, fields = item
        try:
            _check_sample(fields, arrays)
        except BadSample as bad:
            report.problems.append(f"{entry['name']}: sample {key}: {bad.reason}")
        count += 1
    if count != entry["count"]:
        report.problems.append(f"{entry['name']}: {count} samples, manifest says {entry['count']}")
    report.samples += count


def verify(directory: str | Path) -> VerifyReport:
    """Re-read every shard listed in `directory`'s manifest; raises ValueError if there is no manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    report = VerifyReport(str(directory), shards=len(manifest["shards"]))
    arrays = _expected_arrays(manifest)
    for entry in manifest["shards"]:
        _check_shard(directory / entry["name"], entry, arrays, report)
    if manifest["total"] != sum(entry["count"] for entry in manifest["shards"]):
        report.problems.append(f"manifest total {manifest['total']} is not the sum of its shard counts")
    listed = {entry["name"] for entry in manifest["shards"]}
    report.problems += [f"{p.name}: not in the manifest" for p in sorted(directory.glob("*.tar")) if p.name not in listed]
    return report


def add_verify_arguments(subparsers: argparse._SubParsersAction) -> None:
    """Add `verify DIR` to a `maskbench data` subparser group."""
    parser = subparsers.add_parser("verify", help="check shards against their manifest (exit 1 on mismatch)")
    parser.add_argument("directory", help="a folder with manifest.json (canonical or latent shards)")
    parser.set_defaults(func=verify_command)


def verify_command(args: argparse.Namespace) -> int:
    """CLI handler: 0 when everything matches, 1 on any mismatch (no manifest: ConfigError, exit 2)."""
    report = verify(args.directory)
    print(report.summary())
    return 0 if report.ok else 1
