"""Latent samples -> images, with the VAE that encoded the shards.

On latent data the sampler produces latents; every image metric (FID, CLIP score, the grid) must see
images, through exactly the code the pixel path uses. So decoding is the only step that differs: it
inverts `maskbench data encode` (latent = (posterior mean − shift) · scale) and runs the diffusers
decoder, batched, under bf16 autocast on CUDA (fp32 elsewhere).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from maskbench.data.dataset import VaeSpec
from maskbench.eval.fid import MissingWeights


def resolve_vae(spec: VaeSpec, override: str | None) -> VaeSpec:
    """The recorded VAE, or `eval.vae=PATH` in its place (same factors: they belong to the latents)."""
    spec = replace(spec, path=override) if override else spec
    if not (Path(spec.path) / "config.json").is_file():
        raise MissingWeights(f"VAE not found at {spec.path} (the diffusers AutoencoderKL folder the latents were "
                             "encoded with, recorded by `maskbench data encode`): pass eval.vae=PATH")
    return spec


class LatentDecoder:
    """uint8-ready images from latents: C×h×w latents in, 3×H×W images in [-1, 1] out."""

    def __init__(self, spec: VaeSpec, device: torch.device, batch_size: int = 32):
        from diffusers import AutoencoderKL  # heavy; only latent runs need it

        self.spec, self.device, self.batch_size = spec, torch.device(device), batch_size
        self.vae = AutoencoderKL.from_pretrained(spec.path).to(self.device).eval().requires_grad_(False)

    @property
    def resolution(self) -> int:
        return self.spec.resolution

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """N×C×h×w -> N×3×H×W float32 in [-1, 1] (clamped by `to_uint8` later, as pixel samples are)."""
        images = []
        for chunk in latents.split(self.batch_size):
            z = chunk.to(self.device).float() / self.spec.scaling_factor + self.spec.shift_factor   # b×C×h×w
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                images.append(self.vae.decode(z).sample.float())                                   # b×3×H×W
        return torch.cat(images)                                                                   # N×3×H×W
