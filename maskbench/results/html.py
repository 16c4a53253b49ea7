"""`maskbench leaderboard --html DIR`: one self-contained page per study, for people to read.

A study is the rows of the leaderboard CSVs in one folder (`results/<study>/`); its page is
DIR/<study>/report.html. It opens with one sentence generated from the verdicts (`headline`: the plan's
verdict per arm at B under a compute-multiplier plan, else "pays" at the baseline's last horizon), never
typed. It holds what the text report prints, in the same words and numbers (the plan line, `tables.render`'s
tables and notes, cell for cell, the plan's verdict (`tables.render_verdicts`) where it reads the compute
multiplier, and the compute curves (`tables.render_scaling`) with their fits drawn (`plots.plot_fits`) where
a group has them), each group's curves of every measured metric against FLOPs and GPU-hours with their error
bars (`plots.group_curves`), and each arm's final sample grid side by side: the prompts and their noise are fixed by the eval config, never by the arm or
the seed, so the grids show the same prompts. A grid is read from its run directory (RUNS/<run_id>/);
committed CSVs travel without them, so the page then says in one line which grids are missing.
Everything is embedded (PNGs as base64 data URIs, the style inline): the file can be mailed or committed.
"""

from __future__ import annotations

import base64
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from maskbench import __version__
from maskbench.config import PathsConfig
from maskbench.eval.grid import GRID_FILE
from maskbench.results import plots
from maskbench.results.analysis import analyse_rows
from maskbench.results.multiplicity import ArmVerdict, Family
from maskbench.results.multiplier import ArmMultiplier
from maskbench.results.rows import Row, read_rows
from maskbench.results.scaling import GroupFit
from maskbench.results.study_plan import applied_plan, with_ladder
from maskbench.results.summary import SIZE_TOLERANCE, Summary, measured_groups
from maskbench.results.tables import (
    group_label,
    headline,
    ratio_headline,
    render,
    render_multipliers,
    render_scaling,
    render_verdicts,
)
from maskbench.train.checkpoint import RunDir

PAGE = "report.html"
STYLE = """
body { font-family: sans-serif; margin: 1.5em; max-width: 110em; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.4em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.good { background: #dff0d8; } td.bad { background: #f2dede; }
.scroll { overflow-x: auto; }
img { max-width: 100%; } .scroll img { max-width: none; }
p.missing { color: #a94442; }
p.headline { font-size: 1.15em; font-weight: bold; }
"""
GOOD, BAD = frozenset({"better", "pays"}), frozenset({"worse", "does not pay"})


@dataclass
class StudyPage:
    """A study's rows and what `maskbench leaderboard` makes of them."""
    name: str
    paths: list[str]
    rows: list[Row]
    plan_line: str
    family: Family
    baseline: str
    summary: list[Summary]
    measured: list[ArmMultiplier] = field(default_factory=list)
    fits: list[GroupFit] = field(default_factory=list)
    verdicts: list[ArmVerdict] = field(default_factory=list)

    @property
    def headline(self) -> str:
        """One sentence from the verdicts: the plan's verdict per arm at B (compute multiplier), else "pays"
        on the compute-to-target ratio at the baseline's last horizon."""
        return (headline(self.verdicts) or ratio_headline(self.summary, self.family)
                or f"No arm of these rows has a comparison with {self.baseline}: no verdict.")


def analyse(name: str, paths: Sequence[str], plan: str | None, baseline: str | None, on_error: str,
            size_tolerance: float | None = SIZE_TOLERANCE) -> StudyPage:
    """The rows, plan, family, corrected summary, compute curves and verdicts, found as
    `leaderboard.leaderboard_main` finds them (`analysis.analyse_rows`)."""
    rows = read_rows(paths, on_error)
    if not rows:
        raise ValueError(f"no leaderboard rows in {', '.join(paths)}")
    applied = applied_plan(rows, paths, plan, baseline)
    rows = with_ladder(rows, applied)
    analysis = analyse_rows(rows, applied.rules, applied.baseline, applied.family, size_tolerance=size_tolerance)
    return StudyPage(name, list(paths), rows, applied.describe(rows, analysis.tests), applied.family,
                     applied.baseline, analysis.summary, analysis.measured, analysis.fits, analysis.verdicts)


