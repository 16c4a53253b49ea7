"""One run end to end: the trainer, the evaluation at each of its eval points, and the records they leave.

The trainer (`train/`) knows nothing of metrics and evaluation (`eval/`) nothing of training: this
layer joins them. At each eval point it evaluates the EMA weights (every rank scores its share of the
samples and validation loss, the main process reduces them), then writes the point's line in eval.jsonl, its leaderboard row and its tracker log.
It is also where a row's format lives (`leaderboard_row`), shared with re-evaluation, and where a
run that starts from another run's weights (`init_from`) finds and checks them (`load_source`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import yaml
from torch import nn

import maskbench
from maskbench.config import (
    DRAW_SCHEME,
    RunConfig,
    config_hash,
    data_label,
    format_arm,
    load_run_config,
    run_id,
    source_label,
    split_source,
    to_dict,
)
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.errors import ConfigError
from maskbench.eval.clip import check_clip
from maskbench.eval.evaluate import Evaluator, check_eval_inputs, validation_loss
from maskbench.eval.fid import DinoV2Features, InceptionFeatures, MissingWeights
from maskbench.files import write_folder_digests
from maskbench.manifest import read_manifest
from maskbench.metrics import METRICS
from maskbench.models.build import build_model
from maskbench.models.dit import DiT
from maskbench.models.presets import ModelConfig
from maskbench.results.leaderboard import METRIC_COLUMNS, append_rows, as_read
from maskbench.train.checkpoint import RunDir, TrainState, device_name, git_sha, precision_name
from maskbench.train.loop import Start, Trainer, plan_run
from maskbench.train.mfu import device_peak, matmul_precision, mfu
from maskbench.train.repa import encoder_pretrain_flops
from maskbench.train.schedule import Schedule
from maskbench.train.switch import watches_val_loss
from maskbench.train.tracking import log_eval
from maskbench.weights import ENV, REGISTRY


def leaderboard_row(cfg: RunConfig, data: DatasetInfo, state: TrainState, point: float, result: dict,
                    params: int, n_devices: int, device: str, mfu: float | None = None,
                    precision: str | None = None, draw_scheme: str | None = DRAW_SCHEME) -> dict:
    """One leaderboard row: what was trained (from the config and counters) and what was measured.

    `device` (the GPU model, or the CPU), `precision` and `draw_scheme` say which rows may be paired: the same
    draws give other numbers in another precision or on another kernel library's arithmetic. `encoder_flops` is
    what REPA's frozen encoder cost to train, apart from the budget as papers report it (empty: not known)."""
    encoder = encoder_pretrain_flops(cfg, data)
    return {
        "run_id": run_id(cfg), "arm": cfg.arm.name, "phases": format_arm(cfg.arm), "dataset": data_label(cfg.data),
        "model": cfg.model.name, "params": params, "resolution": data.image_size,
        "batch_size": cfg.train.batch_size, "seed": cfg.seed, "budget_flops": cfg.budget.flops, "point": point,
        "step": state.step, "samples_seen": state.step * cfg.train.batch_size, "train_flops": state.flops,
        "gpu_hours": n_devices * state.train_seconds / 3600, "device": device, "precision": precision,
        "draw_scheme": draw_scheme, "encoder_flops": encoder if math.isfinite(encoder) else None,  # NaN: unknown
        "n_devices": n_devices, "mfu": mfu,
        "flops_per_s": state.flops / (state.train_seconds * n_devices) if state.train_seconds > 0 else None,
        **{column: result.get(column) for column in METRIC_COLUMNS},  # every metric and its sampling error
        "fid_features": result.get("fid_features"), "fid_n": result.get("fid_n"), "fid_ref": result.get("fid_ref"),
        "fd_dinov2_features": result.get("fd_dinov2_features"),
        "clip_cos": result.get("clip_cos"), "clip_model": result.get("clip_model"),
        "sampler_steps": cfg.eval.sampler_steps, "cfg_scale": cfg.eval.cfg_scale,
        "init_from": source_label(cfg.init_from) if cfg.init_from else None, "switch_step": state.switch_step,
        # gpu_hours is the training steps' time alone; the rest of the run's time, each in its own column:
        "branch_flops": state.branch_flops, "data_wait_s": state.data_wait_seconds,
        "compile_s": state.compile_seconds, "eval_s": state.eval_seconds,
        "checkpoint_s": state.checkpoint_seconds, "resume_s": state.resume_seconds,
        "maskbench_version": maskbench.__version__, "git_sha": git_sha(), "config_hash": config_hash(cfg),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


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


# Model fields a converted run may change from its source: the long skips it adds, and the kernel choice.
CONVERTIBLE = {"long_skip", "skip_scale", "skip_kappa", "skip_init", "kernels", "name"}


def load_source(cfg: RunConfig) -> Start:
    """`init_from=RUN_DIR[@POINT]`: that run's weights at its eval point POINT (default: its last one).

    `init_weights=ema` (the default) takes the EMA weights: they are what the source's eval points
    measured, so the run starts from the model whose validation loss `until.val_loss_within` compares
    with, and they are what Skip-DiT's train_skip_dit.py loads from a checkpoint that has them. `raw`
    takes the trained weights. Only weights carry over: the optimizer, the EMA's history, the step and
    the FLOPs start afresh, and the source's FLOPs are not part of this run's budget (the leaderboard's
    `init_from` column says where a run started). Checked here, before any work: the source is a run
    with a checkpoint at that point, its architecture is this run's apart from the long skips, and its
    weights load strictly except for exactly the skip layers this run adds.
    """
    path, point = split_source(cfg.init_from)
    source_cfg, run = load_run_config(path), RunDir(path)
    changed = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in CONVERTIBLE
               and getattr(cfg.model, f.name) != getattr(source_cfg.model, f.name)]
    if changed:
        raise ConfigError(f"init_from={cfg.init_from}: its model differs from this run's in {', '.join(changed)} "
                          "(only the long skips may change)")
    saved = run.saved_points()
    point = saved[-1] if point is None and saved else point
    if point not in saved:
        raise ConfigError(f"init_from={cfg.init_from}: no checkpoint at point {point} "
                          f"(have: {', '.join(f'{p:g}' for p in saved) or 'none'})")
    ckpt = run.point_checkpoint(point)
    weights = run.ema_weights(ckpt) if cfg.init_weights == "ema" else run.raw_weights(ckpt)
    with torch.device("meta"):  # shapes only: refuse a mismatch before any data is generated
        check_source_weights(build_model(cfg.model, resolve_dataset(cfg.data, cfg.paths.data, create=False)),
                             weights, cfg.init_from)
    val_losses = [r["val_loss"] for r in run.eval_records() if r["point"] == point]
    if any(p.until and watches_val_loss(p.until) for p in cfg.arm.phases):
        _check_comparable(cfg, source_cfg)
    return Start(lambda model: model.load_state_dict(weights, strict=False),
                 val_losses[-1] if val_losses else None)


