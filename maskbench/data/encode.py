"""Canonical shards -> latent shards: VAE latents and frozen text-encoder token embeddings.

Real-data training runs in latent space with a frozen text tower, so both encoders are run once
here instead of every step. Each output sample holds `KEY.latent.npy` (fp16 C×h×w: the VAE
posterior mean, shifted and scaled by the VAE's own factors, so encoding is deterministic),
`KEY.txtemb.npy` (fp16 T×D: open_clip's text token sequence after `ln_final`, before pooling),
`KEY.txt` and `KEY.json` (the canonical meta plus `text_tokens`, the unpadded token count).

Output shards keep their input shard's name and are written with the same per-unit commit as
packing, so encoding resumes where it stopped. Under `accelerate launch` every process encodes a
disjoint slice of the shards; the main process then writes a manifest that describes the latent
format (channels, latent size, text length and dimension, models, scaling, the pixel shards it came
from) for the trainer and for the evaluator, which decodes samples with the same VAE.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
import webdataset as wds
from accelerate import Accelerator
from PIL import ImageOps
from torchvision.transforms.functional import pil_to_tensor

from maskbench.data.demote import demoted_size, latent_field, parse_ratios, ratio_key, resize
from maskbench.data.pack import claim_output, commit_unit, iter_tar_samples, merge_parts, run_units, unit_done
from maskbench.data.shards import (
    IMAGE_EXTS,
    TAR_MTIME,
    BadSample,
    Skip,
    decode_image,
    decode_json,
    decode_text,
    encode_npy,
    shard_entry,
)
from maskbench.errors import ConfigError
from maskbench.manifest import read_manifest

LATENT_DTYPE = np.float16


@dataclass(frozen=True)
class EncodeOptions:
    vae: str  # a diffusers AutoencoderKL folder (from_pretrained), never downloaded
    text_model: str = "ViT-H-14"  # an open_clip architecture name
    text_weights: str | None = None  # local weights file; None is random init (tests only)
    resolution: int = 256  # images are resized (shorter side) and centre-cropped to this
    batch_size: int = 32
    demote: tuple[float, ...] = ()  # also store the VAE's latents of the image resized by each ratio
    patch: int = 2  # demoted latent sides are snapped to multiples of the DiT's patch (2 for every dit_* preset)


class TextTower(torch.nn.Module):
    """open_clip's text transformer up to `ln_final`: per-token features, not the pooled vector."""

    def __init__(self, name: str, weights: str | None) -> None:
        super().__init__()
        clip = open_clip.create_model(name, pretrained=weights)
        if not hasattr(clip, "token_embedding"):
            raise ConfigError(f"open_clip model {name} has no built-in text transformer; use a CLIP architecture")
        self.token_embedding, self.positional_embedding = clip.token_embedding, clip.positional_embedding
        self.transformer, self.ln_final = clip.transformer, clip.ln_final
        self.register_buffer("attn_mask", clip.attn_mask, persistent=False)
        self.tokenizer = open_clip.get_tokenizer(name)
        self.length, self.dim = self.positional_embedding.shape  # T, D

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(tokens)  # B×T×D
        x = x + self.positional_embedding  # B×T×D
        x = self.transformer(x, attn_mask=self.attn_mask)  # B×T×D
        return self.ln_final(x)  # B×T×D


