"""Train REPA's synth encoder (`repa-synth-v1`, maskbench/train/repa.py) and write the shipped weights.

Each 4×4-pixel patch's feature learns, through linear heads, to classify what its synth cell holds; the heads
reuse the oracle's classes and loss (`eval/oracle.py`), per patch instead of per cell, and only the trunk ships.
Here, not beside the encoder, because it needs the oracle's scene labels (evaluation sits above training).

    python -m maskbench.eval.repa_encoder --train
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from maskbench.data import synth
from maskbench.eval import oracle
from maskbench.train.repa import SYNTH_LAYERS, SYNTH_SIZE, SYNTH_WEIGHTS, SynthEncoder, save_synth_encoder


def patch_labels(scenes: Sequence, grid: int) -> dict[str, torch.Tensor]:
    """Each patch's cell labels (`oracle.stack_labels`, cells row-major): {name: N×grid²}."""
    side = torch.arange(grid) // (grid // 2)                                           # grid: the patch's cell row/col
    cell = (side[:, None] * 2 + side[None, :]).flatten()                              # grid²
    return {name: torch.from_numpy(labels)[:, cell] for name, labels in oracle.stack_labels(scenes).items()}


def train_synth_encoder(seed: int = 1, n_train: int = 20_000, steps: int = 600, batch_size: int = 64,
                        lr: float = 3e-3) -> tuple[SynthEncoder, nn.ModuleDict]:
    """Train the encoder, with linear heads on each patch's feature, to classify the contents of the patch's cell.

    Scenes and initial weights come from `seed` (1: not the oracle's 0); same seed, same weights on CPU. The heads
    reuse the oracle's classes and loss (per patch instead of per cell) and are returned apart: only the trunk ships.
    """
    torch.manual_seed(seed)
    images, scenes = oracle.render_batch(np.random.default_rng(seed), n_train)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0      # N×3×32×32 in [-1, 1]
    encoder = SynthEncoder()
    grid = SYNTH_SIZE // math.prod(stride for *_, stride in SYNTH_LAYERS)
    labels = patch_labels(scenes, grid)                                               # name -> N×grid²
    heads = nn.ModuleDict({name: nn.Linear(encoder.out_dim, n) for name, n in oracle.HEAD_CLASSES.items()})
    params = [*encoder.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(n_train, (batch_size,), generator=generator)           # B
        features = encoder(pixels[index]).flatten(2).transpose(1, 2)                 # B×grid²×64
        loss = oracle.oracle_loss({name: head(features) for name, head in heads.items()},
                                  {name: value[index] for name, value in labels.items()})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return encoder.eval(), heads.eval()


@torch.no_grad()
def patch_accuracy(encoder: SynthEncoder, heads: nn.ModuleDict, seed: int, n: int = 2_000) -> dict[str, float]:
    """Held-out per-patch accuracy of each head (colour and size where the cell holds an object)."""
    images, scenes = oracle.render_batch(np.random.default_rng(seed), n)
    features = encoder(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0).flatten(2).transpose(1, 2)
    labels = patch_labels(scenes, math.isqrt(features.shape[1]))
    accuracy = {}
    for name, head in heads.items():
        scored = labels[name] != synth.NO_LABEL                                      # N×grid²
        accuracy[name] = float((head(features).argmax(-1) == labels[name])[scored].float().mean())
    return accuracy


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train REPA's synth encoder and write its weights.")
    parser.add_argument("--train", action="store_true", required=True)
    parser.add_argument("--out", type=Path, default=SYNTH_WEIGHTS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--n-train", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    train_args = {"seed": args.seed, "n_train": args.n_train, "steps": args.steps}
    start = time.perf_counter()
    encoder, heads = train_synth_encoder(**train_args)
    seconds = time.perf_counter() - start
    save_synth_encoder(encoder, args.out, train_args)
    accuracy = patch_accuracy(encoder, heads, args.seed + 12345)
    print(f"trained in {seconds:.0f} s; held-out per-patch accuracy "
          f"{', '.join(f'{k} {v:.4f}' for k, v in accuracy.items())}; wrote {args.out}")


if __name__ == "__main__":
    main()
