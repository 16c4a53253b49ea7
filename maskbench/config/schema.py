"""The run configuration's schema: typed dataclasses and enums, the shape every run's `config.yaml` has.

Only what a config *is* lives here; how one is composed from YAML (`compose`), what makes one valid
(`validate`) and what names a run (`identity`) are their own modules. What a field does to a run's name is
declared on the field (`added`: hashed only when set; `not_result`: never hashed; neither: hashed always, see
`fields`), so a new field cannot be left off a list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Optional

from maskbench.config.fields import added, not_result
from maskbench.config.presets import ModelConfig

CONF_DIR = Path(__file__).parent.parent / "conf"  # maskbench/conf
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
    grad_cosine_below=C: the debiased cosine between the phase's masked gradient and the full-token gradient,
    on the step's own batch split into `probe_splits` parts, fell below C: masking stopped paying, its
    gradient no longer points where the full one does. Its checks cost FLOPs, which the plan charges.
    per_flop: the cosine is first divided by the masked step's share of a full step's FLOPs, so C = 1 fires
    where a masked step's progress along the full gradient per FLOP falls below a full step's (a normalised
    step, as Adam's, moves the loss by about the cosine of its direction to the gradient).
    """
    val_loss_within: Optional[float] = None
    skip_norm_growth_below: Optional[float] = None
    grad_cosine_below: Optional[float] = added(None)
    every: int = 25
    probe_splits: int = added(4)  # grad_cosine_below: parts of each micro-batch (>= 3 for the debiased estimate)
    per_flop: bool = added(False)  # grad_cosine_below: compare cosine / (masked step FLOPs / full step FLOPs)


@dataclass
class Phase:
    mask_ratio: float = 0.0  # fraction of patch tokens dropped per sample
    fraction: float = 1.0    # fraction of the FLOPs budget this phase spends (its cap, with `until`)
    trainable: Trainable = added(Trainable.all)  # skips: every parameter but the long-skip layers' is frozen
    until: Optional[Until] = added(None)  # end the phase when a rule fires; the rest of its budget moves on
    lr: Optional[list[float]] = added(None)  # [start, end] × train.lr, cosine over the phase (start = end: constant);
                                             # None = the run's schedule. An author's own schedule (`*_authors` arms)
    demote: bool = added(True)            # False: no demotion route in this phase, every sample at the native
                                          # size (anima_lora's recipe demotes only in the last 75% of training)


@dataclass
class ArmConfig:
    name: str = "mask0"                      # the arm's name (rows and run ids carry it); `arm=NAME` picks a shipped arm, `arm=FILE.yaml` yours
    description: str = not_result("")        # one line for `maskbench arms`
    phases: list[Phase] = field(default_factory=lambda: [Phase()])  # the arm: each phase a mask ratio and its share of the budget (docs/arms.md)
    charge_source: bool = not_result(False)  # started from another run (init_from): its source's training FLOPs count as this arm's auxiliary compute (rows' auxiliary_flops), for a method whose cost includes making its source


@dataclass
class MixSource:
    path: str = ""        # a folder holding train/ and val/ shard dirs
    weight: float = 1.0   # relative sampling weight


@dataclass
class DataConfig:
    name: str = "synth"            # with data.path: the source its shards' manifest records (`load_config`)
    path: Optional[str] = None     # directory holding train/ and val/ shard dirs; None = generated under paths.data
    image_size: int = 32           # pixels (synth) or latent size (latent shards; read from the manifest)
    channels: int = 3                        # image channels (read from the manifest for latent shards)
    min_objects: int = 1           # synth only
    max_objects: int = 3           # synth only
    n_train: int = 50_000          # synth only
    n_val: int = 2_000             # synth only
    seed: int = 0                  # synth generation seed (not the run seed)
    num_workers: Optional[int] = not_result(None)  # loader workers per stream; None = sized from the CPUs (data order never depends on it)
    shuffle_buffer: int = 1_000              # samples in the loader's shuffle buffer
    max_bad_fraction: float = 0.05           # undecodable samples tolerated before a run stops (as a share of those read)
    mix: list[MixSource] = field(default_factory=list)  # data=mix: sources sampled by weight


