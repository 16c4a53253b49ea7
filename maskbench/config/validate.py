"""What makes a composed config runnable: the semantic checks types alone cannot express.

Every refusal is one `ConfigError` line, raised before any work starts.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from maskbench.config.identity import split_source
from maskbench.config.presets import LEARNED_SKIP_SCALES, LongSkipKind, check_model
from maskbench.config.schema import LRSchedule, Phase, RunConfig, Trainable, TrainConfig, demote_routes
from maskbench.config.techniques import refuse_exclusive, techniques_of
from maskbench.errors import ConfigError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # what each train.log_with tracker imports


def check_tracker(name: str) -> str | None:
    """Why `train.log_with=name` cannot work here (its package missing), or None."""
    if name != "none" and importlib.util.find_spec(PACKAGES[name]) is None:
        return f"train.log_with={name} needs the {PACKAGES[name]} package: pip install {PACKAGES[name]}"
    return None



def validate(cfg: RunConfig) -> None:
    """Semantic checks that types alone cannot express. Raises ConfigError with one line."""
    phases = cfg.arm.phases
    if not phases:
        raise ConfigError(f"arm {cfg.arm.name!r} has no phases")
    for phase in phases:
        if not 0.0 <= phase.mask_ratio < 1.0:
            raise ConfigError(f"arm {cfg.arm.name!r}: mask ratio {phase.mask_ratio} is outside [0, 1)")
        if not 0.0 < phase.fraction <= 1.0:
            raise ConfigError(f"arm {cfg.arm.name!r}: phase fraction {phase.fraction} is outside (0, 1]")
        _validate_phase_options(cfg, phase)
    total = sum(p.fraction for p in phases)
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ConfigError(f"arm {cfg.arm.name!r}: phase fractions sum to {total:g}, not 1")
    if cfg.budget.flops <= 0:
        raise ConfigError(f"budget.flops must be positive, got {cfg.budget.flops:g}")
    if not cfg.eval.points or any(not 0.0 < p <= 1.0 for p in cfg.eval.points):
        raise ConfigError(f"eval.points must be fractions in (0, 1], got {list(cfg.eval.points)}")
    if cfg.train.grad_accum < 1:
        raise ConfigError(f"train.grad_accum must be at least 1, got {cfg.train.grad_accum}")
    _validate_streams(cfg.train)
    if cfg.arm.charge_source and not cfg.init_from:
        raise ConfigError("arm.charge_source charges the training of the run this one starts from: set init_from")
    if problem := check_tracker(cfg.train.log_with):
        raise ConfigError(problem)
    if cfg.train.keep_checkpoints < 1:
        raise ConfigError("train.keep_checkpoints must be at least 1 (the latest checkpoint is what resumes)")
    _validate_ranges(cfg)
    try:
        check_model(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _validate_techniques(cfg)
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path does not exist: {cfg.data.path}")


def _validate_ranges(cfg: RunConfig) -> None:
    """Numbers that are only meaningful in a range (one line each, as every bad input)."""
    train, ev = cfg.train, cfg.eval
    at_least = {"model.depth": (cfg.model.depth, 1), "train.batch_size": (train.batch_size, 1), "train.warmup_steps": (train.warmup_steps, 0),
                "train.max_bad_steps": (train.max_bad_steps, 1), "train.skip_step_window": (train.skip_step_window, 1),
                "eval.sampler_steps": (ev.sampler_steps, 1),
                "eval.n_samples": (ev.n_samples, 2), "eval.val_samples": (ev.val_samples, 1),
                "eval.batch_size": (ev.batch_size, 1), "eval.grid_size": (ev.grid_size, 1),
                "data.shuffle_buffer": (cfg.data.shuffle_buffer, 1),
                **({"data.num_workers": (cfg.data.num_workers, 0)} if cfg.data.num_workers is not None else {})}
    for name, (value, low) in at_least.items():
        if value < low:
            why = " (a Fréchet distance needs two samples)" if name == "eval.n_samples" else ""
            raise ConfigError(f"{name} must be at least {low}{why}, got {value}")
    fractions = {"train.ema_decay": (train.ema_decay, True), "train.caption_dropout": (train.caption_dropout, False),
                 "train.decay_fraction": (train.decay_fraction, True),
                 "data.max_bad_fraction": (cfg.data.max_bad_fraction, False),
                 "train.max_skipped_share": (train.max_skipped_share, False)}
    for name, (value, open_top) in fractions.items():
        if not (0.0 <= value < 1.0 if open_top else 0.0 <= value <= 1.0):
            raise ConfigError(f"{name} must be in [0, {'1)' if open_top else '1]'}, got {value:g}")
    if train.lr <= 0 or train.grad_clip <= 0 or train.weight_decay < 0:
        raise ConfigError(f"train.lr and train.grad_clip must be positive and train.weight_decay >= 0; got "
                          f"{train.lr:g}, {train.grad_clip:g}, {train.weight_decay:g}")
    _validate_step_guard(train)
    if cfg.init_from is not None:
        split_source(cfg.init_from)  # a malformed @POINT is refused here; the run itself in runs.launch
    if not ev.val_t or any(not 0.0 < t < 1.0 for t in ev.val_t):
        raise ConfigError(f"eval.val_t must be times in (0, 1), got {list(ev.val_t)}")


def _validate_step_guard(train: TrainConfig) -> None:
    """One step guard at a time, each bound in its range."""
    if train.skip_step_grad_norm is not None and train.skip_step_grad_ratio is not None:
        raise ConfigError("train.skip_step_grad_norm and train.skip_step_grad_ratio are two step guards: set one")
    if train.skip_step_grad_norm is not None and not train.skip_step_grad_norm > 0:
        raise ConfigError(f"train.skip_step_grad_norm must be positive (or null), got {train.skip_step_grad_norm:g}")
    if train.skip_step_grad_ratio is not None and not train.skip_step_grad_ratio > 1:
        raise ConfigError(f"train.skip_step_grad_ratio must be above 1 (a bound at the median would refuse half the "
                          f"steps), got {train.skip_step_grad_ratio:g}")


def _validate_phase_options(cfg: RunConfig, phase: Phase) -> None:
    """A skips-only phase and a switch rule: what they need (long skips, a source run, one rule)."""
    name = cfg.arm.name
    if phase.trainable == Trainable.skips:
        if cfg.model.long_skip == LongSkipKind.none or cfg.init_from is None:
            raise ConfigError(f"arm {name!r}: a `trainable: skips` phase trains new long-skip layers on a trained "
                              "DiT: it needs model.long_skip and init_from=RUN_DIR")
        if (demote_routes(cfg.train) or cfg.model.mixer_depth or cfg.model.decoder_depth
                or cfg.model.skip_scale in LEARNED_SKIP_SCALES):
            raise ConfigError(f"arm {name!r}: a `trainable: skips` phase is counted for the plain long-skip DiT "
                              "(no downscale window, mixer or decoder blocks, learned skip gates)")
    if phase.lr is not None:
        if len(phase.lr) != 2 or not all(v > 0 for v in phase.lr):
            raise ConfigError(f"arm {name!r}: a phase's lr is [start, end], two multipliers of train.lr > 0, "
                              f"got {list(phase.lr)}")
        if cfg.train.schedule != LRSchedule.constant:
            raise ConfigError(f"arm {name!r}: its phases carry their own learning rates, which replace the run's "
                              f"schedule: set train.schedule=constant (not {cfg.train.schedule}; no cooled horizons)")
    until = phase.until
    if until is None:
        return
    rules = [r for r in (until.val_loss_within, until.skip_norm_growth_below, until.grad_cosine_below) if r is not None]
    if len(rules) != 1 or until.every < 1:
        raise ConfigError(f"arm {name!r}: `until` takes one of val_loss_within / skip_norm_growth_below / "
                          f"grad_cosine_below, and every >= 1, got {until}")
    if until.per_flop and until.grad_cosine_below is None:
        raise ConfigError(f"arm {name!r}: until.per_flop scales the cosine rule: set until.grad_cosine_below")
    if phase is cfg.arm.phases[-1]:
        raise ConfigError(f"arm {name!r}: the last phase cannot end early (`until`): its budget has nowhere to go")
    if until.val_loss_within is not None and cfg.init_from is None:
        raise ConfigError(f"arm {name!r}: until.val_loss_within compares with the init_from source's validation "
                          "loss: give init_from=RUN_DIR")
    if until.skip_norm_growth_below is not None and cfg.model.long_skip == LongSkipKind.none:
        raise ConfigError(f"arm {name!r}: until.skip_norm_growth_below watches the long-skip layers: set model.long_skip")
    if until.grad_cosine_below is not None:
        _validate_cosine_rule(cfg, phase)
    elif rules[0] < 0:
        raise ConfigError(f"arm {name!r}: `until`'s threshold must be >= 0, got {rules[0]:g}")
    _validate_rule_horizons(cfg, phase)


def _validate_streams(train: TrainConfig) -> None:
    """train.data_streams fixes the global batch's streams; the micro-batches follow from the process count."""
    streams = train.data_streams
    if streams is None:
        return
    if streams < 1 or train.batch_size % streams:
        raise ConfigError(f"train.data_streams must be at least 1 and divide train.batch_size {train.batch_size}, "
                          f"got {streams}")
    if train.grad_accum != 1:
        raise ConfigError(f"train.data_streams={streams} sets the micro-batches (data_streams / processes): leave "
                          f"train.grad_accum at 1, got {train.grad_accum}")