class Encoders(torch.nn.Module):
    """The frozen VAE and text tower, and the latent format they produce."""

    def __init__(self, opts: EncodeOptions) -> None:
        super().__init__()
        if not Path(opts.vae).is_dir():
            raise ConfigError(f"VAE folder not found: {opts.vae} (a diffusers AutoencoderKL saved with save_pretrained)")
        if opts.text_weights is not None and not Path(opts.text_weights).is_file():
            raise ConfigError(f"text weights not found: {opts.text_weights} (an open_clip checkpoint for {opts.text_model})")
        from diffusers import AutoencoderKL  # heavy; imported only when encoding

        self.vae = AutoencoderKL.from_pretrained(opts.vae)
        self.text = TextTower(opts.text_model, opts.text_weights)
        self.requires_grad_(False).eval()
        config = self.vae.config
        self.scaling_factor, self.shift_factor = config.scaling_factor, config.shift_factor or 0.0
        downsample = 2 ** (len(config.block_out_channels) - 1)
        if opts.resolution < downsample or opts.resolution % downsample:
            raise ConfigError(f"--resolution {opts.resolution} is not a multiple of the VAE's downsampling {downsample}")
        self.latent_shape = (config.latent_channels, opts.resolution // downsample, opts.resolution // downsample)
        # ratio key -> latent side; the image is resized to side × downsample pixels before encoding
        self.demoted = {ratio_key(r): demoted_size(self.latent_shape[1], r, opts.patch) for r in opts.demote}
        self.downsample = downsample

    def describe(self, opts: EncodeOptions) -> dict[str, Any]:
        """The manifest's `latent` block: everything a trainer needs to read the shards (latents are square)."""
        return {
            "vae": str(Path(opts.vae).resolve()), "scaling_factor": self.scaling_factor, "shift_factor": self.shift_factor,
            "resolution": opts.resolution, "channels": self.latent_shape[0], "size": self.latent_shape[1],
            "text_model": opts.text_model, "text_weights": opts.text_weights, "text_len": self.text.length,
            "text_dim": self.text.dim, "dtype": np.dtype(LATENT_DTYPE).name,
            **({"demote": self.demoted} if self.demoted else {}),  # only when set: older folders resume
        }

    @torch.no_grad()
    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latents = vae_latents(self.vae, images, self.scaling_factor, self.shift_factor)  # B×C×h×w
        return latents, self.text(tokens)  # B×C×h×w, B×T×D

    @torch.no_grad()
    def demote(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Ratio key -> B×C×s×s: the VAE's latents of the images resized (`resize`) to s × downsample pixels.

        Encoding the resized image, not resizing the native latent, is what a run at that resolution
        would see: a VAE is not equivariant to resizing."""
        return {key: vae_latents(self.vae, resize(images, side * self.downsample), self.scaling_factor,
                                 self.shift_factor) for key, side in self.demoted.items()}


def vae_latents(vae: torch.nn.Module, images: torch.Tensor, scaling_factor: float, shift_factor: float) -> torch.Tensor:
    """B×3×H×W images in [-1, 1] -> B×C×h×w stored latents: the posterior mean, shifted and scaled."""
    return (vae.encode(images).latent_dist.mean - shift_factor) * scaling_factor


def _decoded(path: Path, resolution: int, skipped: Counter) -> Iterator[tuple[str, torch.Tensor, str, dict]]:
    """(key, 3×R×R image in [-1, 1], caption, meta) per readable sample; the rest counted."""
    for item in iter_tar_samples(path):
        if isinstance(item, Skip):
            skipped[item.reason] += item.n
            continue
        key, fields = item
        image_field = next((ext for ext in IMAGE_EXTS if ext in fields), None)
        try:
            if image_field is None:
                raise BadSample("missing_image")
            image = ImageOps.fit(decode_image(fields[image_field]), (resolution, resolution))
            caption, meta = decode_text(fields.get("txt", b"")).strip(), decode_json(fields.get("json", b"{}"))
        except BadSample as bad:
            skipped[bad.reason] += 1
            continue
        yield key, pil_to_tensor(image).float() / 127.5 - 1.0, caption, meta  # 3×R×R


def _batches(samples: Iterator, size: int) -> Iterator[list]:
    batch = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass
class _ShardEncoder:
    """Encodes one canonical shard into a latent shard of the same name, committed atomically."""

    in_dir: Path
    out_dir: Path
    encoders: Encoders
    opts: EncodeOptions
    device: torch.device

    def _encode_batch(self, batch: list[tuple[str, torch.Tensor, str, dict]]) -> Iterator[dict[str, Any]]:
        """Canonical samples -> latent samples, one call of each encoder per batch."""
        keys, images, captions, metas = zip(*batch)
        tokens = self.encoders.text.tokenizer(list(captions))  # B×T int64, 0-padded
        pixels = torch.stack(images).to(self.device)  # B×3×R×R
        latents, texts = self.encoders(pixels, tokens.to(self.device))
        latents = latents.float().cpu().numpy().astype(LATENT_DTYPE)  # B×C×h×w
        texts = texts.float().cpu().numpy().astype(LATENT_DTYPE)  # B×T×D
        demoted = {key: z.float().cpu().numpy().astype(LATENT_DTYPE) for key, z in self.encoders.demote(pixels).items()}
        for i, key in enumerate(keys):
            yield {
                "__key__": key,
                "latent.npy": encode_npy(latents[i]),
                **{latent_field(ratio): encode_npy(z[i]) for ratio, z in demoted.items()},
                "txtemb.npy": encode_npy(texts[i]),
                "txt": captions[i].encode("utf-8"),
                "json": json.dumps({**metas[i], "text_tokens": int((tokens[i] != 0).sum())}).encode("utf-8"),
            }

    def __call__(self, name: str) -> dict[str, Any]:
        stem = name.removesuffix(".tar")
        tmp = self.out_dir / f".tmp-{stem}"
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
        tmp.mkdir(parents=True)
        skipped: Counter = Counter()
        count = 0
        with wds.TarWriter(str(tmp / name), encoder=False, mtime=TAR_MTIME) as sink:
            for batch in _batches(_decoded(self.in_dir / name, self.opts.resolution, skipped), self.opts.batch_size):
                for sample in self._encode_batch(batch):
                    sink.write(sample)
                    count += 1
        path, shards = tmp / name, []
        if count:
            shards.append(shard_entry(path, count))
        else:
            path.unlink()  # an input whose every sample was unreadable
        part = {"shards": shards, "total": count, "skipped": dict(skipped)}
        commit_unit(self.out_dir, stem, tmp, part)
        return part


def encode(in_dir: str | Path, out_dir: str | Path, opts: EncodeOptions, progress: bool = True) -> dict | None:
    """Encode every shard of `in_dir` into `out_dir`; returns the manifest on the main process."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    source = read_manifest(in_dir)
    if "latent" in source:
        raise ConfigError(f"{in_dir} holds latent shards already; encode reads canonical shards (`maskbench data pack`)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file; give a folder for the latent shards")
    # cpu=True is what makes accelerate join a multi-process CPU (gloo) launch instead of running alone.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    encoders = Encoders(opts).to(accelerator.device)
    header = {"source": source["source"], "packer_version": source["packer_version"],
              "filters": source["filters"],
              # `pixels`: the canonical shards encoded here, where `maskbench eval reference` finds the real
              # images behind a held-out split (FID is computed on decoded samples against those).
              "latent": {**encoders.describe(opts), "pixels": str(in_dir.resolve())}}
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        claim_output(out_dir, header)
    accelerator.wait_for_everyone()
    names = [s["name"] for s in source["shards"]]
    mine = [n for n in names[accelerator.process_index :: accelerator.num_processes]
            if not unit_done(out_dir, n.removesuffix(".tar"))]
    work = _ShardEncoder(in_dir, out_dir, encoders, opts, accelerator.device)
    run_units(mine, work, 1, f"encode [{accelerator.process_index}]", progress and accelerator.is_local_main_process)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return None
    return merge_parts(out_dir, header, {})


def add_encode_arguments(subparsers: argparse._SubParsersAction) -> None:
    """Add `encode IN OUT ...` to a `maskbench data` subparser group (multi-GPU: `accelerate launch`)."""
    parser = subparsers.add_parser("encode", help="encode canonical shards into VAE latent + text embedding shards")
    parser.add_argument("input", help="canonical shard folder (with manifest.json)")
    parser.add_argument("output", help="latent shard folder to write")
    parser.add_argument("--vae", required=True, help="local diffusers AutoencoderKL folder, e.g. a saved sd-vae-ft-ema")
    parser.add_argument("--text-model", default="ViT-H-14",
                        help="open_clip architecture of the text tower, or local-dir:DIR (config + weights)")
    parser.add_argument("--text-weights", help="local open_clip weights file for --text-model (not for local-dir:)")
    parser.add_argument("--resolution", type=int, default=256, help="image side before encoding")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--demote", type=parse_ratios, default=(), metavar="R1,R2,...",
                        help="also store the latents of each sample resized by these ratios in (0, 1), e.g. "
                             "0.75,0.875, as KEY.latent_R.npy: what train.demote_routes train on")
    parser.add_argument("--patch", type=int, default=2,
                        help="snap demoted latent sides to multiples of the DiT patch size (default 2)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.set_defaults(func=encode_command)


def encode_command(args: argparse.Namespace) -> int:
    """CLI handler: 0 on success; bad input raises ConfigError (`maskbench` prints it, exit 2)."""
    opts = EncodeOptions(args.vae, args.text_model, args.text_weights, args.resolution, args.batch_size,
                         args.demote, args.patch)
    if args.text_weights is None and not args.text_model.startswith("local-dir:"):
        raise ConfigError(f"--text-weights FILE is needed for {args.text_model} (nothing is downloaded)")
    manifest = encode(args.input, args.output, opts, progress=args.progress)
    if manifest is not None:
        print(f"encoded {manifest['total']} samples into {len(manifest['shards'])} latent shards in {args.output}")
    return 0
