"""Every table of README.md and docs/*.md that reads a committed CSV is generated (`tools/doctables.py`):
regenerated here from its CSVs, it must equal the committed text, so a table typed by hand or left behind by
its rows fails."""

import re
from pathlib import Path

import pytest

from tools import doctables
from tools.doctables import ROOT, TABLES, check, documents, generated, main, marked, write

MARKED = [table for path in documents(ROOT) for table in marked(path)]


@pytest.mark.parametrize("table", MARKED, ids=lambda t: f"{t.path.name}:{t.name}")
def test_a_committed_table_is_what_its_csvs_give(table):
    assert table.name in TABLES, f"{table.path}:{table.line}: no generated table named {table.name!r}"
    assert table.text == generated(table.name), (
        f"{table.path.relative_to(ROOT)}:{table.line}: table {table.name!r} is stale: run "
        "`python -m tools.doctables --write`")


def test_every_generated_table_is_marked_once_and_the_check_passes():
    names = [table.name for table in MARKED]
    assert sorted(names) == sorted(TABLES)
    assert check(ROOT) == []
    assert main(["--root", str(ROOT)]) == 0


def test_the_tables_say_what_their_intervals_allow():
    """The readings issue 35 found typed wrong: a seed that never reached the target is a lower bound, a ratio
    read over a rising curve is flagged, a gap under 2 combined sampling errors is not detected."""
    lsc = next(line for line in generated("tiny-literature").splitlines() if line.startswith("| `lsc_mask75_then0`"))
    assert "> 0.69 (1 of 2 not reached)" in lsc and "> 1.10 (1 of 2 not reached)" in lsc
    first_look = {line.split(" | ")[0]: line for line in generated("literature-first-look").splitlines()}
    assert "0.74 (pooled over a rising curve)" in first_look["| `tread50`"]
    assert "(0.13 SE: not detected)" in first_look["| `tread50`"]
    assert "(1.66 SE: not detected)" in first_look["| `sprint75`"]
    mission = generated("tiny-mission")
    assert "| 0.54 [0.13, 2.28] | 0.67 [0.09, 4.75] |" in mission
    design = generated("crossover-design").splitlines()[-1]
    assert design.startswith("| 3 | 36 | 12 / 12 / 12 |") and "| 30 |" in design


def fixture_root(tmp_path: Path, body: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "arm_step_time.csv").write_bytes((ROOT / "results" / "arm_step_time.csv").read_bytes())
    (tmp_path / "README.md").write_text("# a readme\n")
    (tmp_path / "docs" / "page.md").write_text(f"# page\n\nbefore\n\n{body}\nafter\n")
    return tmp_path


