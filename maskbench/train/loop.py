"""The training loop: one run = (arm, data, model, budget, seed), trained to its FLOPs budget.

Every phase of the arm gets its share of the FLOPs budget as whole steps (`schedule.schedule_phases`); the trunk
steps through them (`step.Stepper` is one step, `switch.PhaseRules` what each phase trains and the rule that
may end it). Each eval point before the last is a cooled horizon: a decay branch run from the trunk and put back
(`horizons`); the last is the trunk's end. Every eval point is checkpointed and handed to `on_point` (evaluation
lives above training). The loader seeks to its saved position on resume, so a resumed run is bit-identical to an
uninterrupted one on CPU. Training seconds are the steps' own time: data wait, compilation, evaluation,
checkpointing and resuming are counted apart; wall-clock never decides when a run stops. Only rank 0 writes logs,
evaluations and leaderboard rows.

What the loop trains with is built before it (`build`) and handed in; what changes while it runs (step, FLOPs,
the schedule, the branch) is its `progress.Progress`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from accelerate import Accelerator
from torch import nn
from tqdm import tqdm

from maskbench.config import RunConfig
from maskbench.data.dataset import DatasetInfo, generate_synth
from maskbench.data.loader import ShardLoader
from maskbench.files import write_atomic
from maskbench.train.build import Parts, Start, build_parts, make_accelerator, open_run, run_schedule
from maskbench.train.checkpoint import RunDir, TrainState, latest_trunk, load_checkpoint, save_checkpoint
from maskbench.train.guard import StepGuard
from maskbench.train.horizons import restore, snapshot
from maskbench.train.progress import Progress
from maskbench.train.schedule import Horizon, ScheduledPhase, make_schedule
from maskbench.train.step import Stepper
from maskbench.train.steplog import StepLog
from maskbench.train.streams import Streams
from maskbench.train.switch import PhaseRules
from maskbench.train.timing import StepTimer


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. non-finite losses in a row); the message says why."""


