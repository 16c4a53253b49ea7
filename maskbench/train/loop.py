"""The training loop: one run = (arm, data, model, budget, seed), trained to its FLOPs budget.

Every phase of the arm gets its share of the FLOPs budget as whole steps (`plan_phases`). All
randomness of a step (timesteps, noise, caption dropout, which tokens are dropped) comes from
generators seeded by (run seed, rank, step), and the loader replays its stream from the resume step,
so a resumed run is bit-identical to an uninterrupted one on CPU. Training seconds exclude evaluation
and checkpointing; wall-clock never decides when a run stops.

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
import signal
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list
from timm.layers import set_fused_attn
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from maskbench.config import ConfigError, RunConfig, Trainable, demote_routes, run_id, to_dict
from maskbench.data.dataset import resolve_dataset
from maskbench.data.shards import ShardLoader, make_loader
from maskbench.models.build import batch_context, build_model, loader_decoder
from maskbench.models.dit import DiT
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import sample_t, windowed_flow_loss
from maskbench.models.presets import check_model
from maskbench.files import write_atomic
from maskbench.train.checkpoint import RunDir, TrainState, environment, load_checkpoint, save_checkpoint
from maskbench.train.diagnostics import BlockNorms
from maskbench.train.ema import EMA
from maskbench.train.schedule import PhasePlan, make_schedule, step_generators
from maskbench.train.switch import crossed, skip_weight_norm, watches_val_loss
from maskbench.train.tracking import flat_scalars, log_step


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. non-finite losses in a row); the message says why."""


