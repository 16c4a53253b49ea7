"""What a run builds before its first step, handed to the loop (`train.loop.Trainer`): the accelerator, the plan,
the model with its EMA, REPA's parts and the optimizer (`Parts`), and, once the run starts, its directory and
trackers (`open_run`).

The model is built before any data is generated or anything is written. The config's validation refused what the
config alone decides (`config.presets.check_model`); the DiT's constructor checks what depends on the data's size
(`check_grid`), which for latent shards is known only once their manifest is read: a bad `model.*` is one line,
nothing on disk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
from timm.layers import set_fused_attn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from maskbench.config import RunConfig, demote_routes, to_dict
from maskbench.data.dataset import DatasetInfo
from maskbench.errors import ConfigError
from maskbench.models.build import build_model
from maskbench.models.dit import DiT
from maskbench.train.checkpoint import RunDir, TrainState, environment
from maskbench.train.ddp import rewrap
from maskbench.train.diagnostics import BlockNorms
from maskbench.train.ema import EMA
from maskbench.train.repa import Repa, make_repa
from maskbench.train.schedule import Schedule, make_schedule
from maskbench.train.streams import stream_layout
from maskbench.train.tracking import flat_scalars


@dataclass
class Start:
    """A run that starts from another run's weights (`init_from`), as `maskbench.runs.launch` loads it."""
    load: Callable[[DiT], None]   # puts the source's weights into the freshly built model (before the EMA copy)
    val_loss: float | None        # the source's fixed-t validation loss at that point (`until.val_loss_within`)


def make_accelerator(cfg: RunConfig, run: RunDir | None = None) -> Accelerator:
    """bf16 on GPUs, fp32 on CPU; the LR schedule steps once per optimizer step (accelerate's default
    steps it once per process), and collectives wait out rank 0's evaluations. Trackers write into `run` (the
    config's own run directory when not given)."""
    cuda = torch.cuda.is_available()
    precision = cfg.train.mixed_precision
    if precision == "auto":
        precision = "bf16" if cuda else "no"
    timeout = InitProcessGroupKwargs(timeout=timedelta(minutes=cfg.train.dist_timeout_minutes))
    # No search for unused parameters: each phase's wrapper registers exactly what it trains (`train.ddp`).
    # The model's buffers (fixed positions, the synth token table) never change: no rebroadcast each forward.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=False, broadcast_buffers=False)
    trackers = None if cfg.train.log_with == "none" else cfg.train.log_with
    acc = Accelerator(cpu=not cuda, mixed_precision=precision, step_scheduler_with_optimizer=False,
                      kwargs_handlers=[timeout, ddp], log_with=trackers, project_dir=str((run or RunDir.of(cfg)).root))
    # the micro-batches per step depend on the process count once train.data_streams fixes the streams
    acc.gradient_accumulation_steps = stream_layout(cfg.train, acc.num_processes)[1]
    return acc


def run_schedule(cfg: RunConfig, n_processes: int, data: DatasetInfo) -> Schedule:
    """The run's schedule on the data it will read (not generated yet if synth): a batch that does not split
    over the data streams, or a budget too small for one step, is refused before any data is generated."""
    n_streams = stream_layout(cfg.train, n_processes)[0]
    if cfg.train.batch_size % n_streams:
        how = "train.data_streams" if cfg.train.data_streams else "processes × train.grad_accum"
        raise ConfigError(f"train.batch_size {cfg.train.batch_size} must be divisible by {how} = {n_streams}")
    return make_schedule(cfg, data, n_streams)


def new_model(cfg: RunConfig, data: DatasetInfo) -> DiT:
    """The run's DiT, initialised from the global RNG. One it cannot build is a bad input (exit 2): the DiT's
    constructor checks the model against the data's size (`check_grid`), which for latent shards is known only
    here."""
    try:
        return build_model(cfg.model, data)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def checkpoint_blocks(model: DiT) -> None:
    """Recompute every mixer and backbone block in backward instead of keeping its activations.

    The wrapper is set on the block instances, not on the class, so a copy taken before (the EMA)
    keeps plain blocks; a copy taken after would still call this model's blocks.
    """
    for block in [*model.mixer, *model.blocks, *model.decoder]:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