def studies(paths: Sequence[str]) -> dict[str, list[str]]:
    """The CSVs by study: the name of the folder they sit in."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        found[Path(path).resolve().parent.name].append(path)
    return dict(found)


def html_main(paths: Sequence[str], out_dir: str, runs: str | None, plan: str | None, baseline: str | None,
              on_error: str, allow_size_mismatch: bool = False) -> int:
    """Write DIR/<study>/report.html for each study among the CSVs; the exit code (2 and one line on bad input)."""
    runs_root = Path(runs or PathsConfig().runs)
    try:
        for name, study_paths in studies(paths).items():
            out = Path(out_dir) / name / PAGE
            out.parent.mkdir(parents=True, exist_ok=True)
            study = analyse(name, study_paths, plan, baseline, on_error,
                            None if allow_size_mismatch else SIZE_TOLERANCE)
            out.write_text(study_page(study, runs_root), encoding="utf-8")
            print(f"study page written to {out}", file=sys.stderr)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def study_page(study: StudyPage, runs: Path) -> str:
    """The whole page of one study, as one string of HTML."""
    title = f"maskbench study: {study.name}"
    head = (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{escape(title)}</title>\n"
            f"<style>{STYLE}</style>\n</head>\n<body>\n<h1>{escape(title)}</h1>\n")
    source = (f"<p>{len(study.rows)} rows from {escape(', '.join(study.paths))}; written by maskbench "
              f"{__version__} (<code>maskbench leaderboard --html</code>).</p>\n")
    parts = [head, f"<p class=\"headline\">{escape(study.headline)}</p>\n", source,
             f"<p>{escape(study.plan_line)}</p>\n",
             "<h2>Verdicts</h2>\n", verdict_html(render(study.summary, "markdown", study.family))]
    if study.verdicts:
        parts += ["<h2>The plan's verdict</h2>\n", verdict_html(render_verdicts(study.verdicts, "markdown",
                                                                                   study.family))]
    if study.measured:
        parts += ["<h2>The measured compute multiplier</h2>\n",
                  verdict_html(render_multipliers(study.measured, "markdown", 1 - study.family.alpha))]
    if study.fits:
        parts += ["<h2>Compute curves (exploratory)</h2>\n", fits_html(study)]
    parts += ["<h2>Curves</h2>\n", curves_html(study), "<h2>Final samples</h2>\n", grids_html(study, runs),
              "</body>\n</html>\n"]
    return "".join(parts)


def fits_html(study: StudyPage) -> str:
    """The compute curves block (`tables.render_scaling`, as the text report prints it) and their fits drawn
    (`plots.plot_fits`)."""
    with tempfile.TemporaryDirectory() as tmp:
        png = plots.plot_fits(study.fits, study.summary, Path(tmp) / "curves.png").read_bytes()
    return (verdict_html(render_scaling(study.fits, "markdown", 1 - study.family.alpha))
            + f"{_img(png, 'compute curves with their fits')}\n")


def verdict_html(markdown: str) -> str:
    """`tables.render`'s Markdown (titles, pipe tables, '- ' notes) as HTML, cell for cell."""
    out, table, notes = [], [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("| "):
            cells = [cell.replace("\\|", "|") for cell in line[2:-2].split(" | ")]  # render escapes | in cells
            if any(cell != "---" for cell in cells):
                table.append(cells)
            continue
        if table:
            out.append(_table(table[0], table[1:]))
            table = []
        if line.startswith("- "):
            notes.append(f"<li>{escape(line[2:])}</li>")
        elif line:
            out.append(f"<h3>{escape(line)}</h3>\n")
    return "".join(out) + (f"<ul>\n{''.join(notes)}\n</ul>\n" if notes else "")


def _table(header: list[str], rows: list[list[str]]) -> str:
    """An HTML table; verdict words that decide (better, worse, pays, does not pay) are shaded."""
    def td(cell: str) -> str:
        shade = " class=\"good\"" if cell in GOOD else " class=\"bad\"" if cell in BAD else ""
        return f"<td{shade}>{escape(cell)}</td>"

    head = "".join(f"<th>{escape(cell)}</th>" for cell in header)
    body = "".join(f"<tr>{''.join(td(cell) for cell in row)}</tr>\n" for row in rows)
    return f"<div class=\"scroll\"><table>\n<tr>{head}</tr>\n{body}</table></div>\n"


def curves_html(study: StudyPage) -> str:
    """Per group, its curves (`plots.group_curves`) at the plan's confidence level."""
    pngs = plots.group_curves(study.summary, level=1 - study.family.alpha)
    if not pngs:
        return "<p>No measured rows to draw.</p>\n"
    return "".join(f"<h3>{escape(group_label(*group))}</h3>\n"
                   f"{_img(png, 'curves of ' + group_label(*group))}\n" for group, png in pngs.items())


@dataclass(frozen=True)
class FinalGrid:
    """Where the grid of an arm's run at its final eval point is, if its run directory is here."""
    arm: str
    seed: int
    run_id: str
    point: float
    path: Path


def final_grids(rows: Sequence[Row], runs: Path, baseline: str) -> dict[tuple, list[FinalGrid]]:
    """Per group (`summary.measured_groups`), per arm (the baseline first), its lowest seed's run at that run's
    last eval point in the rows."""
    grids = {}
    for group, group_rows in measured_groups(rows).items():
        by_arm: dict[str, list[Row]] = defaultdict(list)
        for row in group_rows:
            by_arm[row["arm"]].append(row)
        grids[group] = []
        for arm in sorted(by_arm, key=lambda arm: (arm != baseline, arm)):
            row = min(by_arm[arm], key=lambda row: (row["seed"], -row["point"], row["run_id"]))
            path = RunDir(runs / row["run_id"]).point_samples(row["point"]) / GRID_FILE
            grids[group].append(FinalGrid(arm, row["seed"], row["run_id"], row["point"], path))
    return grids


def grids_html(study: StudyPage, runs: Path) -> str:
    """Per group, its arms' final grids side by side, and one line naming the grids that are not here."""
    out, missing = [], []
    for group, grids in final_grids(study.rows, runs, study.baseline).items():
        present = [grid for grid in grids if grid.path.is_file()]
        missing += [grid for grid in grids if not grid.path.is_file()]
        if not present:
            continue
        head = "".join(f"<th>{escape(grid.arm)} (seed {grid.seed}, point {grid.point:g})</th>" for grid in present)
        cells = "".join(f"<td>{_img(grid.path.read_bytes(), f'{grid.arm} samples')}</td>" for grid in present)
        out.append(f"<h3>{escape(group_label(*group))}</h3>\n"
                   f"<div class=\"scroll\"><table>\n<tr>{head}</tr>\n<tr>{cells}</tr>\n</table></div>\n")
    if missing:
        names = ", ".join(str(grid.path) for grid in missing)
        out.append(f"<p class=\"missing\">Grids missing ({len(missing)}; their run directories are not under "
                   f"{escape(str(runs))}): {escape(names)}</p>\n")
    return "".join(out)


def _img(png: bytes, alt: str) -> str:
    """A PNG embedded in the page."""
    return f"<img src=\"data:image/png;base64,{base64.b64encode(png).decode('ascii')}\" alt=\"{escape(alt)}\">"
