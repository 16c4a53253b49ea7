"""Run configuration: typed dataclasses composed by Hydra from the YAML packaged in `maskbench/conf`.

Hydra's compose API (not `@hydra.main`) is used so the CLI keeps its own subcommands and so every bad
input becomes one clear line and exit code 2 *before* any work starts (`ConfigError`).
Model presets are the one-line functions in `maskbench.models.dit`, registered as the `model` group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Optional

import yaml
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from maskbench.errors import ConfigError
from maskbench.manifest import read_manifest
from maskbench.models.presets import LEARNED_SKIP_SCALES, PRESETS, LongSkipKind, ModelConfig, check_model
from maskbench.weights import REGISTRY, WeightFile, weights_folder

CONF_DIR = Path(__file__).parent / "conf"
CONFIG_GROUPS = ("model", "data", "eval")  # Hydra groups a `key=option` override picks (arm is read apart)


# The string options, validated by OmegaConf (a value outside the list is refused with the list).
LRSchedule = StrEnum("LRSchedule", "wsd constant cosine")    # the LR schedule after the linear warm-up
Precision = StrEnum("Precision", "auto no bf16 fp16")         # auto: bf16 on GPUs, fp32 (no) on CPU
AttentionKernel = StrEnum("AttentionKernel", "auto math")    # auto: SDPA picks flash / memory-efficient kernels
Tracker = StrEnum("Tracker", "none tensorboard wandb")        # experiment tracking (maskbench.train.tracking)
Trainable = StrEnum("Trainable", "all skips")                 # what a phase trains: skips = the long-skip layers only
InitWeights = StrEnum("InitWeights", "ema raw")               # which weights of an init_from source a run starts from
DemoteGate = StrEnum("DemoteGate", "sample batch")            # which samples a demotion route takes (TrainConfig)


@dataclass
class Until:
    """A rule that ends a phase early (its `fraction` is then a cap); checked every `every` steps of the phase.

    val_loss_within=X: the EMA weights' fixed-t validation loss is within X (relative) of the init_from
    source's at the point it was loaded from. skip_norm_growth_below=Y: the long-skip Linear layers' weight
    norm grew by less than Y (relative) over the last `every` steps (Skip-DiT's advice for stage 1).
    """
    val_loss_within: Optional[float] = None
    skip_norm_growth_below: Optional[float] = None
    every: int = 25


@dataclass
class Phase:
    mask_ratio: float = 0.0  # fraction of patch tokens dropped per sample
    fraction: float = 1.0    # fraction of the FLOPs budget this phase spends (its cap, with `until`)
    trainable: Trainable = Trainable.all  # skips: every parameter but the long-skip layers' is frozen
    until: Optional[Until] = None         # end the phase when a rule fires; the rest of its budget moves on
    lr: Optional[list[float]] = None      # [start, end] × train.lr, cosine over the phase (start = end: constant);
                                          # None = the run's schedule. An author's own schedule (`*_authors` arms)


@dataclass
class ArmConfig:
    name: str = "mask0"
    description: str = ""
    phases: list[Phase] = field(default_factory=lambda: [Phase()])


@dataclass
class MixSource:
    path: str = ""        # a folder holding train/ and val/ shard dirs
    weight: float = 1.0   # relative sampling weight


@dataclass
class DataConfig:
    name: str = "synth"            # with data.path: the source its shards' manifest records (`load_config`)
    path: Optional[str] = None     # directory holding train/ and val/ shard dirs; None = generated under paths.data
    image_size: int = 32           # pixels (synth) or latent size (latent shards; read from the manifest)
    channels: int = 3
    min_objects: int = 1           # synth only
    max_objects: int = 3           # synth only
    n_train: int = 50_000          # synth only
    n_val: int = 2_000             # synth only
    seed: int = 0                  # synth generation seed (not the run seed)
    num_workers: Optional[int] = None  # loader workers per stream; None = sized from the CPUs (data order never depends on it)
    shuffle_buffer: int = 1_000
    max_bad_fraction: float = 0.05
    mix: list[MixSource] = field(default_factory=list)  # data=mix: sources sampled by weight


@dataclass
class EvalConfig:
    points: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])
    n_samples: int = 256           # generated images per eval point (the first N held-out prompts)
    final_n_samples: Optional[int] = None  # generated images at the final point (1.0); None = n_samples
    sampler_steps: int = 20        # Euler steps of the rectified-flow ODE
    cfg_scale: float = 2.5
    noise_seed: int = 1234         # fixed noise per prompt index, shared by every arm and seed
    batch_size: int = 128
    val_samples: int = 512         # held-out samples for the validation loss
    val_t: list[float] = field(default_factory=lambda: [(i + 0.5) / 8 for i in range(8)])
    grid_size: int = 64            # images in the sample grid PNG
    inception_weights: Optional[str] = None  # local inception-2015-12-05.pt (real-data FID)
    reference_stats: Optional[str] = None    # FID reference npz; default <data>/val/inception_stats.npz
    clip_model: Optional[str] = None         # e.g. ViT-H-14; None = no CLIP score
    clip_weights: Optional[str] = None       # open_clip tag (cached locally) or a local weights file
    vae: Optional[str] = None                # latent data: VAE folder in place of the one the manifest records
    dinov2_weights: Optional[str] = None     # local timm DINOv2 weights file: adds FD-DINOv2 (real data)
    dinov2_model: str = "vit_large_patch14_dinov2.lvd142m"  # the timm architecture of those weights
    bootstrap_resamples: int = 100  # resamples of the generated samples for the FD and CLIP errors; 0 = none


@dataclass
class BudgetConfig:
    flops: float = 1.0e13          # training FLOPs (fwd+bwd, analytic) every arm gets: 283 unmasked micro_s steps
                                   # at batch 64 (35.2 GFLOP each), ~2-3 CPU-minutes of training per arm; the
                                   # powered study (conf/study/powered.yaml) runs 4e13


@dataclass
class DemoteRoute:
    """One row of the demotion route table: samples whose t lies in `t` train at `ratio` × the native side."""
    ratio: float = 0.5                                           # demoted side / native side, in (0, 1)
    t: list[float] = field(default_factory=lambda: [0.0, 1.0])  # the closed noise window [t_lo, t_hi]
    priority: int = 0                                            # where windows overlap the highest wins (ties: first)


@dataclass
class TrainConfig:
    batch_size: int = 64           # global batch (all processes)
    lr: float = 1e-3
    schedule: LRSchedule = LRSchedule.wsd  # wsd: every eval point is a cooled horizon (`maskbench.train.schedule`)
    decay_fraction: float = 0.2    # wsd: the LR decays (1 - sqrt) over the last this much of each horizon's FLOPs
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    ema_decay: float = 0.999       # with warm-up min(decay, (1+n)/(10+n)): short runs do not lag
    caption_dropout: float = 0.1   # enables classifier-free guidance
    mixed_precision: Precision = Precision.auto
    compile: bool = False
    checkpoint_minutes: float = 10.0
    keep_checkpoints: int = 2      # periodic checkpoints kept; eval-point checkpoints are always kept
    max_bad_steps: int = 5         # consecutive non-finite losses before stopping
    stop_at_step: Optional[int] = None  # save and stop there, as a preemption would (resume later)
    grad_accum: int = 1            # micro-batches per step; processes × grad_accum data streams share the batch
    fused_optimizer: bool = True   # fused AdamW kernel (CUDA only)
    attention: AttentionKernel = AttentionKernel.auto
    pin_memory: bool = True        # page-locked batches for non-blocking host-to-GPU copies (CUDA only)
    activation_checkpointing: bool = False  # recompute each DiT block in backward: less memory, ~1/3 more compute
    dist_timeout_minutes: float = 120.0     # collective timeout: other ranks wait while rank 0 evaluates
    log_with: Tracker = Tracker.none  # tensorboard: event files under the run dir
    mae_weight: float = 0.0        # MaskDiT's MAE loss on the dropped patches (needs model.decoder_depth > 0)
    downscale_window: list[float] = field(default_factory=list)  # [t_lo, t_hi]: samples with t inside train at
    downscale_factor: int = 2      # 1/factor resolution: the one-route shorthand of demote_routes
    demote_routes: list[DemoteRoute] = field(default_factory=list)  # the route table (FLOPs counted at each size)
    demote_gate: DemoteGate = DemoteGate.sample  # sample: each sample by its own t; batch: all of a micro-batch or none
    skip_step_grad_norm: Optional[float] = None  # Skip-DiT's guard: no optimizer step when the global grad norm
                                                 # (before clipping) is non-finite or above this; counted
    repa_weight: float = 0.0       # REPA (sihyun-yu/REPA): λ on its alignment loss, 0 = off (its default 0.5)
    repa_depth: Optional[int] = None  # the aligned block from 1 (mixer, backbone, decoder); None: scaled from 8 of 28
    repa_encoder: Optional[str] = None  # "synth" (the shipped repa-synth-v1) or a timm DINOv2-B weights file;
                                        # None: synth on synth data, else paths.weights' DINOv2-B (train/repa.py)


@dataclass
class PathsConfig:
    runs: str = "runs"
    data: str = "data"
    leaderboard: str = "results/leaderboard.csv"
    weights: Optional[str] = None  # folder laid out as `maskbench weights` lists; None: $MASKBENCH_WEIGHTS, if set


@dataclass
class RunConfig:
    arm: ArmConfig = field(default_factory=ArmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    seed: int = 0
    # RUN_DIR or RUN_DIR@POINT: start from another run's weights (`maskbench.runs.launch.load_source`). The
    # source's FLOPs are not part of this run's budget; its run id names this run (config_hash).
    init_from: Optional[str] = None
    init_weights: InitWeights = InitWeights.ema


# Fields added after the first results landed: hashed only when set, so runs that do not use them keep
# their names (and resume) across upgrades.
_HASHED_WHEN_SET = {
    "model.long_skip", "model.skip_scale", "model.skip_kappa", "model.decoder_depth",
    "train.mae_weight", "train.downscale_window", "train.downscale_factor", "train.demote_routes",
    "train.demote_gate", "model.skip_init", "train.skip_step_grad_norm", "init_from", "init_weights",
    "eval.final_n_samples", "eval.bootstrap_resamples", "model.sparse_fusion", "model.path_drop",
    "train.repa_weight", "train.repa_depth", "train.repa_encoder",
    "model.route_ratio", "model.route_start", "model.route_end",
}
# The same for the fields of each phase (a list element, so not a dotted name above).
_PHASE_HASHED_WHEN_SET = {"trainable", "until", "lr"}

# Fields that cannot change what a run learns or measures; everything else names the run.
_NOT_RESULT_FIELDS = {
    "paths", "data.num_workers", "model.kernels", "train.checkpoint_minutes",
    "train.keep_checkpoints", "train.stop_at_step", "eval.batch_size", "arm.description",
    "eval.inception_weights", "eval.clip_weights", "eval.reference_stats", "eval.vae", "eval.dinov2_weights",
    "eval.dinov2_model",
    "train.fused_optimizer", "train.attention", "train.pin_memory", "train.activation_checkpointing",
    "train.dist_timeout_minutes", "train.log_with",
}


PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # what each train.log_with tracker imports


def check_tracker(name: str) -> str | None:
    """Why `train.log_with=name` cannot work here (its package missing), or None."""
    if name != "none" and importlib.util.find_spec(PACKAGES[name]) is None:
        return f"train.log_with={name} needs the {PACKAGES[name]} package: pip install {PACKAGES[name]}"
    return None


def _register_schema() -> None:
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for name, preset in PRESETS.items():
        store.store(group="model", name=name, node=preset())


def known_arms() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "arm").glob("*.yaml"))


def shipped_arm(name: str) -> ArmConfig:
    """A shipped arm's phases and description, read from its YAML alone (no Hydra compose: `maskbench arms`)."""
    loaded = OmegaConf.load(CONF_DIR / "arm" / f"{name}.yaml")
    node = loaded.arm if "arm" in loaded else loaded
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ArmConfig), node))


