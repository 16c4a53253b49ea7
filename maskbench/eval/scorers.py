"""Image scorers: for each image metric, the value it takes per sample and how those values become the metric.

The evaluator scores each rank's images with every scorer, gathers the per-sample values in prompt order, and
hands each scorer all of them to summarise with its sampling error. A new image metric is its registry entry
(`maskbench/metrics.py`), a scorer here and the line of `eval.evaluate.image_scorers` that builds it for the data
it applies to; the evaluator does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from maskbench.data.synth import scene_from_json
from maskbench.eval.clip import ClipScorer, clip_metrics
from maskbench.eval.fid import FeatureExtractor, FeatureStats, bootstrap_frechet, frechet_of_features
from maskbench.eval.oracle import Oracle


class ImageScorer(Protocol):
    """One image metric: `score` runs on each rank's share of the images, `summarize` on all of them (main)."""

    metric: str  # the registry name its summary reports

    def score(self, images: torch.Tensor, captions: np.ndarray, meta: Sequence[dict]) -> np.ndarray:
        """Per-sample values (S or S×F) of images generated for these prompts (`meta`: each prompt's record)."""
        ...

    def summarize(self, values: np.ndarray, counts: np.ndarray | None) -> dict:
        """The metric of N samples' values and, with `counts` (R×N bootstrap resamples), its sampling error."""
        ...


@dataclass
class FrechetScorer:
    """A Fréchet distance in one network's features (`features`) to the held-out split's statistics. It reports
    the features' name, the sample count and the reference beside the value (`<metric>_features`, `_n`, `_ref`):
    FDs of different features, counts or references are not comparable."""

    metric: str
    features: FeatureExtractor
    reference: FeatureStats

    def score(self, images: torch.Tensor, captions: np.ndarray, meta: Sequence[dict]) -> np.ndarray:
        return self.features(images)                                                           # S×F

    def summarize(self, values: np.ndarray, counts: np.ndarray | None) -> dict:
        return {**frechet_metrics(self.metric, values, self.features.name, self.reference, counts),
                f"{self.metric}_features": self.features.name, f"{self.metric}_n": len(values),
                f"{self.metric}_ref": self.reference.label}


@dataclass
class AlignmentScorer:
    """The synth oracle's verdict on each image: does it show exactly its prompt's scene?"""

    oracle: Oracle
    metric: str = "align_acc"

    def score(self, images: torch.Tensor, captions: np.ndarray, meta: Sequence[dict]) -> np.ndarray:
        return self.oracle.matches(images, [scene_from_json(m) for m in meta])                # S

    def summarize(self, values: np.ndarray, counts: np.ndarray | None) -> dict:
        accuracy = float(values.mean())
        return {self.metric: accuracy, f"{self.metric}_se": binomial_se(accuracy, len(values))}


@dataclass
class ClipScoreScorer:
    """Each image's CLIP cosine with its prompt. A scorer without weights (`is_random`) checks the plumbing only:
    its score goes to `clip_random_init`, never to the CLIP columns."""

    clip: ClipScorer
    metric: str = "clip_score"

    def score(self, images: torch.Tensor, captions: np.ndarray, meta: Sequence[dict]) -> np.ndarray:
        return self.clip(images, captions)                                                     # S

    def summarize(self, values: np.ndarray, counts: np.ndarray | None) -> dict:
        scores = clip_metrics(values, counts)
        if self.clip.is_random:
            return {"clip_random_init": scores}
        return {**scores, "clip_model": self.clip.model_label}


def frechet_metrics(name: str, features: np.ndarray, features_name: str, reference: FeatureStats,
                    counts: np.ndarray | None) -> dict:
    """`name`: the Fréchet distance of the N×F features to the reference; with `counts` (R×N bootstrap
    resamples of the feature rows) also `name_se`, its SD over the resamples, and `name_ci`, their 95%
    percentile interval (eval.jsonl only). With few samples in many dimensions the resamples, ~63% distinct
    rows each, sit above the point value (FD's bias grows as samples fall): the interval need not cover it."""
    distance = frechet_of_features(features, reference, features_name)
    if counts is None:
        return {name: distance}
    resampled = bootstrap_frechet(features, reference, counts)                      # R
    return {name: distance, f"{name}_se": float(resampled.std(ddof=1)),
            f"{name}_ci": [float(bound) for bound in np.percentile(resampled, [2.5, 97.5])]}


def binomial_se(p: float, n: int) -> float:
    """Standard error of a fraction of n independent hits: sqrt(p (1 - p) / n) (plug-in)."""
    return float(np.sqrt(p * (1.0 - p) / n))
