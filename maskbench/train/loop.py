"""The training loop: one run = (arm, data, model, budget, seed), trained to its FLOPs budget.

Every phase of the arm gets its share of the FLOPs budget as whole steps (`plan_phases`). All
randomness of a step (timesteps, noise, caption dropout, which tokens are dropped) comes from one
generator per purpose seeded by (run seed, data stream, step, purpose), so arms with one seed share
every draw but the mask, and the loader seeks to its saved position on resume, so a resumed run is
bit-identical to an uninterrupted one on CPU. Each eval point before the last is a cooled horizon: a
decay branch run from the trunk and put back (`horizons.run_branch`). Training seconds are the steps' own
time: data wait, compilation, evaluation, checkpointing and resuming are counted apart; wall-clock never
decides when a run stops.

Data parallelism: the global batch `train.batch_size` is split over processes × `train.grad_accum`
data streams. Stream s = rank · grad_accum + micro-batch reads its own disjoint share of the shards
(`stream_shards`) and draws its randomness from (seed, s, step), so what a step trains on depends on
the stream count only: 2 processes × 1 micro-batch and 1 process × 2 micro-batches run the same
steps (up to float summation order). Gradients are all-reduced by the DDP wrapper `prepare` adds,
every rank decides together (one gather per step) whether a step was finite and whether to stop,
and only rank 0 writes logs, evaluations and leaderboard rows.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, gather_object
from timm.layers import set_fused_attn
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from maskbench.config import RunConfig, demote_routes, run_id, to_dict
from maskbench.config.presets import check_model
from maskbench.data.dataset import DatasetInfo, generate_synth, resolve_dataset
from maskbench.data.loader import ShardLoader, auto_workers, make_loader, worker_counts
from maskbench.errors import ConfigError
from maskbench.files import write_atomic
from maskbench.models.build import batch_context, build_model, loader_decoder
from maskbench.models.dit import DiT
from maskbench.models.inputs import StepContext, StepInputs
from maskbench.models.masking import host_to_device
from maskbench.models.objective import sample_t, windowed_flow_loss
from maskbench.train.checkpoint import RunDir, TrainState, environment, load_checkpoint, save_checkpoint
from maskbench.train.ddp import rewrap
from maskbench.train.diagnostics import BlockNorms
from maskbench.train.ema import EMA
from maskbench.train.guard import StepGuard
from maskbench.train.horizons import run_branch
from maskbench.train.repa import make_repa
from maskbench.train.schedule import (
    Horizon,
    PhasePlan,
    Schedule,
    make_schedule,
    step_generator,
)
from maskbench.train.steplog import batch_digest, draw_digest, write_step
from maskbench.train.switch import PhaseRules, watches_val_loss
from maskbench.train.timing import StepTimer
from maskbench.train.tracking import flat_scalars


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. non-finite losses in a row); the message says why."""


def checkpoint_blocks(model: DiT) -> None:
    """Recompute every mixer and backbone block in backward instead of keeping its activations.

    The wrapper is set on the block instances, not on the class, so a copy taken before (the EMA)
    keeps plain blocks; a copy taken after would still call this model's blocks.
    """
    for block in [*model.mixer, *model.blocks, *model.decoder]:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def attention_kernels(choice: str) -> contextlib.AbstractContextManager:
    """auto lets SDPA pick flash / memory-efficient kernels; math forces the unfused reference kernel."""
    return sdpa_kernel(SDPBackend.MATH) if choice == "math" else contextlib.nullcontext()


@dataclass
class StepDraws:
    """One stream's micro-batch on the device and every draw of its step (`Trainer.step_draws`): what every
    arm with this seed shares, and the arm's own technique inputs."""
    x0: torch.Tensor                  # b×C×H×W
    t: torch.Tensor                   # b, on the host
    drop: torch.Tensor                # b bool: caption dropped
    noise: torch.Tensor               # b×C×H×W
    context: torch.Tensor             # b×T(×D)
    context_mask: torch.Tensor        # b×T
    inputs: StepInputs                # the mask, TREAD's route, SPRINT's path drop, demotion, REPA

    def loss_args(self, index: torch.Tensor | None = None) -> tuple:
        """(x0, noise, t, context, context_mask, drop) for `objective.flow_loss`, of the samples `index` picks."""
        args = (self.x0, self.noise, self.t, self.context, self.context_mask, self.drop)
        return args if index is None else tuple(x[index.to(x.device)] for x in args)


