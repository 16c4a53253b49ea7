"""The plan of a run: its FLOPs budget as whole steps per phase, each step's cost, and its randomness.

Every step's randomness (timesteps, noise, caption dropout, masks) is a function of (seed, stream,
step), so the plan knows before training what each step will cost, including steps where some samples
train downscaled, and the budget is spent exactly. The per-step FLOPs themselves are counted
analytically in `maskbench.train.flops`.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from maskbench.config import ConfigError, RunConfig, demote_routes
from maskbench.data.dataset import DatasetInfo
from maskbench.models.objective import route_choice, sample_t
from maskbench.train.flops import train_step_flops


def step_generators(seed: int, stream: int, step: int, device: torch.device
                    ) -> tuple[torch.Generator, torch.Generator]:
    """(CPU generator for t / dropout / masks, device generator for noise), both a function of the step."""
    value = (seed * 1_000_003 + stream) * 10_000_019 + step
    cpu = torch.Generator().manual_seed(value)
    dev = torch.Generator(device=device).manual_seed(value + 1) if device.type != "cpu" else cpu
    return cpu, dev


@dataclass(frozen=True)
class PhasePlan:
    """One phase of an arm: its mask ratio and the FLOPs of each whole step its share of the budget buys."""

    mask_ratio: float
    flops_per_step: tuple[int, ...]   # the same for every step, unless some samples train downscaled

    @property
    def steps(self) -> int:
        return len(self.flops_per_step)

    @property
    def flops(self) -> int:
        return sum(self.flops_per_step)


def plan_phases(phases: list[tuple[float, float]], budget_flops: float,
                step_cost: Callable[[float, int], int]) -> list[PhasePlan]:
    """Give each (mask_ratio, budget_fraction) phase fraction × budget FLOPs, as whole steps.

    step_cost(mask_ratio, step) is the cost of the run's global step `step` in that phase: constant
    for most arms, smaller on steps where some samples train at a lower resolution (known in advance,
    because every step's t is a function of the seed). Stopping before the step that would overrun
    loses less than one step per phase, so arms with different phase lists spend the same budget to
    within one step.
    """
    if any(fraction <= 0 for _, fraction in phases) or abs(sum(f for _, f in phases) - 1.0) > 1e-6:
        raise ConfigError(f"phase budget fractions must be positive and sum to 1, got {phases}")
    plans, start = [], 0
    for index, (mask_ratio, fraction) in enumerate(phases):
        allowance, spent, costs = fraction * budget_flops, 0, []
        while spent + (cost := step_cost(mask_ratio, start + len(costs))) <= allowance:
            costs.append(cost)
            spent += cost
        if not costs:
            raise ConfigError(f"budget {budget_flops:.3g} FLOPs is too small for one step of phase {index} "
                             f"(mask {mask_ratio}, {fraction:.0%} of the budget): one step costs {cost:.3g}")
        plans.append(PhasePlan(mask_ratio, tuple(costs)))
        start += len(costs)
    return plans


@dataclass
class Schedule:
    """Where each step sits: its phase, its FLOPs, and the steps at which eval points fall."""
    phases: list[PhasePlan]
    eval_steps: dict[int, float]   # steps completed -> eval point

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    @property
    def total_flops(self) -> int:
        return sum(p.flops for p in self.phases)

    def phase_at(self, step: int) -> tuple[PhasePlan, int]:
        """(the phase of global step `step`, that step's FLOPs)."""
        for phase in self.phases:
            if step < phase.steps:
                return phase, phase.flops_per_step[step]
            step -= phase.steps
        raise IndexError("step past the end of the schedule")


def make_schedule(cfg: RunConfig, data: DatasetInfo, n_streams: int) -> Schedule:
    """Plan phases by FLOPs, then put each eval point at the first step whose FLOPs reach it."""
    cost = functools.cache(functools.partial(batch_step_flops, cfg, data))  # (mask ratio, downscaled) -> FLOPs
    phases = plan_phases([(p.mask_ratio, p.fraction) for p in cfg.arm.phases], cfg.budget.flops,
                         lambda mask_ratio, step: cost(mask_ratio, downscaled_count(cfg, n_streams, step)))
    cumulative = list(itertools.accumulate(flops for phase in phases for flops in phase.flops_per_step))
    eval_steps = {}
    for point in sorted(cfg.eval.points):
        target = point * cumulative[-1] * (1 - 1e-9)
        eval_steps[bisect.bisect_left(cumulative, target) + 1] = point
    return Schedule(phases, eval_steps)


def batch_step_flops(cfg: RunConfig, data: DatasetInfo, mask_ratio: float, downscaled: tuple[int, ...] = ()) -> int:
    """FLOPs of one training step of the global batch, downscaled[r] of its samples at route r's size
    (`demote_routes` order; a step's cost is linear in its batch, so the parts add)."""
    def per_sample(image_size: int) -> int:
        return train_step_flops(cfg.model, image_size, data.channels, data.context_dim or cfg.model.text_width,
                                data.context_len or cfg.model.text_len, 1, mask_ratio,
                                text_encoder=not data.latent)

    sizes = [data.demoted_size(route.ratio, cfg.model.patch_size) for route in demote_routes(cfg.train)]
    full = (cfg.train.batch_size - sum(downscaled)) * per_sample(data.image_size)
    return full + sum(count and count * per_sample(size) for count, size in zip(downscaled, sizes))


def downscaled_count(cfg: RunConfig, n_streams: int, step: int) -> tuple[int, ...]:
    """How many samples of global step `step` train on each demotion route (`route_choice` of their t).

    Each stream's t is the first draw of its step generator (as in `Trainer.stream_loss`), and the
    batch gate decides per stream micro-batch as the loss does, so the counts are known before
    training and the FLOPs budget can be planned exactly.
    """
    routes = demote_routes(cfg.train)
    if not routes:
        return ()
    cpu, b = torch.device("cpu"), cfg.train.batch_size // n_streams
    choices = torch.cat([route_choice(sample_t(b, step_generators(cfg.seed, s, step, cpu)[0], cpu), routes,
                                      cfg.train.demote_gate) for s in range(n_streams)])  # B, −1 = native
    return tuple(int((choices == index).sum()) for index in range(len(routes)))