def test_a_stale_table_fails_the_check_and_write_makes_it_current(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(doctables, "TABLES", {"arm-step-time": TABLES["arm-step-time"]})
    root = fixture_root(tmp_path, "<!-- table: arm-step-time -->\n| arm | typed by hand |\n<!-- /table -->\n")
    (problem,) = check(root)
    assert "docs/page.md:5: table 'arm-step-time' differs from what results/arm_step_time.csv give" in problem
    assert main(["--root", str(root)]) == 1 and "--write" in capsys.readouterr().err
    assert write(root) == [root / "docs" / "page.md"]
    text = (root / "docs" / "page.md").read_text()
    assert text.startswith("# page\n\nbefore\n\n<!-- table: arm-step-time -->\n\n| arm | mask ratio of the step |")
    assert text.endswith("| `sprint75` | 0 | 1,875,824 | 0.353 | 28.5 | 1.04 |\n\n<!-- /table -->\n\nafter\n")
    assert check(root) == [] and write(root) == []  # current: written once, unchanged after


def test_an_unknown_or_unclosed_or_missing_table_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(doctables, "TABLES", {"arm-step-time": TABLES["arm-step-time"]})
    root = fixture_root(tmp_path, "<!-- table: no-such-table -->\n<!-- /table -->\n")
    assert check(root) == ["docs/page.md:5: no generated table named 'no-such-table'",
                           "table 'arm-step-time' is marked nowhere in README.md or docs/"]
    (root / "docs" / "page.md").write_text("<!-- table: arm-step-time -->\n| a |\n")
    assert main(["--root", str(root)]) == 2
    assert "table 'arm-step-time' has no <!-- /table --> line" in capsys.readouterr().err


def fair_root(tmp_path: Path, rows: list[dict], ladder: list[dict] | None = None) -> Path:
    """A repository root holding a fair study of 2 arms x 3 seeds at 1/32 ... 1 of B: its grid, the committed
    fair plan and `rows` as its CSV; and its ladder's grid (mask0 x 3 seeds to 4 B) with `ladder` as its CSV
    (`tests.test_scaling.ladder_rows`)."""
    from maskbench.results.rows import append_rows

    (tmp_path / "maskbench" / "conf" / "study").mkdir(parents=True)
    (tmp_path / "maskbench" / "conf" / "study" / "fair.yaml").write_text(
        "grid:\n  - arm=mask0,mask75\n  - seed=0,1,2\n  - eval.points=[0.03125,0.0625,0.125,0.25,0.5,1.0]\n")
    (tmp_path / "maskbench" / "conf" / "study" / "fair_ladder.yaml").write_text(
        "grid:\n  - arm=mask0\n  - seed=0,1,2\n"
        "  - eval.points=[0.0078125,0.015625,0.03125,0.0625,0.125,0.25,0.5,1.0]\n")
    (tmp_path / "results" / "fair").mkdir(parents=True)
    (tmp_path / "results" / "fair" / "PLAN.md").write_bytes((ROOT / "results" / "fair" / "PLAN.md").read_bytes())
    if rows:
        append_rows(tmp_path / "results" / "fair" / "leaderboard.csv", rows)
    if ladder:
        append_rows(tmp_path / "results" / "fair" / "ladder.csv", ladder)
    return tmp_path


def ladders(rng) -> list[dict]:
    """mask0's ladder of each of 3 seeds to 4 B, on its true curve (no scatter: the ladder check holds)."""
    from tests.test_scaling import ladder_rows

    return [dict(row, created_at="2026-12-07T00:00:00+00:00") for seed in range(3)
            for row in ladder_rows(seed, 0.0, rng)]


def test_a_study_before_its_first_row_shows_every_cell_waiting(tmp_path):
    """A study whose CSV does not exist yet (it started, no cell has finished a horizon) has its progress table,
    every cell '–', and its answer says how many cells are in; neither fails on the missing file."""
    root = fair_root(tmp_path, [])
    progress = doctables.study_progress(root, "fair", doctables.FAIR)
    assert "| `mask75` | – | – | – |" in progress and progress.endswith("0 of 6 cells finished.")
    assert doctables.fair_headline(root).startswith("Not read yet: 0 of 6 cells are in")


def test_the_fair_answer_is_read_only_when_every_cell_is_in_and_then_by_the_plans_rule(tmp_path):
    """Until the last cell's last horizon lands, both answer tables say how many cells are in and nothing else;
    then the headline gives each arm's verdict by the committed plan's rule (FD and validation loss, M(B), the
    held-out check) and the full table adds every horizon and the compute curves."""
    import numpy as np

    from tests.test_scaling import TRUTH, curve_rows

    rng = np.random.default_rng(0)
    after_the_plan = "2026-12-04T00:00:00+00:00"
    rows = [row for seed in range(3) for arm, (a, e) in TRUTH.items()
            for row in curve_rows(arm, seed, a, e, 0.01, rng, created_at=after_the_plan)]
    partial = fair_root(tmp_path / "partial", rows[:-1], ladders(rng))
    fair_answer = TABLES["fair-answer"].render
    for render in (doctables.fair_headline, fair_answer):
        assert render(partial) == ("Not read yet: 5 of 6 cells are in, and results/fair/PLAN.md reads nothing "
                                   "before every cell is.")
    short = fair_root(tmp_path / "short", rows, ladders(rng)[:-1])  # the ladder's last seed without its 4 B
    assert doctables.fair_headline(short).startswith("Not read yet: the baseline's ladder "
                                                     "(`results/fair/ladder.csv`, `mask0` to 4 B) has 2 of 3 seeds in")
    complete = fair_root(tmp_path / "complete", rows, ladders(rng))
    headline = doctables.fair_headline(complete)
    assert headline.startswith("By the plan's rule (") and "mask75" in headline and "Not read yet" not in headline
    assert "docs/studies.md#where-the-answer-stands" in headline  # the verdict table lives in the answer
    # TRUTH gives mask75 the flatter curve: mask0 needs (0.30/0.22)^(1/0.6) · (C/B)^-0.25 × its FLOPs, an M
    # that falls from about 4.0 at 1/32 of B to 1.68 at B, on FD (1000 × the loss) as on val loss
    for label in ("FD", "val loss"):
        trend = re.search(rf"^- {label}: M from 1/32 of B to B: `mask75` ([\d.]+) → ([\d.]+); M rises with "
                          r"compute for 0 of 1 arms and falls for 1 ", headline, re.MULTILINE)
        assert trend and float(trend[1]) == pytest.approx(3.99, rel=0.1)
        assert float(trend[2]) == pytest.approx(1.68, rel=0.1)
    answer = fair_answer(complete)
    assert "| arm | E (95% CI) | A (95% CI) | α (95% CI) |" in answer and "crossover C*" in answer  # check held
    assert "| horizon | C | M mask0 (95% CI) | M mask75 (95% CI) |" in answer  # the measured M (mask0: a check)
    crossover = r"(\d\.\d+e\+\d+ \[.*\]|none within 10× of B \(\d of 3 seeds cross there\))"
    assert len(re.findall(rf"^\| mask75 \| .* \| {crossover} \|$", answer, re.MULTILINE)) == 2  # FD, val loss
    assert answer.startswith("plan results/fair/PLAN.md (fair): ")  # the same text in any checkout
    assert "| M(B) (95% CI) |" in answer and answer.count("mask75") > headline.count("mask75")


def test_a_comparison_against_another_baseline_is_read_exploratory_and_only_when_every_cell_is_in(tmp_path):
    """The literature study's repa against repa_random (its plan: exploratory) is read as `maskbench leaderboard
    CSV --baseline repa_random` reads it: the plan set aside, no verdict, the two arms only; and, like the
    planned reading, not before every cell of the study is in. Here: mask75 against mask0 as the baseline."""
    import numpy as np

    from tests.test_scaling import TRUTH, curve_rows

    rng = np.random.default_rng(0)
    rows = [row for seed in range(3) for arm, (a, e) in TRUTH.items()
            for row in curve_rows(arm, seed, a, e, 0.01, rng, created_at="2026-12-04T00:00:00+00:00")]
    against = dict(study="fair", csv_path=doctables.FAIR, baseline="mask75", arms=("mask0", "mask75"))
    partial = fair_root(tmp_path / "partial", rows[:-1], ladders(rng))
    assert doctables.study_answer(partial, **against).startswith("Not read yet: 5 of 6 cells are in")
    answer = doctables.study_answer(fair_root(tmp_path / "complete", rows, ladders(rng)), **against)
    assert answer.startswith("plan results/fair/PLAN.md (fair) set aside: its baseline is mask0, and against "
                             "--baseline mask75 every reading is exploratory")
    assert "confirmatory" not in answer and "The plan's verdict at B" not in answer  # no plan's rule
    compared = [line for line in answer.splitlines() if "| paired | 3 pairs |" in line]
    assert [line.split(" | ")[4:6] for line in compared] == [["mask0", "fid"], ["mask0", "val_loss"]]
    assert all(line.endswith("| exploratory |") for line in compared)


def test_the_literature_mask0_is_set_against_the_fair_studys_in_combined_sampling_errors(tmp_path):
    """The plan's reproducibility check: each of the literature study's `mask0` rows beside the fair study's of
    the same seed and horizon, the difference over the two rows' errors in quadrature; rows without a partner
    (another seed, another arm) are not shown."""
    from maskbench.results.rows import append_rows
    from tests.test_scaling import curve_rows

    fair = curve_rows("mask0", 0, 0.30, 0.60)
    here = curve_rows("mask0", 0, 0.30, 0.60, scale={1.0: 1.01}) + curve_rows("mask0", 5, 0.30, 0.60) + \
        curve_rows("tread50", 0, 0.30, 0.60)
    rerun = [dict(here[5], val_loss=here[5]["val_loss"] + 1e-12)]   # a rerun of seed 0 at B, one rounding off
    for study, rows in (("fair", fair), ("literature", here), ("literature/seed1_check", rerun)):
        (tmp_path / "results" / study).mkdir(parents=True)
        append_rows(tmp_path / "results" / study / "leaderboard.csv", rows)
    table, rerun_line = doctables.literature_mask0_reproduced(tmp_path).split("\n\n")
    assert "seed 0 at 1 of B" in rerun_line and "bit for bit" not in rerun_line  # any difference is named
    lines = table.splitlines()[2:]
    assert len(lines) == 6 and all(line.startswith("| 0 | ") for line in lines)  # seed 0's six horizons only
    assert "(+0.00 SE)" in lines[0] and "(−0.00 SE)" not in lines[0]
    # at B the loss is 1% higher: 0.01·truth over (0.01·truth)·√2 = 0.71 SE, and FD likewise
    assert lines[-1].startswith("| 0 | 1 | ") and lines[-1].count("(+0.71 SE)") == 2


def test_the_trajectory_table_reads_its_csv_and_marks_a_step_a_run_never_reached(tmp_path):
    """Each run's row of results/literature/trajectories.csv, as `python -m maskbench.results.trajectory` wrote it;
    a step past the run's end is '–', not 0."""
    import io

    from maskbench.results.trajectory import Trajectory, write_csv

    short = Trajectory("mask0", 2, "r", 164, 221.3, 36, 10.17, None, None, 0.8205, None, None, 0.6834)
    out = io.StringIO()
    write_csv([short], out)
    (tmp_path / "results" / "literature").mkdir(parents=True)
    (tmp_path / doctables.TRAJECTORIES).write_text(out.getvalue())
    row = doctables.literature_trajectories(tmp_path).splitlines()[2]
    assert row == "| `mask0` | 2 | 221 (36) | 10.2 / – / – | 0.821 / – / – | 0.683 |"