@dataclass
class EvalConfig:
    points: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])  # eval points as fractions of the budget: each a cooled horizon under wsd
    n_samples: int = 256           # generated images per eval point (the first N held-out prompts)
    final_n_samples: Optional[int] = added(None)  # generated images at the final point (1.0); None = n_samples
    sampler_steps: int = 20        # Euler steps of the rectified-flow ODE
    cfg_scale: float = 2.5                   # classifier-free guidance scale at sampling
    noise_seed: int = 1234         # fixed noise per prompt index, shared by every arm and seed
    batch_size: int = not_result(128)        # images generated (and scored) per batch
    val_samples: int = 512         # held-out samples for the validation loss
    val_t: list[float] = field(default_factory=lambda: [(i + 0.5) / 8 for i in range(8)])  # the fixed t of the validation loss (its mean over these)
    grid_size: int = 64            # images in the sample grid PNG
    inception_weights: Optional[str] = not_result(None)  # local inception-2015-12-05.pt (real-data FID)
    reference_stats: Optional[str] = not_result(None)  # FID reference npz; default <data>/val/inception_stats.npz
    clip_model: Optional[str] = None         # e.g. ViT-H-14; None = no CLIP score
    clip_weights: Optional[str] = not_result(None)  # open_clip tag (cached locally) or a local weights file
    vae: Optional[str] = not_result(None)    # latent data: VAE folder in place of the one the manifest records
    dinov2_weights: Optional[str] = not_result(None)  # local timm DINOv2 weights file: adds FD-DINOv2 (real data)
    dinov2_model: str = not_result("vit_large_patch14_dinov2.lvd142m")  # the timm architecture of those weights
    bootstrap_resamples: int = added(100)  # resamples of the generated samples for the FD and CLIP errors; 0 = none


@dataclass
class BudgetConfig:
    flops: float = 1.0e13          # training FLOPs (fwd+bwd, analytic) every arm gets: 283 unmasked micro_s steps
                                   # at batch 64 (35.2 GFLOP each), ~2-3 CPU-minutes of training per arm; the
                                   # powered study (conf/study/powered.yaml) runs 4e13


@dataclass
class DemoteWindow:
    """One row of the demotion route table: samples whose t lies in `t` train at `ratio` × the native side."""
    ratio: float = 0.5                                           # demoted side / native side, in (0, 1)
    t: list[float] = field(default_factory=lambda: [0.0, 1.0])  # the closed noise window [t_lo, t_hi]
    priority: int = 0                                            # where windows overlap the highest wins (ties: first)


