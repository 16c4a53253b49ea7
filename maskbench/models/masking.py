"""Which tokens each sample keeps when training on a fraction of its tokens (and, for SPRINT, which samples
drop their deep path).

Every sample keeps the same number K of tokens so the kept activations stay one dense B×K×D tensor
(no padding, no ragged batches). Indices are sorted so kept tokens keep their raster order, which
the gather kernels read contiguously and which makes masks easy to inspect.

A mask ratio of 0 returns None, which the DiT reads as "keep every token" and skips the gather
entirely, so the unmasked arm runs exactly the plain DiT.
"""

from __future__ import annotations

import torch

STRUCTURED_RATIO = 0.75  # one kept token per 2×2 group


def _check_ratio(mask_ratio: float) -> None:
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")


def keep_count(seq_len: int, mask_ratio: float) -> int:
    """K = round(L·(1 − ratio)), at least 1; shared with the FLOPs accountant so both agree on K."""
    _check_ratio(mask_ratio)
    return max(1, round(seq_len * (1.0 - mask_ratio)))


def random_keep_idx(batch: int, seq_len: int, mask_ratio: float, generator: torch.Generator | None = None,
                    device: torch.device | str | None = None, grid: tuple[int, int] | None = None,
                    structured: bool = False) -> torch.Tensor | None:
    """B×K sorted kept-token indices, independently random per sample; None at mask ratio 0.

    The random draw happens on the generator's device (CPU by default; the trainer's generators are all
    CPU ones) and is then moved to `device`, so a seeded run keeps the same masks whatever accelerator
    trains it.
    structured=True (SPRINT) keeps one random token in every 2×2 group of the (h, w) token grid,
    which spreads kept tokens evenly; it exists only for mask ratio 0.75.
    """
    _check_ratio(mask_ratio)
    if mask_ratio == 0.0:
        return None
    rng_device = generator.device if generator is not None else None
    if structured:
        keep = _structured_keep_idx(batch, seq_len, mask_ratio, grid, generator, rng_device)
    else:
        noise = torch.rand(batch, seq_len, generator=generator, device=rng_device)     # B×L
        keep = noise.argsort(dim=1)[:, :keep_count(seq_len, mask_ratio)]               # B×K
    return host_to_device(keep.sort(dim=1).values, device)                                 # B×K ascending


def drop_idx(keep_idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """B×(L−K) ascending indices of the tokens keep_idx leaves out.

    A fixed count per sample, so a loss on the dropped tokens gathers them (no boolean mask: indexing with
    one waits for the device to count its True values, and gives a shape torch.compile cannot know)."""
    B, K = keep_idx.shape
    dropped = torch.ones(B, seq_len, dtype=torch.bool, device=keep_idx.device).scatter_(1, keep_idx, False)  # B×L
    return dropped.byte().argsort(dim=1, descending=True, stable=True)[:, :seq_len - K]     # B×(L−K)


def draw_path_drop(batch: int, chance: float, generator: torch.Generator,
                   device: torch.device | str | None = None) -> torch.Tensor | None:
    """B bool, the training samples whose deep path SPRINT drops, each with chance `chance` (its
    `src/models/sit.py`, 0.1 in its config), from their own generator so no other draw of the step moves, on
    the generator's device (the trainer's: the CPU) and then moved to `device`; None at chance 0 (no draw)."""
    if not chance:
        return None
    return host_to_device(torch.rand(batch, generator=generator, device=generator.device) < chance, device)  # B


def host_to_device(x: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """x (drawn on CPU) on `device`; to a GPU from pinned memory with non_blocking=True, a copy
    "asynchronous with respect to the host" (`Tensor.cuda`'s docs), so the step does not wait for it."""
    if device is None or x.device.type != "cpu" or torch.device(device).type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _structured_keep_idx(batch: int, seq_len: int, mask_ratio: float, grid: tuple[int, int] | None,
                         generator: torch.Generator | None, device: torch.device | None) -> torch.Tensor:
    """One kept token per 2×2 group of an (h, w) raster token grid -> B×(L/4), unsorted."""
    if mask_ratio != STRUCTURED_RATIO:
        raise ValueError(f"structured masking keeps one token per 2x2 group, so it needs mask_ratio "
                         f"{STRUCTURED_RATIO}, got {mask_ratio}")
    if grid is None or grid[0] * grid[1] != seq_len or grid[0] % 2 or grid[1] % 2:
        raise ValueError(f"structured masking needs an even (h, w) token grid with h*w = {seq_len}, got {grid}")
    h, w = grid
    cell = torch.randint(0, 4, (batch, h // 2, w // 2), generator=generator, device=device)  # B×h/2×w/2
    rows = 2 * torch.arange(h // 2, device=device)[:, None] + cell // 2                      # B×h/2×w/2
    cols = 2 * torch.arange(w // 2, device=device)[None, :] + cell % 2                       # B×h/2×w/2
    return (rows * w + cols).flatten(1)                                                       # B×L/4
