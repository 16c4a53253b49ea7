"""A shard folder's manifest.json: the marker of a complete folder and the record of what it holds.

At the base of the package because the config reads one field of it (the data's source names a run) before
any data is touched; the shard writer and loader (`data/shards.py`,
`data/loader.py`) build and read the rest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from maskbench.errors import ConfigError

FORMAT = "maskbench-shards-v1"


def read_manifest(shard_dir: str | os.PathLike) -> dict:
    """Load a shard directory's manifest.json (the marker of a complete directory)."""
    path = Path(shard_dir) / "manifest.json"
    if not path.is_file():
        raise ConfigError(f"no shard manifest at {path}; build the shards first (maskbench data synth|pack)")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:  # binary, empty or cut short
        raise ConfigError(f"{path} is not a {FORMAT} manifest (not JSON: {err})") from None
    found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    if found != FORMAT or not isinstance(manifest.get("shards"), list):
        raise ConfigError(f"{path} is not a {FORMAT} manifest (format={found!r})")
    return manifest