def check_source_weights(model: DiT, weights: dict[str, torch.Tensor], source: str) -> None:
    """The source's weights must fit `model` key for key and shape for shape, except the skip layers it adds."""
    expected = model.state_dict()
    new = {name for name, _ in model.skip_parameters()}
    missing, unexpected = set(expected) - set(weights) - new, set(weights) - set(expected)
    mismatched = [k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape]
    if missing or unexpected or mismatched:
        raise ConfigError(f"init_from={source}: its weights do not fit this model (missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}, other shapes {sorted(mismatched)[:3]})")


def _check_comparable(cfg: RunConfig, source_cfg: RunConfig) -> None:
    """A validation loss compared with the source's must be measured the same way, on the same data."""
    same = [cfg.eval.val_t == source_cfg.eval.val_t, cfg.eval.val_samples == source_cfg.eval.val_samples,
            cfg.eval.noise_seed == source_cfg.eval.noise_seed, to_dict(cfg)["data"] == to_dict(source_cfg)["data"]]
    if not all(same):
        raise ConfigError(f"until.val_loss_within compares with {cfg.init_from}'s validation loss: use its data and "
                          "eval.val_t / eval.val_samples / eval.noise_seed")


def make_trainer(cfg: RunConfig) -> Trainer:
    """A trainer that evaluates and records its eval points; refuses, before any training, a run whose
    evaluation could not run (missing weights, reference statistics, too few held-out prompts) or whose
    init_from source does not fit."""
    start = load_source(cfg) if cfg.init_from else None
    recorder = PointRecorder()
    trainer = Trainer(cfg, on_point=recorder, start=start, validation=recorder.validation_loss)
    check_eval_inputs(trainer.data, cfg.eval)
    trainer.accelerator.print("\n".join(plan_lines(cfg, trainer.data, trainer.schedule, exists=True)), flush=True)
    return trainer


