"""Rectified-flow objective: x_t = (1 - t)·x0 + t·ε, the model predicts v = ε - x0.

Kept in one place so training, validation loss, sampling and the gradient probe agree on the
convention (t = 0 is data, t = 1 is noise) and on what each route's loss is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from maskbench.config import DemoteWindow
from maskbench.data.demote import demoted_size, ratio_key, resize
from maskbench.models.dit import DiT
from maskbench.models.inputs import FULL, StepInputs
from maskbench.models.kernels import gather_tokens
from maskbench.models.masking import drop_idx, host_to_device


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


def downscale(x0: torch.Tensor, noise: torch.Tensor, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same samples at 1/factor resolution: box-filtered images, and noise that is still N(0, I).

    The mean of factor² iid N(0, 1) values has variance 1/factor², so scaling it by `factor` gives
    iid N(0, 1) noise at the low resolution. Reusing the full-resolution draw (instead of drawing anew)
    keeps every other random choice of the step identical to the full-resolution arm.
    """
    return F.avg_pool2d(x0, factor), F.avg_pool2d(noise, factor) * factor            # B×C×H/f×W/f each


def demote(x0: torch.Tensor, noise: torch.Tensor, ratio: float, patch: int, generator: torch.Generator | None,
           demoted_x0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, noise) of a route at `ratio`: the side shrinks to `demoted_size`, snapped to the patch grid.

    x0 is `demoted_x0` when the data brings it (latent shards: the VAE's encoding of the resized
    image), else the resized x0 (pixels). Where the native side is an integer multiple of the demoted
    one this is `downscale` (box filter, pooled noise: no new draw). Otherwise pooled noise would be
    correlated and of uneven variance, so fresh N(0, I) noise is drawn from the step's `generator`,
    after every other draw of the step.
    """
    size = demoted_x0.shape[-1] if demoted_x0 is not None else demoted_size(x0.shape[-1], ratio, patch)
    factor, rest = divmod(x0.shape[-1], size)
    if rest == 0:
        low, noise_low = downscale(x0, noise, factor)                                 # n×C×s×s each
    else:
        low = resize(x0, size) if demoted_x0 is None else None                        # n×C×s×s
        noise_low = host_to_device(torch.randn((*x0.shape[:2], size, size), generator=generator,
                                               device=noise.device if generator is None else generator.device),
                                   noise.device)
    return (low if demoted_x0 is None else demoted_x0.to(x0)), noise_low


def in_window(t: torch.Tensor, window: list[float] | tuple[float, ...]) -> torch.Tensor:
    """B bool: which samples' t lie in the closed window [lo, hi] (empty window: none)."""
    if not window:
        return torch.zeros_like(t, dtype=torch.bool)
    lo, hi = window
    return (t >= lo) & (t <= hi)                                                      # B


def window_choice(t: torch.Tensor, windows: Sequence[DemoteWindow], gate: str) -> torch.Tensor:
    """B long: the demotion window each sample trains in (an index into `windows`, tried in order), −1 = native.

    gate "sample": each sample takes the first window that holds its t. gate "batch" (anima's
    strict gate): the whole micro-batch takes the first window that holds every t, else none.
    """
    choice = torch.full(t.shape, -1, dtype=torch.long, device=t.device)               # B
    for index, window in reversed(list(enumerate(windows))):                            # the first match wins
        inside = in_window(t, window.t)                                                # B
        take = inside.all().expand_as(inside) if gate == "batch" else inside          # B
        choice = torch.where(take, index, choice)  # not choice[take] = index: a boolean index syncs the host
    return choice


