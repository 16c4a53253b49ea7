"""The training loop: one run = (arm, data, model, budget, seed), trained to its FLOPs budget.

Every phase of the arm gets its share of the FLOPs budget as whole steps (`plan_phases`). All
randomness of a step (timesteps, noise, caption dropout, which tokens are dropped) comes from
generators seeded by (run seed, rank, step), and the loader replays its stream from the resume step,
so a resumed run is bit-identical to an uninterrupted one on CPU. Training seconds exclude evaluation
and checkpointing; wall-clock never decides when a run stops.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm import tqdm

import maskbench
from maskbench.config import RunConfig, config_hash, format_arm, run_id, to_dict
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.data.shards import make_loader
from maskbench.eval.evaluate import Evaluator, check_eval_inputs
from maskbench.models.build import batch_context, build_model
from maskbench.models.dit import DiT
from maskbench.models.kernels import gather_tokens
from maskbench.models.masking import random_keep_idx
from maskbench.train.checkpoint import (RunDir, TrainState, device_name, environment, git_sha, load_checkpoint,
                                        save_checkpoint, write_atomic)
from maskbench.train.ema import EMA
from maskbench.train.flops import PhasePlan, plan_phases, train_step_flops
from maskbench.train.objective import interpolate, sample_t, velocity_loss


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. non-finite losses in a row); the message says why."""


@dataclass
class Schedule:
    """Where each step sits: its phase, and the steps at which eval points fall."""
    phases: list[PhasePlan]
    eval_steps: dict[int, float]   # steps completed -> eval point

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    @property
    def total_flops(self) -> int:
        return sum(p.flops for p in self.phases)

    def phase_at(self, step: int) -> PhasePlan:
        for phase in self.phases:
            if step < phase.steps:
                return phase
            step -= phase.steps
        raise IndexError("step past the end of the schedule")


def make_schedule(cfg: RunConfig, data: DatasetInfo) -> Schedule:
    """Plan phases by FLOPs, then put each eval point at the first step whose FLOPs reach it."""
    def step_flops(mask_ratio: float) -> int:
        return train_step_flops(cfg.model, data.image_size, data.channels,
                                data.context_dim or cfg.model.text_width, data.context_len or cfg.model.text_len,
                                cfg.train.batch_size, mask_ratio, text_encoder=not data.latent)

    phases = plan_phases([(p.mask_ratio, p.fraction) for p in cfg.arm.phases], cfg.budget.flops, step_flops)
    cumulative, spent = [], 0
    for phase in phases:
        for _ in range(phase.steps):
            spent += phase.flops_per_step
            cumulative.append(spent)
    eval_steps = {}
    for point in sorted(cfg.eval.points):
        target = point * spent * (1 - 1e-9)
        eval_steps[next(i + 1 for i, c in enumerate(cumulative) if c >= target)] = point
    return Schedule(phases, eval_steps)