@contextlib.contextmanager
def preemption_handler(progress: Progress) -> Iterator[None]:
    """While training, SIGINT/SIGTERM only ask the loop to checkpoint and stop at the end of the step."""
    def request_stop(signum, _frame):
        progress.stop_signal = signum
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Trainer:
    """One run's loop. `on_point(trainer, point)` runs on every rank after an eval point's checkpoint (None:
    checkpoints only); `validation(trainer, model)` is the fixed-t validation loss a `val_loss_within` rule checks
    against `start`'s. Both read `cfg`, `data`, `run`, `state`, `accelerator`, `ema`, `block_norms` and `params`."""

    def __init__(self, cfg: RunConfig, data: DatasetInfo, parts: Parts, progress: Progress, run: RunDir,
                 streams: Streams, on_point: Callable[[Trainer, float], None] | None = None,
                 start: Start | None = None, validation: Callable[[Trainer, nn.Module], float] | None = None):
        self.cfg, self.data, self.parts, self.progress, self.run, self.streams = cfg, data, parts, progress, run, streams
        self.on_point, self.state, self.accelerator = on_point, progress.counters, parts.accelerator
        self.ema, self.block_norms, self.params = parts.ema, parts.block_norms, parts.params
        self.guard = StepGuard(cfg.train)  # which steps are skipped, and the stop when too many were
        self.stepper = Stepper(cfg, parts, self.guard, streams)
        measure = functools.partial(validation, self) if validation is not None else None
        self.rules = PhaseRules(cfg, data, self.stepper, measure, start.val_loss if start is not None else None)
        self.timer = StepTimer(parts.accelerator.device)
        self.last_checkpoint = time.monotonic()  # when the trunk last saved (periodic checkpoints)

    def fit(self) -> Path:
        """Train to the budget (resuming if the run directory has a checkpoint), evaluating at each point."""
        if self.run.is_finished():
            self.accelerator.print(f"{self.run.root} is finished; not retraining (delete it to start over)")
            return self.run.root
        open_run(self.cfg, self.parts, self.run, self.state)
        self.resume()
        point = self.progress.schedule.eval_steps.get(self.state.step)
        if point is not None and point not in self.run.evaluated_points():
            self.reach_point(point, save=False)  # stopped between the point's checkpoint and its evaluation
        with preemption_handler(self.progress):
            return self.train(self.open_loaders(self.state.loader_state))

    def resume(self) -> None:
        """Continue from the trunk's newest checkpoint, if any, on the schedule its fired rules left."""
        acc, run = self.accelerator, self.run
        latest = latest_trunk(run, [h.point for h in self.progress.schedule.horizons], acc.num_processes)
        if latest is None:
            return
        tick = time.perf_counter()
        load_checkpoint(acc, latest)
        self.state.resume_seconds += time.perf_counter() - tick
        if self.state.phase_ends:  # rules that fired before the interruption keep their switch
            self.progress.schedule = make_schedule(self.cfg, self.data, self.streams.count, self.state.phase_ends)
        if acc.is_main_process:
            run.truncate_logs(self.state.step)
            print(f"resuming {run.root.name} at step {self.state.step}")

    def open_loaders(self, positions: dict[int, dict]) -> list[ShardLoader]:
        """This rank's loaders at the current step, from `positions`; reopening the trunk's counts as resuming."""
        tick = time.perf_counter()
        loaders = self.streams.open(self.state.step, positions)
        if self.state.step and self.progress.branch is None:
            self.state.resume_seconds += time.perf_counter() - tick
        return loaders

    def train(self, loaders: list[ShardLoader]) -> Path:
        """The trunk: every step of the budget, with each cooled horizon's branch run where it forks."""
        acc, cfg, state, progress = self.accelerator, self.cfg, self.state, self.progress
        batch_iters = [iter(loader) for loader in loaders]
        bar = tqdm(total=progress.schedule.total_flops, initial=state.flops, unit="FLOP", unit_scale=True,
                   disable=not acc.is_main_process, desc=self.run.root.name, dynamic_ncols=True)
        self.last_checkpoint, bad_in_row = time.monotonic(), 0
        with bar, StepLog(self.run.metrics, "a", acc, cfg.train) as log:  # the bar ends its line before any error's
            while state.step < progress.schedule.total_steps:
                for horizon in progress.schedule.horizons:
                    if horizon.fork == state.step and horizon.point not in self.run.evaluated_points():
                        self.checkpoint(f"step-{state.step:08d}", loaders)  # a branch cut short resumes here
                        bar.clear()
                        acc.print(f"horizon {horizon.point:g}: its decay branch, steps {horizon.fork}-"
                                  f"{horizon.schedule.total_steps - 1}, then its evaluation")
                        if self.branch(horizon):
                            bar.close()
                            return self.stop(True, loaders)
                        self.last_checkpoint = time.monotonic()
                        bar.unpause()  # the rate and ETA count the trunk's steps, not branches or evaluations
                phase, flops = progress.schedule.phase_at(state.step)
                out = self.step(phase, flops, batch_iters, loaders, log)
                bad_in_row = 0 if out["finite"] else bad_in_row + 1
                if bad_in_row >= cfg.train.max_bad_steps:
                    raise TrainingStopped(f"{bad_in_row} non-finite losses in a row at step {state.step}; "
                                          "lower train.lr or check the data")
                bar.total = progress.schedule.total_flops
                bar.update(flops)
                skipped = f" skipped {state.skipped_steps}" if state.skipped_steps else ""  # steps without an update
                bar.set_postfix_str(f"step {state.step}/{progress.schedule.total_steps} mask {phase.mask_ratio:g} "
                                    f"loss {out['loss']:.4f}{skipped}", refresh=False)
                if state.step in progress.schedule.eval_steps:
                    log.flush()
                    state.loader_state = self.streams.positions(loaders)
                    bar.clear()
                    self.reach_point(progress.schedule.eval_steps[state.step])
                    self.last_checkpoint = time.monotonic()
                    bar.unpause()
                elif out["checkpoint_due"]:  # one decision for every rank: each enters the save's barrier
                    self.checkpoint(f"step-{state.step:08d}", loaders)
                    self.last_checkpoint = time.monotonic()
                    bar.unpause()
                if out["stop"] or state.step == cfg.train.stop_at_step:
                    log.flush()
                    bar.close()
                    return self.stop(out["stop"], loaders)
        self.count_time(wait=True)
        if acc.is_main_process:
            write_atomic(self.run.done, json.dumps({"step": state.step, "flops": state.flops,
                                                    "branches_flops": state.branches_flops,
                                                    "train_seconds": state.train_seconds}))
        return self.run.root

    def branch(self, horizon: Horizon) -> bool:
        """Train a cooled horizon from the trunk's current step to its end, evaluate it, then put the trunk
        back exactly as it was. Returns True when a stop signal cut the branch short (nothing of it kept:
        the trunk checkpoint at the fork reruns it on resume).

        The branch reads its own loaders, opened at the trunk's current position, so the trunk's stream is
        untouched; from the fork on it is the standalone run of budget point × budget, step for step."""
        self.count_time(wait=True)  # the trunk's last steps are the trunk's
        trunk = snapshot(self.parts, self.progress)
        self.progress.branch = horizon
        loaders = self.open_loaders(trunk["positions"])
        batch_iters = [iter(loader) for loader in loaders]
        stopped = False
        with StepLog(self.run.branch_metrics(horizon.point), "w", self.accelerator, self.cfg.train) as log:
            while self.state.step < horizon.schedule.total_steps and not stopped:
                phase, flops = horizon.schedule.phase_at(self.state.step)
                stopped = self.step(phase, flops, batch_iters, loaders, log)["stop"]
        if not stopped:
            self.state.loader_state = self.streams.positions(loaders)
            self.reach_point(horizon.point)
        del batch_iters, loaders
        self.progress.branch = None
        restore(self.parts, self.progress, trunk)
        return stopped

    def step(self, phase: ScheduledPhase, flops: int, batch_iters: list, loaders: list[ShardLoader], log: StepLog) -> dict:
        """One training step of the schedule in force: its counters and its line in `log`.

        The step's seconds (`StepTimer`: device time, read without a per-step synchronize) exclude the wait
        for its batches and what Dynamo spent compiling, which have their own counters."""
        state, progress = self.state, self.progress
        self.rules.enter(progress, phase)
        tick = time.perf_counter()
        batches = [next(batch_iter) for batch_iter in batch_iters]
        wait = time.perf_counter() - tick
        self.timer.start()
        # A cosine rule's probe is part of the step it checks (the plan charges it there), on its weights before the update.
        probed = self.rules.probe_cosine(batches, phase, state.step) if self.rules.probes_now(progress, phase) else None
        out = self.stepper(batches, wait, phase, state, self.flags)
        self.timer.stop()
        self.count_time()
        self.guard.count(state, phase.index, out["grad_norm"], out["finite"], out["stepped"])
        state.step += 1
        state.flops += flops
        state.branch_flops += flops if progress.branch is not None else 0
        state.data_wait_seconds += out["data_wait"]
        state.bad_samples = dict(sum((Counter(loader.bad_counts()) for loader in loaders), Counter()))
        diagnostics, switch = self.block_norms.step(), {}
        if progress.branch is None:  # a rule that fires replans the trunk
            switch, progress.schedule = self.rules.check(progress, phase, probed)
        log.write(progress, phase, out, self.parts.scheduler.get_last_lr()[0], {**diagnostics, **switch})
        self.guard.after_step(state, progress.active.phases[phase.index])  # as planned now: a rule may have ended it
        return out

    def flags(self) -> tuple[bool, bool]:
        """(a signal asked this rank to stop, a periodic checkpoint is due by its clock), read inside the step."""
        due = time.monotonic() - self.last_checkpoint > self.cfg.train.checkpoint_minutes * 60
        return self.progress.stop_signal is not None, due

    def count_time(self, wait: bool = False) -> None:
        """Add the step time measured so far to the counters; `wait`: all of it (before a row or a checkpoint)."""
        timing = self.timer.read(wait)
        self.state.train_seconds += timing.train
        self.state.compile_seconds += timing.compile

    def checkpoint(self, name: str, loaders: list[ShardLoader]) -> None:
        """Save the run here (with its loaders' positions); the time goes to its own counter."""
        self.count_time(wait=True)
        tick = time.perf_counter()
        self.state.loader_state = self.streams.positions(loaders)
        save_checkpoint(self.accelerator, self.run, name, self.state.step, self.cfg.train.keep_checkpoints)
        self.state.checkpoint_seconds += time.perf_counter() - tick

    def stop(self, signalled: bool, loaders: list[ShardLoader]) -> Path:
        """Preemption (a signal on any rank) or a requested stop: save where we are so that rerunning resumes here."""
        if self.state.step not in self.progress.schedule.eval_steps:
            self.checkpoint(f"step-{self.state.step:08d}", loaders)
        reason = "a signal" if signalled else "train.stop_at_step"
        self.accelerator.print(f"stopped at step {self.state.step} ({reason}); checkpoint saved, "
                               "rerun the same command to resume")
        return self.run.root

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