def mae_target(x_t_tokens: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """MaskDiT's MAE target: the noisy input patch, normalised per patch (zero mean, unit variance)."""
    mean = x_t_tokens.mean(-1, keepdim=True)                                          # B×L×1
    var = x_t_tokens.var(-1, keepdim=True, unbiased=False)                            # B×L×1
    return (x_t_tokens - mean) / (var + eps).sqrt()                                   # B×L×P


def flow_loss(model: DiT, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor, drop_context: torch.Tensor | None = None, inputs: StepInputs = FULL,
              mae_weight: float = 0.0, forward: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The training loss of one batch: velocity MSE on the kept tokens (+ MaskDiT's MAE on the masked ones).

    x0 and noise may be at a lower resolution than the model's native one (downscaled steps); the
    model adapts its positions. A model with decoder blocks predicts every token; the velocity loss
    still reads the kept ones (`inputs.keep_idx`) only, and `mae_weight` adds the MAE loss on the dropped ones.
    `forward` is what runs the model (a compiled or DDP-wrapped copy of it); default: `model` itself.
    TREAD's route (`inputs.span_idx`) changes which blocks a token passes, not which tokens the model predicts.
    A model with SPRINT's sparse-dense fusion predicts every token and is scored on every token (SPRINT's
    src/scheduler/flow_matching.py; docs/arms.md cites the lines).
    """
    keep_idx = inputs.keep_idx
    x_t = interpolate(x0, noise, t)                                                   # B×C×H×W
    target = model.patchify(noise - x0)                                               # B×L×P
    run = model if forward is None else forward  # not `forward or model`: a compiled module has no truth value
    pred = run(x_t, t, context, context_mask, drop_context, inputs)                   # B×K×P or B×L×P
    if keep_idx is None or model.cfg.sparse_fusion:
        return velocity_loss(pred, target)
    loss = velocity_loss(gather_tokens(pred, keep_idx, impl="torch") if model.cfg.decoder_depth else pred,
                         gather_tokens(target, keep_idx, impl="torch"))
    if mae_weight > 0:
        if not model.cfg.decoder_depth:
            raise ValueError("the MAE loss needs predictions for dropped tokens: set model.decoder_depth > 0")
        dropped = drop_idx(keep_idx, target.shape[1])                                 # B×(L−K)
        mae = mae_target(model.patchify(x_t))                                         # B×L×P
        loss = loss + mae_weight * velocity_loss(gather_tokens(pred, dropped, impl="torch"),
                                                 gather_tokens(mae, dropped, impl="torch"))  # B×(L−K)×P each
    return loss


def windowed_flow_loss(model: DiT, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                       context_mask: torch.Tensor, drop_context: torch.Tensor, inputs: StepInputs = FULL,
                       mae_weight: float = 0.0, forward: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """`flow_loss`, except that the samples `window_choice` sends to a demotion route (`inputs.demotion`) train at
    its smaller size, and REPA's loss term (`inputs.repa`) is added.

    The batch splits by route (every sample keeps its own t, noise and caption dropout) and the loss is
    the mean over samples of every part. t may live on the host (the split is then read without a device
    sync). `StepInputs` refuses demotion beside token dropping, routing, path drop or REPA, so a demoted
    step's parts carry no other technique. `inputs.repa(x0, keep_idx)` (`train/repa.py`) adds REPA's λ·alignment
    loss on the tokens its hook took from this forward.
    """
    device, demotion = x0.device, inputs.demotion
    if demotion is None or not demotion.windows:
        loss = flow_loss(model, x0, noise, t.to(device), context, context_mask, drop_context, inputs, mae_weight,
                         forward)
        return loss if inputs.repa is None else loss + inputs.repa(x0, inputs.keep_idx)
    loss = functools.partial(flow_loss, model, mae_weight=mae_weight,
                             forward=batch_dynamic(model if forward is None else forward))
    choice = window_choice(t, demotion.windows, demotion.gate)                          # B, where t is
    # How many samples each part holds is data (their t), and every shape of the part follows from it: read
    # where t is. The trainer keeps t on the host, so this waits on nothing; t on a device would sync here.
    native, *counts = torch.bincount(choice + 1, minlength=len(demotion.windows) + 1).tolist()
    t = t.to(device, non_blocking=True)                                               # B
    if native == len(t):
        return loss(x0, noise, t, context, context_mask, drop_context)
    # Each part's samples in batch order (a stable sort by route, native first): x0[rows] is x0[choice == r].
    order = torch.argsort(choice, stable=True).to(device, non_blocking=True)         # B
    native_rows, *route_rows = order.split([native, *counts])                         # n each
    total = 0.0
    for route, n, rows in [*zip(demotion.windows, counts, route_rows), (None, native, native_rows)]:  # routes, native
        if not n:
            continue
        x0_part, noise_part = x0[rows], noise[rows]                                   # n×C×H×W each
        if route is not None:
            given = demotion.demoted[ratio_key(route.ratio)][rows] if demotion.demoted is not None else None
            x0_part, noise_part = demote(x0_part, noise_part, route.ratio, model.patch_size, demotion.generator,
                                         given)
        total = total + n * loss(x0_part, noise_part, t[rows], context[rows], context_mask[rows], drop_context[rows])
    return total / len(t)


def batch_dynamic(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`run` with the batch dimension of its tensor inputs marked dynamic for torch.compile.

    A route's part changes size every step; compiled for static shapes, each new size would recompile
    until Dynamo's recompile limit and then run eagerly. `maybe_mark_dynamic` (not `mark_dynamic`) lets
    Dynamo still specialise a part of one sample, instead of refusing it: each input size compiles at
    most two graphs (one sample, and any other count). Marking changes no value.
    """
    def marked(*tensors: torch.Tensor | StepInputs | None, **options: torch.Tensor | None) -> torch.Tensor:
        for x in tensors:
            if isinstance(x, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(x, 0)
        return run(*tensors, **options)
    return marked