@dataclass
class Start:
    """A run that starts from another run's weights (`init_from`), as `maskbench.runs.launch` loads it."""
    load: Callable[[DiT], None]   # puts the source's weights into the freshly built model (before the EMA copy)
    val_loss: float | None        # the source's fixed-t validation loss at that point (`until.val_loss_within`)


@contextlib.contextmanager
def preemption_handler(trainer: Trainer) -> Iterator[None]:
    """While training, SIGINT/SIGTERM only ask the loop to checkpoint and stop at the end of the step."""
    def request_stop(signum, _frame):
        trainer.stop_signal = signum
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Trainer:
    def __init__(self, cfg: RunConfig, accelerator: Accelerator | None = None,
                 on_point: Callable[[Trainer, float], None] | None = None, start: Start | None = None,
                 validation: Callable[[Trainer, nn.Module], float] | None = None, data: DatasetInfo | None = None):
        """on_point(trainer, point) runs on every rank after an eval point's checkpoint (None: checkpoints only).
        start: the init_from source; validation(trainer, model): the fixed-t validation loss a
        `val_loss_within` rule checks (evaluation lives above training, so it is handed in); data: the run's
        data as the caller resolved it (`resolve_dataset(create=False)`), resolved here when not given."""
        self.cfg, self.on_point, self.start, self.validation = cfg, on_point, start, validation
        self.accelerator = accelerator or make_accelerator(cfg)
        self.n_streams = self.accelerator.num_processes * cfg.train.grad_accum
        if any(p.until and watches_val_loss(p.until) for p in cfg.arm.phases) and (
                validation is None or start is None or start.val_loss is None):
            raise ConfigError("until.val_loss_within needs the source run's validation loss at its point "
                              "(an init_from source evaluated there)")
        self.data, self.schedule = plan_run(cfg, self.accelerator.num_processes, data)
        self.num_workers = loader_workers(cfg.data.num_workers, cfg.train.grad_accum)
        self.demote_routes = demote_routes(cfg.train)  # a route's ratio missing from latent shards is refused by the plan
        with self.accelerator.main_process_first():  # rank 0 generates missing synth data, the others read it
            generate_synth(cfg.data, cfg.paths.data)
        self.run = RunDir(Path(cfg.paths.runs) / run_id(cfg))
        self.stop_signal: int | None = None
        self.guard = StepGuard(cfg.train)  # which steps are skipped, and the stop when too many were
        self.branch: Horizon | None = None  # the cooled horizon being trained, if any (`horizons.run_branch`)
        self.last_checkpoint = time.monotonic()  # when the trunk last saved (periodic checkpoints)

    @property
    def active(self) -> Schedule:
        """The schedule the current step follows: a horizon's branch, or the trunk."""
        return self.branch.schedule if self.branch is not None else self.schedule

    @property
    def streams(self) -> range:
        """This rank's data streams, one per micro-batch."""
        accum = self.cfg.train.grad_accum
        return range(self.accelerator.process_index * accum, (self.accelerator.process_index + 1) * accum)

    # ----------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        torch.manual_seed(cfg.seed)  # initial weights: a function of the run seed alone
        set_fused_attn(True)  # timm's Attention built next uses SDPA even where its settings would not
        # On the accelerator's device before the EMA copies it: the EMA must live where the model trains.
        model = build_model(cfg.model, self.data).to(acc.device)
        if self.start is not None:
            self.start.load(model)
        self.params = sum(p.numel() for p in model.parameters())
        self.ema = EMA(model, cfg.train.ema_decay)
        self.block_norms = BlockNorms(model)  # after the EMA copy: only the training model records
        self.repa = make_repa(cfg, self.data, model)  # REPA's projector + hook (None when off), also after the copy
        trained = [*model.parameters(), *(self.repa.parameters() if self.repa is not None else ())]
        if cfg.train.activation_checkpointing:
            checkpoint_blocks(model)
        fused = cfg.train.fused_optimizer and acc.device.type == "cuda"
        optimizer = torch.optim.AdamW(trained, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                      weight_decay=cfg.train.weight_decay, fused=fused or None)
        # The LR follows the schedule in force: the trunk's, or a cooled horizon's while its branch trains.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.active.lr_factor(
            step, max(cfg.train.warmup_steps, 0), cfg.train.schedule))
        self.model, self.optimizer, self.scheduler = acc.prepare(model, optimizer, scheduler)
        if self.repa is not None:  # its own DDP wrapper (the projector's grads all-reduced) and checkpoint file
            self.repa = acc.prepare(self.repa)
        # Unwrapped once: accelerate's unwrap_model walks every module per call, ~1.5 ms a step on a small model.
        self.net: DiT = acc.unwrap_model(self.model)
        self.param_list = trained  # for clipping, without a generator walk per step
        self.forward = self.compiled(self.model)
        if cfg.train.compile:  # a demotion route's sub-batches take 2 graphs per input size (`batch_dynamic`)
            sizes = 1 + len({route.ratio for route in self.demote_routes})
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * sizes)
        self.state = TrainState()
        self.timer = StepTimer(acc.device)
        self.rules = PhaseRules(self)
        acc.register_for_checkpointing(self.ema, self.state)  # this order names their files (checkpoint.EMA_FILE)
        if acc.is_main_process:
            self.run.create(to_dict(cfg), environment(acc))
        acc.wait_for_everyone()
        if cfg.train.log_with != "none":  # TensorBoard: RUN_DIR/maskbench/; W&B: project maskbench, run = run id
            acc.init_trackers("maskbench", config=flat_scalars(to_dict(cfg)),
                              init_kwargs={"wandb": {"name": self.run.root.name}})
        latest = self._latest_trunk_checkpoint()
        if latest is not None:
            trained_on = json.loads(self.run.env.read_text())["n_devices"]
            if trained_on != acc.num_processes:
                raise ConfigError(f"{self.run.root.name} was trained on {trained_on} processes; resume it on "
                                 f"{trained_on} (each process replays its own data streams)")
            tick = time.perf_counter()
            load_checkpoint(acc, latest)
            self.state.resume_seconds += time.perf_counter() - tick
            if self.state.phase_ends:  # rules that fired before the interruption keep their switch
                self.schedule = make_schedule(cfg, self.data, self.n_streams, self.state.phase_ends)
            if acc.is_main_process:
                self.run.truncate_logs(self.state.step)
                print(f"resuming {self.run.root.name} at step {self.state.step}")

    def _latest_trunk_checkpoint(self) -> Path | None:
        """The newest checkpoint of the trunk: a cooled horizon's (its branch's end) is not a place to resume."""
        branches = {RunDir.point_name(h.point) for h in self.schedule.horizons}
        trunk = [path for _, path in self.run.list_checkpoints() if path.name not in branches]
        return trunk[-1] if trunk else None

    def make_loaders(self, positions: dict[int, dict] | None = None) -> list[ShardLoader]:
        """One loader per stream of this rank, each starting at the current step: from `positions` (a
        stream's `ShardLoader.state_dict()`) when given, else from the checkpoint's, without re-reading
        the samples before it."""
        cfg, acc = self.cfg, self.accelerator
        decode = loader_decoder(self.data, cfg.model)
        positions = self.state.loader_state if positions is None else positions
        tick = time.perf_counter()
        loaders = [make_loader(self.data.train_source, batch_size=cfg.train.batch_size // self.n_streams,
                               seed=cfg.seed, rank=stream, world_size=self.n_streams,
                               num_workers=self.num_workers, start_step=self.state.step,
                               resume=positions.get(stream), decode=decode,
                               max_bad_fraction=cfg.data.max_bad_fraction, shuffle_buffer=cfg.data.shuffle_buffer,
                               pin_memory=cfg.train.pin_memory and acc.device.type == "cuda")
                   for stream in self.streams]
        if self.state.step and self.branch is None:
            self.state.resume_seconds += time.perf_counter() - tick
        return loaders

    def save_positions(self, loaders: list[ShardLoader]) -> None:
        """Every stream's loader position into the counters a checkpoint saves (the main process writes
        them, so the other ranks' positions are gathered to it)."""
        mine = {stream: loader.state_dict() for stream, loader in zip(self.streams, loaders)}
        if self.accelerator.num_processes > 1:
            mine = {k: v for part in gather_object([mine]) for k, v in part.items()}
        self.state.loader_state = mine

    def _checkpoint(self, name: str, loaders: list[ShardLoader]) -> None:
        """Save the run here (with its loaders' positions); the time goes to its own counter."""
        self.count_time(wait=True)
        tick = time.perf_counter()
        self.save_positions(loaders)
        save_checkpoint(self.accelerator, self.run, name, self.state.step, self.cfg.train.keep_checkpoints)
        self.state.checkpoint_seconds += time.perf_counter() - tick

    def compiled(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        """The training forward. Static shapes: K changes with the mask ratio, so each phase compiles its own
        graph once."""
        return torch.compile(model, dynamic=False) if self.cfg.train.compile else model

    def wrap_again(self) -> None:
        """A new DDP wrapper for what requires a gradient now (a phase switch: `train.ddp`); none on one process."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = rewrap(self.accelerator, self.model)
            self.forward = self.compiled(self.model)

    # ------------------------------------------------------------------------------------ step
    def step_draws(self, batch: dict, phase: PhasePlan, stream: int, step: int) -> StepDraws:
        """One stream's micro-batch on the device with every draw of its step.

        Each purpose draws from its own generator keyed by (seed, stream, step, purpose), so every arm
        with this seed draws the same t, caption dropout and noise here; the mask is its own draw. Every
        draw is made on the CPU and copied to the device from pinned memory: CUDA's generators give
        different numbers on GPUs of different multiprocessor counts once a tensor is large, the CPU's
        give the same numbers everywhere, so arms pair on any device (`config.DRAW_SCHEME`)."""
        cfg, acc, unwrapped = self.cfg, self.accelerator, self.net

        def generator(purpose: str) -> torch.Generator:
            return step_generator(cfg.seed, stream, step, purpose)

        device = acc.device
        x0 = batch["image"].to(device, non_blocking=True)                              # b×C×H×W
        b = x0.shape[0]
        # t stays on the host: the plan counts each step's demoted samples from this same draw
        # (`downscaled_count`), and the loss splits a demotion step by it without waiting on the device.
        t = sample_t(b, generator("t"), torch.device("cpu"))                            # b
        drop = host_to_device(torch.rand(b, generator=generator("dropout")) < cfg.train.caption_dropout, device)  # b
        noise = host_to_device(torch.randn(x0.shape, generator=generator("noise")), device)  # b×C×H×W
        context, context_mask = batch_context(unwrapped, batch, device)
        step_context = StepContext(cfg, batch, phase.mask_ratio, phase.demote, unwrapped.seq_len, unwrapped.grid,
                                   device, generator)
        inputs = StepInputs.draw(step_context, repa=self.repa)  # each technique's own draw (`models.inputs`)
        return StepDraws(x0, t, drop, noise, context, context_mask, inputs)

    def stream_loss(self, batch: dict, phase: PhasePlan, stream: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training loss of one stream's micro-batch, and the digest of its shared draws."""
        acc = self.accelerator
        d = self.step_draws(batch, phase, stream, step)
        with acc.autocast():
            loss = windowed_flow_loss(self.net, *d.loss_args(), d.inputs, self.cfg.train.mae_weight, self.forward)
        return loss, draw_digest(d.t, d.drop, d.noise, device=acc.device)

    def accumulate_gradients(self, batches: list[dict], phase: PhasePlan, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward over this rank's micro-batches; returns their losses and draw digests.

        `accelerator.accumulate` (gradient_accumulation_steps = train.grad_accum, `make_accelerator`) all-reduces
        only after the last micro-batch, and `backward` divides each loss by their count.
        """
        acc, losses, digests = self.accelerator, [], []
        for stream, batch in zip(self.streams, batches):
            # The kernel choice spans backward too: activation checkpointing recomputes attention there.
            # REPA's projector is a second DDP module: inside `accumulate` too, or it all-reduces every micro-batch.
            trained = (self.model,) if self.repa is None else (self.model, self.repa)
            with acc.accumulate(*trained), attention_kernels(self.cfg.train.attention):
                loss, digest = self.stream_loss(batch, phase, stream, step)
                acc.backward(loss)
            losses.append(loss.detach())
            digests.append(digest)
        return torch.stack(losses), torch.stack(digests)                                 # grad_accum each

    def apply_update(self, grad_norm: float, losses_finite: bool, phase: int) -> tuple[bool, bool]:
        """Step on the clipped gradients, or drop the gradients of a non-finite step, or of one the step guard
        refuses (`guard.StepGuard`: the norm before clipping is too large); returns (finite, stepped)."""
        finite = losses_finite and math.isfinite(grad_norm)
        stepped = finite and not self.guard.refuses(self.state, phase, grad_norm)
        if stepped:
            self.optimizer.step()
            self.scheduler.step()
            self.ema.update(self.net)
        self.optimizer.zero_grad(set_to_none=True)
        return finite, stepped

    def read_batches(self, batch_iters: list) -> tuple[list[dict], float]:
        """The next batch of each of this rank's streams, and the seconds spent waiting for them."""
        tick = time.perf_counter()
        batches = [next(batch_iter) for batch_iter in batch_iters]
        return batches, time.perf_counter() - tick

    def train_step(self, batches: list[dict], wait: float, phase: PhasePlan, step: int) -> dict:
        """Forward, backward and update; every number returned is the same on every rank."""
        acc = self.accelerator
        losses, digests = self.accumulate_gradients(batches, phase, step)                # grad_accum each
        # Clipped on the device (the same all-reduced gradients on every rank); its norm joins the one sync.
        grad_norm = self.accelerator.clip_grad_norm_(self.param_list, self.cfg.train.grad_clip)
        due = time.monotonic() - self.last_checkpoint > self.cfg.train.checkpoint_minutes * 60
        host = torch.tensor([[batch_digest(batch), wait, self.stop_signal is not None, due] for batch in batches],
                            dtype=torch.float64)                                             # grad_accum×4
        local = torch.cat([losses.double()[:, None], host.to(acc.device)[:, :1], digests.double()[:, None],
                           host.to(acc.device)[:, 1:], grad_norm.double().expand(len(batches), 1)],
                          dim=1)                                                             # grad_accum×7
        stats = acc.gather(local).cpu()  # streams×7: the step's one host sync
        grad_norm = stats[0, 6].item()
        finite, stepped = self.apply_update(grad_norm, bool(torch.isfinite(stats[:, 0]).all()), phase.index)
        return {"loss": stats[:, 0].mean().item(), "grad_norm": grad_norm, "finite": finite, "stepped": stepped,
                "data_digest": [f"{int(d):08x}" for d in stats[:, 1]],
                "draw_digest": [f"{int(d):08x}" for d in stats[:, 2]],
                "data_wait": stats[:, 3].view(acc.num_processes, -1)[:, 0].max().item(),  # the slowest rank
                "stop": bool(stats[:, 4].any()),
                "checkpoint_due": bool(stats[0, 5])}  # rank 0's clock decides for every rank

    # ------------------------------------------------------------------------------------- run
    def fit(self) -> Path:
        """Train to the budget (resuming if the run directory has a checkpoint), evaluating at each point."""
        if self.run.is_finished():
            self.accelerator.print(f"{self.run.root} is finished; not retraining (delete it to start over)")
            return self.run.root
        self.setup()
        point = self.schedule.eval_steps.get(self.state.step)
        if point is not None and point not in self.run.evaluated_points():
            self.reach_point(point, save=False)  # stopped between the point's checkpoint and its evaluation
        with preemption_handler(self):
            return self._train(self.make_loaders())

    def _train(self, loaders: list[ShardLoader]) -> Path:
        """The trunk: every step of the budget, with each cooled horizon's branch run where it forks."""
        acc, cfg, state = self.accelerator, self.cfg, self.state  # self.schedule: a rule that fires replans it
        batch_iters = [iter(loader) for loader in loaders]
        bar = tqdm(total=self.schedule.total_flops, initial=state.flops, unit="FLOP", unit_scale=True,
                   disable=not acc.is_main_process, desc=self.run.root.name, dynamic_ncols=True)
        self.last_checkpoint, bad_in_row = time.monotonic(), 0
        with bar, open(self.run.metrics, "a") as metrics_log:  # the bar ends its line before any error's
            while state.step < self.schedule.total_steps:
                for horizon in self.schedule.horizons:
                    if horizon.fork == state.step and horizon.point not in self.run.evaluated_points():
                        self._checkpoint(f"step-{state.step:08d}", loaders)  # a branch cut short resumes here
                        bar.clear()
                        acc.print(f"horizon {horizon.point:g}: its decay branch, steps {horizon.fork}-"
                                  f"{horizon.schedule.total_steps - 1}, then its evaluation")
                        if run_branch(self, horizon):
                            bar.close()
                            return self._stop(True, loaders)
                        self.last_checkpoint = time.monotonic()
                        bar.unpause()  # the rate and ETA count the trunk's steps, not branches or evaluations
                phase, flops = self.schedule.phase_at(state.step)
                out = self.step(phase, flops, batch_iters, loaders, metrics_log)
                bad_in_row = 0 if out["finite"] else bad_in_row + 1
                if bad_in_row >= cfg.train.max_bad_steps:
                    raise TrainingStopped(f"{bad_in_row} non-finite losses in a row at step {state.step}; "
                                          "lower train.lr or check the data")
                bar.total = self.schedule.total_flops
                bar.update(flops)
                skipped = f" skipped {state.skipped_steps}" if state.skipped_steps else ""  # steps without an update
                bar.set_postfix_str(f"step {state.step}/{self.schedule.total_steps} mask {phase.mask_ratio:g} "
                                    f"loss {out['loss']:.4f}{skipped}", refresh=False)
                if state.step in self.schedule.eval_steps:
                    metrics_log.flush()
                    self.save_positions(loaders)
                    bar.clear()
                    self.reach_point(self.schedule.eval_steps[state.step])
                    self.last_checkpoint = time.monotonic()
                    bar.unpause()
                elif out["checkpoint_due"]:  # one decision for every rank: each enters the save's barrier
                    self._checkpoint(f"step-{state.step:08d}", loaders)
                    self.last_checkpoint = time.monotonic()
                    bar.unpause()
                if out["stop"] or state.step == cfg.train.stop_at_step:
                    metrics_log.flush()
                    bar.close()
                    return self._stop(out["stop"], loaders)
        self.count_time(wait=True)
        if acc.is_main_process:
            write_atomic(self.run.done, json.dumps({"step": state.step, "flops": state.flops,
                                                    "branches_flops": state.branches_flops,
                                                    "train_seconds": state.train_seconds}))
        return self.run.root

    def step(self, phase: PhasePlan, flops: int, batch_iters: list, loaders: list[ShardLoader], log) -> dict:
        """One training step of the schedule in force: its counters and its line in `log`.

        The step's seconds (`StepTimer`: device time, read without a per-step synchronize) exclude the wait
        for its batches and what Dynamo spent compiling, which have their own counters."""
        state = self.state
        self.rules.enter(phase)
        batches, wait = self.read_batches(batch_iters)
        self.timer.start()
        # A cosine rule's probe is part of the step it checks (the plan charges it there), on its weights before the update.
        probed = self.rules.probe_cosine(batches, phase, state.step) if self.rules.probes_now(phase) else None
        out = self.train_step(batches, wait, phase, state.step)
        self.timer.stop()
        self.count_time()
        self.guard.count(state, phase.index, out["grad_norm"], out["finite"], out["stepped"])
        state.step += 1
        state.flops += flops
        state.branch_flops += flops if self.branch is not None else 0
        state.data_wait_seconds += out["data_wait"]
        state.bad_samples = dict(sum((Counter(loader.bad_counts()) for loader in loaders), Counter()))
        diagnostics = self.block_norms.step()
        switch = self.rules.check(phase, probed) if self.branch is None else {}
        write_step(self, phase, out, {**diagnostics, **switch}, log)
        self.guard.after_step(state, self.active.phases[phase.index])  # as planned now: a rule may have ended it
        return out

    def count_time(self, wait: bool = False) -> None:
        """Add the step time measured so far to the counters; `wait`: all of it (before a row or a checkpoint)."""
        timing = self.timer.read(wait)
        self.state.train_seconds += timing.train
        self.state.compile_seconds += timing.compile

    def _stop(self, signalled: bool, loaders: list[ShardLoader]) -> Path:
        """Preemption (a signal on any rank) or a requested stop: save where we are so that rerunning resumes here."""
        state = self.state
        if state.step not in self.schedule.eval_steps:
            self._checkpoint(f"step-{state.step:08d}", loaders)
        reason = "a signal" if signalled else "train.stop_at_step"
        self.accelerator.print(f"stopped at step {state.step} ({reason}); checkpoint saved, "
                               "rerun the same command to resume")
        return self.run.root

    # ---------------------------------------------------------------------------------- points
    def reach_point(self, point: float, save: bool = True) -> None:
        """Checkpoint an eval point, then hand it to `on_point` (evaluation lives above training); each
        has its own time counter, which the point's row reports. A run that skipped too many steps stops first."""
        self.guard.check(self.state)
        self.count_time(wait=True)
        if save:
            tick = time.perf_counter()
            save_checkpoint(self.accelerator, self.run, RunDir.point_name(point), self.state.step,
                            self.cfg.train.keep_checkpoints)
            self.state.checkpoint_seconds += time.perf_counter() - tick
        tick = time.perf_counter()
        if self.on_point is not None:
            self.on_point(self, point)
        self.accelerator.wait_for_everyone()
        self.state.eval_seconds += time.perf_counter() - tick


def plan_run(cfg: RunConfig, n_processes: int, data: DatasetInfo | None = None) -> tuple[DatasetInfo, Schedule]:
    """The data a run will read (not generated yet if synth; `data` when the caller resolved it already) and
    its schedule, after every check that needs no data: a budget too small for one step is refused before any
    data is generated."""
    n_streams = n_processes * cfg.train.grad_accum
    if cfg.train.batch_size % n_streams:
        raise ConfigError(f"train.batch_size {cfg.train.batch_size} must be divisible by processes × "
                          f"train.grad_accum = {n_streams}")
    data = data or resolve_dataset(cfg.data, cfg.paths.data, create=False)
    try:
        check_model(cfg.model, data.image_size)  # latent data's size is known only here
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return data, make_schedule(cfg, data, n_streams)


def loader_workers(asked: int | None, loaders: int) -> int:
    """Workers per loader: `data.num_workers` when set (a count the loader accepts), else sized from the CPUs
    this process may use, shared with the other processes on its node (torchrun's LOCAL_WORLD_SIZE)."""
    if asked is not None:
        if asked not in worker_counts():
            raise ConfigError(f"data.num_workers must be one of {worker_counts()} (they divide the loader's "
                              f"streams, so the data is the same for each), got {asked}")
        return asked
    cpus = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return auto_workers(cpus, loaders)


def make_accelerator(cfg: RunConfig) -> Accelerator:
    """bf16 on GPUs, fp32 on CPU; the LR schedule steps once per optimizer step (accelerate's default
    steps it once per process), and collectives wait out rank 0's evaluations."""
    cuda = torch.cuda.is_available()
    precision = cfg.train.mixed_precision
    if precision == "auto":
        precision = "bf16" if cuda else "no"
    timeout = InitProcessGroupKwargs(timeout=timedelta(minutes=cfg.train.dist_timeout_minutes))
    # No search for unused parameters: each phase's wrapper registers exactly what it trains (`train.ddp`).
    # The model's buffers (fixed positions, the synth token table) never change: no rebroadcast each forward.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=False, broadcast_buffers=False)
    trackers = None if cfg.train.log_with == "none" else cfg.train.log_with
    return Accelerator(cpu=not cuda, mixed_precision=precision, step_scheduler_with_optimizer=False,
                       gradient_accumulation_steps=cfg.train.grad_accum, kwargs_handlers=[timeout, ddp], log_with=trackers,
                       project_dir=str(Path(cfg.paths.runs) / run_id(cfg)))