def arm_settings(name: str) -> list[str]:
    """The model/train options a shipped arm sets besides its phases, as `key=value` strings."""
    loaded = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "arm" / f"{name}.yaml"))
    if "arm" not in loaded:  # a phases-only arm file
        return []
    return [f"{group}.{key}={value}" for group, options in loaded.items() if group != "arm"
            for key, value in options.items()]


def _split_arm_file(overrides: list[str]) -> tuple[list[str], Optional[Path]]:
    """`arm=path/to/arm.yaml` names a user's arm file; Hydra only knows packaged group options."""
    rest, arm_file = [], None
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "arm" and (value.endswith((".yaml", ".yml")) or "/" in value):
            arm_file = Path(value)
            if not arm_file.is_file():
                raise ConfigError(f"arm file not found: {arm_file}")
        else:
            rest.append(item)
    return rest, arm_file


def _check_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"expected key=value, got {item!r}")
        if key == "arm" and value not in known_arms():
            raise ConfigError(f"unknown arm {value!r}; known arms: {', '.join(known_arms())} "
                              "(or pass arm=path/to/arm.yaml)")
        if key == "model" and value not in PRESETS:
            raise ConfigError(f"unknown model {value!r}; known models: {', '.join(PRESETS)}")


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Compose the packaged defaults with `key=value` overrides, validate, and return a RunConfig."""
    overrides, arm_file = _split_arm_file(list(overrides))
    _check_overrides(overrides)
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="maskbench.conf", version_base=None):
            composed = compose(config_name="config", overrides=overrides)
        if arm_file is not None:
            composed = _merge_arm_file(composed, arm_file, overrides)
        cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), composed))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_one_line(err)) from None
    validate(cfg)
    _label_data(cfg.data, named=any(o.partition("=")[0].lstrip("+") in ("data", "data.name") for o in overrides))
    _fill_weights(cfg)
    return cfg


def _label_data(data: DataConfig, named: bool) -> None:
    """Data on data.path takes the name its shards' manifest records, so the run id and the rows say what
    was trained on; `named`: the command line named the data (data=NAME, data.name=NAME), and a name that
    contradicts the manifest is refused. A manifest written before sources were recorded keeps a given
    name, or else takes the folder's name, and says so in one printed line."""
    if data.path is None or data.mix:
        return
    root = Path(data.path)
    source = read_manifest(root / "train").get("source")
    if source is None:
        if not named:
            print(f"maskbench: {root / 'train' / 'manifest.json'} records no source: labelling the data "
                  f"{root.resolve().name!r} after its folder (data.name=NAME names it)")
            data.name = root.resolve().name
        return
    if named and data.name != source:
        raise ConfigError(f"data.name={data.name} contradicts the shards at {root}, whose manifest records the source "
                          f"{source!r}: drop data=/data.name= (the manifest names the data) or pass data.name={source}")
    data.name = source


