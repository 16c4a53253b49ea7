"""One optimizer step: every draw of each of this rank's micro-batches, forward and backward, the clip, the step's
one host sync, and the update (or none, for a step the guard refuses or whose loss is not finite).

All randomness of a step (timesteps, noise, caption dropout, which tokens are dropped) comes from one generator
per purpose seeded by (run seed, data stream, step, purpose), so arms with one seed share every draw but the mask.
Gradients are all-reduced by the DDP wrapper, and every rank decides together (one gather per step) whether a
step was finite and whether to stop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from maskbench.config import RunConfig
from maskbench.models.build import batch_context
from maskbench.models.inputs import StepContext, StepInputs
from maskbench.models.masking import host_to_device
from maskbench.models.objective import sample_t, windowed_flow_loss
from maskbench.train.build import Parts
from maskbench.train.checkpoint import TrainState
from maskbench.train.guard import StepGuard
from maskbench.train.schedule import ScheduledPhase, step_generator
from maskbench.train.steplog import batch_digest, draw_digest
from maskbench.train.streams import Streams


def shared_draws(cfg: RunConfig, stream: int, step: int, shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """(t, caption dropout, noise) of one stream's micro-batch of `shape` (b×C×H×W) at `step`, on the host: what
    every arm of this seed draws alike. Made on the CPU from generators keyed by (seed, stream, step, purpose), so
    any machine recomputes them from the config alone, and a device's logged `draw_digest` can be checked against
    the CPU's (`expected_draw_digests`)."""
    def generator(purpose: str) -> torch.Generator:
        return step_generator(cfg.seed, stream, step, purpose)

    b = shape[0]
    t = sample_t(b, generator("t"), torch.device("cpu"))                          # b
    drop = torch.rand(b, generator=generator("dropout")) < cfg.train.caption_dropout  # b bool
    return t, drop, torch.randn(shape, generator=generator("noise"))             # b, b, b×C×H×W


def expected_draw_digests(cfg: RunConfig, n_streams: int, step: int, shape: torch.Size) -> list[str]:
    """Every stream's `draw_digest` at `step` as the CPU computes it (hex, as `metrics.jsonl` logs them): the
    integer fingerprint is exact on any device, so a GPU's log equals this where the draws crossed intact."""
    return [f"{int(draw_digest(*shared_draws(cfg, stream, step, shape), device=torch.device('cpu'))):08x}"
            for stream in range(n_streams)]


def attention_kernels(choice: str) -> contextlib.AbstractContextManager:
    """auto lets SDPA pick flash / memory-efficient kernels; math forces the unfused reference kernel."""
    return sdpa_kernel(SDPBackend.MATH) if choice == "math" else contextlib.nullcontext()


