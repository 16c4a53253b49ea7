"""What a reading may claim from its intervals: a compute-to-target ratio read where an arm's monotone fit
pooled a stretch over which its measured curve rose is flagged as such, and a gap under 2 combined sampling
errors is "not detected", under every rule (one run a side too, and under a compute-to-target plan)."""

import pytest

from maskbench.results.analysis import analyse_rows
from maskbench.results.multiplicity import EXPLORATORY
from maskbench.results.rows import append_rows, read_rows
from maskbench.results.summary import summarize
from maskbench.results.tables import render
from maskbench.results.targets import reached_on_pooled

BUDGET = 1e13
POINTS = (0.25, 0.5, 0.75, 1.0)
# The literature study's seed 0 on `tiny` (results/literature/first_look/leaderboard.csv): mask0's and tread50's FD and
# val loss at the four horizons, with each row's sampling error.
MASK0_FD = ((77787, 776), (37149, 834), (15109, 612), (10635, 933))
TREAD_FD = ((43014, 616), (27909, 685), (9277, 855), (10419, 1306))
MASK0_LOSS = ((1.0497, 0.00301), (0.30757, 0.00564), (0.22796, 0.00484), (0.19278, 0.00425))
SPRINT_LOSS = ((0.86331, 0.00413), (0.28421, 0.00549), (0.21871, 0.00458), (0.18322, 0.00390))


def rows(arm: str, fd, loss, seed: int = 0, shift: float = 0.0) -> list[dict]:
    return [{"run_id": f"{arm}-s{seed}", "arm": arm, "dataset": "synth", "model": "tiny", "budget_flops": BUDGET,
             "point": point, "seed": seed, "train_flops": point * BUDGET, "gpu_hours": point,
             "fid": fd[i][0] + shift, "fid_se": fd[i][1], "fid_features": "oracle-synth-v1", "fid_n": 256,
             "val_loss": loss[i][0] + shift / 1e5, "val_loss_se": loss[i][1]}
            for i, point in enumerate(POINTS)]


def board(tmp_path, *groups: list[dict]) -> list[dict]:
    path = tmp_path / "board.csv"
    append_rows(path, [row for group in groups for row in group])
    return read_rows([path], on_error="abort")


def test_a_target_reached_on_a_pooled_stretch_of_a_rising_curve_is_told_apart():
    """TREAD's FD fell to 9,277 and rose to 10,419; the fit pools the two (at their weighted mean) and so reaches
    mask0's 10,635 between 0.5 and 0.75: that reading rests on the pooling. The same curve without the rise, or a
    target the unpooled part reaches, or one never reached, is not flagged."""
    curve = [(p, fd) for p, (fd, _) in zip(POINTS, TREAD_FD)]
    weights = [1 / se**2 for _, se in TREAD_FD]
    assert reached_on_pooled(curve, 10635, weights=weights)
    assert not reached_on_pooled([*curve[:3], (1.0, 9000)], 10635)  # kept falling: measured, not pooled
    assert not reached_on_pooled(curve, 30000, weights=weights)     # reached where the fit left the curve as it is
    assert not reached_on_pooled(curve, 5000, weights=weights)      # never reached
    accuracy = [(1, 0.1), (2, 0.5), (3, 0.4), (4, 0.9)]             # higher is better: a fall pools
    assert reached_on_pooled(accuracy, 0.45, higher_is_better=True)
    assert not reached_on_pooled(accuracy, 0.8, higher_is_better=True)


def test_the_leaderboard_flags_a_ratio_read_over_a_rising_curve(tmp_path):
    """The literature study's TREAD reading: its FD ratio to mask0's final value (0.74) is flagged in the table,
    the CSV and the notes; its val-loss ratios, read on a curve that kept falling, are not."""
    found = board(tmp_path, rows("mask0", MASK0_FD, MASK0_LOSS), rows("tread50", TREAD_FD, MASK0_LOSS, shift=-1e3))
    summary = summarize(found)
    (tread,) = [r for r in summary if r.arm == "tread50" and r.comparisons]
    final = next(t for t in tread.comparisons["fid"].targets if t.point == 1.0)
    assert final.pooled == {"train_flops": 1, "gpu_hours": 1}
    assert all(not any(t.pooled.values()) for t in tread.comparisons["val_loss"].targets)
    text = render(summary, "markdown")
    assert "(pooled over a rising curve: 1/1)" in text and "pooled over a rising curve (k/n)" in text
    csv_text = render(summary, "csv")
    header, *lines = csv_text.splitlines()
    assert "fid_flops_ratio_pooled" in header.split(",")


def test_one_run_a_side_states_its_gap_in_combined_sampling_errors(tmp_path):
    """SPRINT's val-loss gap on the literature study is 1.66 combined sampling errors: not detected, where the
    study page read it as a gain; TREAD's FD gap is 0.13 of them."""
    found = board(tmp_path, rows("mask0", MASK0_FD, MASK0_LOSS), rows("sprint75", TREAD_FD, SPRINT_LOSS))
    (sprint,) = [r for r in summarize(found) if r.arm == "sprint75" and r.comparisons]
    verdict = sprint.comparisons["val_loss"].difference.verdict
    assert verdict.startswith("not tested: no interval from fewer than 2 runs")
    assert "|Δ| is 1.66 combined sampling errors: not detected" in verdict
    tread_fd = sprint.comparisons["fid"].difference.verdict  # TREAD's FD curve under this arm's name
    assert "|Δ| is 0.13 combined sampling errors: not detected" in tread_fd


def test_a_significant_test_on_a_gap_under_two_sampling_errors_is_not_detected_without_a_plan(tmp_path):
    """Three seeds whose differences agree closely make a significant paired test, but a gap of 300 in FD against
    sampling errors of 933 and 1,306 is under 2 combined ones: "not detected", with or without a plan, the test's
    word kept after it. A gap of 3,000 stays "better"."""
    groups = []
    for seed in range(3):
        groups += [rows("mask0", MASK0_FD, MASK0_LOSS, seed, shift=7 * seed),
                   rows("small", MASK0_FD, MASK0_LOSS, seed, shift=7 * seed - 300 - seed),
                   rows("large", MASK0_FD, MASK0_LOSS, seed, shift=7 * seed - 3000 - seed)]
    found = board(tmp_path, *groups)
    analysis = analyse_rows(found, None, "mask0", EXPLORATORY, fits=False)
    verdicts = {r.arm: r.comparisons["fid"].difference.verdict for r in analysis.summary if r.comparisons}
    assert verdicts["small"].startswith("not detected: |Δ| 301 is under 2 combined sampling errors")
    assert verdicts["small"].endswith("the test alone: better")
    assert verdicts["large"] == "better"


@pytest.mark.parametrize("shift", [0.0, -1e3])
def test_rows_without_sampling_errors_read_as_before(tmp_path, shift):
    """No sampling errors: no gap rule and no count of them in the verdict."""
    plain = [{k: v for k, v in row.items() if not k.endswith("_se")}
             for row in rows("mask0", MASK0_FD, MASK0_LOSS) + rows("arm", TREAD_FD, MASK0_LOSS, shift=shift)]
    (arm,) = [r for r in summarize(board(tmp_path, plain)) if r.arm == "arm" and r.comparisons]
    assert arm.comparisons["fid"].difference.verdict == "not tested: no interval from fewer than 2 runs"
