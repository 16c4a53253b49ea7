"""What an evaluated point leaves behind: its leaderboard row, its eval.jsonl line, its signed samples.

The trainer (`train/`) knows nothing of metrics and evaluation (`eval/`) nothing of training: `PointRecorder`,
the trainer's `on_point`, joins them. At each eval point it evaluates the EMA weights (every rank scores its
share of the samples and validation loss, the main process reduces them), then writes the point's line in
eval.jsonl, its leaderboard row and its tracker log. A row's format lives here (`leaderboard_row`), shared
with re-evaluation.
"""

from __future__ import annotations

import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

import maskbench
from maskbench.config import DRAW_SCHEME, RunConfig, config_hash, data_label, format_arm, run_id, source_label
from maskbench.data.dataset import DatasetInfo
from maskbench.eval.evaluate import Evaluator, validation_loss
from maskbench.files import write_folder_digests
from maskbench.metrics import METRICS
from maskbench.results.rows import METRIC_COLUMNS, append_rows, as_read, complete_row
from maskbench.runs.source import source_flops
from maskbench.train.checkpoint import RunDir, TrainState, device_name, git_sha, precision_name
from maskbench.train.mfu import device_peak, matmul_precision, mfu
from maskbench.train.repa import encoder_pretrain_flops
from maskbench.train.streams import stream_layout
from maskbench.train.tracking import log_eval

if TYPE_CHECKING:
    from maskbench.train.loop import Trainer


def leaderboard_row(cfg: RunConfig, data: DatasetInfo, state: TrainState, point: float, result: dict,
                    params: int, n_devices: int, device: str, mfu: float | None = None,
                    precision: str | None = None, draw_scheme: str | None = DRAW_SCHEME) -> dict:
    """One leaderboard row: what was trained (from the config and counters) and what was measured.

    `device` (the GPU model, or the CPU), `precision` and `draw_scheme` say which rows may be paired: the same
    draws give other numbers in another precision or on another kernel library's arithmetic. `encoder_flops` is
    what REPA's frozen encoder cost to train, apart from the budget as papers report it (empty: not known), and
    `auxiliary_flops` every such cost known (the encoder's, a charged source's), which a charged reading adds."""
    encoder = encoder_pretrain_flops(cfg, data)
    encoder = encoder if math.isfinite(encoder) else None  # NaN: unknown
    return complete_row({
        "run_id": run_id(cfg), "arm": cfg.arm.name, "phases": format_arm(cfg.arm), "dataset": data_label(cfg.data),
        "model": cfg.model.name, "params": params, "resolution": data.image_size,
        "batch_size": cfg.train.batch_size, "seed": cfg.seed, "budget_flops": cfg.budget.flops, "point": point,
        "step": state.step, "samples_seen": state.step * cfg.train.batch_size, "train_flops": state.flops,
        "gpu_hours": n_devices * state.train_seconds / 3600, "device": device, "precision": precision,
        "draw_scheme": draw_scheme, "encoder_flops": encoder, "auxiliary_flops": _auxiliary(cfg, encoder),
        "n_devices": n_devices, "mfu": mfu, "data_streams": stream_layout(cfg.train, n_devices)[0],
        "flops_per_s": state.flops / (state.train_seconds * n_devices) if state.train_seconds > 0 else None,
        **{column: result.get(column) for column in METRIC_COLUMNS},  # every metric and its sampling error
        "fid_features": result.get("fid_features"), "fid_n": result.get("fid_n"), "fid_ref": result.get("fid_ref"),
        "fd_dinov2_features": result.get("fd_dinov2_features"),
        "clip_cos": result.get("clip_cos"), "clip_model": result.get("clip_model"),
        "sampler_steps": cfg.eval.sampler_steps, "cfg_scale": cfg.eval.cfg_scale,
        "init_from": source_label(cfg.init_from) if cfg.init_from else None, "switch_step": state.switch_step,
        "skipped_steps": state.skipped_steps,  # steps without an update (the step guard, non-finite): FLOPs spent idle
        # gpu_hours is the training steps' time alone; the rest of the run's time, each in its own column:
        "branch_flops": state.branch_flops, "data_wait_s": state.data_wait_seconds,
        "compile_s": state.compile_seconds, "eval_s": state.eval_seconds,
        "checkpoint_s": state.checkpoint_seconds, "resume_s": state.resume_seconds,
        "maskbench_version": maskbench.__version__, "git_sha": git_sha(), "config_hash": config_hash(cfg),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"), "source": None,  # a measured row
    })


