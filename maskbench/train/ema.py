"""Exponential moving average of the weights, the copy that is evaluated.

A fixed decay of 0.999 averages over ~1k steps and so lags badly in CPU-sized runs of ~1k steps; the
warm-up `min(decay, (1 + n) / (10 + n))` makes the average track early training and reach the full
decay only in long runs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.updates = 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self._ema_params = list(self.model.parameters())
        self._source: tuple[nn.Module, list[torch.Tensor]] | None = None  # the tracked model and its parameters

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        decay = self.current_decay()
        if self._source is None or self._source[0] is not model:  # listing parameters each step costs ~1.5 ms
            self._source = (model, list(model.parameters()))
        params = [p.detach().to(e.dtype) for p, e in zip(self._source[1], self._ema_params)]
        torch._foreach_lerp_(self._ema_params, params, 1.0 - decay)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "model": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        self.updates = state["updates"]
        self.model.load_state_dict(state["model"])
