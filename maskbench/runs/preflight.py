"""A run before its first step: the checks it makes and the plan it prints (`--dry-run`: these alone).

`dry_run` makes every check a run makes before training (the init_from source, the shards, the model
against the data, the budget, the evaluation's weights and reference statistics) and returns the plan
`plan_lines` prints at a run's start, with the time it should take at this machine's measured rate.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from maskbench.config import DRAW_SCHEME, RunConfig, format_arm, to_dict
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.errors import ConfigError
from maskbench.eval.clip import check_clip
from maskbench.eval.evaluate import check_eval_inputs
from maskbench.eval.fid import DinoV2Features, InceptionFeatures, MissingWeights
from maskbench.manifest import read_manifest
from maskbench.runs.source import load_source
from maskbench.train.build import new_model, run_schedule
from maskbench.train.checkpoint import RunDir, device_name
from maskbench.train.schedule import Schedule
from maskbench.weights import ENV, REGISTRY


def dry_run(cfg: RunConfig, n_processes: int = 1) -> list[str]:
    """`maskbench run --dry-run`: check what the run needs and return its plan, training and writing nothing.

    The checks a run makes before its first step, in its order: the init_from source, the shards (each
    one its manifest lists, there at its size), the model against the data's size, the budget
    (`make_schedule` refuses one too small for a step), the evaluation's inputs (weights, reference
    statistics). Synth data not generated yet is planned from its config; its evaluation inputs are
    checked once it exists (synth scenes need no downloaded weights but an optional CLIP).
    """
    data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
    if cfg.init_from:
        load_source(cfg, data)
    schedule = run_schedule(cfg, n_processes, data)
    with torch.device("meta"):  # the model against the data's size (the DiT's own check), on shapes alone
        new_model(cfg, data)
    exists = (data.val_dir / "manifest.json").is_file()
    if exists:
        for shard_dir in (data.val_dir, *(train for train, _ in data.mix or [(data.train_dir, 1.0)])):
            check_shards(shard_dir)
    check_weights(cfg, data)
    if exists:
        check_eval_inputs(data, cfg.eval)
    elif cfg.eval.clip_model:
        check_clip(cfg.eval.clip_model, cfg.eval.clip_weights)
    return plan_lines(cfg, data, schedule, RunDir.of(cfg), exists)


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


def plan_lines(cfg: RunConfig, data: DatasetInfo, schedule: Schedule, run: RunDir, exists: bool) -> list[str]:
    """The plan as printed: run, data, phases (steps, FLOPs), eval points (step, branch), total, time."""
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
    model, found = None, []
    for metrics in Path(cfg.paths.runs).glob("*/metrics.jsonl"):
        model = to_dict(cfg)["model"] if model is None else model  # converted once, and only if there is a run
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
