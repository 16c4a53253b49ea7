"""`maskbench leaderboard`'s text fits 120 columns by default, every column is behind --details, and
Markdown does not depend on it: on the committed powered study (five seeds, Holm, FLOPs ratios tested) and
fair study's first two cells (one seed, the compute-multiplier verdict)."""

import csv
import re
from pathlib import Path

import pytest

from maskbench.cli import main as cli_main
from maskbench.results.leaderboard import leaderboard_main
from maskbench.results.rows import read_rows
from maskbench.results.study_plan import applied_plan
from maskbench.results.summary import summarize
from maskbench.results.tables import DETAILS_HINT, WIDTH, short_verdict

POWERED = "results/powered/leaderboard.csv"
# The fair study's first two cells (mask0 and mask75, seed 0): finished, so their rows never change while the study
# appends the rest to its CSV.
FAIR_RUNS = ("mask0-synth-micro_s-s0-fd76a2d4", "mask75-synth-micro_s-s0-9abf85bb")


@pytest.fixture(scope="module")
def fair(tmp_path_factory) -> str:
    """A CSV of the fair study's FAIR_RUNS rows, with its PLAN.md beside it (the plan the leaderboard applies), less
    the line naming its ladder: these rows are read on their own `mask0` run, as without a ladder."""
    folder = tmp_path_factory.mktemp("fair")
    with open("results/fair/leaderboard.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = [row for row in reader if row["run_id"] in FAIR_RUNS]
    assert len(rows) == 8  # four horizons each
    with open(folder / "leaderboard.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=reader.fieldnames)
        writer.writeheader()
        writer.writerows(rows)
    plan = Path("results/fair/PLAN.md").read_text(encoding="utf-8").splitlines(keepends=True)
    (folder / "PLAN.md").write_text("".join(line for line in plan if not line.startswith("ladder:")), encoding="utf-8")
    return str(folder / "leaderboard.csv")


@pytest.fixture(params=["powered", "fair"])
def study(request) -> str:
    """Each committed study's CSV in turn."""
    return POWERED if request.param == "powered" else request.getfixturevalue("fair")


def printed(capsys, path: str, fmt: str = "table", details: bool = False) -> str:
    assert leaderboard_main([path], fmt, details=details) == 0
    return capsys.readouterr().out


def test_the_default_text_fits_120_columns_and_says_where_the_rest_is(study, capsys):
    out = printed(capsys, study)
    assert max(len(line) for line in out.splitlines()) <= WIDTH
    assert out.rstrip().splitlines()[-1] == DETAILS_HINT
    assert "synth/micro_s/b64/" in out and "(FD features: oracle-synth-v1)" in out  # the group is a heading
    assert not re.search(r"^dataset +model", out, re.MULTILINE)


def test_the_powered_studys_verdicts_and_intervals_are_all_there(capsys):
    out = printed(capsys, POWERED)
    rows = read_rows([POWERED])
    family = applied_plan(rows, [POWERED], None, None).family
    compared = [r for r in summarize(rows, "mask0", family.compared()) if r.comparisons]
    assert {r.arm for r in compared} == {"mask75", "mask75_then0"}
    for arm in ("mask0", "mask75", "mask75_then0"):
        assert re.search(rf"^{arm} ", out, re.MULTILINE)
    assert re.search(r"^mask75 +val_loss .* better$", out, re.MULTILINE)
    assert "no difference detected after holm (uncorrected: better)" in out
    assert re.search(r"^mask75_then0 +fid .* no difference detected$", out, re.MULTILINE)
    for record in compared:  # each difference's interval, and each FLOPs ratio's, with its bound and misses
        for c in record.comparisons.values():
            d = c.difference
            assert f"{d.mean:.4g} [{d.lo:.3g}, {d.hi:.3g}]" in out
            for t in c.targets:
                r = t.ratios["train_flops"]
                assert f"{r.bound}{r.geomean:.3f} [{r.lo:.3g}, {r.hi:.3g}]" in out
    assert ">0.862 [0.734, 1.01] (1/5 not reached)" in out and "†1/5" in out and "†k/n: pooled over a rising" in out
    assert "disagree: synth/micro_s/b64/4e+13 mask75" not in out  # FD nothing detected, val loss better: partly
    assert "device-h ratio" not in out and "MDE  " not in out


def test_the_fair_studys_verdict_words_survive_the_narrowing(fair, capsys):
    out = printed(capsys, fair)
    assert "not tested (one run a side); |Δ| 6.93 SE: detected against eval noise only" in out
    assert re.search(r"^0\.125 +3\.99e\+12 +1\.722$", out, re.MULTILINE) and "FD (eval SE)" in out  # the measured M
    assert "synth/micro_s/b64/3.2e+13: T1, the difference at B" in out
    assert re.search(r"^mask75 +fid +>1\.000 \(1/1 past the ladder\) +past the ladder +undecided$", out, re.MULTILINE)
    verdicts = [line for line in out.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 1 and ": undecided: " in verdicts[0]
    assert "\n  least 1: past the ladder; val loss:" in out  # the reasons wrap, indented, not cut


def test_details_prints_every_column_on_one_line_a_row(capsys, request):
    out = printed(capsys, POWERED, details=True)
    header = next(line for line in out.splitlines() if line.startswith("dataset  model    batch  budget  arm  "))
    assert "FD features" in header
    assert all(column in out for column in ("device-h ratio", "MDE", "eval/seed SE", "FD p adj", "metrics"))
    assert "(pooled over a rising curve: 1/5)" in out and DETAILS_HINT not in out
    assert max(len(line) for line in out.splitlines()) > 1000  # the notes, each on one line
    fair = printed(capsys, request.getfixturevalue("fair"), details=True)
    assert re.search(r"^group +arm +metric +Δ at B", fair, re.MULTILINE)


def test_markdown_and_csv_do_not_depend_on_details(study, capsys):
    for fmt in ("markdown", "csv"):
        assert printed(capsys, study, fmt) == printed(capsys, study, fmt, details=True)


def test_the_cli_passes_details_and_documents_it(fair, capsys):
    assert cli_main(["leaderboard", fair, "--details"]) == 0
    assert "eval/seed SE" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["leaderboard", "--help"])
    assert "--details" in capsys.readouterr().out


@pytest.mark.parametrize(("verdict", "short"), [
    ("better", "better"),
    ("no difference detected; an effect larger than 877 would have been detected", "no difference detected"),
    ("no difference detected after holm (uncorrected: better); an effect larger than 877 would have been detected",
     "no difference detected after holm (uncorrected: better)"),
    ("not detected: |Δ| 1.02 is under 2 combined sampling errors (1.41); the test alone: better",
     "not detected: |Δ| under 2 SE; the test alone: better"),
    ("not tested: no interval from fewer than 2 runs; |Δ| is 1.66 combined sampling errors: not detected",
     "not tested (one run a side); |Δ| 1.66 SE: not detected"),
    ("inconclusive: zero spread over seeds, so no interval width and no p", "inconclusive: zero spread, no p"),
])
def test_a_short_verdict_keeps_its_words(verdict, short):
    assert short_verdict(verdict) == short
