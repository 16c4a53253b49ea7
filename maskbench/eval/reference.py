"""`maskbench eval reference`: Inception statistics of held-out real images, built once per dataset.

The statistics are an npz of (mu, sigma) kept beside the data (default `<val shards>/inception_stats.npz`,
where `maskbench run` looks for them), never inside clean-fid's site-packages folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm

from maskbench.data.shards import BadSample, decode_image, read_manifest, shard_urls
from maskbench.eval.fid import FeatureStats, InceptionFeatures, reference_stats

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
            image = image.resize((size, size), Image.Resampling.BICUBIC)
        buffer.append(np.asarray(image))
        if len(buffer) == batch:
            yield np.stack(buffer)
            buffer = []
    if buffer:
        yield np.stack(buffer)


def build_reference(src: str | Path, out: str | Path, weights: str | None, size: int | None = None,
                    limit: int | None = None, device: str = "cpu", batch: int = 64) -> FeatureStats:
    """Inception (clean-fid 'clean') statistics of the images under src, saved to out."""
    src = Path(src)
    if not src.exists():
        raise ValueError(f"no such image folder or shard dir: {src}")
    extractor = InceptionFeatures(weights, device, batch_size=batch)
    return reference_stats(image_batches(src, size, batch, limit), extractor, out)
