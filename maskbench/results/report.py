"""`maskbench leaderboard`: read CSVs, print the per-arm summary and comparisons (or, with --mlperf, the
MLPerf-style scores), optionally plot.

Apart from `leaderboard.py` (the CSV's schema and locked appends) so that writers of rows need neither
scipy nor matplotlib, and so the modules import one way: leaderboard <- stats <- mlperf, plots <- report.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from maskbench.results import stats
from maskbench.results.leaderboard import DEFAULT_CSV, read_rows


def leaderboard_main(paths: Sequence[str], fmt: str = "table", plot: str | None = None,
                     baseline: str = "mask0", on_error: str = "skip", mlperf: bool = False,
                     crossover: str | None = None) -> int:
    """All of `maskbench leaderboard`: read CSVs, print the summary, optionally plot; the exit code.

    With no paths it reads DEFAULT_CSV. Wrong input (a CSV that does not exist, an unknown format
    or error policy, a malformed row under abort) prints one line on stderr and returns 2; files
    without a single row return 1. With mlperf, the MLPerf-style scores are printed instead of the
    summary, and 1 is returned, with the run counts on stderr, when no arm has enough runs. With
    crossover=ARM, the crossover map of ARM against the baseline is printed (and drawn with plot) instead.
    """
    from maskbench.results import plots  # matplotlib: only once a summary is to be printed or drawn

    paths = list(paths) or [DEFAULT_CSV]
    missing = [path for path in paths if not Path(path).is_file()]
    try:
        if missing:
            raise ValueError(f"no such leaderboard CSV: {', '.join(missing)}")
        if fmt not in stats.FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(stats.FORMATS)}")
        if mlperf and plot:
            raise ValueError("--mlperf prints the MLPerf-style scores only; plot without it")
        if mlperf and crossover:
            raise ValueError("--mlperf and --crossover are different reports: pick one")
        rows = read_rows(paths, on_error)
        if not rows:
            print(f"no leaderboard rows in {', '.join(paths)}", file=sys.stderr)
            return 1
        if mlperf:
            return _print_mlperf(rows, baseline, fmt)
        if crossover:
            return _print_crossover(rows, crossover, baseline, plot)
        summary = stats.summarize(rows, baseline_arm=baseline)
        print(stats.render(summary, fmt))
        if plot:
            print(f"plot written to {plots.plot_leaderboard(summary, plot)}", file=sys.stderr)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _print_mlperf(rows, baseline: str, fmt: str) -> int:
    from maskbench.results.mlperf import MIN_RUNS, mlperf_summary, render_mlperf

    scores, notes = mlperf_summary(rows, baseline_arm=baseline)
    if not scores:
        print(f"--mlperf scores arms with >= {MIN_RUNS} finished runs, the {baseline} baseline among them "
              "(MLPerf's minimum for text-to-image); none here. " + " ".join(notes), file=sys.stderr)
        return 1
    print(render_mlperf(scores, notes, fmt))
    return 0


def _print_crossover(rows, arm: str, baseline: str, plot: str | None) -> int:
    from maskbench.results.crossover import crossover_cells, plot_crossover, render_cells

    cells = crossover_cells(rows, arm=arm, baseline=baseline)
    if not cells:
        print(f"no crossover cells: no seed has both a {arm} and a {baseline} run of the same model, batch size "
              "and budget", file=sys.stderr)
        return 1
    print(render_cells(cells))
    if plot:
        print(f"plot written to {plot_crossover(cells, plot, f'{arm} against {baseline}')}", file=sys.stderr)
    return 0
