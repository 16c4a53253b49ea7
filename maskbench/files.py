"""Writing files so that readers never see half of one, and hashing them.

The one home of both for every layer (data, train, results), so it imports only the standard library.
A folder is signed by a `digests.json` inside it (the sha256 of each of its other files), written when
the folder is complete: `maskbench repro` then tells which file's bytes changed since.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

DIGESTS = "digests.json"  # in a signed folder: {path relative to the folder: sha256}


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace `path` with `data` (text is written as UTF-8) in one step.

    The data goes to `.NAME.tmp` in the same folder first and is then renamed over `path` with
    os.replace: a rename within one file system is atomic, so a reader (or a rerun after a crash)
    finds the old file or the new one, never a partial one; a temporary file in another folder
    could sit on another file system, where os.replace fails. The fixed temporary name assumes one
    writer per path at a time (a main process, a file lock, or a unit's own files). There is no
    fsync: this guards against the process dying, not the machine.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)


def write_json_atomic(
    path: str | os.PathLike, obj: Any, *, indent: int = 2, sort_keys: bool = False, newline: bool = True
) -> None:
    """`write_atomic` of `json.dumps(obj, indent=indent, sort_keys=sort_keys)`, plus a final newline
    unless `newline` is False: the options keep each kind of file in its byte format (the shard
    writer's manifest is the default; pack writes indent=1, sorted, without the newline)."""
    write_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + ("\n" if newline else ""))


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks (shards are too large to hold in memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of `obj`'s canonical JSON (sorted keys, no spaces): a record's digest, whatever the key order
    or spacing of the file it sits in."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def folder_digests(folder: str | os.PathLike) -> dict[str, str]:
    """{path relative to `folder`: sha256} of every file under it except its own digests.json."""
    folder = Path(folder)
    files = {path.relative_to(folder).as_posix(): path for path in sorted(folder.rglob("*")) if path.is_file()}
    return {name: sha256_file(path) for name, path in files.items() if name != DIGESTS}


def write_folder_digests(folder: str | os.PathLike) -> None:
    """Sign a complete folder: its digests.json lists every other file in it, whatever they are."""
    write_json_atomic(Path(folder) / DIGESTS, folder_digests(folder), sort_keys=True)


def folder_change(folder: str | os.PathLike) -> str | None:
    """The first file (in name order) whose bytes differ from its digests.json, that is missing, or that it
    does not list; None if the folder is as signed."""
    signed, found = json.loads((Path(folder) / DIGESTS).read_text()), folder_digests(folder)
    for name in sorted(signed.keys() | found.keys()):
        if name not in found:
            return f"{name} is missing"
        if name not in signed:
            return f"{name} is not signed"
        if found[name] != signed[name]:
            return f"{name} changed (sha256 {found[name][:12]}, signed {signed[name][:12]})"
    return None