def lr_lambda(cfg: RunConfig, total_steps: int):
    warmup = max(cfg.train.warmup_steps, 0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.train.schedule == "cosine":
            progress = (step - warmup) / max(total_steps - warmup, 1)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
    return factor


def step_generators(seed: int, rank: int, step: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """(CPU generator for t / dropout / masks, device generator for noise), both a function of the step."""
    value = (seed * 1_000_003 + rank) * 10_000_019 + step
    cpu = torch.Generator().manual_seed(value)
    dev = torch.Generator(device=device).manual_seed(value + 1) if device.type != "cpu" else cpu
    return cpu, dev


class Trainer:
    def __init__(self, cfg: RunConfig, accelerator: Accelerator | None = None):
        self.cfg = cfg
        self.accelerator = accelerator or make_accelerator(cfg)
        # Plan first: a budget too small for one step is refused before any data is generated.
        self.schedule = make_schedule(cfg, resolve_dataset(cfg.data, cfg.paths.data, create=False))
        self.data = resolve_dataset(cfg.data, cfg.paths.data)
        check_eval_inputs(self.data, cfg.eval)
        self.run = RunDir(Path(cfg.paths.runs) / run_id(cfg))
        self.stop_signal: int | None = None

    # ----------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        torch.manual_seed(cfg.seed)  # initial weights: a function of the run seed alone
        model = build_model(cfg.model, self.data)
        self.params = sum(p.numel() for p in model.parameters())
        self.ema = EMA(model, cfg.train.ema_decay)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                      weight_decay=cfg.train.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, self.schedule.total_steps))
        self.model, self.optimizer, self.scheduler = acc.prepare(model, optimizer, scheduler)
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.state = TrainState()
        acc.register_for_checkpointing(self.ema, self.state)
        if acc.is_main_process:
            self.run.create(to_dict(cfg), environment(acc))
        acc.wait_for_everyone()
        latest = self.run.latest_checkpoint()
        if latest is not None:
            load_checkpoint(acc, latest)
            if acc.is_main_process:
                self.run.truncate_logs(self.state.step)
                print(f"resuming {self.run.root.name} at step {self.state.step}")
        self.evaluator: Evaluator | None = None

    # ------------------------------------------------------------------------------------ step
    def train_step(self, batch: dict, phase: PhasePlan, step: int) -> dict:
        cfg, acc, model = self.cfg, self.accelerator, self.model
        unwrapped: DiT = acc.unwrap_model(model)
        gen_cpu, gen_dev = step_generators(cfg.seed, acc.process_index, step, acc.device)
        x0 = batch["image"].to(acc.device, non_blocking=True)                          # B×C×H×W
        B = x0.shape[0]
        t = sample_t(B, gen_cpu, torch.device("cpu")).to(acc.device)                   # B
        drop = (torch.rand(B, generator=gen_cpu) < cfg.train.caption_dropout).to(acc.device)  # B
        keep_idx = random_keep_idx(B, unwrapped.seq_len, phase.mask_ratio, generator=gen_cpu,
                                   device=acc.device, grid=unwrapped.grid, structured=cfg.model.structured_mask)
        noise = torch.randn(x0.shape, generator=gen_dev, device=acc.device)            # B×C×H×W
        target = unwrapped.patchify(noise - x0)                                         # B×L×P
        if keep_idx is not None:
            target = gather_tokens(target, keep_idx, impl="torch")                       # B×K×P
        context, context_mask = batch_context(unwrapped, batch, acc.device)
        with acc.autocast():
            pred = self.forward(interpolate(x0, noise, t), t, context, context_mask, keep_idx, drop)  # B×K×P
        loss = velocity_loss(pred, target)
        if not torch.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            return {"loss": float("nan"), "grad_norm": float("nan"), "finite": False}
        acc.backward(loss)
        grad_norm = acc.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update(unwrapped)
        return {"loss": acc.gather(loss.detach()).mean().item(), "grad_norm": float(grad_norm), "finite": True}

    # ------------------------------------------------------------------------------------- run
    def fit(self) -> Path:
        """Train to the budget (resuming if the run directory has a checkpoint), evaluating at each point."""
        if self.run.is_finished():
            print(f"{self.run.root} is finished; not retraining (delete it to start over)")
            return self.run.root
        self.setup()
        acc, cfg, schedule, state = self.accelerator, self.cfg, self.schedule, self.state
        loader = make_loader(self.data.train_dir, batch_size=cfg.train.batch_size // acc.num_processes,
                             seed=cfg.seed, rank=acc.process_index, world_size=acc.num_processes,
                             num_workers=cfg.data.num_workers, start_step=state.step, decode=self.data.decode,
                             max_bad_fraction=cfg.data.max_bad_fraction, shuffle_buffer=cfg.data.shuffle_buffer)
        batches = iter(loader)
        self._install_signal_handlers()
        bar = tqdm(total=schedule.total_flops, initial=state.flops, unit="FLOP", unit_scale=True,
                   disable=not acc.is_main_process, desc=self.run.root.name, dynamic_ncols=True)
        last_checkpoint, bad_in_row = time.monotonic(), 0
        with open(self.run.metrics, "a") as metrics_log:
            while state.step < schedule.total_steps:
                phase = schedule.phase_at(state.step)
                tick = time.perf_counter()
                batch = next(batches)
                data_wait = time.perf_counter() - tick
                out = self.train_step(batch, phase, state.step)
                if acc.device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - tick
                bad_in_row = 0 if out["finite"] else bad_in_row + 1
                state.skipped_nonfinite += not out["finite"]
                if bad_in_row >= cfg.train.max_bad_steps:
                    raise TrainingStopped(f"{bad_in_row} non-finite losses in a row at step {state.step}; "
                                          "lower train.lr or check the data")
                state.step += 1
                state.flops += phase.flops_per_step
                state.train_seconds += seconds
                state.data_wait_seconds += data_wait
                state.bad_samples = loader.bad_counts()
                if acc.is_main_process:
                    metrics_log.write(json.dumps({
                        "step": state.step - 1, "mask_ratio": phase.mask_ratio, "loss": out["loss"],
                        "lr": self.scheduler.get_last_lr()[0], "grad_norm": out["grad_norm"],
                        "flops": state.flops, "seconds": state.train_seconds, "data_wait": data_wait,
                        "bad_samples": state.bad_samples, "skipped_nonfinite": state.skipped_nonfinite}) + "\n")
                bar.update(phase.flops_per_step)
                bar.set_postfix_str(f"step {state.step}/{schedule.total_steps} mask {phase.mask_ratio:g} "
                                    f"loss {out['loss']:.4f}", refresh=False)
                if state.step in schedule.eval_steps:
                    metrics_log.flush()
                    self._eval_point(schedule.eval_steps[state.step])
                    last_checkpoint = time.monotonic()
                elif time.monotonic() - last_checkpoint > cfg.train.checkpoint_minutes * 60:
                    save_checkpoint(acc, self.run, f"step-{state.step:08d}", state.step, cfg.train.keep_checkpoints)
                    last_checkpoint = time.monotonic()
                if self._should_stop(state.step):
                    metrics_log.flush()
                    bar.close()
                    return self._stop()
        bar.close()
        if acc.is_main_process:
            write_atomic(self.run.done, json.dumps({"step": state.step, "flops": state.flops,
                                                    "train_seconds": state.train_seconds}))
        return self.run.root

    def _should_stop(self, step: int) -> bool:
        return self.stop_signal is not None or step == self.cfg.train.stop_at_step

    def _stop(self) -> Path:
        """Preemption or a requested stop: save where we are so that rerunning resumes here."""
        state = self.state
        if state.step not in self.schedule.eval_steps:
            save_checkpoint(self.accelerator, self.run, f"step-{state.step:08d}", state.step,
                            self.cfg.train.keep_checkpoints)
        reason = f"signal {self.stop_signal}" if self.stop_signal is not None else "train.stop_at_step"
        print(f"stopped at step {state.step} ({reason}); checkpoint saved, rerun the same command to resume")
        return self.run.root

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            self.stop_signal = signum
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, request_stop)

    # ------------------------------------------------------------------------------------ eval
    def _eval_point(self, point: float) -> None:
        acc, state = self.accelerator, self.state
        save_checkpoint(acc, self.run, f"point-{point:g}", state.step, self.cfg.train.keep_checkpoints)
        if point in state.evaluated_points or not acc.is_main_process:
            acc.wait_for_everyone()
            return
        if self.evaluator is None:
            self.evaluator = Evaluator(self.data, self.cfg.eval, acc.device)
        result = self.evaluator.evaluate(self.ema.model, self.run.samples / f"point-{point:g}")
        row = leaderboard_row(self.cfg, self.data, self.state, point, result, self.params,
                              acc.num_processes, device_name(acc.device))
        self.run.record_eval(row, result, self.cfg.paths.leaderboard)
        state.evaluated_points.append(point)
        acc.wait_for_everyone()