def _auxiliary(cfg: RunConfig, encoder: float | None) -> float | None:
    """Every FLOP the run spent outside its training steps that is known: its REPA encoder's pretraining, and its
    source's training when its arm charges it (`arm.charge_source`). None when neither is known."""
    source = source_flops(cfg) if cfg.arm.charge_source and cfg.init_from else None
    known = [flops for flops in (encoder, source) if flops is not None]
    return sum(known) if known else None


def record_point(run: RunDir, row: dict, result: dict, leaderboard: str | Path) -> None:
    """An evaluated point's records: its eval.jsonl line (row + per-t losses, grid, ...) and its CSV row.

    Each is signed in the run's ledger as it reads back (the line as eval.jsonl holds it, the row as
    `read_rows` types its cells), and so are the point's samples, which `maskbench repro` scores again.
    """
    point = row["point"]
    run.record_eval(row, result)
    run.sign_record("eval.jsonl", point, run.eval_records()[-1])
    append_rows(leaderboard, [row])
    run.sign_record("leaderboard", point, as_read(row))
    write_folder_digests(run.point_samples(point))
    run.sign_folder(run.point_samples(point))


class PointRecorder:
    """The trainer's `on_point`: evaluate the EMA weights at an eval point and record the result."""

    def __init__(self) -> None:
        self.evaluator: Evaluator | None = None  # built at the first point: its networks stay loaded

    def evaluator_for(self, trainer: Trainer) -> Evaluator:
        if self.evaluator is None:
            with trainer.accelerator.main_process_first():  # the main process writes missing reference statistics
                acc = trainer.accelerator
                self.evaluator = Evaluator(trainer.data, trainer.cfg.eval, acc.device, rank=acc.process_index,
                                           world=acc.num_processes)
        return self.evaluator

    def validation_loss(self, trainer: Trainer, model: nn.Module) -> float:
        """The eval points' fixed-t validation loss of `model`, for a `val_loss_within` rule (every rank)."""
        ev = trainer.cfg.eval
        return validation_loss(model, self.evaluator_for(trainer).evalset, ev.val_t, ev.noise_seed, ev.batch_size,
                               trainer.accelerator.device, ev.val_samples, trainer.accelerator)[0]

    def __call__(self, trainer: Trainer, point: float) -> None:
        acc, state = trainer.accelerator, trainer.state
        result = self.evaluator_for(trainer).evaluate(trainer.ema.model, trainer.run.point_samples(point), acc, point)
        diagnostics = trainer.block_norms.summary()
        if not acc.is_main_process:
            return
        result["diagnostics"] = diagnostics
        peak, source = device_peak(acc.device, matmul_precision(acc.mixed_precision, acc.device))
        # None when every step so far was a compile step (`compile_s`): no step time to divide by
        utilisation = mfu(state.flops, state.train_seconds, acc.num_processes, peak) if state.train_seconds else None
        if utilisation is not None:
            print(f"point {point:g}: {utilisation * peak / 1e12:.3g} TFLOP/s per device, MFU {utilisation:.1%} of "
                  f"{peak / 1e12:.3g} ({source})")
        if utilisation is not None and utilisation > 1:  # a peak measured while the machine was busy
            print("warning: MFU above 100% means the peak is too low; on a quiet machine run "
                  "`maskbench bench peak --remeasure`", file=sys.stderr)
        row = leaderboard_row(trainer.cfg, trainer.data, state, point, result, trainer.params, acc.num_processes,
                              device_name(acc.device), utilisation, precision_name(acc.mixed_precision))
        record_point(trainer.run, row, result, trainer.cfg.paths.leaderboard)
        print(point_line(row), flush=True)
        if trainer.cfg.train.log_with != "none":
            log_eval(acc, result, state.step)


def point_line(row: dict) -> str:
    """An evaluated point in one console line: each metric the row has, with its sampling error."""
    measured = [f"{metric.label} {row[metric.name]:.4g}" + (f" ± {row[metric.se_column]:.2g}"
                                                           if row.get(metric.se_column) is not None else "")
                for metric in METRICS if row.get(metric.name) is not None]
    where = f"horizon {row['point']:g}" if row["point"] < 1 else "point 1"
    return (f"{where} (step {row['step']}, {row['train_flops']:.3g} FLOPs): {', '.join(measured)}"
            + (f" ({row['fid_n']} samples)" if row.get("fid_n") else ""))
