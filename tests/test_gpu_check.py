"""benchmarks/gpu_check.sh: it fits one device command, a failing step never stops the report, its --cpu mode
runs every step at toy size, and without a GPU it says so in one line."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check_report  # noqa: E402

STEPS = ["env", "kernels", "standins", "synth", "encode", "reference", "train", "arms", "ddp"]
ONE_COMMAND_S = 8 * 60       # the first device command's target
DEVICE_LIMIT_S = 10 * 60     # the device machine's limit on one command
INSTALL_AND_REPORT_S = 30    # the kit's pip install and the final report, with room


def plan(script: str) -> dict[str, int]:
    done = subprocess.run(["bash", script, "--plan"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return {name: int(limit) for name, limit in (line.split("\t") for line in done.stdout.splitlines())}


@pytest.mark.parametrize("script", ["benchmarks/gpu_check.sh", "benchmarks/device/gpu_bench.sh"])
def test_the_gpu_plan_fits_one_device_command(script):
    """Every step's limit plus its kill grace, the install and the report fit 8 minutes (the limits alone ~7.5)."""
    limits = plan(script)
    total = limits.pop("total")
    assert total + INSTALL_AND_REPORT_S <= ONE_COMMAND_S < DEVICE_LIMIT_S
    assert sum(limits.values()) <= 450
    if script.endswith("gpu_check.sh"):
        assert list(limits) == STEPS


def test_every_step_runs_under_timeout_with_a_kill_and_nothing_skips_the_report():
    steps = (REPO / "benchmarks" / "device" / "steps.sh").read_text()  # the machinery both commands source
    assert 'timeout -k "$KILL_S" "$limit"' in steps and "trap finish EXIT" in steps
    for script in ("benchmarks/gpu_check.sh", "benchmarks/device/gpu_bench.sh", "benchmarks/device/steps.sh"):
        text = (REPO / script).read_text()
        assert "|| exit" not in text and not re.search(r"\bexit 1\b", text)
        # no console script on the device: every maskbench command is `python -m maskbench` (or the wrapper)
        assert not [line for line in text.splitlines() if line.lstrip().startswith("maskbench ")
                    or " maskbench run" in line.replace("-m maskbench run", "")]


FAKE_PYTHON = """#!/usr/bin/env bash
# Every step fails at once; the report script runs for real.
case "$1" in
  benchmarks/gpu_check_report.py) exec {python} "$@" ;;
esac
echo "some output"
echo "RuntimeError: boom in $1" >&2
exit 3
"""


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECK_DIR": str(tmp_path / "work")}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu", "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.json", "gpu_check.tar.gz"]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [s["name"] for s in report["steps"]] == STEPS and not report["all_passed"]
    assert all(s["status"] == "failed" for s in report["steps"])  # each ran, none was skipped by another's failure
    assert report["steps"][0]["first_error"] == "RuntimeError: boom in benchmarks/device/env_check.py"
    # the rule arm's probe runs inside the ddp step, under its limit, its error in the step's log
    assert report["steps"][-1]["first_error"] == "RuntimeError: boom in benchmarks/device/arms_check.py"


FORCED_LIMIT_S = 60  # a forced limit no item here comes near: the cut is GPU_CHECK_CUT_AFTER's


