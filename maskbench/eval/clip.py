"""CLIP score of generated images against their prompts, with open_clip, never downloading.

Default model ViT-H-14 / laion2b_s32b_b79k, as MLPerf's Stable Diffusion benchmark. Two conventions
are reported side by side: `clip_cos`, the plain mean cosine (MLPerf), and `clip_score`,
100 · max(mean cosine, 0) (torchmetrics CLIPScore).

open_clip fetches a tag's weights from the Hugging Face hub (or a URL) when they are not cached, and
without a network that means retries and a long hang. Here a tag is first resolved to a file already
in the local cache; if there is none, `MissingWeights` says what to fetch and which option takes it.
A model may also be an open_clip `local-dir:DIR` folder (`open_clip_config.json` + weights), which
carries its own weights (`eval.clip_weights` is then ignored).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from huggingface_hub import try_to_load_from_cache
from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME
from PIL import Image

from maskbench.errors import ConfigError
from maskbench.eval.fid import MissingWeights, as_uint8_images

DEFAULT_MODEL = "ViT-H-14"
DEFAULT_PRETRAINED = "laion2b_s32b_b79k"
OPENAI_CLIP_CACHE = os.path.expanduser("~/.cache/clip")  # where open_clip stores URL downloads


def _cached_tag_file(tag_cfg: dict, cache_dir: str | None) -> str | None:
    """The local copy of a tag's weights in the HF hub cache or open_clip's URL cache, if any."""
    if tag_cfg.get("hf_hub"):
        repo_id, filename = os.path.split(tag_cfg["hf_hub"])
        names = [HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME] if not filename else [filename]
        for name in names:
            cached = try_to_load_from_cache(repo_id, name, cache_dir=cache_dir)
            if isinstance(cached, str):  # otherwise None, or a marker that the file is known absent
                return cached
    if tag_cfg.get("url"):
        path = os.path.join(cache_dir or OPENAI_CLIP_CACHE, os.path.basename(tag_cfg["url"]))
        if os.path.isfile(path):
            return path
    return None


def _tag_source(tag_cfg: dict) -> str:
    """Where a tag's weights are published, for the MissingWeights message."""
    if tag_cfg.get("hf_hub"):
        repo_id, filename = os.path.split(tag_cfg["hf_hub"])
        return f"https://huggingface.co/{repo_id}/blob/main/{filename or HF_WEIGHTS_NAME}"
    return tag_cfg["url"]


def resolve_pretrained(model_name: str, pretrained: str, cache_dir: str | None = None) -> tuple[str, dict]:
    """An open_clip tag or a weights file -> (local file, the tag's preprocessing config or {})."""
    if os.path.isfile(pretrained):
        return pretrained, {}
    tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
    if not tag_cfg:
        if os.sep in pretrained or os.path.splitext(pretrained)[1]:
            raise MissingWeights(
                f"CLIP weights file not found at {pretrained}: pass an existing file as eval.clip_weights=PATH"
            )
        known = open_clip.list_pretrained_tags_by_model(model_name)
        raise ConfigError(
            f"{pretrained!r} is neither a weights file nor an open_clip tag of {model_name} (known: {known})"
        )
    cached = _cached_tag_file(tag_cfg, cache_dir)
    if cached is None:
        raise MissingWeights(
            f"CLIP weights {model_name}/{pretrained} are not cached locally: "
            f"download {_tag_source(tag_cfg)} and pass eval.clip_weights=PATH"
        )
    return cached, tag_cfg


LOCAL_DIR = "local-dir:"


def check_clip(model_name: str, pretrained: str | None) -> None:
    """Raise MissingWeights / ValueError (one line) unless the configured CLIP can load offline."""
    if model_name.startswith(LOCAL_DIR):
        folder = model_name.removeprefix(LOCAL_DIR)
        if not os.path.isfile(os.path.join(folder, "open_clip_config.json")):
            raise MissingWeights(f"no open_clip model folder at {folder} (open_clip_config.json + weights) for "
                                 "eval.clip_model=local-dir:DIR")
    elif pretrained:
        resolve_pretrained(model_name, pretrained)


