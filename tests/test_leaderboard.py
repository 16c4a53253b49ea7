"""The leaderboard CSV: concurrent appends, typed round trip, malformed rows, reference rows, CLI entry."""

import csv
import logging
import multiprocessing
import re
from pathlib import Path

import pytest
from filelock import FileLock

from maskbench.cli import main as cli_main
from maskbench.results import rows as leaderboard_rows
from maskbench.results.leaderboard import leaderboard_main
from maskbench.results.rows import COLUMNS, append_rows, read_rows
from maskbench.results.study_plan import load_plan

REPO = Path(__file__).resolve().parents[1]
N_PROCESSES, ROWS_EACH, BATCH = 8, 50, 10


def measured(run_id: str = "r0", **values) -> dict:
    """A minimal valid measured row."""
    return {"run_id": run_id, "arm": "mask0", "dataset": "synth", "model": "tiny",
            "budget_flops": 1e12, "point": 1.0, "seed": 0, **values}


def _append_in_batches(csv_path: str, writer: int, barrier) -> None:
    """Child process: 5 appends of 10 long rows, started together with the others. A ~20 kB batch
    takes several write() calls, which can interleave mid-row unless the lock serialises appends."""
    barrier.wait()
    for start in range(0, ROWS_EACH, BATCH):
        append_rows(csv_path, [measured(f"w{writer}-{i}", seed=writer, step=i, fid=100.0 + i,
                                        phases="0.75:0.75,0.0:0.25," * 100)
                               for i in range(start, start + BATCH)])


