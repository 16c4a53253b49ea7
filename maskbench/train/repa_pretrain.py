"""Pretrain REPA's synth encoder (`repa-synth-v2`, maskbench/train/repa.py) without labels, and write the shipped
weights.

REPA's own target is DINOv2, a self-supervised encoder (sihyun-yu/REPA train.py; docs/arms.md cites the line):
it never saw the labels of what it is later used on. This is the synth counterpart, trained on synth pixels only,
no scene, caption or label of any kind, and nothing from the evaluation (the FD oracle `oracle-synth-v1` reads the
scenes' shape, colour and size; this module imports nothing of `maskbench.eval`).

The objective is a dense InfoNCE (SimCLR's loss, per patch, as DenseCL/PixPro apply it). Each image gives two views,
each shifted by up to ±4 px on the black background, its intensity scaled a little and pixel noise added; the second
is local: all but a random 12-20 px square is blacked out. The features of the same place in both views are a
positive pair, the sampled places of the batch's other images the negatives. Each 4×4-pixel patch's feature must so
say what surrounds its place, invariant to the jitter, from its neighbourhood alone (the local view hides the rest
of the image, so the layout of the other cells cannot identify the image). A small MLP projection head (SimCLR's)
sits on top while training and is dropped: only the trunk ships.

    python -m maskbench.train.repa_pretrain --train   # re-train and rewrite the shipped synth encoder
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from maskbench.data import synth
from maskbench.train import flops
from maskbench.train.repa import (
    SYNTH_LAYERS,
    SYNTH_SIZE,
    SYNTH_WEIGHTS,
    SynthEncoder,
    init_synth_encoder,
    save_synth_encoder,
)

GRID = 8          # the encoder's map side: one feature per 4×4-pixel patch of a 32-pixel image
PATCH = SYNTH_SIZE // GRID
SHIFT = 4         # a view moves the image by up to ±SHIFT pixels on each axis (black fills in)
BRIGHTNESS = (0.9, 1.0)  # a view scales the image's intensity a little (more teaches the encoder to drop colour)
NOISE = 0.05      # std of the Gaussian pixel noise on a view, in [-1, 1] units
WINDOW = (12, 20)  # the local view keeps a random square window of this many pixels a side (the rest black)
HEAD_HIDDEN = 128


@dataclass(frozen=True)
class PretrainArgs:
    """Everything the shipped weights depend on (stored in the file's metadata)."""

    seed: int = 1
    n_train: int = 20_000
    steps: int = 900
    batch_size: int = 32
    pairs: int = 512            # positive pairs sampled per step (at most; each one the other images' negative)
    lr: float = 3e-3
    temperature: float = 0.2


def render_images(seed: int, n: int) -> torch.Tensor:
    """n synth images drawn from `seed`, pixels only: N×3×32×32 in [-1, 1]. The scenes behind them are thrown away."""
    rng = np.random.default_rng(seed)
    scenes = [synth.sample_scene(rng) for _ in range(n)]
    images = np.stack([synth.render(scene, rng, SYNTH_SIZE) for scene in scenes])    # N×32×32×3 uint8
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def augment(images: torch.Tensor, generator: torch.Generator, local: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random view of each image: shifted by up to ±SHIFT px, intensity scaled, noised; a local view also blacks
    out all but a random square window. -> (B×3×32×32 view, B×2 shift (dy, dx): view pixel (y+dy, x+dx) shows image
    pixel (y, x), B×G² bool: the patches wholly inside the window, all of them in a full view)."""
    b, _, side, _ = images.shape
    padded = F.pad(images, (SHIFT,) * 4, value=-1.0)                                # black, as the background
    offset = torch.randint(0, 2 * SHIFT + 1, (b, 2), generator=generator)           # B×2 crop corner
    rows = (offset[:, 0, None] + torch.arange(side))[:, None, :, None].expand(b, 3, side, padded.shape[-1])
    view = padded.gather(2, rows)
    cols = (offset[:, 1, None] + torch.arange(side))[:, None, None, :].expand(b, 3, side, side)
    view = view.gather(3, cols)                                                      # B×3×32×32
    inside = torch.ones(b, GRID * GRID, dtype=torch.bool)
    if local:
        size = torch.randint(WINDOW[0], WINDOW[1] + 1, (b, 1), generator=generator)  # B×1
        corner = (torch.rand(b, 2, generator=generator) * (side - size + 1)).long()  # B×2
        pixel = torch.arange(side)
        keep_y = (pixel >= corner[:, :1]) & (pixel < corner[:, :1] + size)           # B×32
        keep_x = (pixel >= corner[:, 1:]) & (pixel < corner[:, 1:] + size)
        view = torch.where(keep_y[:, None, :, None] & keep_x[:, None, None, :], view, -1.0)
        patch_y = keep_y.unflatten(1, (GRID, PATCH)).all(-1)                         # B×G
        patch_x = keep_x.unflatten(1, (GRID, PATCH)).all(-1)
        inside = (patch_y[:, :, None] & patch_x[:, None, :]).flatten(1)
    scale = torch.empty(b, 1, 1, 1).uniform_(*BRIGHTNESS, generator=generator)
    view = (view + 1) * scale - 1 + NOISE * torch.randn(view.shape, generator=generator)
    return view, SHIFT - offset, inside


def matched_patches(shift_a: torch.Tensor, shift_b: torch.Tensor) -> torch.Tensor:
    """The pairs of patches that show the same place of the same image in views a and b: P×3 (image, patch in a,
    patch in b), patches row-major on the GRID×GRID map. Patch b is the one whose centre is nearest a's centre."""
    delta = shift_b - shift_a                                                       # B×2 pixels
    step = torch.div(2 * delta + PATCH - 1, 2 * PATCH, rounding_mode="floor")       # nearest patch offset, B×2
    i = torch.arange(GRID)
    ib, jb = i[None, :, None] + step[:, 0, None, None], i[None, None, :] + step[:, 1, None, None]  # B×G×G each
    ib, jb = ib.expand(-1, GRID, GRID), jb.expand(-1, GRID, GRID)
    valid = (ib >= 0) & (ib < GRID) & (jb >= 0) & (jb < GRID)
    image, ia, ja = valid.nonzero(as_tuple=True)
    return torch.stack([image, ia * GRID + ja, ib[valid] * GRID + jb[valid]], dim=1)


def info_nce(za: torch.Tensor, zb: torch.Tensor, image: torch.Tensor, temperature: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric InfoNCE over P pairs: row k of za and zb positive, the rows of other images negative (P×D, P×D,
    P image indices). Other places of the same image are left out: a place half a patch away is nearly the same
    view, and telling them apart would teach exact position, not content. -> (loss, top-1 accuracy of finding the
    positive among the candidates)."""
    logits = F.normalize(za, dim=-1) @ F.normalize(zb, dim=-1).T / temperature     # P×P
    target = torch.arange(len(za))
    same = (image[:, None] == image[None, :]) & (target[:, None] != target[None, :])
    logits = logits.masked_fill(same, float("-inf"))
    loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    return loss, (logits.argmax(1) == target).float().mean()


def make_head(dim: int) -> nn.Sequential:
    """SimCLR's projection head on each patch feature; dropped after training."""
    return nn.Sequential(nn.Linear(dim, HEAD_HIDDEN), nn.GELU(), nn.Linear(HEAD_HIDDEN, dim))


def pair_loss(encoder: SynthEncoder, head: nn.Module, images: torch.Tensor, pairs: int, temperature: float,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A full and a local view of `images`, `pairs` matched patch pairs drawn among the local view's window, their
    InfoNCE (and top-1 accuracy)."""
    view_a, shift_a, _ = augment(images, generator)
    view_b, shift_b, inside = augment(images, generator, local=True)
    features = encoder(torch.cat([view_a, view_b])).flatten(2).transpose(1, 2)     # 2B×G²×D
    fa, fb = features.chunk(2)
    matched = matched_patches(shift_a, shift_b)                                     # P×3
    matched = matched[inside[matched[:, 0], matched[:, 2]]]
    matched = matched[torch.randperm(len(matched), generator=generator)[:pairs]]
    za = head(fa[matched[:, 0], matched[:, 1]])                                     # P×D
    zb = head(fb[matched[:, 0], matched[:, 2]])
    return info_nce(za, zb, matched[:, 0], temperature)


def pretrain_synth_encoder(images: torch.Tensor, seed: int = 1, steps: int = 900, batch_size: int = 32,
                           pairs: int = 512, lr: float = 3e-3, temperature: float = 0.2) -> SynthEncoder:
    """Train a SynthEncoder from `images` alone (N×3×32×32 in [-1, 1]) by dense InfoNCE between two views.

    Initial weights are `init_synth_encoder(seed)` (the random control arm's encoder, when seed is its seed);
    batches, views and pairs come from `seed` too: same images and seed, same weights on CPU."""
    encoder = init_synth_encoder(seed).train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = make_head(encoder.out_dim)
    optimizer = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(len(images), (batch_size,), generator=generator)
        loss, _ = pair_loss(encoder, head, images[index], pairs, temperature, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return encoder.eval()


def pretrain_flops(args: PretrainArgs) -> int:
    """The pretraining's FLOPs: per step, the encoder on 2·batch views and the head on 2·pairs patch features,
    forward and backward (3× forward), and the P×P similarity matmul of the loss (3× too). An upper count: by one
    conv's input gradient (the images need none, which `flops.py`'s convention would not count), and a step draws
    at most `pairs` pairs (a local window holds ~10 places of an image: ~340 of 512 at batch 32)."""
    views = 2 * args.batch_size
    encoder = SynthEncoder.forward_flops(views)
    rows = 2 * args.pairs
    dim = SYNTH_LAYERS[-1][1]
    head = flops.conv_forward_flops(1, dim, HEAD_HIDDEN, 1, rows) + flops.conv_forward_flops(1, HEAD_HIDDEN, dim, 1, rows)
    similarity = 2 * args.pairs * args.pairs * dim
    return 3 * args.steps * (encoder + head + similarity)


@torch.no_grad()
def held_out_matching(encoder: SynthEncoder, seed: int, n: int = 512, pairs: int = 1024) -> dict[str, float]:
    """A label-free quality figure on images the training never saw: for `pairs` patch pairs of two full views, how
    often a patch's nearest feature (cosine, encoder features, no head) among the other images' is its own
    counterpart; chance is about 1/pairs. Pairs on background alone (no object pixel in the view's patch) are left
    out: they are all alike."""
    images = render_images(seed, n)
    generator = torch.Generator().manual_seed(seed)
    view_a, shift_a, _ = augment(images, generator)
    view_b, shift_b, _ = augment(images, generator)
    fa = encoder(view_a).flatten(2).transpose(1, 2)
    fb = encoder(view_b).flatten(2).transpose(1, 2)
    matched = matched_patches(shift_a, shift_b)
    lit = view_a.amax(1).unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH).amax((-1, -2)).flatten(1) > -0.5  # N×G²
    matched = matched[lit[matched[:, 0], matched[:, 1]]]
    matched = matched[torch.randperm(len(matched), generator=generator)[:pairs]]
    loss, top1 = info_nce(fa[matched[:, 0], matched[:, 1]], fb[matched[:, 0], matched[:, 2]], matched[:, 0], 0.2)
    return {"pairs": len(matched), "top1": float(top1), "info_nce": float(loss)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Pretrain REPA's synth encoder (no labels) and write its weights.")
    parser.add_argument("--train", action="store_true", required=True)
    parser.add_argument("--out", type=Path, default=SYNTH_WEIGHTS)
    defaults = PretrainArgs()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parsed = vars(parser.parse_args(argv))
    out = parsed.pop("out")
    parsed.pop("train")
    args = PretrainArgs(**parsed)
    wall, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
    images = render_images(args.seed, args.n_train)
    fields = asdict(args)
    del fields["n_train"]
    encoder = pretrain_synth_encoder(images, **fields)
    wall, cpu = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu
    count = pretrain_flops(args)
    save_synth_encoder(encoder, out, asdict(args), count)
    matching = held_out_matching(encoder, args.seed + 12345)
    print(json.dumps({"wrote": str(out), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "pretrain_flops": count,
                      "held_out_matching": matching}))


if __name__ == "__main__":
    main()