def _validate_cosine_rule(cfg: RunConfig, phase: Phase) -> None:
    """grad_cosine_below compares the phase's masked gradient with the full one, each micro-batch in parts."""
    name, until = cfg.arm.name, phase.until
    if phase.mask_ratio <= 0:
        raise ConfigError(f"arm {name!r}: until.grad_cosine_below compares a masked gradient with the full one: "
                          "its phase needs mask_ratio > 0")
    micro = cfg.train.batch_size // (cfg.train.data_streams or cfg.train.grad_accum)  # at most, on one process
    if until.probe_splits < 3 or micro < until.probe_splits:
        raise ConfigError(f"arm {name!r}: until.probe_splits must be >= 3 (the debiased cosine pairs distinct parts) "
                          f"and at most the micro-batch ({micro}); got {until.probe_splits}")


def _validate_rule_horizons(cfg: RunConfig, phase: Phase) -> None:
    """Under wsd, a cooled horizon is the standalone run of its budget, which a rule decides like the trunk's
    only while both are in the rule's phase at a constant LR: so one rule phase, the first, ending (at its cap)
    before any horizon's LR decay starts. Its branches then never hold a rule check (`make_schedule`)."""
    phases = cfg.arm.phases
    if cfg.train.schedule != LRSchedule.wsd or all(point == 1.0 for point in cfg.eval.points):
        return
    rules = [p for p in phases if p.until is not None]
    if phase is not phases[0] or len(rules) > 1 or phase.fraction > 1 - cfg.train.decay_fraction + 1e-9:
        raise ConfigError(f"arm {cfg.arm.name!r}: cooled horizons (train.schedule=wsd, eval points before 1.0) need "
                          "its one rule phase (`until`) to be the first and to end before the LR decay (fraction "
                          f"<= 1 - train.decay_fraction = {1 - cfg.train.decay_fraction:g}); else set "
                          "eval.points=[1.0] or train.schedule=constant")


