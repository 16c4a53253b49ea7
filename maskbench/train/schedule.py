"""The plan of a run: its FLOPs budget as whole steps per phase, each step's cost, its LR, its cooled
horizons, and its randomness.

Every step's randomness (timesteps, noise, caption dropout, masks) is a function of (seed, stream,
step, purpose), so the plan knows before training what each step will cost, including steps where some
samples train downscaled, and the budget is spent exactly. The per-step FLOPs themselves are counted
analytically in `maskbench.train.flops`. Under the warmup-stable-decay LR schedule every eval point
before the last is a `Horizon`: the standalone plan of that budget and the trunk step it forks from.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from maskbench.config import LRSchedule, Phase, RunConfig, Trainable, Until, demote_routes
from maskbench.data.dataset import DatasetInfo
from maskbench.errors import ConfigError
from maskbench.models.inputs import StepInputs
from maskbench.models.objective import sample_t, window_choice
from maskbench.train.flops import skips_only_step_flops, train_step_flops
from maskbench.train.repa import repa_sample_flops

# The purposes a step draws random numbers for, each from its own stream (common random numbers): two
# arms with one seed draw the same t, caption dropout and noise at every step they share, whatever else
# each draws (its techniques' `StepInputs` fields: the mask, a demotion route's fresh noise) and in whatever
# order. Append only: a purpose's index keys its stream.
DRAWS = ("t", "dropout", "noise", *StepInputs.purposes())


def step_generator(seed: int, stream: int, step: int, purpose: str) -> torch.Generator:
    """The CPU generator of one purpose's draws at one step of one data stream, keyed by all four.

    numpy's SeedSequence hashes the key, so neighbouring steps and purposes get unrelated streams. It is a
    CPU generator on every device: the CPU's numbers do not depend on the machine, where CUDA's depend on
    the GPU model for large tensors, so a run draws the same numbers on a laptop, an A100 or an H200.
    """
    key = np.random.SeedSequence([seed, stream, step, DRAWS.index(purpose)]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(key) >> 1)  # 63 bits: manual_seed's positive range


@dataclass(frozen=True)
class ScheduledPhase:
    """One phase of an arm: its mask ratio and the FLOPs of each whole step its share of the budget buys."""

    mask_ratio: float
    flops_per_step: tuple[int, ...]   # the same for every step, unless some samples train downscaled
    trainable: str = "all"            # all, or skips: only the long-skip layers train (`Phase.trainable`)
    until: Until | None = None        # the rule that may end it early (`Phase.until`)
    lr: tuple[float, float] | None = None  # its own LR multipliers [start, end] (`Phase.lr`), else the run's
    index: int = 0                    # its place in the arm
    start: int = 0                    # the global step it starts at
    demote: bool = True               # whether its steps take the run's demotion routes (`Phase.demote`)

    @property
    def steps(self) -> int:
        return len(self.flops_per_step)

    @property
    def flops(self) -> int:
        return sum(self.flops_per_step)


def schedule_phases(phases: Sequence[Phase], budget_flops: float, step_cost: Callable[[Phase, int, int], int],
                ends: Mapping[int, int] | None = None,
                constant_cost: Callable[[Phase], int | None] | None = None) -> list[ScheduledPhase]:
    """Give each phase fraction × budget FLOPs, as whole steps.

    step_cost(phase, step, done) is the cost of the run's global step `step`, the `done`-th step of its
    phase (from 1): constant for most arms, smaller on steps where some samples train at a lower
    resolution (known in advance, because every step's t is a function of the seed), or in a skips-only
    phase, larger on the steps a `grad_cosine_below` rule checks (`rule_checks`). Stopping before the
    step that would overrun loses less than one step per phase, so arms with different phase lists
    spend the same budget to within one step.

    ends[i] = n: phase i's rule fired after n steps (`Phase.until`); the rest of its allowance moves to
    phase i + 1, so the run still spends its budget to within one step per phase.

    constant_cost(phase), where given, is the cost of every step of a phase whose steps all cost the same (None
    for one whose do not): its steps are then counted at once, not one by one (a large budget schedules ~10^6 steps).
    """
    if any(p.fraction <= 0 for p in phases) or abs(sum(p.fraction for p in phases) - 1.0) > 1e-6:
        raise ConfigError(f"phase budget fractions must be positive and sum to 1, got {[p.fraction for p in phases]}")
    ends = ends or {}
    scheduled, start, carried = [], 0, 0.0
    for index, phase in enumerate(phases):
        allowance, spent, costs = phase.fraction * budget_flops + carried, 0, []
        fixed = constant_cost(phase) if constant_cost is not None and index not in ends else None
        if fixed:  # the whole steps the allowance holds, as the loop below counts them (exact int/float compares)
            n = max(int(allowance // fixed), 0)
            n = next(k for k in (n + 1, n, n - 1, n - 2) if k * fixed <= allowance) if n else 0
            costs, spent, cost = [fixed] * n, n * fixed, fixed
        while not fixed and len(costs) < ends.get(index, len(costs) + 1):
            cost = step_cost(phase, start + len(costs), len(costs) + 1)
            if index not in ends and spent + cost > allowance:
                break
            costs.append(cost)
            spent += cost
        if not costs:
            raise ConfigError(f"budget {budget_flops:.3g} FLOPs is too small for one step of phase {index} "
                              f"(mask {phase.mask_ratio}, {phase.fraction:.0%} of the budget): one step costs {cost:.3g}")
        carried = allowance - spent if index in ends else 0.0
        scheduled.append(ScheduledPhase(phase.mask_ratio, tuple(costs), phase.trainable, phase.until,
                                         tuple(phase.lr) if phase.lr is not None else None, index, start, phase.demote))
        start += len(costs)
    return scheduled


@dataclass
class Schedule:
    """Where each step sits: its phase, its FLOPs, the steps at which eval points fall, where its LR
    decays, and (wsd) the cooled horizons that branch off it."""
    phases: list[ScheduledPhase]
    eval_steps: dict[int, float]   # steps completed -> eval point (evaluated on this schedule's own weights)
    decay_start: int | None = None  # wsd: the first step of the LR decay
    horizons: list[Horizon] = field(default_factory=list)  # wsd: the eval points before the last, as branches

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    @property
    def total_flops(self) -> int:
        return sum(p.flops for p in self.phases)

    def phase_at(self, step: int) -> tuple[ScheduledPhase, int]:
        """(the phase of global step `step`, that step's FLOPs)."""
        for phase in self.phases:
            if step < phase.steps:
                return phase, phase.flops_per_step[step]
            step -= phase.steps
        raise IndexError("step past the end of the schedule")

    def lr_factor(self, step: int, warmup: int, kind: str) -> float:
        """The LR multiplier of step `step`: a linear warm-up, then constant, cosine to the end, or (wsd)
        constant until `decay_start` and 1 − √progress over the rest (Hägele et al. 2024's best decay shape).
        A phase with its own LR (`Phase.lr`, constant runs only) follows it instead: cosine from start to end
        over the phase's steps, as MicroDiT's masked phase; start = end is constant."""
        warm = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        phase, _ = self.phase_at(min(step, self.total_steps - 1))  # LambdaLR asks one step past the last
        if phase.lr is not None:
            start, end = phase.lr
            progress = (step - phase.start) / max(phase.steps - 1, 1)
            return warm * (end + (start - end) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        if kind == LRSchedule.cosine:
            progress = (step - warmup) / max(self.total_steps - warmup, 1)
            return warm if step < warmup else 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        span = self.total_steps - (self.decay_start or 0)  # decay steps (none: a plan too short to decay)
        if kind == LRSchedule.wsd and self.decay_start is not None and step >= self.decay_start and span > 0:
            return warm * (1 - math.sqrt(min((step - self.decay_start) / span, 1.0)))
        return warm


@dataclass(frozen=True)
class Horizon:
    """An eval point of a wsd run: the same arm trained *to* `point` × budget and annealed.

    `schedule` is exactly the plan a standalone run of that budget would follow. Until `fork` its steps
    are the trunk's (same phases, FLOPs and constant LR), so the trainer runs the trunk to `fork`, then
    this schedule's remaining steps as a branch, evaluates, and resumes the trunk where it left it.
    """
    point: float
    schedule: Schedule
    fork: int


def make_schedule(cfg: RunConfig, data: DatasetInfo, n_streams: int, ends: Mapping[int, int] | None = None) -> Schedule:
    """Plan phases by FLOPs, then put each eval point at the first step whose FLOPs reach it.

    With `ends` (phases whose rule fired: `schedule_phases`), the eval points a run had already reached when
    a rule fired keep their steps; the later ones move to where the replanned FLOPs reach them.
    Under `train.schedule=wsd` every eval point before the last is a `Horizon` instead: a branch with
    its own cooled schedule. A rule arm's horizon is the standalone run of its budget, whose rule fires
    where the trunk's did if that was before its own phase's cap, and else never (`horizon_ends`).
    """
    cost = functools.cache(functools.partial(batch_step_flops, cfg, data))  # (mask ratio, downscaled) -> FLOPs
    frozen = functools.cache(functools.partial(skips_only_batch_flops, cfg, data))  # mask ratio -> FLOPs

    def step_cost(phase: Phase, step: int, done: int) -> int:
        if phase.trainable == Trainable.skips:
            return frozen(phase.mask_ratio)
        probe = cost(0.0, ()) + cost(phase.mask_ratio, ()) if rule_checks(phase.until, done) else 0
        return cost(phase.mask_ratio, downscaled_count(cfg, n_streams, step) if phase.demote else ()) + probe

    routes = demote_routes(cfg.train)

    def constant_cost(phase: Phase) -> int | None:
        """step_cost of every step of a phase without a rule's probe steps or demotion draws (None for others)."""
        if phase.trainable == Trainable.skips:
            return frozen(phase.mask_ratio)
        if (phase.until is None or phase.until.grad_cosine_below is None) and not (phase.demote and routes):
            return cost(phase.mask_ratio, ())
        return None

    def planned(budget: float, points: Sequence[float], ends: Mapping[int, int]) -> Schedule:
        phases = schedule_phases(cfg.arm.phases, budget, step_cost, ends, constant_cost)
        decay = _decay_start(phases, cfg.train.decay_fraction) if cfg.train.schedule == LRSchedule.wsd else None
        return Schedule(phases, _eval_steps(points, phases), decay)

    def horizon_ends(budget: float) -> dict[int, int]:
        """The trunk's fired rules that a standalone run of `budget` shares: those that fired before its own cap
        (the config allows one rule phase, the first, ending before the LR decay, so the runs agree until then)."""
        return {i: n for i, n in (ends or {}).items() if n < planned(budget, [1.0], {}).phases[i].steps}

    if cfg.train.schedule == LRSchedule.wsd:
        trunk = planned(cfg.budget.flops, [p for p in cfg.eval.points if p == 1.0], dict(ends or {}))
        for point in sorted(p for p in cfg.eval.points if p < 1.0):
            try:
                alone = planned(point * cfg.budget.flops, [1.0], horizon_ends(point * cfg.budget.flops))
            except ConfigError as err:
                raise ConfigError(f"eval point {point:g} is a run of its own under train.schedule=wsd, and {err}; "
                                  "raise budget.flops or drop that point") from None
            trunk.horizons.append(Horizon(point, alone, _fork_step(trunk, alone)))
        return trunk
    ends = dict(ends or {})
    schedule = planned(cfg.budget.flops, cfg.eval.points, {})
    for index in sorted(ends):
        replanned = planned(cfg.budget.flops, cfg.eval.points, {i: ends[i] for i in ends if i <= index})
        switch = replanned.phases[index + 1].start
        reached = {step: point for step, point in schedule.eval_steps.items() if step <= switch}
        later = {max(step, switch + 1): point for step, point in replanned.eval_steps.items()
                 if point not in reached.values()}
        schedule = Schedule(replanned.phases, {**reached, **later}, replanned.decay_start)
    return schedule


def rule_checks(until: Until | None, done: int) -> bool:
    """Whether a phase's `grad_cosine_below` rule probes at its `done`-th step (from 1): every `until.every` steps,
    the last step of the phase included, so the FLOPs the plan charges are the FLOPs the trainer spends."""
    return until is not None and until.grad_cosine_below is not None and done % until.every == 0


def _eval_steps(points: Sequence[float], phases: list[ScheduledPhase]) -> dict[int, float]:
    """Each eval point at the first step whose cumulative FLOPs reach that fraction of the plan's."""
    cumulative = list(itertools.accumulate(flops for phase in phases for flops in phase.flops_per_step))
    eval_steps = {}
    for point in sorted(points):
        target = point * cumulative[-1] * (1 - 1e-9)
        eval_steps[bisect.bisect_left(cumulative, target) + 1] = point
    return eval_steps


def _decay_start(phases: list[ScheduledPhase], fraction: float) -> int:
    """The first step all of whose predecessors together spend ≥ (1 − fraction) of the FLOPs."""
    cumulative = list(itertools.accumulate(flops for phase in phases for flops in phase.flops_per_step))
    return min(bisect.bisect_left(cumulative, (1 - fraction) * cumulative[-1] * (1 - 1e-9)) + 1, len(cumulative))


def _fork_step(trunk: Schedule, alone: Schedule) -> int:
    """The first step at which a horizon's standalone plan leaves the trunk's: its LR decay, or a phase
    that ends sooner (a two-phase arm's last phase is then wholly in the branch)."""
    fork = min(alone.decay_start, trunk.decay_start)
    for mine, theirs in zip(alone.phases, trunk.phases):
        if mine.steps != theirs.steps:
            return min(fork, mine.start + min(mine.steps, theirs.steps))
    return fork


def _step_flops(counter: Callable[..., int], cfg: RunConfig, data: DatasetInfo, image_size: int, batch: int,
                mask_ratio: float) -> int:
    """A `maskbench.train.flops` step counter on this run's model and data at one input size and batch."""
    return counter(cfg.model, image_size, data.channels, data.context_dim or cfg.model.text_width,
                   data.context_len or cfg.model.text_len, batch, mask_ratio, text_encoder=not data.latent)


def skips_only_batch_flops(cfg: RunConfig, data: DatasetInfo, mask_ratio: float) -> int:
    """FLOPs of one step of the global batch in a skips-only phase (never downscaled: the config refuses it)."""
    return _step_flops(skips_only_step_flops, cfg, data, data.image_size, cfg.train.batch_size, mask_ratio)


def batch_step_flops(cfg: RunConfig, data: DatasetInfo, mask_ratio: float, downscaled: tuple[int, ...] = ()) -> int:
    """FLOPs of one training step of the global batch, downscaled[r] of its samples at route r's size
    (`demote_routes` order; a step's cost is linear in its batch, so the parts add). REPA's projector and
    encoder add theirs (the config refuses REPA with demotion, so only at the native size)."""
    def per_sample(image_size: int) -> int:
        return (_step_flops(train_step_flops, cfg, data, image_size, 1, mask_ratio)
                + repa_sample_flops(cfg, data, mask_ratio))

    sizes = [data.demoted_size(route.ratio, cfg.model.patch_size) for route in demote_routes(cfg.train)]
    full = (cfg.train.batch_size - sum(downscaled)) * per_sample(data.image_size)
    return full + sum(count and count * per_sample(size) for count, size in zip(downscaled, sizes))


def downscaled_count(cfg: RunConfig, n_streams: int, step: int) -> tuple[int, ...]:
    """How many samples of global step `step` train on each demotion route (`window_choice` of their t).

    Each stream's t comes from its step's "t" generator (as in `step.Stepper.draws`), and the batch
    gate decides per stream micro-batch as the loss does, so the counts are known before training and
    the FLOPs budget can be planned exactly.
    """
    routes = demote_routes(cfg.train)
    if not routes:
        return ()
    cpu, b = torch.device("cpu"), cfg.train.batch_size // n_streams
    choices = torch.cat([window_choice(sample_t(b, step_generator(cfg.seed, s, step, "t"), cpu), routes,
                                      cfg.train.demote_gate) for s in range(n_streams)])  # B, −1 = native
    return tuple(int((choices == index).sum()) for index in range(len(routes)))
