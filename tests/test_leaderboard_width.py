"""`maskbench leaderboard`'s text fits 120 columns by default, every column is behind --details, and
Markdown does not depend on it: on the committed powered study (five seeds, Holm, FLOPs ratios tested) and
fair study (one seed, the compute-multiplier verdict)."""

import re

import pytest

from maskbench.cli import main as cli_main
from maskbench.results.leaderboard import read_rows
from maskbench.results.report import applied_plan, leaderboard_main
from maskbench.results.summary import summarize
from maskbench.results.tables import DETAILS_HINT, WIDTH, short_verdict

POWERED, FAIR = "results/powered/leaderboard.csv", "results/fair/leaderboard.csv"


def printed(capsys, path: str, fmt: str = "table", details: bool = False) -> str:
    assert leaderboard_main([path], fmt, details=details) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("path", [POWERED, FAIR])
def test_the_default_text_fits_120_columns_and_says_where_the_rest_is(path, capsys):
    out = printed(capsys, path)
    assert max(len(line) for line in out.splitlines()) <= WIDTH
    assert out.rstrip().splitlines()[-1] == DETAILS_HINT
    assert "synth/micro_s/b64/" in out and "(FD features: oracle-synth-v1)" in out  # the group is a heading
    assert not re.search(r"^dataset +model", out, re.MULTILINE)


def test_the_powered_studys_verdicts_and_intervals_are_all_there(capsys):
    out = printed(capsys, POWERED)
    rows = read_rows([POWERED])
    _, _, family = applied_plan(rows, [POWERED], None, None)
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
    assert "disagree: synth/micro_s/b64/4e+13 mask75 at the final point: FD no difference detected" in out
    assert "device-h ratio" not in out and "MDE  " not in out


def test_the_fair_studys_verdict_words_survive_the_narrowing(capsys):
    out = printed(capsys, FAIR)
    assert "not tested (one run a side); |Δ| 6.93 SE: detected against eval noise only" in out
    assert ">0.998 (1/1 not reached)" in out and "FD (eval SE)" in out
    assert "synth/micro_s/b64/3.2e+13: T1, the difference at B" in out
    assert re.search(r"^mask75_then0 +fid +3\.156 +undecided +no held-out check +undecided$", out, re.MULTILINE)
    verdicts = [line for line in out.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 2 and all(": undecided: " in line for line in verdicts)
    assert "  difference at B is higher, against M;" in out  # the verdict's reasons wrap, indented, not cut


def test_details_prints_every_column_on_one_line_a_row(capsys):
    out = printed(capsys, POWERED, details=True)
    header = next(line for line in out.splitlines() if line.startswith("dataset  model    batch  budget  arm  "))
    assert "FD features" in header
    assert all(column in out for column in ("device-h ratio", "MDE", "eval/seed SE", "FD p adj", "metrics"))
    assert "(pooled over a rising curve: 1/5)" in out and DETAILS_HINT not in out
    assert max(len(line) for line in out.splitlines()) > 1000  # the notes, each on one line
    fair = printed(capsys, FAIR, details=True)
    assert re.search(r"^group +arm +metric +Δ at B", fair, re.MULTILINE)


@pytest.mark.parametrize("path", [POWERED, FAIR])
def test_markdown_and_csv_do_not_depend_on_details(path, capsys):
    for fmt in ("markdown", "csv"):
        assert printed(capsys, path, fmt) == printed(capsys, path, fmt, details=True)


def test_the_cli_passes_details_and_documents_it(capsys):
    assert cli_main(["leaderboard", FAIR, "--details"]) == 0
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