def run_forced(script: str, tmp_path: Path, cut_after: int, steps: str) -> dict:
    """`bash SCRIPT --cpu` running only `steps`, each cut by its limit right after its `cut_after`-th item
    (benchmarks/stream.py's GPU_CHECK_CUT_AFTER): its JSON report. The cut falls at that item however fast the
    machine makes items, and at once, not after the limit's seconds."""
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path / "work"), "GPU_CHECK_LIMIT_S": str(FORCED_LIMIT_S),
           "GPU_CHECK_CUT_AFTER": str(cut_after), "GPU_CHECK_STEPS": steps, "PYTHON": sys.executable}
    done = subprocess.run(["bash", script, "--cpu", "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    name = Path(script).stem
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{name}.json", f"{name}.tar.gz"]
    return json.loads((tmp_path / "out" / f"{name}.json").read_text())


def cut_with(step: dict) -> int:
    """The items a step cut by its limit finished, as its report line says them."""
    assert step["status"] == "timed out" and step["rc"] == 124, step
    assert step["limit_s"] == FORCED_LIMIT_S, step  # the cut point is the item counts below, not a clock
    done, planned = step["items_done"], step["items_planned"]
    of = f" of {planned}" if planned is not None else ""
    assert step["first_error"].startswith(f"timed out after {done}{of} items in {step['limit_s']}s"), step
    return done


def test_a_step_cut_by_its_limit_keeps_the_items_it_finished(tmp_path):
    """env and kernels, each cut after its third item: env reports Python's line and the imports of torch and
    triton (before the rest), kernels its first three rows."""
    report = run_forced("benchmarks/gpu_check.sh", tmp_path, 3, "env,kernels")
    env, kernels = report["steps"]
    assert [env["name"], kernels["name"]] == ["env", "kernels"] and not report["all_passed"]
    assert cut_with(env) == 3 and env["items_planned"] > 3
    found = report["env"]  # its lines so far: Python's, then each import's
    assert found["python"] and list(found["import_seconds"]) == ["torch", "triton"] and "cuda_available" not in found
    assert found["packages"]["torch"]["version"] == importlib.metadata.version("torch")
    assert cut_with(kernels) == 3 and len(report["kernels"]) == 3


def test_the_step_time_step_cut_by_its_limit_keeps_the_models_it_finished(tmp_path):
    """Command 2's step_time at toy size (tiny, then dit_b2) cut after its second row: tiny's two rows, with the
    empty peak memory of a CPU, are in the report, and the step timed out before dit_b2's."""
    report = run_forced("benchmarks/device/gpu_bench.sh", tmp_path, 2, "step_time")
    [step] = report["steps"]
    assert cut_with(step) == 2 and step["items_planned"] == 4
    rows = report["tables"]["step_time"]
    assert [(r["model"], r["mask_ratio"], r["peak_memory_gib"]) for r in rows] == [("tiny", "0.0", ""),
                                                                                    ("tiny", "0.75", "")]


def test_env_lists_every_import_and_the_packages_it_loaded_before_any_cuda_call(tmp_path):
    """env_check --cpu: each module the later steps use imported and timed, then CUDA; timm's and transformers'
    versions and folders (transformers, which open_clip loads when present, "not installed" where it is not)."""
    sys.path.insert(0, str(REPO / "benchmarks" / "device"))
    from env_check import IMPORTS, NOT_INSTALLED

    out = tmp_path / "env.jsonl"
    done = subprocess.run([sys.executable, "benchmarks/device/env_check.py", "--cpu", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    parts = [line["part"] for line in lines]
    assert parts == ["python", *["import"] * len(IMPORTS), "cuda"]  # every import before the first CUDA call
    assert [line["module"] for line in lines[1:-1]] == list(IMPORTS) and all(line["seconds"] >= 0 for line in lines[1:-1])
    env = gpu_check_report.read_env(out)
    assert not env["problems"]
    timm = env["packages"]["timm"]
    assert timm["version"] == importlib.metadata.version("timm") and (Path(timm["from"]) / "layers").is_dir()
    transformers = env["packages"]["transformers"]
    if importlib.util.find_spec("transformers") is None:
        assert transformers == {"version": NOT_INSTALLED, "from": None, "via": "open_clip"}
    else:
        assert transformers["version"] == importlib.metadata.version("transformers") and transformers["from"]


def test_the_report_names_a_timed_out_step_and_the_steps_not_run(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "steps.tsv").write_text("env\t0\t5\t20\nkernels\t124\t40\t40\n")
    (logs / "kernels.log").write_text("checking L=256\ntiming drop fwd\n")
    report = gpu_check_report.report(tmp_path, "gpu")
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("env", "ok"), ("kernels", "timed out"), *[(name, "not run") for name in STEPS[2:]]]
    assert report["steps"][1]["first_error"] == "timed out after 0 items in 40s; last: timing drop fwd"
    assert report["seconds"] == 45 and not report["all_passed"]


def test_first_error_line_prefers_the_exception():
    log = Path(__file__).with_name("_first_error.log")
    try:
        log.write_text("warming up\nTraceback (most recent call last):\n  File x\n[rank1]: FileNotFoundError: "
                       "[Errno 2] no metrics.jsonl\nmaskbench FAILED\n")
        assert gpu_check_report.first_error_line(log) == "[rank1]: FileNotFoundError: [Errno 2] no metrics.jsonl"
    finally:
        log.unlink()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_0() -> None:
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert len(done.stdout.splitlines()) == 1 and "needs a CUDA GPU" in done.stdout


@pytest.mark.slow
def test_every_step_runs_at_toy_size_on_the_cpu(tmp_path: Path) -> None:
    """--cpu: the same steps as on a GPU, at toy size (two arms: the draws of mask75 against mask0's)."""
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path / "work"), "GPU_CHECK_ARMS": "mask0 mask75",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu", "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.json", "gpu_check.tar.gz"]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["all_passed"] and [s["name"] for s in report["steps"]] == STEPS
    [train] = report["train"]
    assert train["done"] and train["mask_ratios"] == [0.75, 0.0]
    [point] = train["eval_points"]
    assert point["fid_features"] == "standin-random-inception" and point["clip_score"] is not None
    assert report["arms_ok"] == "2 of 2" and report["draws_match_mask0"] == {"mask75": True}
    assert report["draws_match_cpu"] == {"mask0": True, "mask75": True}  # here the device is the CPU itself
    assert all(arm["dynamo"]["graph_breaks"] == 0 and arm["dynamo"]["graphs"] >= 1 for arm in report["arms"])
    # the peak GPU memory of every arm and of the train run: in the schema, empty on a CPU
    assert all(arm["peak_memory_gib"] is None for arm in report["arms"]) and train["dynamo"]["peak_memory_gib"] is None
    assert [(s["items_done"], s["items_planned"]) for s in report["steps"] if s["name"] == "arms"] == [(2, 2)]
    assert [(r["n_devices"], r["done"], r["switched_at"] is not None) for r in report["ddp"]] == [(2, True, True)] * 2
    listing = subprocess.run(["tar", "-tzf", str(tmp_path / "out" / "gpu_check.tar.gz")], capture_output=True,
                             text=True, check=True).stdout.splitlines()
    assert "gpu_check/logs/steps.tsv" in listing and any(name.startswith("gpu_check/grids/") for name in listing)


def test_an_arm_whose_phase_buys_no_step_gets_a_budget_that_does(tmp_path):
    """arms_check's toy budget: kept for an arm it fits, doubled for maskdit50_authors (unmasked 5% of it) and
    repa_mask75_then0 (REPA's costlier steps), which the kit's --cpu mode once failed on."""
    sys.path.insert(0, str(REPO / "benchmarks" / "device"))
    from arms_check import fitting_budget

    from maskbench.config import load_config
    from maskbench.data.dataset import resolve_dataset
    from maskbench.train.build import run_schedule

    toy = ["model=tiny", "model.width=32", "model.depth=3", "model.heads=2", "model.text_width=32",
           "model.text_depth=1", "model.text_len=24", "train.batch_size=8", "eval.points=[1.0]",
           f"paths.data={tmp_path}", "budget.flops=1e9"]
    assert fitting_budget(["arm=mask0", *toy]) == ["budget.flops=1e+09"]
    for arm in ("maskdit50_authors", "repa_mask75_then0"):
        [budget] = fitting_budget([f"arm={arm}", *toy])
        assert float(budget.partition("=")[2]) > 1e9
        cfg = load_config([f"arm={arm}", *toy, budget])
        run_schedule(cfg, 1, resolve_dataset(cfg.data, cfg.paths.data, create=False))  # every phase a whole step


def test_each_arm_is_written_as_it_ends_and_a_cut_check_reports_those_it_finished(tmp_path, monkeypatch):
    """arms_check appends an arm's line the moment the arm ends (the next arm finds it in the file); the report of
    a check cut after 2 of 3 arms lists those 2 and pairs their draws with mask0's; the finished check's verdict
    fails an arm of PAIRED whose draws differ."""
    sys.path.insert(0, str(REPO / "benchmarks" / "device"))
    import arms_check

    out = tmp_path / "arms.jsonl"
    digests = {"mask0": ["a", "b"], "mask75": ["a", "b"], "mask75_then0": ["a", "c"]}
    lines_before = []

    def trained(arm, work, overrides, counts, source):
        lines_before.append(len(out.read_text().splitlines()) if out.is_file() else 0)
        return {"arm": arm, "status": "ok", "run_dir": str(work / arm), "draw_digests": digests[arm],
                "peak_memory_gib": None}

    monkeypatch.setattr(arms_check, "run_arm", trained)
    monkeypatch.setattr(arms_check, "DynamoCounts", lambda: None)  # nothing to count, no logging handler left
    arms_check.run_shard(list(digests), tmp_path, [], "inductor", float("inf"), out)
    assert lines_before == [0, 1, 2]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert arms_check.verdict(records) == 1  # mask75_then0 drew otherwise than mask0

    out.write_text("".join(line + "\n" for line in out.read_text().splitlines()[:2]) + '{"arm": "mask75_th')
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "steps.tsv").write_text("arms\t124\t110\t110\n")
    (tmp_path / "logs" / "arms.log").write_text("items planned: 3 arms\narms_check: mask75 ok in 9.0s\n")
    report = gpu_check_report.report(tmp_path, "gpu", ("arms",))
    assert report["steps"][0]["first_error"] == ("timed out after 2 of 3 items in 110s; "
                                                 "last: arms_check: mask75 ok in 9.0s")
    assert [(a["arm"], a["draws_match_mask0"], a["peak_memory_gib"]) for a in report["arms"]] == [
        ("mask0", None, None), ("mask75", True, None)]
    assert report["draws_match_mask0"] == {"mask75": True} and report["arms_ok"] == "2 of 2"