@dataclass
class TrainConfig:
    batch_size: int = 64           # global batch (all processes)
    lr: float = 1e-3                         # AdamW learning rate at the top of the schedule
    schedule: LRSchedule = LRSchedule.wsd  # wsd: every eval point is a cooled horizon (`maskbench.train.schedule`)
    decay_fraction: float = 0.2    # wsd: the LR decays (1 - sqrt) over the last this much of each horizon's FLOPs
    warmup_steps: int = 50                   # linear LR warm-up from 0
    weight_decay: float = 0.0                # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    grad_clip: float = 1.0                   # global gradient-norm clip (0: none)
    ema_decay: float = 0.999       # with warm-up min(decay, (1+n)/(10+n)): short runs do not lag
    caption_dropout: float = 0.1   # enables classifier-free guidance
    mixed_precision: Precision = Precision.auto  # auto: bf16 on GPUs, fp32 on CPU
    compile: bool = False                    # torch.compile the model (docs/cluster.md)
    checkpoint_minutes: float = not_result(10.0)  # minutes between periodic checkpoints
    keep_checkpoints: int = not_result(2)  # periodic checkpoints kept; eval-point checkpoints are always kept
    max_bad_steps: int = 5         # consecutive non-finite losses before stopping
    stop_at_step: Optional[int] = not_result(None)  # save and stop there, as a preemption would (resume later)
    grad_accum: int = 1            # micro-batches per step; processes × grad_accum data streams share the batch
    data_streams: Optional[int] = added(None)  # the batch's data streams on any process count, data_streams / processes micro-batches each: runs on 1, 2 or 8 processes pair (docs/runs.md); none: processes × grad_accum
    fused_optimizer: bool = not_result(True)  # fused AdamW kernel (CUDA only)
    attention: AttentionKernel = not_result(AttentionKernel.auto)  # auto: SDPA picks flash / memory-efficient kernels; math: the reference kernel
    pin_memory: bool = not_result(True)  # page-locked batches for non-blocking host-to-GPU copies (CUDA only)
    activation_checkpointing: bool = not_result(False)  # recompute each DiT block in backward: less memory, ~1/3 more compute
    dist_timeout_minutes: float = not_result(120.0)  # collective timeout: other ranks wait while rank 0 evaluates
    log_with: Tracker = not_result(Tracker.none)  # tensorboard: event files under the run dir
    mae_weight: float = added(0.0)  # MaskDiT's MAE loss on the dropped patches (needs model.decoder_depth > 0)
    downscale_window: list[float] = added(default_factory=list)  # [t_lo, t_hi]: samples with t inside train at
    downscale_factor: int = added(2)  # 1/factor resolution: the one-route shorthand of demote_routes
    demote_routes: list[DemoteWindow] = added(default_factory=list)  # the route table (FLOPs counted at each size)
    demote_gate: DemoteGate = added(DemoteGate.sample)  # sample: each sample by its own t; batch: all of a micro-batch or none
    skip_step_grad_norm: Optional[float] = added(None)  # Skip-DiT's guard as its authors wrote it: no optimizer step
                                                        # when the global grad norm (before clipping) is above this
    skip_step_grad_ratio: Optional[float] = added(None)  # the guard relative to the run: no optimizer step when that
                                                         # norm is above this × the median of the phase's last norms
    skip_step_window: int = added(25)  # skip_step_grad_ratio's last norms, per phase; it acts once it has that many
    max_skipped_share: float = not_result(0.5)  # stop (exit 2) once more than this share of the run's steps, or of a
                                                # phase's, were skipped (guard or non-finite); 1: never stop
    repa_weight: float = added(0.0)  # REPA (sihyun-yu/REPA): λ on its alignment loss, 0 = off (its default 0.5)
    repa_depth: Optional[int] = added(None)  # the aligned block from 1 (mixer, backbone, decoder); None: scaled from 8 of 28
    repa_encoder: Optional[str] = added(None)  # "synth" (the shipped repa-synth-v2), "random" (the control) or a DINOv2-B file;
                                               # None: synth on synth data, else paths.weights' DINOv2-B (train/repa.py)


@dataclass
class PathsConfig:
    runs: str = "runs"                       # where run directories go
    data: str = "data"                       # where generated synth data goes
    leaderboard: str = "results/leaderboard.csv"  # the CSV a run appends its rows to
    weights: Optional[str] = None  # folder laid out as `maskbench weights` lists; None: $MASKBENCH_WEIGHTS, if set


@dataclass
class RunConfig:
    arm: ArmConfig = field(default_factory=ArmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    paths: PathsConfig = not_result(default_factory=PathsConfig)
    seed: int = 0  # the run's seed: arms of one seed share initial weights, batches, t, dropout and noise
    init_from: Optional[str] = added(None)   # RUN_DIR or RUN_DIR@POINT: start from that run's weights
    # (`maskbench.runs.source.load_source`); the source's FLOPs are not part of this run's budget, and its run id
    # names this run (config_hash).
    init_weights: InitWeights = added(InitWeights.ema)  # which weights of the init_from source: ema or raw



def demote_routes(train: TrainConfig) -> list[DemoteWindow]:
    """The route table in the order routes are tried (highest priority first, ties in list order).

    `downscale_window` + `downscale_factor` is the one-route shorthand (ratio 1/factor), kept so that
    the runs trained with it keep their names and results.
    """
    if train.downscale_window:
        return [DemoteWindow(1 / train.downscale_factor, list(train.downscale_window))]
    return sorted(train.demote_routes, key=lambda route: -route.priority)


