"""One run end to end: the trainer, the evaluation at each of its eval points, and the records they leave.

The trainer (`train/`) knows nothing of metrics and evaluation (`eval/`) nothing of training: this
layer joins them. At each eval point it evaluates the EMA weights (every rank samples, the main
process scores), then writes the point's line in eval.jsonl, its leaderboard row and its tracker log.
It is also where a row's format lives (`leaderboard_row`), shared with re-evaluation.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import maskbench
from maskbench.config import RunConfig, config_hash, format_arm, run_id
from maskbench.data.dataset import DatasetInfo
from maskbench.eval.evaluate import Evaluator, check_eval_inputs
from maskbench.results.leaderboard import append_rows
from maskbench.train.checkpoint import RunDir, TrainState, device_name, git_sha
from maskbench.train.loop import Trainer
from maskbench.train.mfu import device_peak, matmul_precision, mfu
from maskbench.train.tracking import log_eval


def leaderboard_row(cfg: RunConfig, data: DatasetInfo, state: TrainState, point: float, result: dict,
                    params: int, n_devices: int, device: str, mfu: float | None = None) -> dict:
    """One leaderboard row: what was trained (from the config and counters) and what was measured."""
    return {
        "run_id": run_id(cfg), "arm": cfg.arm.name, "phases": format_arm(cfg.arm), "dataset": data.name,
        "model": cfg.model.name, "params": params, "resolution": data.image_size,
        "batch_size": cfg.train.batch_size, "seed": cfg.seed, "budget_flops": cfg.budget.flops, "point": point,
        "step": state.step, "samples_seen": state.step * cfg.train.batch_size, "train_flops": state.flops,
        "gpu_hours": n_devices * state.train_seconds / 3600, "device": device,
        "n_devices": n_devices, "mfu": mfu, "val_loss": result["val_loss"],
        "flops_per_s": state.flops / (state.train_seconds * n_devices) if state.train_seconds > 0 else None,
        "fid": result.get("fid"), "fid_features": result.get("fid_features"), "fid_n": result.get("fid_n"),
        "fid_ref": result.get("fid_ref"), "fd_dinov2": result.get("fd_dinov2"),
        "fd_dinov2_features": result.get("fd_dinov2_features"),
        "clip_score": result.get("clip_score"), "clip_cos": result.get("clip_cos"),
        "clip_model": result.get("clip_model"), "align_acc": result.get("align_acc"),
        "sampler_steps": cfg.eval.sampler_steps, "cfg_scale": cfg.eval.cfg_scale,
        "maskbench_version": maskbench.__version__, "git_sha": git_sha(), "config_hash": config_hash(cfg),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def record_point(run: RunDir, row: dict, result: dict, leaderboard: str | Path) -> None:
    """An evaluated point's records: its eval.jsonl line (row + per-t losses, grid, ...) and its CSV row."""
    run.record_eval(row, result)
    append_rows(leaderboard, [row])


class PointRecorder:
    """The trainer's `on_point`: evaluate the EMA weights at an eval point and record the result."""

    def __init__(self) -> None:
        self.evaluator: Evaluator | None = None  # built at the first point: its networks stay loaded

    def __call__(self, trainer: Trainer, point: float) -> None:
        acc, state = trainer.accelerator, trainer.state
        if self.evaluator is None:
            with acc.main_process_first():  # the main process writes any missing reference statistics
                self.evaluator = Evaluator(trainer.data, trainer.cfg.eval, acc.device, scores=acc.is_main_process)
        result = self.evaluator.evaluate(trainer.ema.model, trainer.run.point_samples(point), acc)
        diagnostics = trainer.block_norms.summary()
        if not acc.is_main_process:
            return
        result["diagnostics"] = diagnostics
        peak, source = device_peak(acc.device, matmul_precision(acc.mixed_precision, acc.device))
        utilisation = mfu(state.flops, state.train_seconds, acc.num_processes, peak)
        print(f"point {point:g}: {utilisation * peak / 1e12:.3g} TFLOP/s per device, MFU {utilisation:.1%} of "
              f"{peak / 1e12:.3g} ({source})")
        row = leaderboard_row(trainer.cfg, trainer.data, state, point, result, trainer.params, acc.num_processes,
                              device_name(acc.device), utilisation)
        record_point(trainer.run, row, result, trainer.cfg.paths.leaderboard)
        if trainer.cfg.train.log_with != "none":
            log_eval(acc, result, state.step)


def make_trainer(cfg: RunConfig) -> Trainer:
    """A trainer that evaluates and records its eval points; refuses, before any training, a run whose
    evaluation could not run (missing weights, reference statistics, too few held-out prompts)."""
    trainer = Trainer(cfg, on_point=PointRecorder())
    check_eval_inputs(trainer.data, cfg.eval)
    return trainer


def train(cfg: RunConfig) -> Path:
    """Train, evaluate and record one run; its run directory."""
    return make_trainer(cfg).fit()