def test_concurrent_appends_leave_every_row_whole(tmp_path):
    csv_path = str(tmp_path / "board.csv")
    ctx = multiprocessing.get_context("fork")  # a writer needs nothing fresh: forked, it starts in milliseconds
    barrier = ctx.Barrier(N_PROCESSES)
    workers = [ctx.Process(target=_append_in_batches, args=(csv_path, w, barrier))
               for w in range(N_PROCESSES)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    with open(csv_path, newline="") as f:
        records = list(csv.reader(f))
    assert records[0] == list(COLUMNS)
    assert sum(record == list(COLUMNS) for record in records) == 1
    assert all(len(record) == len(COLUMNS) for record in records)
    rows = read_rows([csv_path], on_error="abort")
    assert len(rows) == N_PROCESSES * ROWS_EACH
    expected = {f"w{w}-{i}" for w in range(N_PROCESSES) for i in range(ROWS_EACH)}
    assert {row["run_id"] for row in rows} == expected


def test_rows_are_written_while_the_lock_beside_the_csv_is_held(tmp_path, monkeypatch):
    """Deterministic, no timing: the row appears between taking `<csv>.lock` and releasing it.
    (The 8-process test above also passes without the lock on this filesystem.)"""
    path = tmp_path / "board.csv"
    seen = []

    class RecordingLock(FileLock):
        def __enter__(self):
            lock = super().__enter__()
            seen.append(("locked", self.lock_file, self.is_locked, path.exists()))
            return lock

        def __exit__(self, *exc):
            seen.append(("releasing", self.is_locked, path.read_text().count("r0,")))
            return super().__exit__(*exc)

    monkeypatch.setattr(leaderboard_rows, "FileLock", RecordingLock)
    append_rows(path, [measured()])
    assert seen == [("locked", f"{path}.lock", True, False), ("releasing", True, 1)]
    assert [row["run_id"] for row in read_rows([path])] == ["r0"]


def test_round_trip_is_typed_and_missing_keys_are_empty(tmp_path):
    path = tmp_path / "nested" / "board.csv"
    append_rows(path, [measured(step=881, train_flops=1.74e13, fid=271.25, device="cpu")])
    append_rows(path, [measured("r1", fid=None)])
    first, second = read_rows([path])
    assert first["step"] == 881 and isinstance(first["step"], int)
    assert first["train_flops"] == 1.74e13 and first["fid"] == 271.25
    assert first["device"] == "cpu" and first["clip_score"] is None and first["source"] is None
    assert second["fid"] is None
    assert path.read_text().count("run_id,") == 1


def test_append_rejects_unknown_keys_and_bad_types_before_writing(tmp_path):
    path = tmp_path / "board.csv"
    with pytest.raises(ValueError, match="unknown leaderboard column.*fid_score"):
        append_rows(path, [measured(fid_score=3.0)])
    with pytest.raises(ValueError, match="'step': expected an integer"):
        append_rows(path, [measured(step=1.5)])
    with pytest.raises(ValueError, match="empty required column.*budget_flops"):
        append_rows(path, [measured(budget_flops=None)])
    assert not path.exists()


def test_append_refuses_a_file_with_another_header(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text("run_id,arm\nr0,mask0\n")
    with pytest.raises(ValueError, match="different header"):
        append_rows(path, [measured()])


def _good_line(run_id: str, fid: str = "50.0") -> list[str]:
    cells = dict.fromkeys(COLUMNS, "")
    cells.update(run_id=run_id, arm="mask0", dataset="synth", model="tiny", budget_flops="1e12",
                 point="1.0", seed="0", fid=fid)
    return [cells[column] for column in COLUMNS]


def test_malformed_rows_are_reported_with_file_and_line(tmp_path, caplog):
    path = tmp_path / "board.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerow(_good_line("ok0"))            # line 2
        writer.writerow(_good_line("short")[:10])     # line 3: truncated by a crash
        writer.writerow(_good_line("badfid", "abc"))  # line 4
        writer.writerow(_good_line("nanfid", "nan"))  # line 5
        writer.writerow(_good_line("ok1"))            # line 6
    with caplog.at_level(logging.WARNING):
        rows = read_rows([path])
    assert [row["run_id"] for row in rows] == ["ok0", "ok1"]
    assert f"{path}:3: expected {len(COLUMNS)} fields, got 10" in caplog.text
    assert f"{path}:4: column 'fid': expected a finite number, got 'abc'" in caplog.text
    assert f"{path}:5:" in caplog.text
    with pytest.raises(ValueError, match=f"^{path}:3: "):
        read_rows([path], on_error="abort")


def test_a_foreign_header_is_one_error_at_line_one(tmp_path, caplog):
    path = tmp_path / "other.csv"
    path.write_text("run_id,arm,colour\nr0,mask0,red\n")
    with caplog.at_level(logging.WARNING):
        assert read_rows([path]) == []
    assert f"{path}:1: header does not match" in caplog.text and "colour" in caplog.text


def test_read_rows_merges_files_with_any_column_order(tmp_path):
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    append_rows(first, [measured("a0")])
    with open(second, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(reversed(COLUMNS))
        writer.writerow(reversed(_good_line("b0", "12.5")))
    rows = read_rows([first, second])
    assert [(row["run_id"], row["fid"]) for row in rows] == [("a0", None), ("b0", 12.5)]


def test_reference_csv_parses_and_cites_every_row():
    rows = read_rows([REPO / "results" / "reference.csv"], on_error="abort")
    by_id = {row["run_id"]: row for row in rows}
    assert all(row["source"] for row in rows)
    dit = {by_id[f"ref-dit-{size}-400k"]["fid"] for size in ("s2", "b2", "l2", "xl2")}
    assert dit == {68.4, 43.5, 23.3, 19.5}
    assert all(by_id[f"ref-dit-{size}-400k"]["train_flops"] is None for size in ("s2", "b2", "l2", "xl2"))
    assert by_id["ref-microdit-coco"]["fid"] == 12.66
    assert by_id["ref-maskdit-in256"]["fid"] == 2.28
    issue10 = by_id["ref-microdiffusion-issue10"]
    assert issue10["fid"] is None and "issue #10" in issue10["source"]


def test_leaderboard_main_prints_plots_and_reports_bad_input(tmp_path, capsys):
    board = tmp_path / "board.csv"
    append_rows(board, [measured(f"{arm}-{seed}", arm=arm, seed=seed, fid=fid + seed, train_flops=1e12,
                                 gpu_hours=0.1, fid_features="oracle-synth-v1")
                        for arm, fid in (("mask0", 300.0), ("mask75", 200.0)) for seed in (0, 1)])
    plot = tmp_path / "plots" / "board.png"
    reference = REPO / "results" / "reference.csv"
    assert leaderboard_main([str(board), str(reference)], "markdown", str(plot), "mask0", "skip") == 0
    out = capsys.readouterr().out
    assert "| mask75 |" in out and "oracle-synth-v1" in out and "DiT-XL/2" in out
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert leaderboard_main([str(tmp_path / "missing.csv")], "table", None, "mask0", "skip") == 2
    assert leaderboard_main([str(board)], "html", None, "mask0", "skip") == 2
    assert "unknown format 'html'" in capsys.readouterr().err


def test_a_csv_written_before_the_added_columns_reads_and_takes_new_rows(tmp_path):
    old_columns = [c for c in COLUMNS if c not in leaderboard_rows.ADDED_COLUMNS]
    path = tmp_path / "old.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, old_columns)
        writer.writeheader()
        writer.writerow({c: measured(fid=9.5).get(c, "") for c in old_columns})
    assert read_rows([path], on_error="abort")[0]["fd_dinov2"] is None
    append_rows(path, [measured("r1", fid=8.0, fd_dinov2=120.5, fid_ref="32px-n6-abcd1234")])
    with open(path, newline="") as f:
        assert tuple(next(csv.reader(f))) == COLUMNS
    rows = read_rows([path], on_error="abort")
    assert [(r["run_id"], r["fid"], r["fd_dinov2"], r["fid_ref"]) for r in rows] == [
        ("r0", 9.5, None, None), ("r1", 8.0, 120.5, "32px-n6-abcd1234")]


# ------------------------------------------------------------------------------------ a study's plan
PLAN = {"study": "demo", "written": "2026-06-01T00:00:00+00:00", "primary_metrics": "[fid, val_loss]",
        "baseline": "mask0", "targets": "baseline horizons", "test": "paired t over seeds", "alpha": "0.05",
        "correction": "holm", "pays": "\n  ratio: flops\n  interval: below 1\n  metrics: all primary"}


def write_plan(folder: Path, body: str = "# the plan\n", **changes: str | None) -> Path:
    """A PLAN.md from PLAN with some keys changed (None: left out)."""
    keys = {**PLAN, **changes}
    front = "".join(f"{key}: {value}\n" for key, value in keys.items() if value is not None)
    path = folder / "PLAN.md"
    path.write_text(f"---\n{front}---\n{body}", encoding="utf-8")
    return path


def paired_lines(out: list[str]) -> list[str]:
    """The comparison table's lines (one per arm and metric) of a printed summary."""
    return [line for line in out if line.startswith("synth") and "  paired  " in line]


@pytest.fixture
def study(tmp_path) -> Path:
    """results/<study>/leaderboard.csv: mask0 and mask75, 3 seeds, points 0.5 and 1, FD and val loss, written
    2026-03-01. mask75 starts worse and ends better, so every horizon's ratio is a value (no bound)."""
    folder = tmp_path / "study"
    rows = [measured(f"{arm}-s{seed}", arm=arm, seed=seed, point=point, train_flops=point * 1e12, gpu_hours=point,
                     fid=fid, val_loss=fid / 1000, fid_features="oracle-synth-v1",
                     created_at="2026-03-01T12:00:00+00:00")
            for seed in range(3)
            for arm, curve in (("mask0", ((0.5, 300.0 + seed), (1.0, 200.0 + seed))),
                               ("mask75", ((0.5, 320.0 + 2 * seed), (1.0, 180.0 + 3 * seed))))
            for point, fid in curve]
    append_rows(folder / "leaderboard.csv", rows)
    return folder


def test_without_a_plan_every_reading_is_exploratory(study, capsys):
    assert leaderboard_main([str(study / "leaderboard.csv")], details=True) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("no plan: exploratory")
    comparisons = paired_lines(out)
    assert len(comparisons) == 2 and all(line.endswith("exploratory") for line in comparisons)


def test_the_plan_beside_the_csv_is_applied_and_rows_before_it_explore(study, capsys):
    write_plan(study)  # written 2026-06-01, after the rows
    assert leaderboard_main([str(study / "leaderboard.csv")], details=True) == 0
    out = capsys.readouterr().out.splitlines()
    # per metric: the final difference and the FLOPs ratios at horizons 0.5 and 1 -> 6 tests
    assert out[0].startswith(f"plan {study / 'PLAN.md'} (demo): primary fid, val_loss; baseline mask0; "
                             "paired t over seeds, alpha 0.05; holm across the 6 tests it reads")
    assert "after 12 of these 12 rows: its readings of them are exploratory" in out[0]
    assert len(paired_lines(out)) == 2 and all(line.endswith("exploratory") for line in paired_lines(out))


def test_a_plan_written_before_every_row_confirms_its_planned_readings(study, capsys):
    write_plan(study, written="2026-01-01T00:00:00+00:00", primary_metrics="[fid]")
    assert leaderboard_main([str(study / "leaderboard.csv")], details=True) == 0
    out = capsys.readouterr().out.splitlines()
    assert "before every row: its planned readings are confirmatory" in out[0] and "holm across the 3 tests" in out[0]
    fid, loss = paired_lines(out)
    assert fid.endswith("confirmatory") and loss.endswith("exploratory")  # val loss is shown, not planned
    assert leaderboard_main([str(study / "leaderboard.csv")]) == 0  # compact: readings that differ keep a column
    compact = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [row[-1] for row in compact if row[:2] in (["mask75", "fid"], ["mask75", "val_loss"])] == [
        "confirmatory", "exploratory"]


def test_plan_flag_and_a_baseline_other_than_the_plans(study, tmp_path, capsys):
    plan = write_plan(tmp_path, written="2026-01-01T00:00:00+00:00")
    assert leaderboard_main([str(study / "leaderboard.csv")], plan=str(plan), details=True) == 0
    assert "confirmatory" in capsys.readouterr().out.splitlines()[0]
    # another baseline sets the plan aside: its tests are about mask0, so every reading against mask75 explores
    assert leaderboard_main([str(study / "leaderboard.csv")], baseline="mask75", plan=str(plan), details=True) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"plan {plan} (") and "set aside: its baseline is mask0, and against --baseline mask75 " \
        "every reading is exploratory" in out[0]
    fid, loss = paired_lines(out)
    assert " mask0 " in fid and fid.endswith("exploratory") and loss.endswith("exploratory")


@pytest.mark.parametrize(("front", "message"), [
    ({"alpha": "1.5"}, "alpha must be a number in (0, 1), got 1.5"),
    ({"correction": "bonferroni"}, "correction must be one of holm, none, got 'bonferroni'"),
    ({"test": "welch"}, "test: this report applies 'paired t over seeds' only, got 'welch'"),
    ({"primary_metrics": "[fid, loss]"}, "primary_metrics must be a non-empty list of"),
    ({"written": "2026-06-01"}, "written must be a date-time with a time zone"),
    ({"baseline": None, "seed": "3"}, "front matter keys: missing ['baseline'], unknown ['seed']"),
    ({"pays": "\n  ratio: steps\n  interval: below 1\n  metrics: all primary"}, "pays.ratio must be one of flops"),
    ({"primary_metrics": "[fid, val_loss"}, "front matter line"),
])
def test_a_malformed_plan_is_one_clear_error(study, capsys, front, message):
    plan = write_plan(study, **front)
    with pytest.raises(ValueError, match=f"^plan {plan}: ") as err:
        load_plan(plan)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert cli_main(["leaderboard", str(study / "leaderboard.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: plan {plan}: ") and err.count("\n") == 1


def test_a_plan_without_front_matter_is_refused(study, capsys):
    (study / "PLAN.md").write_text("# a plan in prose only\n", encoding="utf-8")
    assert cli_main(["leaderboard", str(study / "leaderboard.csv"), "--crossover", "mask75"]) == 2
    assert "no front matter" in capsys.readouterr().err


def test_the_committed_plans_parse_and_say_they_came_after_the_data():
    for name in ("powered", "crossover"):
        plan = load_plan(REPO / "results" / name / "PLAN.md")
        assert (plan.study, plan.primary, plan.baseline) == (name, ("fid", "val_loss"), "mask0")
        assert (plan.alpha, plan.correction, plan.pays) == (0.05, "holm", "train_flops")
        body = (REPO / "results" / name / "PLAN.md").read_text(encoding="utf-8").split("---\n", 2)[2]
        first = " ".join(body.split("\n\n")[1].split())
        assert ("written after the data; its readings of these rows are exploratory; it is the plan for the re-run"
                in first.lower())
        rows = read_rows([REPO / "results" / name / "leaderboard.csv"], on_error="abort")
        assert plan.family(rows).confirmatory is False


# ------------------------------------------------------------------ a plan that reads the compute multiplier
FAIR_B = 3.2e13
FAIR_POINTS = (0.125, 0.25, 0.5, 1.0)
# arm: (val loss A, FD A) of L(C) = E + A·(C/B)^−0.6, the floor shared, so M(B) = (A_mask0 / A_arm)^(1/0.6): mask75
# 1.68 on both metrics (pays), mask75_then0 0.62 on both (does not pay), mask75_until_cosine 1.68 on val loss but 1 on
# FD (the metrics disagree: undecided).
FAIR_ARMS = {"mask0": (0.30, 0.30), "mask75": (0.22, 0.22), "mask75_then0": (0.40, 0.40),
             "mask75_until_cosine": (0.22, 0.30)}
MULTIPLIER_PAYS = "\n  ratio: compute multiplier\n  interval: above 1\n  metrics: all primary"


def fair_rows(seeds: int = 4, scale: dict[str, float] | None = None, ladder: bool = True,
              fd_scale: dict[str, float] | None = None) -> list[dict]:
    """The fair study's design on synthetic curves: every arm at 1/8 ... 1 of B, each seed's amplitudes moved by
    3% (its own training), each point by its sampling error (0.3% val loss, 1% FD), written 2026-12-04; with
    `ladder`, mask0's ladder beside it (a run of the same seed to 4 B, the same curve). `scale` multiplies an
    arm's val loss at every point, `fd_scale` its FD. All arms fall as C^−0.6, so M is constant:
    (0.30 / A)^(1 / 0.6): mask75 1.68, mask75_then0 0.62, mask75_until_cosine 1.68 on val loss and 1 on FD."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows = []
    runs = [(arm, amplitudes, f"{arm}-s", FAIR_B, FAIR_POINTS) for arm, amplitudes in FAIR_ARMS.items()]
    runs += [("mask0", FAIR_ARMS["mask0"], "mask0-ladder-s", 4 * FAIR_B, tuple(p / 4 for p in (*FAIR_POINTS, 2, 4)))
             ] if ladder else []
    for seed in range(seeds):
        jitter = 1 + 0.03 * rng.normal()
        for arm, (loss_a, fd_a), name, budget, points in runs:
            for point in points:
                c = point * budget / FAIR_B
                loss = (0.05 + loss_a * jitter * c**-0.6) * (scale or {}).get(arm, 1.0)
                fd = (50 + 1000 * fd_a * jitter * c**-0.6) * (fd_scale or {}).get(arm, 1.0)
                rows.append(measured(f"{name}{seed}", arm=arm, seed=seed, model="micro_s", batch_size=64,
                                     budget_flops=budget, point=point, train_flops=c * FAIR_B, gpu_hours=c,
                                     val_loss=loss * (1 + 0.003 * rng.normal()), val_loss_se=0.003 * loss,
                                     fid=fd * (1 + 0.01 * rng.normal()), fid_se=0.01 * fd, fid_n=2048,
                                     fid_features="oracle-synth-v1", precision="fp32", draw_scheme="crn-v3",
                                     created_at="2026-12-04T00:00:00+00:00"))
    return rows


@pytest.fixture
def fair(tmp_path) -> Path:
    folder = tmp_path / "fair"
    append_rows(folder / "leaderboard.csv", fair_rows())
    write_plan(folder, written="2026-12-03T07:17:00+00:00", pays=MULTIPLIER_PAYS,
               prediction_fails="paired relative error")
    return folder


def test_a_compute_multiplier_plan_tests_the_difference_and_the_measured_m_at_b_holm_across_the_12(fair):
    """T1 (the difference at B) and T2 (log of the measured M(B), read off mask0's ladder) per arm and metric,
    3 arms × 2 metrics × 2 = 12 tests, Holm across them by hand; mask0's own run, read on its ladder as a check,
    is not tested."""
    import numpy as np

    from maskbench.results.estimators import holm
    from maskbench.results.multiplicity import MULTIPLIER, correct_study
    from maskbench.results.multiplier import measured_multipliers
    from maskbench.results.summary import summarize

    plan = load_plan(fair / "PLAN.md")
    rows = read_rows([fair / "leaderboard.csv"])
    family = plan.family(rows)
    assert (plan.rule, plan.pays, family.rule, family.confirmatory) == (MULTIPLIER, "train_flops", MULTIPLIER, True)
    summary = summarize(rows, "mask0", family.compared())
    measured = measured_multipliers(rows, "mask0")
    first = [(r.arm, m, c.difference.p) for r in summary for m, c in r.comparisons.items()]
    second = [(m.arm, m.metric, m.at_budget.p) for m in measured if m.arm != "mask0"]
    assert len(first) == len(second) == 6
    assert all(m.at_budget.geomean == pytest.approx(1, abs=0.02) for m in measured if m.arm == "mask0")
    by_hand = dict(zip([(arm, m, test) for test, found in (("T1", first), ("T2", second)) for arm, m, _ in found],
                       holm([p for found in (first, second) for *_, p in found])))
    corrected, remeasured, tests = correct_study(summary, measured, family)
    assert tests == 12
    for r in corrected:
        for metric, c in r.comparisons.items():
            assert c.difference.p_adj == pytest.approx(by_hand[r.arm, metric, "T1"])
    for m in remeasured:
        if m.arm != "mask0":
            assert m.at_budget.p_adj == pytest.approx(by_hand[m.arm, m.metric, "T2"])
            assert np.array_equal([r.p_adj for r in m.multipliers[:-1]], [r.p for r in m.multipliers[:-1]],
                                  equal_nan=True)  # other horizons: reported, not tested


def test_the_compute_multiplier_verdict_is_printed_per_arm_with_what_each_metric_showed(fair, capsys):
    assert leaderboard_main([str(fair / "leaderboard.csv")], details=True) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert ("holm across the 12 tests it reads; pays: compute multiplier M(B), measured on the baseline's ladder, "
            "above 1") in lines[0]
    assert "before every row: its planned readings are confirmatory" in lines[0]
    # the measured M replaces the isotonic compute-to-target ratios: one name for one quantity
    assert "Compute to reach mask0's value" not in out
    assert "The measured compute multiplier M(C)" in out
    group = "synth/micro_s/b64/3.2e+13"
    verdicts = {line.split(": ")[1].split(" at B")[0].split()[-1]: line.split(": ")[2]
                for line in lines if line.startswith(f"verdict: {group}")}
    assert verdicts == {"mask75": "pays", "mask75_then0": "does not pay", "mask75_until_cosine": "undecided"}
    (why,) = [line for line in lines if line.startswith(f"verdict: {group} mask75_until_cosine")]
    assert "FD: no difference detected at B" in why and "val loss: better at B" in why
    assert not any(line.startswith("disagree:") for line in lines)  # FD neither way, val loss better: no conflict
    table = lines[lines.index(next(line for line in lines if line.startswith("The plan's verdict at B"))) + 1:]
    assert table[0].split()[:4] == ["group", "arm", "metric", "Δ"] and "M p adj" in table[0]
    assert "held out" not in table[0]  # the verdict reads no fit
    pays = [line for line in table if line.startswith(f"{group}  mask75 ")]
    assert len(pays) == 2 and all(re.search(r"above 1 +pays +confirmatory$", line) for line in pays)
    assert all(re.search(r"below 1 +does not pay +confirmatory$", line)
               for line in table if line.startswith(f"{group}  mask75_then0 "))
    assert leaderboard_main([str(fair / "leaderboard.csv")], "csv") == 0
    captured = capsys.readouterr()
    assert "The plan's verdict" not in captured.out and f"verdict: {group} mask75 at B" in captured.err


def test_the_metrics_disagree_only_when_they_point_opposite_ways(tmp_path, capsys):
    """mask75 with FD 40% worse at every point: better on val loss, worse on FD (M below 1): it does not pay and
    the metrics disagree; without the ladder nothing past mask0's B is known, so its M(B) is a bound and no
    verdict reads it below 1."""
    folder = tmp_path / "fair"
    append_rows(folder / "leaderboard.csv", fair_rows(fd_scale={"mask75": 1.4}))
    write_plan(folder, written="2026-12-03T07:17:00+00:00", pays=MULTIPLIER_PAYS)
    assert leaderboard_main([str(folder / "leaderboard.csv")], details=True) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [line for line in lines if line.startswith("verdict: synth/micro_s/b64/3.2e+13 mask75 at B")]
    assert ": does not pay: FD: worse at B" in line and "val loss: better at B" in line
    assert "disagree: synth/micro_s/b64/3.2e+13 mask75: the metrics disagree: worse on FD, better on val loss" in lines


def test_without_a_ladder_an_arm_better_than_the_baseline_at_b_reads_a_bound_and_no_verdict(tmp_path, capsys):
    """No ladder: mask75 beats mask0's last horizon on every seed, so its M(B) is only a lower bound ("past the
    ladder") and the arm is undecided, however clear its difference at B."""
    folder = tmp_path / "fair"
    append_rows(folder / "leaderboard.csv", fair_rows(ladder=False))
    write_plan(folder, written="2026-12-03T07:17:00+00:00", pays=MULTIPLIER_PAYS)
    assert leaderboard_main([str(folder / "leaderboard.csv")], details=True) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [line for line in lines if line.startswith("verdict: synth/micro_s/b64/3.2e+13 mask75 at B")]
    assert ": undecided: " in line and "M(B) at least" in line and "past the ladder" in line


def test_a_gap_under_two_combined_sampling_errors_is_not_detected():
    """Δ = −1 on every seed but one (a significant paired test); with sampling errors of 1 on each side over 4
    pairs the combined SE of Δ is √(4·1/16 + 4·1/16) = 0.71: a gap of 1 is under 2 of them."""
    from maskbench.results.estimators import paired_difference
    from maskbench.results.multiplicity import detected_difference

    base = [100.0, 110.0, 120.0, 130.0]
    found = paired_difference([b - 1 for b in base[:3]] + [base[3] - 1.1], base, arm_se=[1.0] * 4, base_se=[1.0] * 4)
    assert found.verdict == "better" and found.eval_se == pytest.approx(2**-0.5)
    assert detected_difference(found).verdict.startswith("not detected: |Δ| 1.02 is under 2 combined sampling errors")
    wide = paired_difference([b - 3 for b in base[:3]] + [base[3] - 3.1], base, arm_se=[1.0] * 4, base_se=[1.0] * 4)
    assert detected_difference(wide).verdict == "better"
    assert detected_difference(paired_difference([99.0, 108.9, 119.0], base[:3])).verdict == "better"  # no SEs


def test_the_same_rows_under_a_flops_plan_are_read_as_before(fair, capsys):
    """The older rule on the same rows: every ratio tested, "pays" off the ratios, no compute-multiplier verdict."""
    write_plan(fair, written="2026-12-03T07:17:00+00:00", prediction_fails="paired relative error")
    assert leaderboard_main([str(fair / "leaderboard.csv")], details=True) == 0
    out = capsys.readouterr().out
    assert "holm across the 12 tests" not in out.splitlines()[0] and "pays: FLOPs ratio below 1" in out.splitlines()[0]
    assert "The plan's verdict" not in out and "(reported, not tested)" not in out
    assert "FD p adj" in out


@pytest.mark.parametrize(("pays", "message"), [
    ("\n  ratio: compute multiplier\n  interval: below 1\n  metrics: all primary",
     "pays.interval: this report applies 'above 1' only, got 'below 1'"),
    ("\n  ratio: flops\n  interval: above 1\n  metrics: all primary",
     "pays.interval: this report applies 'below 1' only, got 'above 1'"),
])
def test_the_interval_must_match_the_ratio(study, pays, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_plan(write_plan(study, pays=pays))


def test_a_compute_multiplier_plan_needs_metrics_that_fall(study):
    with pytest.raises(ValueError, match="primary metric\\(s\\) align_acc rise as training goes on"):
        load_plan(write_plan(study, pays=MULTIPLIER_PAYS, primary_metrics="[val_loss, align_acc]"))


def test_every_committed_plan_parses_and_only_the_fair_one_reads_the_multiplier():
    from maskbench.results.multiplicity import MULTIPLIER, RATIO

    rules = {name: load_plan(REPO / "results" / name / "PLAN.md") for name in ("powered", "crossover", "plateau", "fair")}
    assert {name: (plan.rule, plan.pays) for name, plan in rules.items()} == {
        "powered": (RATIO, "train_flops"), "crossover": (RATIO, "train_flops"), "plateau": (RATIO, "train_flops"),
        "fair": (MULTIPLIER, "train_flops")}
    text = (REPO / "results" / "fair" / "PLAN.md").read_text(encoding="utf-8")
    assert re.search(r"\nFront matter amended \(\d{4}-\d\d-\d\d \d\d:\d\d UTC, before any row\): it now encodes the "
                     r"tests and the verdict the prose above states; the prose is unchanged\.\n", text)


def test_a_row_missing_a_declared_column_is_refused_naming_it_and_metric_columns_come_from_the_registry():
    """A run's row must name every column of the schema (None where it has nothing): one the builder forgot is
    refused by name, not written empty. The metric columns are the registry's, each once, typed float."""
    from maskbench.metrics import METRICS
    from maskbench.results.rows import COLUMNS, FLOAT_COLUMNS, _metric, complete_row

    full = {column: None for column in COLUMNS}
    assert complete_row(full) is full
    with pytest.raises(ValueError, match="without declared column\\(s\\): val_loss_se, skipped_steps"):
        complete_row({k: v for k, v in full.items() if k not in ("skipped_steps", "val_loss_se")})
    for m in METRICS:
        assert COLUMNS.count(m.name) == COLUMNS.count(m.se_column) == 1
        assert {m.name, m.se_column} <= FLOAT_COLUMNS
    with pytest.raises(ValueError, match="not a registered metric"):
        _metric("fid_typo")
