"""A diagnostic of REPA's synth encoder (`repa-synth-v2`, maskbench/train/repa.py): how much of each synth cell's
content a linear read of its patches' frozen features recovers, on held-out scenes.

Evaluation, not training: the encoder was pretrained without labels (`train/repa_pretrain.py`) and stays frozen
here; only the linear probes fit the labels (the oracle's classes, `eval/oracle.py`: shape or empty, colour and
size of the object in the patch's cell), on scenes of their own seed, and are scored on others. Nothing here is
written to the shipped weights.

    python -m maskbench.eval.repa_probe                       # the shipped encoder and the random control
    python -m maskbench.eval.repa_probe --weights FILE ...    # other synth encoder files
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from maskbench.data import synth
from maskbench.eval import oracle
from maskbench.train.repa import RANDOM_SEED, SYNTH_WEIGHTS, SynthEncoder, init_synth_encoder, load_synth_encoder

PROBE_SEED = 777  # probe scenes: not the encoder's (1), nor the oracle's (0)


def patch_labels(scenes: Sequence, grid: int) -> dict[str, torch.Tensor]:
    """Each patch's cell labels (`oracle.stack_labels`, cells row-major): {name: N×grid²}."""
    side = torch.arange(grid) // (grid // 2)                                           # grid: the patch's cell row/col
    cell = (side[:, None] * 2 + side[None, :]).flatten()                              # grid²
    return {name: torch.from_numpy(labels)[:, cell] for name, labels in oracle.stack_labels(scenes).items()}


@torch.no_grad()
def patch_features(encoder: nn.Module, images: np.ndarray) -> torch.Tensor:
    """uint8 N×32×32×3 -> the frozen encoder's N×G²×D patch features."""
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return torch.cat([encoder.eval()(chunk) for chunk in pixels.split(512)]).flatten(2).transpose(1, 2)


def lit_patches(images: np.ndarray, grid: int) -> torch.Tensor:
    """uint8 N×32×32×3 -> N×grid² bool: the patches holding a pixel of an object (any non-black pixel)."""
    side = images.shape[1] // grid
    lit = torch.from_numpy(images.max(-1) > 0).unflatten(1, (grid, side)).unflatten(3, (grid, side))  # N×g×s×g×s
    return lit.any(4).any(2).flatten(1)


def linear_probe(encoder: nn.Module, seed: int = PROBE_SEED, n_train: int = 1_000, n_test: int = 1_000,
                 steps: int = 200, lr: float = 0.05) -> dict[str, dict[str, float]]:
    """Held-out per-patch accuracy of linear probes on the standardised frozen features, fitted full-batch with
    Adam on `n_train` scenes from `seed`, scored on the next `n_test`. Two reads, each its own probes:
    "cell": every patch says what its synth cell holds (shape or empty, colour, size), the task `repa-synth-v1`
    was trained on; "object": the patches on an object say its shape, colour and size (what a local feature holds).
    Colour and size are scored where the cell holds an object."""
    images, scenes = oracle.render_batch(np.random.default_rng(seed), n_train + n_test)
    features = patch_features(encoder, images)                                       # N×G²×D
    grid = math.isqrt(features.shape[1])
    labels = patch_labels(scenes, grid)
    mean, std = features[:n_train].mean((0, 1)), features[:n_train].std((0, 1)) + 1e-6
    features = (features - mean) / std
    subsets = {"cell": torch.ones(features.shape[:2], dtype=torch.bool), "object": lit_patches(images, grid)}
    torch.manual_seed(seed)
    accuracy: dict[str, dict[str, float]] = {}
    for subset, chosen in subsets.items():
        accuracy[subset] = {}
        for name, classes in oracle.HEAD_CLASSES.items():
            head = nn.Linear(features.shape[-1], classes)
            optimizer = torch.optim.Adam(head.parameters(), lr=lr)
            x, y = features[:n_train][chosen[:n_train]], labels[name][:n_train][chosen[:n_train]]
            for _ in range(steps):
                loss = F.cross_entropy(head(x), y, ignore_index=synth.NO_LABEL)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                truth = labels[name][n_train:]
                scored = (truth != synth.NO_LABEL) & chosen[n_train:]
                hits = head(features[n_train:]).argmax(-1) == truth
                accuracy[subset][name] = float(hits[scored].float().mean())
    return accuracy


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Linear-probe REPA's synth encoders on held-out synth labels.")
    parser.add_argument("--weights", type=Path, nargs="*", default=[], help="other synth encoder files (raw)")
    args = parser.parse_args(argv)
    encoders: dict[str, nn.Module] = {SYNTH_WEIGHTS.name: load_synth_encoder(),
                                      f"random (seed {RANDOM_SEED})": init_synth_encoder(RANDOM_SEED)}
    for path in args.weights:
        encoder = SynthEncoder()
        encoder.load_state_dict(load_file(str(path)))
        encoders[str(path)] = encoder
    print(json.dumps({name: linear_probe(encoder) for name, encoder in encoders.items()}, indent=1))


if __name__ == "__main__":
    main()
