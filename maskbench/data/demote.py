"""Demotion: the same image at a smaller size, for the routes that train some noise levels cheaper.

One home for what a demoted sample is, shared by training on pixels (resized in the step), latent
encoding (`maskbench data encode --demote`: the VAE's encoding of the resized image) and the probe.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def demoted_size(size: int, ratio: float, multiple: int) -> int:
    """round(size · ratio) snapped to a multiple of `multiple` (the patch size): 32px at 0.75, patch 4 -> 24."""
    return max(multiple, round(size * ratio / multiple) * multiple)


def resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """B×C×H×W -> B×C×size×size, antialiased bilinear (a triangle filter as wide as the output pixel,
    so shrinking by a non-integer factor averages every input pixel instead of aliasing)."""
    return F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def ratio_key(ratio: float) -> str:
    """How a ratio names its demoted latents: in a manifest, in a batch (`batch["demoted"]["0.75"]`)."""
    return f"{ratio:g}"


def latent_field(key: str) -> str:
    """The shard field holding a sample's demoted latent at ratio key `key`, e.g. `latent_0.75.npy`."""
    return f"latent_{key}.npy"


def field_key(field: str) -> str | None:
    """The ratio key of a demoted-latent shard field (the inverse of `latent_field`), None for other fields."""
    if field.startswith("latent_") and field.endswith(".npy"):
        return field.removeprefix("latent_").removesuffix(".npy")
    return None


def parse_ratios(text: str) -> tuple[float, ...]:
    """'0.75,0.875' -> (0.75, 0.875); each in (0, 1) (argparse reports a bad one in one line)."""
    try:
        ratios = tuple(float(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ratios like 0.75,0.875, got {text!r}") from None
    if not all(0 < r < 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"ratios must be in (0, 1), got {text!r}")
    return ratios
