"""Figures written the moment each exists, so that a step its time limit cuts keeps what it measured.

A device command may be cut at any second (benchmarks/gpu_check.sh runs each step under `timeout`), and the machine
may be lent for that one call: a script that wrote its results at its end would bring back nothing. So each
measurement is one JSON line or one CSV row, appended and flushed as it is made, and a script first prints how many
it plans (`announce`), from which benchmarks/gpu_check_report.py says "timed out after N of M items".

A test that rehearses a cut must not depend on how fast its machine makes the items, so `GPU_CHECK_CUT_AFTER=N`
(tests only) stops a script right after its N-th item as its step's limit would (`cut_if_due`).
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
from pathlib import Path

PLANNED = "items planned:"  # the first line a streaming script prints; gpu_check_report.items reads it
CUT_AFTER = "GPU_CHECK_CUT_AFTER"  # N >= 1: tests only, see cut_if_due
_written = 0  # the items this process has written


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
    cut_if_due()


def cut_if_due() -> None:
    """Under GPU_CHECK_CUT_AFTER=N, once this process has written its N-th item: stop as a step cut by its limit.

    A test that forced a few seconds' limit and counted on the machine making some items, not all, in that time
    passed or failed with the machine's speed. Here the cut falls after exactly N items, at once: the script tells the
    `timeout` that runs its step (benchmarks/device/steps.sh) that the limit is up, with the SIGALRM that
    timeout's own timer sends, so timeout TERMs it, KILLs it after the grace and exits 124 as at its limit. Not
    under `timeout` (run by hand, or an arms shard, whose parent is arms_check), it waits until it is killed.
    """
    global _written
    _written += 1
    cut = os.environ.get(CUT_AFTER)
    if not cut or _written < int(cut):
        return
    parent = Path(f"/proc/{os.getppid()}/comm")
    if parent.is_file() and parent.read_text().strip() == "timeout":
        os.kill(os.getppid(), signal.SIGALRM)
    while True:
        signal.pause()


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
