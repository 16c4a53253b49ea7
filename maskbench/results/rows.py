"""The leaderboard CSV: one row per (run, eval point), appended by many processes, read back typed.

Why a CSV: runs on a cluster append to one file on a shared filesystem, users merge the files of
several machines, and the published reference rows ship as a CSV in the same schema
(`results/reference.csv`). A `filelock.FileLock` beside the file serialises appends so concurrent
writers never interleave half rows, and every row is validated on the way in and on the way out,
so one bad line (a crash mid-write, a hand edit) is reported as FILE:LINE instead of silently
corrupting a table of averages.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from maskbench.metrics import METRICS

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Column:
    """One leaderboard column: its name, how its cells read back, and whether CSVs may predate it."""

    name: str
    kind: type = str      # int, float (finite) or str; an empty cell is None whatever the kind
    added: bool = False   # added after CSVs were first written: a file without it reads it as empty, and appending
    #                       to such a file first rewrites its header (and pads its rows), under the same lock


def _added(name: str, kind: type = str) -> Column:
    return Column(name, kind, added=True)


def _metric(name: str, added: bool = False) -> Column:
    """A metric's value column (or, with a `_se` suffix, its sampling error's) where the committed CSVs have it:
    the name checked against `maskbench.metrics` (a float, as every metric is), never typed a second time."""
    base = name.removesuffix("_se")
    metric = next((m for m in METRICS if m.name == base), None)
    if metric is None or name not in (metric.name, metric.se_column):
        raise ValueError(f"{name!r} is not a registered metric's column")
    return Column(name, float, added)


# The schema, in the order the committed CSVs have their columns: the one list a column is declared in. A metric's
# columns (`maskbench.metrics`: the value and its `_se`) sit among them by name (`_metric`); one registered since
# comes after them, added.
_DECLARED: tuple[Column, ...] = (
    Column("run_id"), Column("arm"), Column("phases"), Column("dataset"), Column("model"), Column("params", int),
    Column("resolution", int), Column("batch_size", int), Column("seed", int), Column("budget_flops", float),
    Column("point", float), Column("step", int), Column("samples_seen", int), Column("train_flops", float),
    Column("gpu_hours", float), Column("device"), Column("n_devices", int), Column("mfu", float),
    _metric("val_loss"), _metric("fid"), Column("fid_features"), Column("fid_n", int),
    _metric("clip_score"), Column("clip_cos", float), Column("clip_model"), _metric("align_acc"),
    Column("sampler_steps", int), Column("cfg_scale", float), Column("maskbench_version"), Column("git_sha"),
    Column("config_hash"), Column("created_at"), Column("source"),
    _added("fid_ref"), _metric("fd_dinov2", added=True), _added("fd_dinov2_features"), _added("flops_per_s", float),
    _added("init_from"), _added("switch_step", int), _added("branch_flops", float), _added("data_wait_s", float),
    _added("compile_s", float), _added("eval_s", float), _added("checkpoint_s", float), _added("resume_s", float),
    *(_metric(f"{name}_se", added=True) for name in ("val_loss", "fid", "fd_dinov2", "clip_score", "align_acc")),
    _added("precision"), _added("draw_scheme"), _added("encoder_flops", float), _added("skipped_steps", int),
    _added("data_streams", int), _added("auxiliary_flops", float),
)
METRIC_COLUMNS = tuple(column for m in METRICS for column in (m.name, m.se_column))
SCHEMA: tuple[Column, ...] = _DECLARED + tuple(_added(name, float) for name in METRIC_COLUMNS
                                               if name not in {c.name for c in _DECLARED})
COLUMNS = tuple(c.name for c in SCHEMA)
ADDED_COLUMNS = tuple(c.name for c in SCHEMA if c.added)
INT_COLUMNS = frozenset(c.name for c in SCHEMA if c.kind is int)
FLOAT_COLUMNS = frozenset(c.name for c in SCHEMA if c.kind is float)
# A measured row must say what it measured to be grouped; a reference row (non-empty `source`)
# only has to say where its numbers come from, and is empty wherever that source gives nothing.
REQUIRED_MEASURED = ("run_id", "arm", "dataset", "model", "budget_flops", "point", "seed")
REQUIRED_REFERENCE = ("run_id", "arm", "source")
ON_ERROR = ("skip", "abort")
DEFAULT_CSV = "results/leaderboard.csv"

Value = str | int | float | None
Row = dict[str, Value]


def parse_value(column: str, text: str) -> Value:
    """Parse one cell into its column's type: int, finite float, or str; empty means None."""
    if text == "":
        return None
    if column in INT_COLUMNS:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"column {column!r}: expected an integer, got {text!r}") from None
    if column in FLOAT_COLUMNS:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"column {column!r}: expected a finite number, got {text!r}")
        return value
    return text


def parse_row(cells: Mapping[str, str]) -> Row:
    """Type every column of one row (cells keyed by column name) and check the required ones."""
    row = {column: parse_value(column, cells.get(column, "")) for column in COLUMNS}
    required = REQUIRED_REFERENCE if row["source"] else REQUIRED_MEASURED
    missing = [column for column in required if row[column] is None]
    if missing:
        raise ValueError(f"empty required column(s): {', '.join(missing)}")
    return row