@dataclass
class Parts:
    """What the loop trains with. `model` is the accelerator's (DDP-wrapped on several processes), `net` the bare
    DiT; `forward` the training forward (compiled when `train.compile`); `trained` what the optimizer updates."""
    accelerator: Accelerator
    model: nn.Module
    net: DiT
    forward: Callable[..., torch.Tensor]
    ema: EMA
    repa: Repa | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    trained: list[nn.Parameter]
    block_norms: BlockNorms
    params: int               # the DiT's parameter count (rows report it)
    compile: bool

    @property
    def wrapped(self) -> tuple[nn.Module, ...]:
        """The DDP modules a backward all-reduces: the model, and REPA's projector when on."""
        return (self.model,) if self.repa is None else (self.model, self.repa)

    def wrap_again(self) -> None:
        """A new DDP wrapper for what requires a gradient now (a phase switch: `train.ddp`); none on one process."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = rewrap(self.accelerator, self.model)
            self.forward = compiled(self.model, self.compile)


def compiled(model: nn.Module, compile: bool) -> Callable[..., torch.Tensor]:
    """The training forward. Static shapes: K changes with the mask ratio, so each phase compiles its own
    graph once."""
    return torch.compile(model, dynamic=False) if compile else model


def build_parts(cfg: RunConfig, data: DatasetInfo, acc: Accelerator, start: Start | None,
                lr_factor: Callable[[int], float]) -> Parts:
    """The model (from the run seed alone, and `start`'s weights), its EMA, REPA's projector and hook, AdamW and
    the LR scheduler (`lr_factor(step)`: the schedule in force), each prepared by the accelerator."""
    torch.manual_seed(cfg.seed)  # initial weights: a function of the run seed alone
    set_fused_attn(True)  # timm's Attention built next uses SDPA even where its settings would not
    # On the accelerator's device before the EMA copies it: the EMA must live where the model trains.
    model = new_model(cfg, data).to(acc.device)
    if start is not None:
        start.load(model)
    ema = EMA(model, cfg.train.ema_decay)
    block_norms = BlockNorms(model)  # after the EMA copy: only the training model records
    repa = make_repa(cfg, data, model)  # REPA's projector + hook (None when off), also after the copy
    trained = [*model.parameters(), *(repa.parameters() if repa is not None else ())]
    if cfg.train.activation_checkpointing:
        checkpoint_blocks(model)
    fused = cfg.train.fused_optimizer and acc.device.type == "cuda"
    optimizer = torch.optim.AdamW(trained, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                  weight_decay=cfg.train.weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    params = sum(p.numel() for p in model.parameters())
    wrapped, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    if repa is not None:  # its own DDP wrapper (the projector's grads all-reduced) and checkpoint file
        repa = acc.prepare(repa)
    if cfg.train.compile:  # a demotion route's sub-batches take 2 graphs per input size (`batch_dynamic`)
        sizes = 1 + len({route.ratio for route in demote_routes(cfg.train)})
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * sizes)
    # Unwrapped once: accelerate's unwrap_model walks every module per call, ~1.5 ms a step on a small model.
    return Parts(acc, wrapped, acc.unwrap_model(wrapped), compiled(wrapped, cfg.train.compile), ema, repa,
                 optimizer, scheduler, trained, block_norms, params, cfg.train.compile)


def open_run(cfg: RunConfig, parts: Parts, run: RunDir, counters: TrainState) -> None:
    """A run about to train: what its checkpoints hold, its directory (rank 0) and its trackers (TensorBoard:
    RUN_DIR/maskbench/; W&B: project maskbench, run = run id)."""
    acc = parts.accelerator
    acc.register_for_checkpointing(parts.ema, counters)  # this order names their files (checkpoint.EMA_FILE)
    if acc.is_main_process:
        run.create(to_dict(cfg), environment(acc))
    acc.wait_for_everyone()
    if cfg.train.log_with != "none":
        acc.init_trackers("maskbench", config=flat_scalars(to_dict(cfg)), init_kwargs={"wandb": {"name": run.root.name}})