@dataclass
class StepDraws:
    """One stream's micro-batch on the device and every draw of its step (`Stepper.draws`): what every
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


class Stepper:
    """The steps of one run on this rank's data streams (one micro-batch each)."""

    def __init__(self, cfg: RunConfig, parts: Parts, guard: StepGuard, streams: Streams) -> None:
        self.cfg, self.parts, self.guard, self.streams = cfg, parts, guard, streams

    def draws(self, batch: dict, phase: ScheduledPhase, stream: int, step: int) -> StepDraws:
        """One stream's micro-batch on the device with every draw of its step.

        Each purpose draws from its own generator keyed by (seed, stream, step, purpose), so every arm
        with this seed draws the same t, caption dropout and noise here; the mask is its own draw. Every
        draw is made on the CPU and copied to the device from pinned memory: CUDA's generators give
        different numbers on GPUs of different multiprocessor counts once a tensor is large, the CPU's
        give the same numbers everywhere, so arms pair on any device (`config.DRAW_SCHEME`)."""
        cfg, net, device = self.cfg, self.parts.net, self.parts.accelerator.device

        def generator(purpose: str) -> torch.Generator:
            return step_generator(cfg.seed, stream, step, purpose)

        x0 = batch["image"].to(device, non_blocking=True)                              # b×C×H×W
        # t stays on the host: the plan counts each step's demoted samples from this same draw
        # (`downscaled_count`), and the loss splits a demotion step by it without waiting on the device.
        t, drop, noise = shared_draws(cfg, stream, step, x0.shape)                     # b, b, b×C×H×W
        drop, noise = host_to_device(drop, device), host_to_device(noise, device)
        context, context_mask = batch_context(net, batch, device)
        step_context = StepContext(cfg, batch, phase.mask_ratio, phase.demote, net.seq_len, net.grid, device, generator)
        inputs = StepInputs.draw(step_context, repa=self.parts.repa)  # each technique's own draw (`models.inputs`)
        return StepDraws(x0, t, drop, noise, context, context_mask, inputs)

    def stream_loss(self, batch: dict, phase: ScheduledPhase, stream: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training loss of one stream's micro-batch, and the digest of its shared draws."""
        parts = self.parts
        d = self.draws(batch, phase, stream, step)
        with parts.accelerator.autocast():
            loss = windowed_flow_loss(parts.net, *d.loss_args(), d.inputs, self.cfg.train.mae_weight, parts.forward)
        return loss, draw_digest(d.t, d.drop, d.noise, device=parts.accelerator.device)

    def accumulate_gradients(self, batches: list[dict], phase: ScheduledPhase, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward over this rank's micro-batches; returns their losses and draw digests.

        `accelerator.accumulate` (gradient_accumulation_steps = train.grad_accum, `build.make_accelerator`)
        all-reduces only after the last micro-batch, and `backward` divides each loss by their count.
        """
        acc, losses, digests = self.parts.accelerator, [], []
        for stream, batch in zip(self.streams.ids, batches):
            # The kernel choice spans backward too: activation checkpointing recomputes attention there.
            # REPA's projector is a second DDP module: inside `accumulate` too, or it all-reduces every micro-batch.
            with acc.accumulate(*self.parts.wrapped), attention_kernels(self.cfg.train.attention):
                loss, digest = self.stream_loss(batch, phase, stream, step)
                acc.backward(loss)
            losses.append(loss.detach())
            digests.append(digest)
        return torch.stack(losses), torch.stack(digests)                                 # grad_accum each

    def apply_update(self, counters: TrainState, grad_norm: float, losses_finite: bool, phase: int) -> tuple[bool, bool]:
        """Step on the clipped gradients, or drop the gradients of a non-finite step, or of one the step guard
        refuses (`guard.StepGuard`: the norm before clipping is too large); returns (finite, stepped)."""
        parts = self.parts
        finite = losses_finite and math.isfinite(grad_norm)
        stepped = finite and not self.guard.refuses(counters, phase, grad_norm)
        if stepped:
            parts.optimizer.step()
            parts.scheduler.step()
            parts.ema.update(parts.net)
        parts.optimizer.zero_grad(set_to_none=True)
        return finite, stepped

    def __call__(self, batches: list[dict], wait: float, phase: ScheduledPhase, counters: TrainState,
                 flags: Callable[[], tuple[bool, bool]]) -> dict:
        """Forward, backward and update of step `counters.step`; every number returned is the same on every rank.
        flags(): (a stop was asked for, a checkpoint is due), read once the gradients are in; they join the one sync."""
        acc = self.parts.accelerator
        losses, digests = self.accumulate_gradients(batches, phase, counters.step)    # grad_accum each
        # Clipped on the device (the same all-reduced gradients on every rank); its norm joins the one sync.
        grad_norm = acc.clip_grad_norm_(self.parts.trained, self.cfg.train.grad_clip)
        stop, due = flags()
        host = torch.tensor([[batch_digest(batch), wait, stop, due] for batch in batches],
                            dtype=torch.float64)                                             # grad_accum×4
        local = torch.cat([losses.double()[:, None], host.to(acc.device)[:, :1], digests.double()[:, None],
                           host.to(acc.device)[:, 1:], grad_norm.double().expand(len(batches), 1)],
                          dim=1)                                                             # grad_accum×7
        stats = acc.gather(local).cpu()  # streams×7: the step's one host sync
        grad_norm = stats[0, 6].item()
        finite, stepped = self.apply_update(counters, grad_norm, bool(torch.isfinite(stats[:, 0]).all()), phase.index)
        return {"loss": stats[:, 0].mean().item(), "grad_norm": grad_norm, "finite": finite, "stepped": stepped,
                "data_digest": [f"{int(d):08x}" for d in stats[:, 1]],
                "draw_digest": [f"{int(d):08x}" for d in stats[:, 2]],
                "data_wait": stats[:, 3].view(acc.num_processes, -1)[:, 0].max().item(),  # the slowest rank
                "stop": bool(stats[:, 4].any()),
                "checkpoint_due": bool(stats[0, 5])}  # rank 0's clock decides for every rank
