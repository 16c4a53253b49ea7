"""`init_from=RUN_DIR[@POINT]`: a run that starts from another run's weights finds them and checks, before any
work, that they fit (`load_source`).
"""

from __future__ import annotations

import dataclasses

import torch

from maskbench.config import RunConfig, load_run_config, split_source, to_dict
from maskbench.config.presets import ModelConfig
from maskbench.data.dataset import DatasetInfo
from maskbench.errors import ConfigError
from maskbench.models.build import build_model
from maskbench.models.dit import DiT
from maskbench.results.rows import auxiliary_flops
from maskbench.train.checkpoint import RunDir
from maskbench.train.loop import Start
from maskbench.train.switch import watches_val_loss

# Model fields a converted run may change from its source: the long skips it adds, and the kernel choice.
CONVERTIBLE = {"long_skip", "skip_scale", "skip_kappa", "skip_init", "kernels", "name"}


def load_source(cfg: RunConfig, data: DatasetInfo) -> Start:
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
        check_source_weights(build_model(cfg.model, data), weights, cfg.init_from)
    val_losses = [r["val_loss"] for r in run.eval_records() if r["point"] == point]
    if any(p.until and watches_val_loss(p.until) for p in cfg.arm.phases):
        _check_comparable(cfg, source_cfg)
    return Start(lambda model: model.load_state_dict(weights, strict=False),
                 val_losses[-1] if val_losses else None)


def source_flops(cfg: RunConfig) -> float | None:
    """What the source of `init_from` cost up to the point this run starts from: its training FLOPs and its own
    auxiliary ones (a source that was itself charged for its source carries that too), from its eval record at
    that point. None: the source has no record there (it never evaluated it)."""
    path, point = split_source(cfg.init_from)
    run = RunDir(path)
    point = run.saved_points()[-1] if point is None and run.saved_points() else point
    records = [record for record in run.eval_records() if record["point"] == point]
    return records[-1]["train_flops"] + (auxiliary_flops(records[-1]) or 0.0) if records else None


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
