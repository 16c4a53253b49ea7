"""Sampling: fixed noise per prompt index and the Euler ODE sampler for rectified flow.

The noise of prompt i depends only on (noise_seed, i) and is drawn on the CPU, so every arm, seed and
device sees byte-identical initial noise for the same prompt: the comparison between arms is paired.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def fixed_noise(indices: range | list[int], shape: tuple[int, ...], noise_seed: int) -> torch.Tensor:
    """N×C×H×W standard normal noise; row i is a function of (noise_seed, indices[i]) alone."""
    generator = torch.Generator()
    rows = []
    for index in indices:
        generator.manual_seed(noise_seed * 1_000_003 + index)
        rows.append(torch.randn(shape, generator=generator))                    # C×H×W
    return torch.stack(rows)                                                     # N×C×H×W


def guided_velocity(model: nn.Module, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                    context_mask: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """v = v_uncond + s·(v_cond − v_uncond), conditional and unconditional in one doubled batch."""
    B = x.shape[0]
    if cfg_scale == 1.0:
        return model.unpatchify(model(x, t, context, context_mask).float())     # B×C×H×W
    drop = torch.cat([torch.zeros(B, dtype=torch.bool), torch.ones(B, dtype=torch.bool)]).to(x.device)
    tokens = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([context, context]),
                   torch.cat([context_mask, context_mask]), drop_context=drop)  # 2B×L×P
    v_cond, v_uncond = model.unpatchify(tokens.float()).chunk(2)                # B×C×H×W each, fp32 under autocast
    return v_uncond + cfg_scale * (v_cond - v_uncond)


@contextmanager
def inference_precision(device: torch.device) -> Iterator[None]:
    """bf16 autocast and TF32 matmuls on CUDA, for the EMA model's sampling and validation-loss forwards (the
    training precision; fp32 would be several times slower). Elsewhere nothing changes, so CPU results stay
    bit-identical to plain fp32. The global TF32 flag is restored: the trainer's MFU reads it."""
    if device.type != "cuda":
        yield
        return
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@torch.no_grad()
def euler_sample(model: nn.Module, noise: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor,
                 steps: int, cfg_scale: float) -> torch.Tensor:
    """Integrate dx/dt = v from t = 1 (noise) to t = 0 (data) in `steps` uniform Euler steps."""
    x = noise                                                                    # B×C×H×W
    times = torch.linspace(1.0, 0.0, steps + 1, device=noise.device)
    for t, t_next in zip(times[:-1], times[1:]):
        v = guided_velocity(model, x, t.expand(x.shape[0]), context, context_mask, cfg_scale)
        x = x + (t_next - t) * v                                                 # B×C×H×W
    return x


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats N×C×H×W -> uint8 N×H×W×C, the form every metric takes."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
