"""The SLURM array script of `maskbench sweep --emit slurm`, run without Slurm: stand-ins for `srun` and `scontrol` on
PATH. It requeues its own task when the time-limit signal stopped the run (exit 130, or 143 through a launcher), and
only then, at most MAX_RESTARTS times; the requeued task resumes to the very weights of a run never stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from maskbench.cli import main
from maskbench.config import load_config
from maskbench.runs.launch import train
from maskbench.runs.sweep import MAX_RESTARTS
from tests.conftest import FAST, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
TASK = {"SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "0"}
# Slurm's srun, standing in: the task's command here (a stand-in for the run, or tests/slurm_task.py for maskbench).
SRUN = "#!/bin/bash\n{body}\n"
SCONTROL = '#!/bin/bash\nprintf "%s\\n" "$*" >> "$SCONTROL_LOG"\n'


def emit(tmp_path: Path, overrides: list[str], capsys) -> Path:
    """The one-process SLURM script of a one-cell sweep, written to tmp_path/sweep.sbatch."""
    assert main(["sweep", *overrides, "--emit", "slurm", "--nproc", "1"]) == 0
    script = tmp_path / "sweep.sbatch"
    script.write_text(capsys.readouterr().out)
    return script


def run_task(script: Path, srun_body: str, restarts: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The script as Slurm would start array task 0 after `restarts` restarts: its result and the requeues it asked."""
    bin_dir = script.parent / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN.format(body=srun_body)), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = script.parent / "scontrol.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, **TASK, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SCONTROL_LOG": str(log),
           "SLURM_RESTART_COUNT": str(restarts)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    return done, log.read_text().splitlines() if log.is_file() else []


@pytest.mark.parametrize(("code", "restarts", "requeued"), [
    (0, 0, False),                  # finished
    (1, 0, False),                  # failed
    (2, 0, False),                  # bad input
    (130, 0, True),                 # stopped by the time-limit signal
    (143, 3, True),                 # the same through a launcher that got the signal too
    (130, MAX_RESTARTS, False),     # a cell that keeps stopping: no more tries
])
def test_only_a_run_stopped_by_the_time_limit_signal_is_requeued(tmp_path, capsys, code, restarts, requeued):
    script = emit(tmp_path, [f"paths.leaderboard={tmp_path / 'none.csv'}"], capsys)
    done, requeues = run_task(script, f"exit {code}", restarts)
    assert done.returncode == code, done.stdout + done.stderr
    assert requeues == (["requeue 77_0"] if requeued else []), done.stdout


def test_a_signal_to_the_script_itself_is_preemption_and_not_requeued(tmp_path, capsys):
    """Preemption and scancel signal the job script too; Slurm (--requeue), not the script, requeues a preempted task."""
    script = emit(tmp_path, [f"paths.leaderboard={tmp_path / 'none.csv'}"], capsys)
    done, requeues = run_task(script, "kill -TERM $PPID; exit 130", 0)
    assert done.returncode == 143 and requeues == [] and "not requeued here" in done.stdout


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_stopped_by_the_time_limit_is_requeued_and_resumes_bit_exact(tmp_path, synth_root, capsys):
    """First start: the run gets SIGTERM after its first eval point, saves, exits 130, and the script requeues the
    task. Restarted (SLURM_RESTART_COUNT 1): it resumes, finishes and is not requeued; its losses and final weights
    equal a run's that was never stopped."""
    extra = ("arm=mask75_then0", "budget.flops=1.5e9", *FAST)
    script = emit(tmp_path, tiny_overrides(tmp_path / "slurm", synth_root, *extra), capsys)
    task = f'while [ "$1" != maskbench ]; do shift; done; shift; exec {sys.executable} {REPO}/tests/slurm_task.py "$@"'
    stopped, requeues = run_task(script, task, 0)
    assert stopped.returncode == 130 and requeues == ["requeue 77_0"], stopped.stdout[-2000:] + stopped.stderr[-2000:]
    [run_dir] = (tmp_path / "slurm" / "runs").iterdir()
    assert not (run_dir / "done.json").exists()
    resumed, requeues = run_task(script, task, 1)
    assert resumed.returncode == 0 and requeues == [], resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming" in resumed.stdout and (run_dir / "done.json").exists()

    never_stopped = train(load_config(tiny_overrides(tmp_path / "whole", synth_root, *extra)))
    assert never_stopped.name == run_dir.name and _losses(run_dir) == _losses(never_stopped)
    final = "checkpoints/point-1/model.safetensors"
    a, b = load_file(run_dir / final), load_file(never_stopped / final)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
