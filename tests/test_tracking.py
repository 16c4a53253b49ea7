"""train.log_with=tensorboard: event files under the run directory with the step scalars and eval images."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maskbench.cli import main
from tests.conftest import tiny_overrides


def test_a_tensorboard_run_writes_step_scalars_and_sample_grids(tmp_path: Path, synth_root: Path) -> None:
    assert main(["run", *tiny_overrides(tmp_path, synth_root, "arm=mask0", "train.log_with=tensorboard")]) == 0
    [run_dir] = (tmp_path / "runs").iterdir()
    [event_file] = (run_dir / "maskbench").glob("events.out.tfevents.*")  # the hparams go to a subfolder
    events = EventAccumulator(str(event_file.parent), size_guidance={"scalars": 0, "images": 0}).Reload()
    tags = events.Tags()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/mask_ratio", "train/flops"} <= set(tags["scalars"])
    assert {"eval/val_loss", "eval/fid", "eval/align_acc"} <= set(tags["scalars"])
    n_steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, n_steps + 1))
    assert len(events.Images("eval/samples")) == 2                                    # eval points 0.5 and 1.0
    assert events.Scalars("eval/fid")[-1].step == n_steps
