"""Figures written the moment each exists, so that a step its time limit cuts keeps what it measured.

A device command may be cut at any second (benchmarks/gpu_check.sh runs each step under `timeout`), and the machine
may be lent for that one call: a script that wrote its results at its end would bring back nothing. So each
measurement is one JSON line or one CSV row, appended and flushed as it is made, and a script first prints how many
it plans (`announce`), from which benchmarks/gpu_check_report.py says "timed out after N of M items".
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

PLANNED = "items planned:"  # the first line a streaming script prints; gpu_check_report.planned_items reads it


def announce(planned: int, what: str) -> None:
    """Print the number of items this run will write (its log keeps it for the report)."""
    print(f"{PLANNED} {planned} {what}", flush=True)


def append(path: Path, text: str) -> None:
    """`text` at the end of `path` in one write: processes appending lines to one file never interleave them."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def append_json_line(path: Path, record: dict) -> None:
    append(path, json.dumps(record) + "\n")


def append_csv_row(path: Path, row: dict) -> None:
    """One CSV row; the header (the row's keys) first when the file is new or empty."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(row))
    if not path.is_file() or path.stat().st_size == 0:
        writer.writeheader()
    writer.writerow(row)
    append(path, buffer.getvalue())


def fresh(path: Path) -> Path:
    """`path` emptied for a new run's lines (its folder made): a stale file's rows must not count as this run's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path