def _format_row(row: Mapping[str, Value]) -> list[str]:
    """Cells of one row in COLUMNS order, validated by the reader's own rules before writing."""
    unknown = sorted(set(row) - set(COLUMNS))
    if unknown:
        raise ValueError(f"unknown leaderboard column(s): {', '.join(unknown)}; "
                         f"known: {', '.join(COLUMNS)}")
    cells = ["" if row.get(column) is None else str(row[column]) for column in COLUMNS]
    parse_row(dict(zip(COLUMNS, cells)))  # never write a row that read_rows would reject
    return cells


def complete_row(row: Row) -> Row:
    """A row as a run writes it, checked to name every declared column (None where it has nothing): a column
    added to the schema but not to the row's builder is refused here, by name, instead of written empty."""
    missing = [column for column in COLUMNS if column not in row]
    if missing:
        raise ValueError(f"leaderboard row without declared column(s): {', '.join(missing)}")
    return row


def as_read(row: Mapping[str, Value]) -> Row:
    """A row as `read_rows` will give it back once written (every cell through text and its column's type)."""
    return parse_row(dict(zip(COLUMNS, _format_row(row))))


def append_rows(csv_path: str | os.PathLike, rows: Sequence[Mapping[str, Value]]) -> None:
    """Append rows to a leaderboard CSV, creating it with a header if missing.

    Safe under concurrent writers (processes, nodes on a shared filesystem): the header check and
    the write happen under `<csv>.lock`, and the data is fsync'ed before the lock is released, so a
    reader never sees half a row from a live writer. Keys missing from a row are written empty;
    unknown keys or badly typed values raise ValueError before the file is touched.
    """
    lines = [_format_row(row) for row in rows]
    path = Path(csv_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"), open(path, "a+", newline="", encoding="utf-8") as f:
        f.seek(0)  # "a+" reads from anywhere but always writes at the end
        header = next(csv.reader([f.readline()]), [])
        writer = csv.writer(f)
        if not header:
            writer.writerow(COLUMNS)
        elif tuple(header) != COLUMNS:
            if tuple(header) != COLUMNS[:len(header)] or set(COLUMNS[len(header):]) - set(ADDED_COLUMNS):
                raise ValueError(f"{path} has a different header than this maskbench's schema; "
                                 "write to a new CSV")
            _upgrade_header(f, len(header))
            writer = csv.writer(f)
        writer.writerows(lines)
        f.flush()
        os.fsync(f.fileno())


def _upgrade_header(f, n_old: int) -> None:
    """Rewrite an open CSV written before ADDED_COLUMNS existed: the full header, every row padded."""
    f.seek(0)
    old = list(csv.reader(f))
    f.seek(0)
    f.truncate()
    writer = csv.writer(f)
    writer.writerow(COLUMNS)
    writer.writerows(cells + [""] * (len(COLUMNS) - n_old) if cells else cells for cells in old[1:])


def auxiliary_flops(row: Row) -> float | None:
    """The FLOPs a run spent outside its training steps (REPA's encoder's pretraining; a charged source's training):
    `auxiliary_flops`, or for a row from before that column, `encoder_flops`, then the only such cost recorded."""
    spent = row.get("auxiliary_flops")
    return row.get("encoder_flops") if spent is None else spent


def read_rows(paths: Iterable[str | os.PathLike], on_error: str = "skip") -> list[Row]:
    """Read and merge leaderboard CSVs into typed rows (columns may come in any order).

    A malformed row (wrong field count, bad type, empty required column) is reported as
    "FILE:LINE: reason": logged as a warning and skipped under on_error="skip", raised as
    ValueError under "abort". A file whose header is not the schema is one such error at line 1.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    rows: list[Row] = []
    for path in paths:
        rows.extend(_read_file(Path(path), on_error))
    return rows


def _read_file(path: Path, on_error: str) -> list[Row]:
    """Typed rows of one CSV; see read_rows for the error policy. A file that is not text, or not a
    leaderboard (no schema column in its header), is bad input whatever the policy."""
    try:
        return _read_rows_of(path, on_error)
    except (UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"{path} is not a text CSV ({err})") from None


def _read_rows_of(path: Path, on_error: str) -> list[Row]:
    rows: list[Row] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return rows
        if not set(header) & set(COLUMNS):  # not a leaderboard at all, rather than one of another schema
            raise ValueError(f"{path} is not a leaderboard CSV (its first line names none of its columns)")
        problem = _header_problem(header)
        if problem:
            _report(f"{path}:1: {problem}", on_error)
            return rows
        for cells in reader:
            if not cells:  # blank line
                continue
            try:
                if len(cells) != len(header):
                    raise ValueError(f"expected {len(header)} fields, got {len(cells)}")
                rows.append(parse_row(dict(zip(header, cells))))
            except ValueError as err:
                _report(f"{path}:{reader.line_num}: {err}", on_error)
    return rows


def _header_problem(header: list[str]) -> str | None:
    """Why a header is not the schema (any order is fine), or None."""
    unknown = sorted(set(header) - set(COLUMNS))
    missing = [column for column in COLUMNS if column not in header and column not in ADDED_COLUMNS]
    if unknown or missing:
        return (f"header does not match the schema (unknown: {unknown or 'none'}; "
                f"missing: {missing or 'none'})")
    if len(set(header)) != len(header):
        return "header repeats a column"
    return None


def _report(message: str, on_error: str) -> None:
    """Raise under abort; otherwise log the problem and let the caller skip the row."""
    if on_error == "abort":
        raise ValueError(message)
    logger.warning("%s (skipped)", message)
