"""Rectified-flow objective: x_t = (1 - t)·x0 + t·ε, the model predicts v = ε - x0.

Kept in one place so training, validation loss and sampling agree on the convention
(t = 0 is data, t = 1 is noise).
"""

from __future__ import annotations

import torch


def sample_t(batch: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Logit-normal(0, 1) times (SD3's choice): more weight on mid-range noise levels."""
    return torch.sigmoid(torch.randn(batch, generator=generator, device=device))   # B


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t on the straight path between data (t = 0) and noise (t = 1)."""
    t = t.view(-1, *([1] * (x0.dim() - 1)))                                          # B×1×1×1
    return (1 - t) * x0 + t * noise                                                   # B×C×H×W


def velocity_loss(pred: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the kept tokens (pred, target: B×K×P); masked tokens carry no loss."""
    return torch.mean((pred.float() - target_tokens.float()) ** 2)