def fill_eval_weights(cfg: EvalConfig, folder: Path, registry: tuple[WeightFile, ...] = REGISTRY) -> EvalConfig:
    """`cfg` with each unset eval.*_weights option pointing at its registry file in `folder`.

    A needed file is pointed at even when absent, so the loader's refusal names the path it expected; an
    optional one (FD-DINOv2) only when present, since setting it turns its metric on. A file fills its
    option only for the architecture it holds weights of (CLIP weights are ViT-H-14's).
    """
    filled = {}
    for entry in registry:
        path = folder / entry.file
        if entry.fills is None or getattr(cfg, entry.fills) is not None:
            continue
        if entry.arch is not None and getattr(cfg, entry.arch[0]) != entry.arch[1]:
            continue
        if entry.needed or path.is_file():
            filled[entry.fills] = str(path)
    return dataclasses.replace(cfg, **filled)


def _fill_weights(cfg: RunConfig) -> None:
    """eval.*_weights left unset take their file from the weights folder (paths.weights or $MASKBENCH_WEIGHTS)."""
    cfg.paths.weights = weights_folder(cfg.paths.weights)
    if cfg.paths.weights is not None:
        cfg.eval = fill_eval_weights(cfg.eval, Path(cfg.paths.weights))


def _merge_arm_file(composed: DictConfig, arm_file: Path, overrides: list[str]) -> DictConfig:
    """A user's arm file: phases only (the `arm` group's keys), or, like the shipped arms in the global
    package, an `arm:` section plus model/train options. Command-line overrides still win over the file."""
    try:
        loaded = OmegaConf.load(arm_file)
    except (UnicodeDecodeError, yaml.YAMLError) as err:  # binary, or not YAML
        raise ConfigError(f"arm file {arm_file} is not valid YAML: {_one_line(err)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"arm file {arm_file} must be a mapping with `phases` (or an `arm:` section)")
    arm_only = "arm" not in loaded
    arm = loaded if arm_only else loaded.arm
    if not isinstance(arm, DictConfig) or "phases" not in arm:
        raise ConfigError(f"arm file {arm_file} has no `phases` list: an arm is its phases "
                          "(e.g. phases: [{mask_ratio: 0.75, fraction: 1.0}])")
    if "name" not in arm:
        arm.name = arm_file.stem
    if arm_only:
        composed.arm = OmegaConf.merge(OmegaConf.structured(ArmConfig), arm)
        return composed
    values = [o for o in overrides if o.partition("=")[0] not in CONFIG_GROUPS]  # groups were composed already
    return OmegaConf.merge(composed, loaded, OmegaConf.from_dotlist(values))


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config a run recorded in its directory (what `eval` and `repro` rebuild it from)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    try:
        recorded = OmegaConf.load(path)
    except (UnicodeDecodeError, yaml.YAMLError) as err:  # a binary or truncated file: not what a run writes
        raise ConfigError(f"{path} is not a run's config (not YAML text: {_one_line(err)})") from None
    if not isinstance(recorded, DictConfig) or not recorded:  # empty, or a list: defaults would stand in for it
        raise ConfigError(f"{path} is not a run's config (not a mapping of its settings)")
    try:
        cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), recorded))
    except OmegaConfBaseException as err:
        raise ConfigError(f"{path}: {_one_line(err)}") from None
    return cfg