def leaderboard_row(cfg: RunConfig, data: DatasetInfo, state: TrainState, point: float, result: dict,
                    params: int, n_devices: int, device: str) -> dict:
    """One leaderboard row: what was trained (from the config and counters) and what was measured."""
    return {
        "run_id": run_id(cfg), "arm": cfg.arm.name, "phases": format_arm(cfg.arm), "dataset": data.name,
        "model": cfg.model.name, "params": params, "resolution": data.image_size,
        "batch_size": cfg.train.batch_size, "seed": cfg.seed, "budget_flops": cfg.budget.flops, "point": point,
        "step": state.step, "samples_seen": state.step * cfg.train.batch_size, "train_flops": state.flops,
        "gpu_hours": n_devices * state.train_seconds / 3600, "device": device,
        "n_devices": n_devices, "val_loss": result["val_loss"],
        "fid": result.get("fid"), "fid_features": result.get("fid_features"), "fid_n": result.get("fid_n"),
        "clip_score": result.get("clip_score"), "clip_cos": result.get("clip_cos"),
        "clip_model": result.get("clip_model"), "align_acc": result.get("align_acc"),
        "sampler_steps": cfg.eval.sampler_steps, "cfg_scale": cfg.eval.cfg_scale,
        "maskbench_version": maskbench.__version__, "git_sha": git_sha(), "config_hash": config_hash(cfg),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def make_accelerator(cfg: RunConfig) -> Accelerator:
    cuda = torch.cuda.is_available()
    precision = cfg.train.mixed_precision
    if precision == "auto":
        precision = "bf16" if cuda else "no"
    return Accelerator(cpu=not cuda, mixed_precision=precision)


def train(cfg: RunConfig) -> Path:
    return Trainer(cfg).fit()