def lr_lambda(cfg: RunConfig, total_steps: Callable[[], int]):
    """total_steps is read at every step: a phase's rule may end it early and replan the rest."""
    warmup = max(cfg.train.warmup_steps, 0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.train.schedule == "cosine":
            progress = (step - warmup) / max(total_steps() - warmup, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
    return factor


def batch_digest(batch: dict) -> int:
    """crc32 of a batch's sample keys: a per-step fingerprint of what a stream read, cheap to log and gather."""
    return zlib.crc32("\n".join(batch["key"]).encode())


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


def set_trainable(model: DiT, trainable: str) -> None:
    """all: every parameter trains; skips: only the long-skip layers (Skip-DiT's stage 1). Frozen parameters
    get no gradient, so autograd skips their weight grads and the optimizer leaves them (and their Adam
    state) untouched."""
    skips = {id(param) for _, param in model.skip_parameters()}
    for param in model.parameters():
        param.requires_grad_(trainable == Trainable.all or id(param) in skips)


@dataclass
class Start:
    """A run that starts from another run's weights (`init_from`), as `maskbench.runs.launch` loads it."""
    load: Callable[[DiT], None]   # puts the source's weights into the freshly built model (before the EMA copy)
    val_loss: float | None        # the source's fixed-t validation loss at that point (`until.val_loss_within`)


@contextlib.contextmanager
def preemption_handler(trainer: "Trainer") -> Iterator[None]:
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
                 validation: Callable[[Trainer, nn.Module], float] | None = None):
        """on_point(trainer, point) runs on every rank after an eval point's checkpoint (None: checkpoints only).
        start: the init_from source; validation(trainer, model): the fixed-t validation loss a
        `val_loss_within` rule checks (evaluation lives above training, so it is handed in)."""
        self.cfg, self.on_point, self.start, self.validation = cfg, on_point, start, validation
        self.accelerator = accelerator or make_accelerator(cfg)
        self.n_streams = self.accelerator.num_processes * cfg.train.grad_accum
        if cfg.train.batch_size % self.n_streams:
            raise ConfigError(f"train.batch_size {cfg.train.batch_size} must be divisible by processes × "
                             f"train.grad_accum = {self.n_streams}")
        if self.accelerator.num_processes > 1 and any(p.trainable != Trainable.all for p in cfg.arm.phases):
            raise ConfigError("a `trainable: skips` phase runs on one process: DDP fixes the parameters it "
                              "all-reduces when it wraps the model")
        if any(p.until and watches_val_loss(p.until) for p in cfg.arm.phases) and (
                validation is None or start is None or start.val_loss is None):
            raise ConfigError("until.val_loss_within needs the source run's validation loss at its point "
                              "(an init_from source evaluated there)")
        # Plan first: a budget too small for one step is refused before any data is generated.
        planned_data = resolve_dataset(cfg.data, cfg.paths.data, create=False)
        try:
            check_model(cfg.model, planned_data.image_size)  # latent data's size is known only here
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.routes = demote_routes(cfg.train)  # a route's ratio missing from latent shards is refused by the plan
        self.schedule = make_schedule(cfg, planned_data, self.n_streams)
        with self.accelerator.main_process_first():  # rank 0 generates missing synth data, the others read it
            self.data = resolve_dataset(cfg.data, cfg.paths.data)
        self.run = RunDir(Path(cfg.paths.runs) / run_id(cfg))
        self.stop_signal: int | None = None

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
        if cfg.train.activation_checkpointing:
            checkpoint_blocks(model)
        fused = cfg.train.fused_optimizer and acc.device.type == "cuda"
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                      weight_decay=cfg.train.weight_decay, fused=fused or None)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, lambda: self.schedule.total_steps))
        self.model, self.optimizer, self.scheduler = acc.prepare(model, optimizer, scheduler)
        # Unwrapped once: accelerate's unwrap_model walks every module per call, ~1.5 ms a step on a small model.
        self.net: DiT = acc.unwrap_model(self.model)
        self.param_list = list(self.model.parameters())  # for clipping, without a generator walk per step
        # Static shapes: K changes with the mask ratio, so each phase compiles its own graph once.
        self.forward = torch.compile(self.model, dynamic=False) if cfg.train.compile else self.model
        self.state = TrainState()
        self.trainable = Trainable.all  # what the model trains now (a phase may freeze all but the skips)
        acc.register_for_checkpointing(self.ema, self.state)  # this order names their files (checkpoint.EMA_FILE)
        if acc.is_main_process:
            self.run.create(to_dict(cfg), environment(acc))
        acc.wait_for_everyone()
        if cfg.train.log_with != "none":  # TensorBoard: RUN_DIR/maskbench/; W&B: project maskbench, run = run id
            acc.init_trackers("maskbench", config=flat_scalars(to_dict(cfg)),
                              init_kwargs={"wandb": {"name": self.run.root.name}})
        latest = self.run.latest_checkpoint()
        if latest is not None:
            trained_on = json.loads(self.run.env.read_text())["n_devices"]
            if trained_on != acc.num_processes:
                raise ConfigError(f"{self.run.root.name} was trained on {trained_on} processes; resume it on "
                                 f"{trained_on} (each process replays its own data streams)")
            load_checkpoint(acc, latest)
            if self.state.phase_ends:  # rules that fired before the interruption keep their switch
                self.schedule = make_schedule(cfg, self.data, self.n_streams, self.state.phase_ends)
            if acc.is_main_process:
                self.run.truncate_logs(self.state.step)
                print(f"resuming {self.run.root.name} at step {self.state.step}")

    def make_loaders(self) -> list[ShardLoader]:
        """One loader per stream of this rank, each resuming at the current step."""
        cfg, acc = self.cfg, self.accelerator
        decode = loader_decoder(self.data, cfg.model)
        return [make_loader(self.data.train_source, batch_size=cfg.train.batch_size // self.n_streams, seed=cfg.seed,
                            rank=stream, world_size=self.n_streams, num_workers=cfg.data.num_workers,
                            start_step=self.state.step, decode=decode,
                            max_bad_fraction=cfg.data.max_bad_fraction, shuffle_buffer=cfg.data.shuffle_buffer,
                            pin_memory=cfg.train.pin_memory and acc.device.type == "cuda")
                for stream in self.streams]

    # ------------------------------------------------------------------------------------ step
    def stream_loss(self, batch: dict, phase: PhasePlan, stream: int, step: int) -> torch.Tensor:
        """The training loss of one stream's micro-batch, its randomness drawn from (seed, stream, step)."""
        cfg, acc = self.cfg, self.accelerator
        unwrapped = self.net
        gen_cpu, gen_dev = step_generators(cfg.seed, stream, step, acc.device)
        x0 = batch["image"].to(acc.device, non_blocking=True)                          # b×C×H×W
        b = x0.shape[0]
        t = sample_t(b, gen_cpu, torch.device("cpu")).to(acc.device)                   # b (first draw: see downscaled_count)
        drop = (torch.rand(b, generator=gen_cpu) < cfg.train.caption_dropout).to(acc.device)  # b
        keep_idx = random_keep_idx(b, unwrapped.seq_len, phase.mask_ratio, generator=gen_cpu,
                                   device=acc.device, grid=unwrapped.grid, structured=cfg.model.structured_mask)
        noise = torch.randn(x0.shape, generator=gen_dev, device=acc.device)            # b×C×H×W
        context, context_mask = batch_context(unwrapped, batch, acc.device)
        with acc.autocast():
            return windowed_flow_loss(unwrapped, x0, noise, t, context, context_mask, keep_idx, drop,
                                      self.routes, cfg.train.demote_gate, cfg.train.mae_weight,
                                      forward=self.forward, generator=gen_dev, demoted=batch.get("demoted"))

    def accumulate_gradients(self, batches: list[dict], phase: PhasePlan, step: int) -> torch.Tensor:
        """Backward over this rank's micro-batches (all-reduced once, after the last); returns their losses."""
        acc, losses = self.accelerator, []
        for micro, (stream, batch) in enumerate(zip(self.streams, batches)):
            sync = micro == len(batches) - 1
            # The kernel choice spans backward too: activation checkpointing recomputes attention there.
            with contextlib.nullcontext() if sync else acc.no_sync(self.model), \
                    attention_kernels(self.cfg.train.attention):
                loss = self.stream_loss(batch, phase, stream, step)
                acc.backward(loss / len(batches))
            losses.append(loss.detach())
        return torch.stack(losses)                                                       # grad_accum

    def apply_update(self, losses_finite: bool) -> tuple[float, bool, bool]:
        """Clip and step, or drop the gradients of a non-finite step, or of one the step guard refuses
        (`train.skip_step_grad_norm`: the norm before clipping is above it); returns (grad norm, finite, stepped)."""
        grad_norm = float(self.accelerator.clip_grad_norm_(self.param_list, self.cfg.train.grad_clip))
        finite = losses_finite and math.isfinite(grad_norm)
        guard = self.cfg.train.skip_step_grad_norm
        stepped = finite and (guard is None or grad_norm <= guard)
        if stepped:
            self.optimizer.step()
            self.scheduler.step()
            self.ema.update(self.net)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite, stepped

    def train_step(self, batch_iters: list, phase: PhasePlan, step: int) -> dict:
        """Read, forward, backward and update; every number returned is the same on every rank."""
        acc, waits, batches = self.accelerator, [], []
        for batch_iter in batch_iters:
            tick = time.perf_counter()
            batches.append(next(batch_iter))
            waits.append(time.perf_counter() - tick)
        losses = self.accumulate_gradients(batches, phase, step)                       # grad_accum
        stop = float(self.stop_signal is not None)
        local = [[loss, batch_digest(batch), wait, stop] for loss, batch, wait in zip(losses.tolist(), batches, waits)]
        stats = acc.gather(torch.tensor(local, dtype=torch.float64, device=acc.device)).cpu()  # streams×4
        grad_norm, finite, stepped = self.apply_update(bool(torch.isfinite(stats[:, 0]).all()))
        return {"loss": stats[:, 0].mean().item(), "grad_norm": grad_norm, "finite": finite, "stepped": stepped,
                "data_digest": [f"{int(d):08x}" for d in stats[:, 1]],
                "data_wait": stats[:, 2].view(acc.num_processes, -1).sum(1).max().item(),  # the slowest rank
                "stop": bool(stats[:, 3].any())}

    # ------------------------------------------------------------------------------------- run
    def fit(self) -> Path:
        """Train to the budget (resuming if the run directory has a checkpoint), evaluating at each point."""
        if self.run.is_finished():
            self.accelerator.print(f"{self.run.root} is finished; not retraining (delete it to start over)")
            return self.run.root
        self.setup()
        point = self.schedule.eval_steps.get(self.state.step)
        if point is not None and point not in self.run.evaluated_points():
            self._reach_point(point, save=False)  # stopped between the point's checkpoint and its evaluation
        with preemption_handler(self):
            return self._train(self.make_loaders())

    def _train(self, loaders: list[ShardLoader]) -> Path:
        acc, cfg, state = self.accelerator, self.cfg, self.state  # self.schedule: a rule that fires replans it
        batch_iters = [iter(loader) for loader in loaders]
        bar = tqdm(total=self.schedule.total_flops, initial=state.flops, unit="FLOP", unit_scale=True,
                   disable=not acc.is_main_process, desc=self.run.root.name, dynamic_ncols=True)
        last_checkpoint, bad_in_row = time.monotonic(), 0
        with open(self.run.metrics, "a") as metrics_log:
            while state.step < self.schedule.total_steps:
                phase, flops = self.schedule.phase_at(state.step)
                self._enter(phase)
                tick = time.perf_counter()
                out = self.train_step(batch_iters, phase, state.step)
                if acc.device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - tick
                bad_in_row = 0 if out["finite"] else bad_in_row + 1
                state.skipped_nonfinite += not out["finite"]
                state.skipped_grad_norm += out["finite"] and not out["stepped"]
                if bad_in_row >= cfg.train.max_bad_steps:
                    raise TrainingStopped(f"{bad_in_row} non-finite losses in a row at step {state.step}; "
                                          "lower train.lr or check the data")
                state.step += 1
                state.flops += flops
                state.train_seconds += seconds
                state.data_wait_seconds += out["data_wait"]
                state.bad_samples = dict(sum((Counter(loader.bad_counts()) for loader in loaders), Counter()))
                diagnostics = self.block_norms.step()
                switch = self._check_rule(phase)
                if acc.is_main_process:
                    record = {
                        "step": state.step - 1, "mask_ratio": phase.mask_ratio, "loss": out["loss"],
                        "lr": self.scheduler.get_last_lr()[0], "grad_norm": out["grad_norm"],
                        "flops": state.flops, "seconds": state.train_seconds, "data_wait": out["data_wait"],
                        "data_digest": out["data_digest"], "bad_samples": state.bad_samples,
                        "skipped_nonfinite": state.skipped_nonfinite, **diagnostics, **switch}
                    if cfg.train.skip_step_grad_norm is not None:
                        record["skipped_grad_norm"] = state.skipped_grad_norm
                    metrics_log.write(json.dumps(record) + "\n")
                    if cfg.train.log_with != "none":
                        log_step(acc, record, state.step)
                bar.total = self.schedule.total_flops
                bar.update(flops)
                bar.set_postfix_str(f"step {state.step}/{self.schedule.total_steps} mask {phase.mask_ratio:g} "
                                    f"loss {out['loss']:.4f}", refresh=False)
                if state.step in self.schedule.eval_steps:
                    metrics_log.flush()
                    self._reach_point(self.schedule.eval_steps[state.step])
                    last_checkpoint = time.monotonic()
                elif time.monotonic() - last_checkpoint > cfg.train.checkpoint_minutes * 60:
                    save_checkpoint(acc, self.run, f"step-{state.step:08d}", state.step, cfg.train.keep_checkpoints)
                    last_checkpoint = time.monotonic()
                if out["stop"] or state.step == cfg.train.stop_at_step:
                    metrics_log.flush()
                    bar.close()
                    return self._stop(out["stop"])
        bar.close()
        if acc.is_main_process:
            write_atomic(self.run.done, json.dumps({"step": state.step, "flops": state.flops,
                                                    "train_seconds": state.train_seconds}))
        return self.run.root

    def _stop(self, signalled: bool) -> Path:
        """Preemption (a signal on any rank) or a requested stop: save where we are so that rerunning resumes here."""
        state = self.state
        if state.step not in self.schedule.eval_steps:
            save_checkpoint(self.accelerator, self.run, f"step-{state.step:08d}", state.step,
                            self.cfg.train.keep_checkpoints)
        reason = "a signal" if signalled else "train.stop_at_step"
        self.accelerator.print(f"stopped at step {state.step} ({reason}); checkpoint saved, "
                               "rerun the same command to resume")
        return self.run.root


    # ---------------------------------------------------------------------------------- phases
    def _enter(self, phase: PhasePlan) -> None:
        """Before a step: freeze what the phase does not train, note where the first phase ended, and take
        the baseline of a growth rule at the phase's first step."""
        model = self.net
        if phase.trainable != self.trainable:
            set_trainable(model, phase.trainable)
            self.trainable = phase.trainable
        state = self.state
        if phase.index > 0 and state.switch_step is None:
            state.switch_step = phase.start
            self.accelerator.print(f"switched to phase {phase.index} at step {phase.start}")
        if phase.until is not None and state.step == phase.start and not watches_val_loss(phase.until):
            state.rule = {"previous": skip_weight_norm(model)}

    def _check_rule(self, phase: PhasePlan) -> dict:
        """After a step of a rule phase, every `until.every` steps before its cap: measure, and if the rule
        fires, end the phase here and replan the rest of the budget. Returns what the step's log records."""
        until, state = phase.until, self.state
        done = state.step - phase.start
        if until is None or done % until.every or done >= phase.steps:
            return {}
        if watches_val_loss(until):
            value = self.validation(self, self.ema.model)
        else:
            value = skip_weight_norm(self.net)
        fired = crossed(until, value, state.rule, self.start.val_loss if self.start else None)
        if self.accelerator.num_processes > 1:  # one decision for every rank
            fired = broadcast_object_list([fired])[0]
        record = {"until": {"phase": phase.index, "value": value, "fired": fired}}
        if fired:
            state.phase_ends = {**state.phase_ends, phase.index: done}
            self.schedule = make_schedule(self.cfg, self.data, self.n_streams, state.phase_ends)
            self.accelerator.print(f"phase {phase.index}'s rule fired after {done} steps (step {state.step}); "
                                   f"{self.schedule.total_steps - state.step} steps left")
        return record

    # ---------------------------------------------------------------------------------- points
    def _reach_point(self, point: float, save: bool = True) -> None:
        """Checkpoint an eval point, then hand it to `on_point` (evaluation lives above training)."""
        if save:
            save_checkpoint(self.accelerator, self.run, RunDir.point_name(point), self.state.step,
                            self.cfg.train.keep_checkpoints)
        if self.on_point is not None:
            self.on_point(self, point)
        self.accelerator.wait_for_everyone()


def make_accelerator(cfg: RunConfig) -> Accelerator:
    """bf16 on GPUs, fp32 on CPU; the LR schedule steps once per optimizer step (accelerate's default
    steps it once per process), and collectives wait out rank 0's evaluations."""
    cuda = torch.cuda.is_available()
    precision = cfg.train.mixed_precision
    if precision == "auto":
        precision = "bf16" if cuda else "no"
    timeout = InitProcessGroupKwargs(timeout=timedelta(minutes=cfg.train.dist_timeout_minutes))
    trackers = None if cfg.train.log_with == "none" else cfg.train.log_with
    return Accelerator(cpu=not cuda, mixed_precision=precision, step_scheduler_with_optimizer=False,
                       kwargs_handlers=[timeout], log_with=trackers,
                       project_dir=str(Path(cfg.paths.runs) / run_id(cfg)))

