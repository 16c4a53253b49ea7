"""Small random stand-ins for the networks a real-data run loads from disk, for tests and the GPU check.

A fresh machine has no VAE, no CLIP and no Inception weights, and nothing may be downloaded, yet the
real path (encode -> train on latents -> decode -> FID, CLIP) must run end to end somewhere other
than a cluster. These files have the real formats (a diffusers AutoencoderKL folder, an open_clip
model folder for `local-dir:`, a TorchScript file with Inception's `layers` interface), so they travel
through exactly the loading code real weights do. Their metrics measure nothing about image quality:
the Inception stand-in carries a marker, so its Fréchet distance is labelled
`standin-random-inception`, and the CLIP stand-in's model name is its folder, `.../standin-clip`.

    python -m maskbench.eval.standins OUT_DIR      # writes OUT_DIR/{vae/, standin-clip/, standin-inception.pt}
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from torch import nn

from maskbench.eval.fid import INCEPTION_DIM, STANDIN_MARKER

CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def make_vae(levels: int = 2, latent_channels: int = 4, scaling_factor: float = 0.5):
    """A random diffusers AutoencoderKL with 2**(levels-1)× downsampling (no mid-block attention: cheap)."""
    from diffusers import AutoencoderKL

    widths = tuple(8 * 2**i for i in range(levels))
    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
                         block_out_channels=widths, layers_per_block=1, latent_channels=latent_channels,
                         norm_num_groups=8, sample_size=32, scaling_factor=scaling_factor, mid_block_add_attention=False)


def write_vae(out: Path, levels: int = 2) -> Path:
    """A random VAE saved with save_pretrained, the folder `maskbench data encode --vae` takes."""
    make_vae(levels).save_pretrained(out)
    return out


def write_clip(out: Path) -> str:
    """A random tiny open_clip model as a `local-dir:` folder (config + weights); returns its model name.

    open_clip reads such a folder in any process, so `eval.clip_model=local-dir:DIR` and
    `maskbench data encode --text-model local-dir:DIR` need no registration step.
    """
    import open_clip

    out.mkdir(parents=True, exist_ok=True)
    (out / "open_clip_config.json").write_text(json.dumps({"model_cfg": CLIP_CONFIG, "preprocess_cfg": {}}))
    torch.save(open_clip.CLIP(**CLIP_CONFIG).state_dict(), out / "open_clip_pytorch_model.bin")
    return f"local-dir:{out.resolve()}"


class _StandinInception(nn.Module):
    """B×3×299×299 in [-1, 1] -> B×2048 through `.layers`, as clean-fid's TorchScript Inception."""

    def __init__(self) -> None:
        super().__init__()
        self.maskbench_standin = True  # kept by TorchScript as an attribute: InceptionFeatures reads it
        self.layers = nn.Sequential(nn.Conv2d(3, 16, 13, stride=13), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                                    nn.Linear(16 * 16, INCEPTION_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def write_inception(path: Path) -> Path:
    """A random TorchScript network with Inception's interface, marked as a stand-in."""
    module = _StandinInception()
    assert hasattr(module, STANDIN_MARKER)
    with warnings.catch_warnings():  # TorchScript is deprecated, but clean-fid's Inception is a TorchScript file
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.script(module).save(str(path))
    return path


def write_all(out: Path, seed: int = 0) -> dict[str, str]:
    """Every stand-in under out; returns the paths (and the CLIP model name) the CLI options take."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"vae": str(write_vae(out / "vae").resolve()), "clip_model": write_clip(out / "standin-clip"),
             "inception_weights": str(write_inception(out / "standin-inception.pt").resolve())}
    (out / "standins.json").write_text(json.dumps(paths, indent=2))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maskbench.eval.standins", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to write the stand-ins into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(write_all(args.out, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