def train(cfg: RunConfig) -> Path:
    """Train, evaluate and record one run; its run directory."""
    return make_trainer(cfg).fit()


# --------------------------------------------------------------------------------------------- dry run
def dry_run(cfg: RunConfig, n_processes: int = 1) -> list[str]:
    """`maskbench run --dry-run`: check what the run needs and return its plan, training and writing nothing.

    The checks a run makes before its first step, in its order: the init_from source, the shards (each
    one its manifest lists, there at its size), the model against the data's size, the budget
    (`make_schedule` refuses one too small for a step), the evaluation's inputs (weights, reference
    statistics). Synth data not generated yet is planned from its config; its evaluation inputs are
    checked once it exists (synth scenes need no downloaded weights but an optional CLIP).
    """
    if cfg.init_from:
        load_source(cfg)
    data, schedule = plan_run(cfg, n_processes)
    exists = (data.val_dir / "manifest.json").is_file()
    if exists:
        for shard_dir in (data.val_dir, *(train for train, _ in data.mix or [(data.train_dir, 1.0)])):
            check_shards(shard_dir)
    check_weights(cfg, data)
    if exists:
        check_eval_inputs(data, cfg.eval)
    elif cfg.eval.clip_model:
        check_clip(cfg.eval.clip_model, cfg.eval.clip_weights)
    return plan_lines(cfg, data, schedule, exists)


def check_weights(cfg: RunConfig, data: DatasetInfo) -> None:
    """Every weight file the run's evaluation loads is there; else one line naming all that are not, and the
    one setting that points every metric at a folder holding them (paths.weights).

    The evaluation's own checks (`check_eval_inputs`) stop at the first missing file; someone fetching
    weights by hand for a cluster wants the whole list at once. Real data always computes FID (Inception);
    CLIP and DINOv2 weights are loaded when their options are set.
    """
    ev, folder = cfg.eval, cfg.paths.weights
    loads = {"inception_weights": (not data.synthetic, lambda: InceptionFeatures.check_weights(ev.inception_weights)),
             "clip_weights": (ev.clip_model is not None, lambda: check_clip(ev.clip_model, ev.clip_weights)),
             "dinov2_weights": (not data.synthetic and ev.dinov2_weights is not None,
                                lambda: DinoV2Features.check_weights(ev.dinov2_weights, ev.dinov2_model))}
    files = {entry.fills: entry.file for entry in REGISTRY if entry.fills}
    missing, explicit = [], []
    for option, (loaded, check) in loads.items():
        try:
            if loaded:
                check()
        except MissingWeights:
            path = getattr(ev, option)
            missing.append(f"eval.{option}={path}" if path else f"{files[option]} (eval.{option} unset)")
            if path and (folder is None or Path(path) != Path(folder) / files[option]):
                explicit.append(f"eval.{option}")
    if missing:
        fix = (f"put them in {folder} (paths.weights) under the names `maskbench weights` lists" if folder else
               f"fetch the files `maskbench weights` lists into one folder and set paths.weights=DIR (or {ENV}=DIR)")
        given = f"; {', '.join(explicit)} given explicitly win over it" if explicit else ""
        raise MissingWeights(f"missing weights: {', '.join(missing)}: {fix}{given}")


