"""Writing files so that readers never see half of one, and hashing them.

The one home of both for every layer (data, train, results), so it imports only the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


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
