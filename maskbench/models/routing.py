"""TREAD's token routing (Krause et al. 2025): in training, a random subset of the backbone's tokens skips a span
of blocks and rejoins, as it was, at the positions it left.

The authors' code (CompVis/tread at fccf77c; docs/arms.md, the `tread50` row, cites the lines): at block
`start_layer_idx` the model keeps a copy of its tokens, draws per sample a random `selection_ratio` of them to
route (`routing_module.py`: argsort of uniform noise), and runs blocks start..end (inclusive) on the others only
(`dit.py`, `routing_module.py`). After block end it scatters those back over the copy, out of place (`dit.py`,
`routing_module.py`), so every routed token re-enters with the value it had before the span. The model predicts,
and the loss reads, every token (`edm.py`), and only a training model routes (`dit.py`): sampling runs the plain
network. The shipped route is DiT-B/2's blocks 2..8 of 12 at ratio 0.5 (`configs/model/tread.yaml`).

Here a route is a keep/bypass index set exactly like a mask (`random_keep_idx`): `span_idx`, the B×R sorted
positions among the backbone's tokens that the span runs on; the other ones bypass it. The trainer draws it from
the step's "mask" generator, after the mask, and passes it to the model; without one (sampling, validation loss,
every arm with `model.route_ratio=0`) the model runs every block on every token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from maskbench.config.presets import ModelConfig, route_span
from maskbench.models.kernels import gather_tokens
from maskbench.models.masking import random_keep_idx


def draw_token_route(cfg: ModelConfig, batch: int, seq_len: int, keep_idx: torch.Tensor | None,
               generator: torch.Generator | None = None,
               device: torch.device | str | None = None) -> torch.Tensor | None:
    """B×R sorted `span_idx`, independently random per sample; None when the model routes nothing (no draw).

    The route is drawn over the tokens the backbone holds: the K that keep_idx (B×K) kept, or all seq_len.
    R = K·(1 − model.route_ratio) rounded (`keep_count`); the authors keep K − int(K·ratio), the same at
    ratio 0.5 on an even K.
    """
    tokens = seq_len if keep_idx is None else keep_idx.shape[1]
    return random_keep_idx(batch, tokens, cfg.route_ratio, generator=generator, device=device)


def run_routed(blocks: Iterable[nn.Module], tokens: torch.Tensor, span_idx: torch.Tensor, cfg: ModelConfig,
               run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The backbone blocks in order, `run(block, tokens)` each; the blocks of `route_span` on the span_idx tokens
    only, the others waiting at their positions. tokens B×K×D, span_idx B×R -> B×K×D."""
    start, end = route_span(cfg)
    for i, block in enumerate(blocks):
        if i == start:
            bypass = tokens                                                            # B×K×D
            tokens = gather_tokens(tokens, span_idx, impl=cfg.kernels)                 # B×R×D
        tokens = run(block, tokens)                                                    # B×R×D inside the span
        if i == end:
            tokens = rejoin(tokens, bypass, span_idx)                                  # B×K×D
    return tokens


def rejoin(routed: torch.Tensor, bypass: torch.Tensor, span_idx: torch.Tensor) -> torch.Tensor:
    """B×K×D: the span's outputs (routed, B×R×D) back at span_idx, every other token as it entered the span.

    A plain out-of-place scatter over the copy, as the authors' `end_route`. `scatter_tokens` does not fit:
    the rows it does not write all hold one fill vector, where here each bypassing token keeps its own value.
    """
    index = span_idx[..., None].expand(-1, -1, bypass.shape[-1])                      # B×R×D view
    return bypass.scatter(1, index, routed.to(bypass.dtype))                           # B×K×D