def _validate_techniques(cfg: RunConfig) -> None:
    """The options of the literature arms (long skips, MaskDiT decoder + MAE, downscaled steps)."""
    model, train = cfg.model, cfg.train
    if train.mae_weight < 0 or (train.mae_weight > 0 and model.decoder_depth < 1):
        raise ConfigError(f"train.mae_weight={train.mae_weight:g} needs model.decoder_depth >= 1 "
                          "(the MAE loss is on the decoder's predictions for dropped tokens)")
    if model.structured_mask and any(p.mask_ratio not in (0.0, 0.75) for p in cfg.arm.phases):
        raise ConfigError("model.structured_mask keeps one token per 2x2 group: every phase needs mask 0 or 0.75")
    _validate_demotion(cfg)
    _validate_repa(cfg)
    if (why := refuse_exclusive(techniques_of(cfg), described=True)) is not None:
        raise ConfigError(why)


def _validate_repa(cfg: RunConfig) -> None:
    """REPA's options (the encoder's data, latent or not, is checked where the data is known: train/repa.py)."""
    train, blocks = cfg.train, cfg.model.mixer_depth + cfg.model.depth + cfg.model.decoder_depth
    if train.repa_weight < 0:
        raise ConfigError(f"train.repa_weight must be >= 0 (0 = off), got {train.repa_weight:g}")
    if not train.repa_weight and (train.repa_depth is not None or train.repa_encoder is not None):
        raise ConfigError("train.repa_depth and train.repa_encoder do nothing without train.repa_weight > 0")
    if train.repa_depth is not None and not 1 <= train.repa_depth <= blocks:
        raise ConfigError(f"train.repa_depth={train.repa_depth} must be a block from 1 to {blocks} "
                          "(mixer, backbone and decoder blocks, in the order they run)")
    if train.repa_weight and any(p.trainable == Trainable.skips for p in cfg.arm.phases):
        raise ConfigError("train.repa_weight aligns the tokens of a fully trained model: it cannot run with a "
                          "`trainable: skips` phase")