def trainer_for(cfg: RunConfig, data: DatasetInfo, accelerator: Accelerator | None = None,
                on_point: Callable[[Trainer, float], None] | None = None, start: Start | None = None,
                validation: Callable[[Trainer, nn.Module], float] | None = None) -> Trainer:
    """The loop of one run with what it trains built (`build`), then its synth data generated: a batch, budget,
    model or rule that cannot be is refused before any data is made. `data`: as the caller resolved it
    (`resolve_dataset(create=False)`); the other arguments as `Trainer` takes them."""
    run = RunDir.of(cfg)
    acc = accelerator or make_accelerator(cfg, run)
    streams = Streams(cfg, data, acc)
    progress = Progress(TrainState(), run_schedule(cfg, acc.num_processes, data))
    warmup = max(cfg.train.warmup_steps, 0)
    # The LR follows the schedule in force: the trunk's, or a cooled horizon's while its branch trains.
    parts = build_parts(cfg, data, acc, start, lambda step: progress.active.lr_factor(step, warmup, cfg.train.schedule))
    trainer = Trainer(cfg, data, parts, progress, run, streams, on_point, start, validation)
    with acc.main_process_first():  # rank 0 generates missing synth data, the others read it
        generate_synth(cfg.data, cfg.paths.data)
    return trainer
