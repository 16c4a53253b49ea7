"""`maskbench leaderboard`: read CSVs and the study's plan (`study_plan`), print the per-arm summary and
comparisons, the measured compute multiplier and the fitted compute curves where they passed their check (or,
with --mlperf, the MLPerf-style scores; with --crossover, the crossover map), optionally plot.

The results package is layered so that writers of rows need neither scipy nor matplotlib and the modules
import one way. The CSV format: `rows` (schema, locked appends, typed reads). The statistics: estimators <-
targets <- summary <- multiplier <- scaling, multiplicity <- study_plan <- analysis (and mlperf, crossover).
The rendering: tables, plots, html, and this command, which puts them together.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from maskbench.results.analysis import analyse_rows
from maskbench.results.rows import DEFAULT_CSV, read_rows
from maskbench.results.study_plan import AppliedPlan, applied_plan, with_ladder
from maskbench.results.summary import SIZE_TOLERANCE
from maskbench.results.tables import (
    DETAILS_HINT,
    FORMATS,
    WIDTH,
    render,
    render_multipliers,
    render_scaling,
    render_verdicts,
    wrap_lines,
)


def leaderboard_main(paths: Sequence[str], fmt: str = "table", plot: str | None = None,
                     baseline: str | None = None, on_error: str = "skip", mlperf: bool = False,
                     crossover: str | None = None, plan: str | None = None,
                     allow_size_mismatch: bool = False, details: bool = False) -> int:
    """All of `maskbench leaderboard`: read CSVs, print the summary, optionally plot; the exit code.

    With no paths it reads DEFAULT_CSV. Wrong input (a CSV that does not exist, an unknown format
    or error policy, a malformed row under abort, a malformed plan)
    prints one line on stderr and returns 2, as do files without a single row. The summary and the
    crossover map first say which plan they applied (`plan`, else PLAN.md beside the CSVs), or that there
    is none. With mlperf, the MLPerf-style scores are printed instead of the summary, and 1 is returned,
    with the run counts on stderr, when no arm has enough runs. With crossover=ARM, the crossover map of
    ARM against the baseline is printed (and drawn with plot) instead. Otherwise the compute curves follow
    the summary in table and Markdown formats (`scaling`, under their own heading: CSV stays one table), and
    plot also draws them beside it, to PNG's name with `_fits` (`plots.plot_fits`). Under a plan whose
    "pays" is the compute multiplier, each arm's verdict at B follows last (on stderr beside a CSV).
    The text (fmt "table") fits `tables.WIDTH` columns and ends with a line saying what `details` adds: every
    column, one line a row, as the tables were before they had to fit a terminal.
    """
    from maskbench.results import plots  # matplotlib: only once a summary is to be printed or drawn

    paths = list(paths) or [DEFAULT_CSV]
    missing = [path for path in paths if not Path(path).is_file()]
    try:
        if missing:
            raise ValueError(f"no such leaderboard CSV: {', '.join(missing)}")
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        if mlperf and plot:
            raise ValueError("--mlperf prints the MLPerf-style scores only; plot without it")
        if mlperf and crossover:
            raise ValueError("--mlperf and --crossover are different reports: pick one")
        rows = read_rows(paths, on_error)
        if not rows:  # empty, or not a leaderboard (read_rows said why, line by line): bad input
            raise ValueError(f"no leaderboard rows in {', '.join(paths)}")
        if mlperf:
            return _print_mlperf(rows, baseline or "mask0", fmt)
        applied = applied_plan(rows, paths, plan, baseline)
        rows = with_ladder(rows, applied)
        found, baseline, family = applied.rules, applied.baseline, applied.family
        tolerance = None if allow_size_mismatch else SIZE_TOLERANCE
        if crossover:
            return _print_crossover(rows, crossover, applied, plot, tolerance,
                                    compact=fmt == "table" and not details)
        analysis = analyse_rows(rows, found, baseline, family, fits=fmt != "csv" or bool(plot),
                                size_tolerance=tolerance)
        summary, fits = analysis.summary, analysis.fits
        compact = fmt == "table" and not details
        _print_plan_line(applied.describe(rows, analysis.tests), fmt, compact)
        print(render(summary, fmt, family, details))
        if fmt != "csv" and analysis.measured:
            for found in (analysis.measured, *analysis.also):
                print("\n" + render_multipliers(found, fmt, 1 - family.alpha))
        if fits and fmt != "csv":
            print("\n" + render_scaling(fits, fmt, 1 - family.alpha, details))
        if analysis.verdicts:
            verdicts = render_verdicts(analysis.verdicts, fmt, family, details)
            print(verdicts if fmt == "csv" else "\n" + verdicts, file=sys.stderr if fmt == "csv" else sys.stdout)
        if compact:
            print("\n" + DETAILS_HINT)
        if plot:
            print(f"plot written to {plots.plot_leaderboard(summary, plot)}", file=sys.stderr)
            if fits:
                print(f"plot written to {plots.plot_fits(fits, summary, plot)}", file=sys.stderr)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _print_plan_line(line: str, fmt: str, compact: bool = False) -> None:
    """The line saying which plan was applied: on stderr beside a CSV, so the CSV stays one table; else
    first on stdout, a paragraph of its own (a blank line apart, so Markdown does not read it into a table),
    wrapped to `tables.WIDTH` in compact text."""
    if fmt == "csv":
        print(line, file=sys.stderr)
    else:
        print("\n".join(wrap_lines([line], WIDTH if compact else None)), end="\n\n")


def _print_mlperf(rows, baseline: str, fmt: str) -> int:
    from maskbench.results.mlperf import MIN_RUNS, mlperf_summary, render_mlperf

    scores, notes = mlperf_summary(rows, baseline_arm=baseline)
    if not scores:
        print(f"--mlperf scores arms with >= {MIN_RUNS} finished runs, the {baseline} baseline among them "
              "(MLPerf's minimum for text-to-image); none here. " + " ".join(notes), file=sys.stderr)
        return 1
    print(render_mlperf(scores, notes, fmt))
    return 0


def _print_crossover(rows, arm: str, applied: AppliedPlan, plot: str | None, size_tolerance: float | None,
                     compact: bool) -> int:
    from maskbench.results.crossover import correct_cells, crossover_cells, plot_crossover, render_cells

    baseline, family = applied.baseline, applied.family
    measured = sorted({row["arm"] for row in rows if not row["source"]})
    if arm not in measured:  # a typo, not an empty map: bad input
        raise ValueError(f"--crossover {arm}: no such arm in these rows; they have {', '.join(measured)}")
    cells = crossover_cells(rows, arm=arm, baseline=baseline, metrics=family.compared(), level=1 - family.alpha,
                            size_tolerance=size_tolerance)
    if not cells:
        print(f"no crossover cells: no seed has both a {arm} and a {baseline} run of the same model, batch size "
              "and budget", file=sys.stderr)
        return 1
    cells, tests = correct_cells(cells, family)
    _print_plan_line(applied.describe(rows, tests), "table" if compact else "markdown", compact)
    print(render_cells(cells, family, compact))
    if compact:
        print("\n" + DETAILS_HINT)
    if plot:
        print(f"plot written to {plot_crossover(cells, plot, f'{arm} against {baseline}')}", file=sys.stderr)
    return 0