def with_eval_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A recorded run's config with eval.* / paths.* changed (what re-evaluation may change), validated."""
    bad = [o for o in overrides if not o.startswith(("eval.", "paths."))]
    if bad:
        raise ConfigError(f"only eval.* and paths.* can change when re-evaluating; got {bad[0]!r}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(overrides))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_one_line(err)) from None
    validate(cfg)
    _fill_weights(cfg)
    return cfg


def _one_line(err: BaseException) -> str:
    """The first line of an error and of each error that caused it (Hydra wraps OmegaConf's reason)."""
    parts = []
    while err is not None:
        text = str(err).strip()
        parts.append(text.splitlines()[0] if text else type(err).__name__)
        err = err.__cause__
    return ": ".join(parts).replace("Could not override", "unknown or invalid key:").strip()


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
    if problem := check_tracker(cfg.train.log_with):
        raise ConfigError(problem)
    if cfg.train.keep_checkpoints < 1:
        raise ConfigError("train.keep_checkpoints must be at least 1 (the latest checkpoint is what resumes)")
    _validate_ranges(cfg)
    try:
        check_model(cfg.model, cfg.data.image_size if cfg.data.path is None and not cfg.data.mix else None)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _validate_techniques(cfg)
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path does not exist: {cfg.data.path}")


def _validate_ranges(cfg: RunConfig) -> None:
    """Numbers that are only meaningful in a range (one line each, as every bad input)."""
    train, ev = cfg.train, cfg.eval
    at_least = {"model.depth": (cfg.model.depth, 1), "train.batch_size": (train.batch_size, 1), "train.warmup_steps": (train.warmup_steps, 0),
                "train.max_bad_steps": (train.max_bad_steps, 1), "eval.sampler_steps": (ev.sampler_steps, 1),
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
                 "data.max_bad_fraction": (cfg.data.max_bad_fraction, False)}
    for name, (value, open_top) in fractions.items():
        if not (0.0 <= value < 1.0 if open_top else 0.0 <= value <= 1.0):
            raise ConfigError(f"{name} must be in [0, {'1)' if open_top else '1]'}, got {value:g}")
    if train.lr <= 0 or train.grad_clip <= 0 or train.weight_decay < 0:
        raise ConfigError(f"train.lr and train.grad_clip must be positive and train.weight_decay >= 0; got "
                          f"{train.lr:g}, {train.grad_clip:g}, {train.weight_decay:g}")
    if train.skip_step_grad_norm is not None and not train.skip_step_grad_norm > 0:
        raise ConfigError(f"train.skip_step_grad_norm must be positive (or null), got {train.skip_step_grad_norm:g}")
    if cfg.init_from is not None:
        split_source(cfg.init_from)  # a malformed @POINT is refused here; the run itself in runs.launch
    if not ev.val_t or any(not 0.0 < t < 1.0 for t in ev.val_t):
        raise ConfigError(f"eval.val_t must be times in (0, 1), got {list(ev.val_t)}")


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
    rules = [r for r in (until.val_loss_within, until.skip_norm_growth_below) if r is not None]
    if len(rules) != 1 or rules[0] < 0 or until.every < 1:
        raise ConfigError(f"arm {name!r}: `until` takes one of val_loss_within / skip_norm_growth_below (>= 0) "
                          f"and every >= 1, got {until}")
    if phase is cfg.arm.phases[-1]:
        raise ConfigError(f"arm {name!r}: the last phase cannot end early (`until`): its budget has nowhere to go")
    if until.val_loss_within is not None and cfg.init_from is None:
        raise ConfigError(f"arm {name!r}: until.val_loss_within compares with the init_from source's validation "
                          "loss: give init_from=RUN_DIR")
    if until.skip_norm_growth_below is not None and cfg.model.long_skip == LongSkipKind.none:
        raise ConfigError(f"arm {name!r}: until.skip_norm_growth_below watches the long-skip layers: set model.long_skip")
    if cfg.train.schedule == LRSchedule.wsd and any(point < 1.0 for point in cfg.eval.points):
        raise ConfigError(f"arm {name!r}: a phase that ends by a rule (`until`) gives each horizon a run that leaves "
                          "the trunk where the rule fires, so its eval points cannot be cooled branches: set "
                          "train.schedule=constant (un-annealed snapshots) or eval.points=[1.0]")


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
    if train.repa_weight and (demote_routes(train) or any(p.trainable == Trainable.skips for p in cfg.arm.phases)):
        raise ConfigError("train.repa_weight aligns native-resolution tokens of a fully trained model: it cannot run "
                          "with train.demote_routes / downscale_window or a `trainable: skips` phase")


def demote_routes(train: TrainConfig) -> list[DemoteRoute]:
    """The route table in the order routes are tried (highest priority first, ties in list order).

    `downscale_window` + `downscale_factor` is the one-route shorthand (ratio 1/factor), kept so that
    the runs trained with it keep their names and results.
    """
    if train.downscale_window:
        return [DemoteRoute(1 / train.downscale_factor, list(train.downscale_window))]
    return sorted(train.demote_routes, key=lambda route: -route.priority)


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
    if routes and (any(p.mask_ratio > 0 for p in cfg.arm.phases) or cfg.model.route_ratio > 0):
        raise ConfigError("downscaled steps and token dropping or routing are separate arms: "
                          "train.demote_routes / downscale_window need every phase at mask 0 and model.route_ratio=0")
    if routes and cfg.model.skip_scale in LEARNED_SKIP_SCALES:
        raise ConfigError(f"model.skip_scale={cfg.model.skip_scale}'s gate is defined on the native token grid: "
                          "it cannot run the demoted steps of train.demote_routes / downscale_window")


def to_dict(cfg: RunConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)


def _drop_fields(tree: dict, dotted: set[str], prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if name in dotted:
            continue
        out[key] = _drop_fields(value, dotted, f"{name}.") if isinstance(value, dict) else value
    return out


def _lookup(tree: dict, dotted: str) -> object:
    for key in dotted.split("."):
        tree = tree[key]
    return tree


# How a step's random draws are keyed (`maskbench.train.schedule.step_generator`) and its data read (v2: every
# loader interleaves `LOADER_STREAMS` streams, whatever its worker count). Hashed into every run id: runs
# trained under an older scheme drew differently, so a new run must not resume one of them.
DRAW_SCHEME = "crn-v2"


def config_hash(cfg: RunConfig) -> str:
    """sha256 of the fields that change results (paths, worker counts, kernel choice excluded), and of
    the draw scheme.

    init_from is hashed as the source's run id and point, not its path: the same source moved or named
    by a relative path is the same start."""
    tree, defaults = to_dict(cfg), to_dict(RunConfig())
    unset = {name for name in _HASHED_WHEN_SET if _lookup(tree, name) == _lookup(defaults, name)}
    relevant = _drop_fields(tree, _NOT_RESULT_FIELDS | unset)
    phase_defaults = _phase_dict(Phase())
    relevant["arm"]["phases"] = [{k: v for k, v in phase.items()
                                  if k not in _PHASE_HASHED_WHEN_SET or v != phase_defaults[k]}
                                 for phase in relevant["arm"]["phases"]]
    if cfg.init_from is not None:
        relevant["init_from"] = source_label(cfg.init_from)
    relevant["draws"] = DRAW_SCHEME
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def _phase_dict(phase: Phase) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(phase), resolve=True, enum_to_str=True)


def split_source(init_from: str) -> tuple[Path, Optional[float]]:
    """RUN_DIR@POINT -> (RUN_DIR, POINT); RUN_DIR alone -> (RUN_DIR, None: its final point)."""
    path, at, point = init_from.rpartition("@")
    if not at:
        return Path(init_from), None
    try:
        return Path(path), float(point)
    except ValueError:
        raise ConfigError(f"init_from={init_from!r}: expected RUN_DIR or RUN_DIR@POINT (a fraction such as 0.5)") from None


def source_label(init_from: str) -> str:
    """The source's run id, with @point when one was given (the leaderboard's init_from column)."""
    path, point = split_source(init_from)
    return path.name if point is None else f"{path.name}@{point:g}"


def run_id(cfg: RunConfig) -> str:
    return f"{cfg.arm.name}-{cfg.data.name}-{cfg.model.name}-s{cfg.seed}-{config_hash(cfg)[:8]}"


def format_arm(arm: ArmConfig) -> str:
    """Compact phase list, e.g. `0.75@75%,0@25%` (the leaderboard's `phases` column); a rule phase's
    fraction is a cap (`0@<=30%`) and a skips-only phase says so (`/skips`)."""
    return ",".join(f"{p.mask_ratio:g}@{'<=' if p.until else ''}{p.fraction * 100:g}%"
                    f"{'/skips' if p.trainable == Trainable.skips else ''}" for p in arm.phases)
