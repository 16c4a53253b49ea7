"""DDP's wrapper, made for the phase in force, so that no step searches for unused parameters.

DDP all-reduces the gradient of every parameter it registered and waits for each one. An arm whose phases
differ in what gets a gradient (MaskDiT's mask token at mask 0, Skip-DiT's frozen blocks) would need
`find_unused_parameters=True`, which walks the autograd graph after every forward, in every phase. Instead a
phase sets `requires_grad` on exactly what it trains: not what it freezes, nor what its steps leave idle
(`models.dit.idle_parameters`, checked against a real backward for every shipped arm). DDP registers what
requires a gradient when it wraps, so a phase switch that changes either wraps the model again: one broadcast
of the weights, which every rank already holds.
"""

from __future__ import annotations

from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from maskbench.config import RunConfig
from maskbench.models.dit import idle_parameters

Layout = tuple[str, tuple[str, ...]]  # (what the phase trains: a `Trainable`, the parameters its steps leave idle)


def phase_layout(cfg: RunConfig, trainable: str, mask_ratio: float) -> Layout:
    """What a phase's steps give a gradient: a phase of the same layout keeps the wrapper."""
    return trainable, tuple(idle_parameters(cfg.model, mask_ratio))


def rewrap(acc: Accelerator, wrapped: DistributedDataParallel) -> DistributedDataParallel:
    """`wrapped`'s module in a new DDP wrapper that registers what requires a gradient now (the accelerator
    keeps the module, not the wrapper, for its checkpoints). Made here rather than by `accelerate.prepare`,
    which would patch the module's forward (autocast) a second time; the kwargs and communication hook are
    the accelerator's."""
    wrapped.reducer._remove_autograd_hooks()  # else the old wrapper goes on counting the gradients it registered
    handler = acc.ddp_handler
    new = DistributedDataParallel(wrapped.module, device_ids=wrapped.device_ids, output_device=wrapped.output_device,
                                  **(handler.to_kwargs() if handler is not None else {}))
    if handler is not None:
        handler.register_comm_hook(new)
    return new