def _validate_demotion(cfg: RunConfig) -> None:
    """Demotion routes: ratios, windows, and the sizes they give on the model's patch grid."""
    train, patch = cfg.train, cfg.model.patch_size
    window = train.downscale_window
    if not window and train.downscale_factor != TrainConfig.downscale_factor:
        raise ConfigError(f"train.downscale_factor={train.downscale_factor} does nothing without "
                          "train.downscale_window=[t_lo,t_hi] (the noise window whose samples are downscaled)")
    if window:
        if train.demote_routes:
            raise ConfigError("train.downscale_window is the one-route shorthand of train.demote_routes: set one of them")
        if len(window) != 2 or not 0.0 <= window[0] < window[1] <= 1.0:
            raise ConfigError(f"train.downscale_window must be [t_lo, t_hi] with 0 <= t_lo < t_hi <= 1, got {window}")
        if train.downscale_factor < 2 or cfg.data.image_size % (train.downscale_factor * patch):
            raise ConfigError(f"train.downscale_factor={train.downscale_factor} must be >= 2 and divide the "
                              f"{cfg.data.image_size // patch}-token grid")
    for route in train.demote_routes:
        if not 0.0 < route.ratio < 1.0:
            raise ConfigError(f"train.demote_routes: ratio {route.ratio:g} is outside (0, 1) (demoted side / native side)")
        if len(route.t) != 2 or not 0.0 <= route.t[0] < route.t[1] <= 1.0:
            raise ConfigError(f"train.demote_routes: t window must be [t_lo, t_hi] with 0 <= t_lo < t_hi <= 1, "
                              f"got {list(route.t)} (ratio {route.ratio:g})")
    routes = demote_routes(train)
    if not routes and train.demote_gate != TrainConfig.demote_gate:
        raise ConfigError(f"train.demote_gate={train.demote_gate} does nothing without train.demote_routes")
    if not routes and not all(p.demote for p in cfg.arm.phases):
        raise ConfigError(f"arm {cfg.arm.name!r}: a phase's `demote: false` does nothing without train.demote_routes "
                          "/ downscale_window (it turns the routes off in that phase)")
    if routes and cfg.model.skip_scale in LEARNED_SKIP_SCALES:
        raise ConfigError(f"model.skip_scale={cfg.model.skip_scale}'s gate is defined on the native token grid: "
                          "it cannot run the demoted steps of train.demote_routes / downscale_window")