def check_shards(shard_dir: Path) -> None:
    """Every shard the manifest lists is there, readable, at the size it records (`data verify` reads them all)."""
    for entry in read_manifest(shard_dir)["shards"]:
        path = shard_dir / entry["name"]
        try:
            size = path.stat().st_size
            path.open("rb").close()
        except OSError as err:
            raise ConfigError(f"shard {path} is not readable: {err.strerror}") from None
        if size != entry["bytes"]:
            raise ConfigError(f"shard {path} has {size} bytes, its manifest says {entry['bytes']}: "
                              f"`maskbench data verify {shard_dir}`")


def plan_lines(cfg: RunConfig, data: DatasetInfo, schedule: Schedule, exists: bool) -> list[str]:
    """The plan as printed: run, data, phases (steps, FLOPs), eval points (step, branch), total, time."""
    run = RunDir(Path(cfg.paths.runs) / run_id(cfg))
    state = "finished: not retrained" if run.is_finished() else "exists: resumes" if run.root.exists() else "new"
    where = (f"{data.train_dir.parent}" if exists
             else f"{data.train_dir.parent}: not generated yet, generated on the first run "
                  f"({cfg.data.n_train} train + {cfg.data.n_val} held-out scenes)")
    lines = [f"run       {run.root} ({state})", f"arm       {cfg.arm.name}: {format_arm(cfg.arm)}",
             (f"data      {data.name}, {data.image_size}px x {data.channels}{' latents' if data.latent else ''} "
              f"at {where}"),
             f"model     {cfg.model.name}, batch {cfg.train.batch_size}, budget {cfg.budget.flops:.3g} FLOPs"]
    for phase in schedule.phases:
        lines.append(f"phase {phase.index}   mask {phase.mask_ratio:g}: steps {phase.start}-"
                     f"{phase.start + phase.steps - 1} ({phase.steps} steps, {phase.flops:.3g} FLOPs)")
    points = {point: f"eval      point {point:g} at step {step}" for step, point in schedule.eval_steps.items()}
    branches = 0
    for horizon in schedule.horizons:
        own = horizon.schedule
        flops = sum(own.phase_at(step)[1] for step in range(horizon.fork, own.total_steps))
        branches += flops
        points[horizon.point] = (f"eval      point {horizon.point:g} at step {own.total_steps}, a cooled horizon: "
                                 f"branches off the trunk at step {horizon.fork}, {own.total_steps - horizon.fork} "
                                 f"steps, {flops:.3g} FLOPs")
    lines += [points[point] for point in sorted(points)]
    total = schedule.total_flops + branches
    lines.append(f"FLOPs     {total:.3g} ({schedule.total_flops:.3g} trunk + {branches:.3g} branches), "
                 f"{schedule.total_steps} trunk steps")
    lines.append(f"paired    with every arm of seed {cfg.seed}: initial weights, batches, t, caption dropout, noise "
                 f"({DRAW_SCHEME}); the mask is the arm's own")
    rate = measured_rate(cfg)
    lines.append(f"time      ~{total / rate[0] / 60:.3g} min at {rate[0]:.3g} FLOP/s, measured by {rate[1]}"
                 if rate else "time      no measured step rate yet")
    return lines


def measured_rate(cfg: RunConfig) -> tuple[float, str] | None:
    """Training FLOP/s of this machine's latest run of the same model and batch under paths.runs, and that run.

    Read from its metrics.jsonl (cumulative FLOPs over training seconds); a run on another device or
    process count does not count."""
    device = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model, found = to_dict(cfg)["model"], []
    for metrics in Path(cfg.paths.runs).glob("*/metrics.jsonl"):
        try:
            recorded = yaml.safe_load((metrics.parent / "config.yaml").read_text())
            env = json.loads((metrics.parent / "env.json").read_text())
            last = json.loads(metrics.read_text().splitlines()[-1])
            same = (recorded["model"] == model and recorded["train"]["batch_size"] == cfg.train.batch_size
                    and env["device"] == device and env["n_devices"] == 1)
            rate = last["flops"] / last["seconds"]
        except (OSError, ValueError, KeyError, IndexError, TypeError, ZeroDivisionError, yaml.YAMLError):
            continue  # a run killed while writing, or not a run: no rate from it
        if same:
            found.append((metrics.stat().st_mtime, rate, metrics.parent.name))
    return max(found)[1:] if found else None
