"""`maskbench eval reference`: Inception (and DINOv2) statistics of held-out real images, once per dataset.

The statistics are an npz of (mu, sigma) kept beside the data (default `<val shards>/inception_stats.npz`,
where `maskbench run` looks for them), never inside clean-fid's site-packages folder. Each records the
images it was built from and their size, which a run checks against the size its samples will have.

Given a latent held-out split, the images are the pixel shards that split was encoded from (the latent
manifest records them), resized and centre-cropped exactly as `maskbench data encode` did: FID then
compares decoded samples with the very images the VAE saw, at the decoded resolution.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image, ImageOps
from tqdm import tqdm

from maskbench.data.shards import BadSample, decode_image, shard_urls
from maskbench.errors import ConfigError
from maskbench.eval.fid import DinoV2Features, FeatureExtractor, FeatureStats, InceptionFeatures, reference_stats_many
from maskbench.manifest import read_manifest

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def _shard_images(shard_dir: Path) -> Iterator[Image.Image]:
    for sample in wds.DataPipeline(wds.SimpleShardList(shard_urls(shard_dir)), wds.tarfile_to_samples()):
        field = next((k for k in ("png", "jpg", "webp") if k in sample), None)
        try:
            if field is not None:
                yield decode_image(sample[field])
        except BadSample:
            continue


def _folder_images(folder: Path) -> Iterator[Image.Image]:
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
        yield Image.open(path)


def image_batches(src: Path, size: int | None, batch: int, limit: int | None) -> Iterator[np.ndarray]:
    """uint8 N×H×W×3 batches from a shard dir (with manifest.json) or a folder of images."""
    images = _shard_images(src) if (src / "manifest.json").is_file() else _folder_images(src)
    total = read_manifest(src)["total"] if (src / "manifest.json").is_file() else None
    buffer = []
    for i, image in enumerate(tqdm(images, total=limit or total, desc="reference images", unit="img")):
        if limit is not None and i >= limit:
            break
        image = image.convert("RGB")
        if size is not None and image.size != (size, size):
            image = ImageOps.fit(image, (size, size), Image.Resampling.BICUBIC)  # as `maskbench data encode`
        buffer.append(np.asarray(image))
        if len(buffer) == batch:
            yield np.stack(buffer)
            buffer = []
    if buffer:
        yield np.stack(buffer)


def pixel_source(src: Path, size: int | None) -> tuple[Path, int | None]:
    """(image folder or pixel shards, size): a latent split stands for the pixel shards it was encoded from."""
    latent = read_manifest(src).get("latent") if (src / "manifest.json").is_file() else None
    if latent is None:
        return src, size
    if "pixels" not in latent:
        raise ConfigError(f"{src} is a latent split whose manifest does not record its pixel shards (encoded by an "
                          "older maskbench): pass those shards as SRC with --size and --out")
    if size is not None and size != latent["resolution"]:
        raise ConfigError(f"{src} decodes to {latent['resolution']}px images; --size {size} would not match them")
    return Path(latent["pixels"]), int(latent["resolution"])


def build_reference(src: str | Path, out: str | Path, weights: str | None, size: int | None = None,
                    limit: int | None = None, device: str = "cpu", batch: int = 64,
                    dinov2: tuple[str, str] | None = None) -> list[FeatureStats]:
    """Inception (clean-fid 'clean') statistics of the images under src, saved to out; with
    dinov2=(model, weights) also DINOv2 statistics, saved beside it as dinov2_stats.npz."""
    src = Path(src)
    if not src.exists():
        raise ConfigError(f"no such image folder or shard dir: {src}")
    images, size = pixel_source(src, size)
    if not images.exists():
        raise ConfigError(f"the pixel shards {images} recorded for {src} are not there")
    extractors: dict[Path, FeatureExtractor] = {Path(out): InceptionFeatures(weights, device, batch_size=batch)}
    if dinov2:
        extractors[Path(out).with_name("dinov2_stats.npz")] = DinoV2Features(*dinov2, device, batch_size=batch)
    return reference_stats_many(image_batches(images, size, batch, limit), extractors, str(images), size or 0)
