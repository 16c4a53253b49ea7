"""The one way benchmarks write a whole table: a CSV under results/, header from the rows (a script whose figures
must survive its being cut writes them row by row instead: stream.py)."""

from __future__ import annotations

import csv
from pathlib import Path


def write_rows(path: Path, rows: list[dict], fields: list[str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
