"""Training diagnostics for the architecture arms: per-block feature norms and the long-skip layers.

ScaleLong's argument is that long skips make hidden features grow and oscillate from step to step;
Skip-DiT's is that skips keep them stable. Both are claims about feature norms over training, so the
trainer logs them: the mean token norm of each block's output in every training step (forward hooks,
so no second forward), its relative change from the previous step, and the weight and bias norms of
each long-skip fusion layer. `metrics.jsonl` gets the per-step values, `eval.jsonl` a summary per
eval point (the mean over the steps since the previous point). With several processes, rank 0 logs
the norms of its own micro-batches: a diagnostic needs no extra collective per step.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from maskbench.models.dit import DiT


def named_blocks(model: DiT) -> list[tuple[str, nn.Module]]:
    """Every transformer block in forward order: mixer.i, block.i, decoder.i."""
    groups = (("mixer", model.mixer), ("block", model.blocks), ("decoder", model.decoder))
    return [(f"{group}.{i}", block) for group, blocks in groups for i, block in enumerate(blocks)]


def skip_norms(model: DiT) -> dict[str, float]:
    """L2 norms of each long-skip fusion layer's weight and bias, keyed `skip.<fusing block>.weight|bias`."""
    return to_host(_skip_norms(model))


def _skip_norms(model: DiT) -> dict[str, torch.Tensor]:
    """`skip_norms` still on the device."""
    return {f"skip.{index}.{name}": param.detach().float().norm()
            for index, skip in model.long_skips.items() for name, param in skip.proj.named_parameters()}


def to_host(scalars: dict[str, torch.Tensor]) -> dict[str, float]:
    """Scalar tensors as floats in one device-to-host copy: one wait for the device, not one per value."""
    if not scalars:
        return {}
    return dict(zip(scalars, torch.stack(list(scalars.values())).tolist()))


class BlockNorms:
    """Collects the mean token norm of every block's output during training forwards.

    Hooks are registered on the model that trains (not on the EMA copy, which evaluates), and record
    only in training mode with grad enabled, so validation and sampling never touch them, and not while
    `paused` (a rule's gradient probe runs extra forwards inside a step: they are not the step's).
    They add into preallocated device tensors in place: a hook that appended to a Python list would make
    torch.compile guard on the list's length and compile a graph per micro-batch, then fall back to eager.
    """

    def __init__(self, model: DiT) -> None:
        self.model = model
        self.names = [name for name, _ in named_blocks(model)]
        device = next(model.parameters()).device
        self._sums = torch.zeros(len(self.names), device=device)     # Σ over this step's forwards, per block
        self._counts = torch.zeros(len(self.names), device=device)   # forwards recorded, per block
        self._previous: dict[str, float] = {}
        self._norm_sums: dict[str, float] = defaultdict(float)
        self._osc_sums: dict[str, float] = defaultdict(float)
        self._osc_counts: dict[str, int] = defaultdict(int)
        self._steps = 0
        self._paused = False
        for index, (_, block) in enumerate(named_blocks(model)):
            block.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if module.training and torch.is_grad_enabled() and not self._paused:
                self._sums[index] += output.detach().float().norm(dim=-1).mean()   # mean over B×N tokens
                self._counts[index] += 1
        return record

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside this block are not recorded (a probe's, between a step's draws and its update)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def step(self) -> dict:
        """This step's block norms (mean over its micro-batches), their oscillation, and the skip norms."""
        recorded = {f"count.{name}": count for name, count in zip(self.names, self._counts)}
        means = {name: total / count.clamp(min=1) for name, total, count in zip(self.names, self._sums, self._counts)}
        skips = _skip_norms(self.model) if self.model.long_skips else {}
        host = to_host({**means, **skips, **recorded})                      # block, skip and count names differ
        norms = {name: host[name] for name in means if host[f"count.{name}"]}
        self._sums.zero_()
        self._counts.zero_()
        oscillation = {name: abs(value - self._previous[name]) / max(self._previous[name], 1e-12)
                       for name, value in norms.items() if name in self._previous}
        self._previous = norms
        for name, value in norms.items():
            self._norm_sums[name] += value
        for name, value in oscillation.items():
            self._osc_sums[name] += value
            self._osc_counts[name] += 1
        self._steps += 1
        return {"block_norm": norms, "block_osc": oscillation,
                **({"skip_norm": {name: host[name] for name in skips}} if skips else {})}

    def summary(self) -> dict:
        """Means over the steps since the last summary (the eval point's window), then start a new window."""
        steps = max(self._steps, 1)
        out = {"block_norm": {name: total / steps for name, total in self._norm_sums.items()},
               "block_osc": {name: total / self._osc_counts[name] for name, total in self._osc_sums.items()},
               "skip_norm": skip_norms(self.model), "steps": self._steps}
        self._norm_sums.clear()
        self._osc_sums.clear()
        self._osc_counts.clear()
        self._steps = 0
        return out