def paired_cosines(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
    """Cosine of each image with its own caption: N×D, N×D -> N."""
    return (F.normalize(image_features, dim=-1) * F.normalize(text_features, dim=-1)).sum(-1)


def clip_metrics(cosines: np.ndarray | Sequence[float], counts: np.ndarray | None = None) -> dict[str, float]:
    """clip_cos = mean cosine (MLPerf); clip_score = 100 · max(mean cosine, 0) (torchmetrics).

    With `counts` (R×N bootstrap resamples of the samples, fid.bootstrap_counts) also clip_score_se: the
    SD of clip_score over the resamples, the sampling error of a mean of per-sample cosines.
    """
    clip_cos = float(np.mean(cosines))
    scores = {"clip_cos": clip_cos, "clip_score": 100.0 * max(clip_cos, 0.0)}
    if counts is not None:
        resampled = 100.0 * np.maximum(counts @ np.asarray(cosines, np.float64) / len(cosines), 0.0)  # R
        scores["clip_score_se"] = float(resampled.std(ddof=1))
    return scores


class ClipScorer:
    """Per-sample image-caption cosines under an open_clip model.

    `pretrained` is an open_clip tag (must already be cached) or a local weights file. None gives a
    randomly initialised model for tests only: `is_random` is then True and the caller must not
    write its score to the leaderboard as a CLIP score.
    """

    def __init__(
        self,
        model_name: str = DEFAULT_MODEL,
        pretrained: str | None = DEFAULT_PRETRAINED,
        device: str | torch.device = "cpu",
        batch_size: int = 32,
        cache_dir: str | None = None,
    ):
        local = model_name.startswith(LOCAL_DIR)  # the folder holds the weights
        pretrained = None if local else pretrained
        weights, tag_cfg = resolve_pretrained(model_name, pretrained, cache_dir) if pretrained else (None, {})
        self.is_random = pretrained is None and not local
        # the leaderboard's clip_model
        self.model_label = model_name if local else f"{model_name}/{pretrained or 'random-init'}"
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.model, _, self.preprocess = open_clip.create_model_and_transforms(
            model_name,
            pretrained=weights,
            device=self.device,
            force_quick_gelu=tag_cfg.get("quick_gelu", False),  # as the tag's weights were trained
            image_mean=tag_cfg.get("mean"),
            image_std=tag_cfg.get("std"),
            image_interpolation=tag_cfg.get("interpolation"),
            image_resize_mode=tag_cfg.get("resize_mode"),
            pretrained_text=False,  # never fetch a base text tower for a random init
        )
        self.model.eval()
        self.tokenizer = open_clip.get_tokenizer(model_name)  # the BPE vocab ships with open_clip

    @torch.no_grad()
    def __call__(self, images: np.ndarray | torch.Tensor, captions: Sequence[str]) -> np.ndarray:
        """uint8 N×H×W×3 images and their N captions -> N cosines."""
        images = as_uint8_images(images)
        if len(captions) != len(images):
            raise ValueError(f"got {len(images)} images but {len(captions)} captions")
        return np.concatenate(
            [
                self._cosines(images[i : i + self.batch_size], captions[i : i + self.batch_size])
                for i in range(0, len(images), self.batch_size)
            ]
        )

    def _cosines(self, images: np.ndarray, captions: Sequence[str]) -> np.ndarray:
        pixels = torch.stack([self.preprocess(Image.fromarray(image)) for image in images])  # B×3×S×S
        pixels = pixels.to(self.device)
        tokens = self.tokenizer(list(captions)).to(self.device)  # B×context_length
        image_features = self.model.encode_image(pixels)  # B×D
        text_features = self.model.encode_text(tokens)  # B×D
        return paired_cosines(image_features, text_features).float().cpu().numpy()  # B
