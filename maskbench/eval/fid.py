"""Fréchet distance between feature statistics, and clean-fid's Inception features, offline.

FID = ||mu1 - mu2||^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^1/2). The statistics (mu, S) of the
held-out real images are computed once and saved as an npz beside the dataset; each eval point
then only extracts features of its samples. Which network made the features is recorded with the
statistics (`features_name`), so Inception FID and the synth oracle's FD are never mixed up.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from cleanfid.downloads_helper import inception_url
from cleanfid.resize import build_resizer
from scipy import linalg

from maskbench.errors import UserError

if TYPE_CHECKING:
    from accelerate import Accelerator

INCEPTION_FEATURES_NAME = "inception-2015-12-05-clean"
STANDIN_FEATURES_NAME = "standin-random-inception"  # a random network shaped like Inception: not FID
STANDIN_MARKER = "maskbench_standin"  # attribute a stand-in TorchScript file carries (maskbench.eval.standins)
INCEPTION_DIM = 2048


class MissingWeights(UserError, FileNotFoundError):
    """An evaluation weights file is not on disk; nothing is ever downloaded at run time.

    The message is one line: the file to fetch and the config option that takes its path, so the
    CLI can print it as is and exit with code 2.
    """


class FeatureExtractor(Protocol):
    """What `reference_stats` needs: a name recorded with the stats, and uint8 images -> features."""

    name: str

    def __call__(self, images: np.ndarray | torch.Tensor) -> np.ndarray: ...


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     root1: np.ndarray | None = None) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2).

    Not `cleanfid.fid.frechet_distance`: it takes `sqrtm` of the non-symmetric product S1 S2 with
    SciPy's `disp` argument (deprecated, removed in SciPy 1.18), prints, and on the rank-deficient
    covariances of a few hundred samples in 2048-d it needs an eps fix and returns complex parts or
    small negatives. Here tr((S1 S2)^1/2) is computed as the sum of square roots of the eigenvalues
    of the symmetric PSD matrix S1^1/2 S2 S1^1/2 (same spectrum as S1 S2): exact, real, no eps.
    `root1`: S1^1/2 (`_psd_sqrt` of float64 sigma1) when the caller has it already.
    """
    mu1, mu2 = np.atleast_1d(mu1).astype(np.float64), np.atleast_1d(mu2).astype(np.float64)
    sigma1, sigma2 = np.atleast_2d(sigma1).astype(np.float64), np.atleast_2d(sigma2).astype(np.float64)
    dim = mu1.shape[0]
    if mu2.shape != (dim,) or sigma1.shape != (dim, dim) or sigma2.shape != (dim, dim):
        raise ValueError(
            f"statistics do not match: mu {mu1.shape} vs {mu2.shape}, sigma {sigma1.shape} vs {sigma2.shape}"
        )
    root1 = _psd_sqrt(sigma1) if root1 is None else root1
    return _distance(mu1 - mu2, np.trace(sigma1), np.trace(sigma2), _trace_sqrt(root1 @ sigma2 @ root1))


def _distance(diff: np.ndarray, trace1: float, trace2: float, tr_covmean: float) -> float:
    """||mu1 - mu2||^2 + tr S1 + tr S2 - 2 tr (S1 S2)^1/2, from its parts."""
    distance = diff @ diff + trace1 + trace2 - 2.0 * tr_covmean
    return max(float(distance), 0.0)  # a squared distance; only rounding can take it below 0


def _trace_sqrt(psd: np.ndarray) -> float:
    """tr(M^1/2) of a symmetric PSD matrix: the sum of square roots of its eigenvalues (below 0: rounding)."""
    return float(np.sqrt(np.clip(linalg.eigvalsh(psd), 0.0, None)).sum())


def _psd_sqrt(sigma: np.ndarray) -> np.ndarray:
    """Symmetric square root of a covariance matrix (eigenvalues below 0 are rounding: clipped)."""
    eigvals, eigvecs = linalg.eigh((sigma + sigma.T) / 2.0)
    return (eigvecs * np.sqrt(np.clip(eigvals, 0.0, None))) @ eigvecs.T


_SIGMA_ROOTS: dict[str, np.ndarray] = {}  # `FeatureStats.sigma_root` by a digest of sigma, the latest few
_SIGMA_ROOTS_KEPT = 4


@dataclass(frozen=True)
class FeatureStats:
    """Gaussian statistics of a feature set, and which network produced the features."""

    mu: np.ndarray  # F
    sigma: np.ndarray  # F×F
    n: int
    features_name: str
    source: str = ""     # reference statistics: the images they were built from
    resolution: int = 0  # reference statistics: the side the images were resized to (0: unknown)

    @property
    def label(self) -> str:
        """What the leaderboard's `fid_ref` records: resolution, count and a digest of (mu, sigma)."""
        digest = hashlib.sha256(self.mu.astype(np.float64).tobytes() + self.sigma.astype(np.float64).tobytes())
        return f"{self.resolution or '?'}px-n{self.n}-{digest.hexdigest()[:8]}"

    @classmethod
    def from_features(cls, features: np.ndarray, features_name: str) -> FeatureStats:
        if features.ndim != 2 or features.shape[0] < 2:
            raise ValueError(f"need an N×F feature array with N >= 2, got shape {features.shape}")
        features = features.astype(np.float64)
        return cls(features.mean(axis=0), np.cov(features, rowvar=False), features.shape[0], features_name)

    @functools.cached_property
    def sigma_root(self) -> np.ndarray:
        """S^1/2 (read-only), reused by every distance to these statistics and every bootstrap against them: an
        F×F eigendecomposition takes seconds at 2048-d on a CPU, and each eval point, each evaluator of a
        process (a run's horizons, `repro`'s reruns) loads the same reference statistics again."""
        key = hashlib.sha256(self.sigma.tobytes()).hexdigest() + f"{self.sigma.dtype}{self.sigma.shape}"
        if key not in _SIGMA_ROOTS:
            if len(_SIGMA_ROOTS) >= _SIGMA_ROOTS_KEPT:
                del _SIGMA_ROOTS[next(iter(_SIGMA_ROOTS))]  # the oldest
            root = _psd_sqrt(self.sigma)
            root.flags.writeable = False
            _SIGMA_ROOTS[key] = root
        return _SIGMA_ROOTS[key]

    def frechet_distance(self, other: FeatureStats) -> float:
        if self.features_name != other.features_name:
            raise ValueError(f"cannot compare {self.features_name!r} features with {other.features_name!r} features")
        reuse = self.sigma.dtype == np.float64 and self.sigma.ndim == 2  # else computed on the float64 2-d copy
        root = self.sigma_root if reuse else None
        return frechet_distance(self.mu, self.sigma, other.mu, other.sigma, root1=root)


BOOTSTRAP_SEED = 0  # fixed: re-evaluating a point draws the same resamples, so it reproduces the errors


def bootstrap_counts(n: int, resamples: int, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """How often each of n samples is drawn in each of `resamples` resamples of n with replacement: R×n."""
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples)


def bootstrap_frechet(features: np.ndarray, reference: FeatureStats, counts: np.ndarray) -> np.ndarray:
    """The Fréchet distance to the fixed `reference` of each bootstrap resample of the feature rows: R.

    Each resample's trace term tr((S S_ref)^1/2) = tr((S_ref^1/2 S S_ref^1/2)^1/2) needs no square root
    of its own: with A the drawn rows, centred, weighted by sqrt(count / (n-1)) and multiplied by
    S_ref^1/2 (computed once), S_ref^1/2 S S_ref^1/2 = A^T A, whose non-zero eigenvalues are those of
    A A^T. So one symmetric eigen-decomposition of the smaller of the two Gram matrices (the ~63%
    distinct rows of a resample, or the feature dimension) gives it.
    """
    x = features.astype(np.float64)                                                # N×F
    root = reference.sigma_root                                                    # F×F
    z = x @ root                                                                   # N×F: rows x_i S_ref^1/2
    trace_ref = float(np.trace(reference.sigma))
    return np.array([_resample_distance(x, z, root, c, reference.mu, trace_ref) for c in counts])  # R


def frechet_of_features(features: np.ndarray, reference: FeatureStats, features_name: str) -> float:
    """The Fréchet distance of N feature rows (their mean and np.cov covariance) to `reference`: the resample that
    draws every row once (`bootstrap_frechet`). With fewer rows than dimensions its trace term is one N×N
    eigen-decomposition instead of `frechet_distance`'s F×F one (256 samples of 2048-d Inception features:
    ~500× fewer operations); with more, the same F×F one."""
    if features_name != reference.features_name:
        raise ValueError(f"cannot compare {reference.features_name!r} features with {features_name!r} features")
    return float(bootstrap_frechet(features, reference, np.ones((1, len(features)), dtype=np.int64))[0])


def _resample_distance(x: np.ndarray, z: np.ndarray, root: np.ndarray, counts: np.ndarray, mu_ref: np.ndarray,
                       trace_ref: float) -> float:
    """FD to the reference of the resample that draws row i counts[i] times (np.cov's n-1 normalisation)."""
    n, drawn = counts.sum(), counts > 0
    weights = counts[drawn, None].astype(np.float64)                               # k×1
    mu = (weights * x[drawn]).sum(0) / n                                           # F
    trace = float((weights * (x[drawn] - mu) ** 2).sum()) / (n - 1)                # tr S
    a = np.sqrt(weights / (n - 1)) * (z[drawn] - mu @ root)                        # k×F
    gram = a @ a.T if len(a) <= a.shape[1] else a.T @ a                            # k×k or F×F
    return _distance(mu - mu_ref, trace, trace_ref, _trace_sqrt(gram))


def save_stats(path: str | os.PathLike, stats: FeatureStats) -> None:
    """Write the stats as a plain npz (no pickles), e.g. beside the dataset's shards."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:  # a file object, so numpy does not append ".npz" to the name
        np.savez(f, mu=stats.mu, sigma=stats.sigma, n=stats.n, features_name=stats.features_name,
                 source=stats.source, resolution=stats.resolution)


def load_stats(path: str | os.PathLike) -> FeatureStats:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no reference statistics at {path}: build them with `maskbench eval reference`")
    with np.load(path, allow_pickle=False) as data:
        extras = {key: data[key].item() for key in ("source", "resolution") if key in data}  # older files lack them
        return FeatureStats(data["mu"], data["sigma"], int(data["n"]), str(data["features_name"]), **extras)


def reference_stats(
    image_batches: Iterable[np.ndarray | torch.Tensor], extractor: FeatureExtractor, out_path: str | os.PathLike
) -> FeatureStats:
    """Statistics of held-out real images, built once and saved to `out_path`."""
    return reference_stats_many(image_batches, {out_path: extractor})[0]


def reference_stats_many(image_batches: Iterable[np.ndarray | torch.Tensor],
                         extractors: dict[str | os.PathLike, FeatureExtractor], source: str = "",
                         resolution: int = 0) -> list[FeatureStats]:
    """Statistics in several feature spaces from one pass over the images, each saved to its path."""
    features: dict = {path: [] for path in extractors}
    for batch in image_batches:
        for path, extractor in extractors.items():
            features[path].append(extractor(batch))                                      # B×F
    stats = []
    for path, extractor in extractors.items():
        found = FeatureStats.from_features(np.concatenate(features[path]), extractor.name)
        found = FeatureStats(found.mu, found.sigma, found.n, found.features_name, source, resolution)
        save_stats(path, found)
        stats.append(found)
    return stats


GATHER_ROWS = 256  # rows each rank sends per round of `gather_to_main`: what bounds a rank's extra memory


def gather_to_main(rows: np.ndarray | torch.Tensor, accelerator: Accelerator,
                   chunk: int = GATHER_ROWS) -> np.ndarray | None:
    """Every rank's rows (images, features), concatenated in rank order, on the main process only (None on the
    others), `chunk` rows per rank per round.

    Only the main process writes samples and computes metrics, so only it needs them all; an all-gather would
    put every image on every rank (~10 GB a rank at 50k samples of 256 px). Ranks may hold different counts
    (the prompts need not split evenly): each round pads to `chunk` rows and the padding is cut off. A rank
    holds one round on its device; the main process, world × one round, plus the result on the host.
    """
    local = torch.as_tensor(rows)                                                      # n_rank×…
    device, world = accelerator.device, accelerator.num_processes
    counts = accelerator.gather(torch.tensor([local.shape[0]], device=device)).tolist()  # world
    main = accelerator.is_main_process
    kept: list[list[torch.Tensor]] = [[] for _ in counts]
    for start in range(0, max(counts), chunk):
        part = torch.zeros((chunk, *local.shape[1:]), dtype=local.dtype)              # chunk×…, padded
        mine = local[start:start + chunk]
        part[:len(mine)] = mine
        part = part.to(device)
        received = [torch.empty_like(part) for _ in range(world)] if main else None
        torch.distributed.gather(part, received, dst=0)
        if main:
            for rank, (got, n) in enumerate(zip(received, counts)):
                kept[rank].append(got[:max(0, min(chunk, n - start))].cpu())
    if not main:
        return None
    return torch.cat([torch.cat(parts) if parts else local[:0] for parts in kept]).numpy()  # N×…


def as_uint8_images(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """Validate a batch of N×H×W×3 uint8 images (numpy or torch) and return it as numpy."""
    if isinstance(images, torch.Tensor):
        images = images.detach().cpu().numpy()
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected uint8 images of shape N×H×W×3, got {images.dtype} {images.shape}")
    return images


class InceptionFeatures:
    """clean-fid's features in mode "clean": 2048-d pool3 of the TorchScript Inception of StyleGAN2-ADA.

    clean-fid would download the weights to a fixed /tmp path; here they are loaded from a path the
    user gives (`eval.inception_weights=PATH`), and never fetched. A stand-in file made by
    `maskbench.eval.standins` (a small random network with the same interface, for machines without
    the weights) is recognised by its marker and named `standin-random-inception`, never Inception.
    """

    def __init__(self, weights_path: str | None, device: str | torch.device = "cpu", batch_size: int = 64):
        self.check_weights(weights_path)
        self.device = torch.device(device)
        self.batch_size = batch_size
        with warnings.catch_warnings():  # TorchScript is deprecated; clean-fid's Inception is a TorchScript file
            warnings.simplefilter("ignore", FutureWarning)
            try:
                self.model = torch.jit.load(weights_path, map_location=self.device).eval()
            except RuntimeError as err:
                raise MissingWeights(f"Inception weights at {weights_path} are not a TorchScript file "
                                     f"({str(err).splitlines()[0][:80]}): download {inception_url}") from None
        self.name = STANDIN_FEATURES_NAME if hasattr(self.model, STANDIN_MARKER) else INCEPTION_FEATURES_NAME
        self.resize = build_resizer("clean")  # PIL bicubic to 299×299 on each float channel, no re-quantising

    @classmethod
    def features_name_of(cls, weights_path: str | None) -> str:
        """The feature-space name a weights file gives, read on the CPU (to check reference statistics)."""
        return cls(weights_path, "cpu").name

    @staticmethod
    def check_weights(weights_path: str | None) -> None:
        """Raise MissingWeights (one line: what to fetch, which option takes it) unless the file is there."""
        if weights_path is None or not os.path.isfile(weights_path):
            where = "not configured" if weights_path is None else f"not found at {weights_path}"
            raise MissingWeights(
                f"Inception weights {where}: download {inception_url} and pass eval.inception_weights=PATH"
            )

    @torch.no_grad()
    def __call__(self, images: np.ndarray | torch.Tensor) -> np.ndarray:
        images = as_uint8_images(images)
        return np.concatenate(
            [self._features(images[i : i + self.batch_size]) for i in range(0, len(images), self.batch_size)]
        )

    def _features(self, images: np.ndarray) -> np.ndarray:
        """As cleanfid.inception_torchscript.InceptionV3W.forward with resize_inside=False."""
        resized = np.stack([self.resize(image) for image in images])  # B×299×299×3 float32 in [0, 255]
        x = torch.from_numpy(resized).permute(0, 3, 1, 2).to(self.device)  # B×3×299×299
        x = (x - 128.0) / 128.0  # B×3×299×299 in [-1, 1]
        return self.model.layers.forward(x).view(len(images), INCEPTION_DIM).cpu().numpy()  # B×2048


class DinoV2Features:
    """CLS-token features of a timm DINOv2 ViT (FD-DINOv2, as SPRINT and dgm-eval report), offline.

    The weights come from a local file (`eval.dinov2_weights`; timm's own pretrained loader, with the
    positional embedding resampled to the 224 px input dgm-eval uses); images are resized bicubically
    to 224 and normalised with the model's own mean and std.
    """

    size = 224

    def __init__(self, model_name: str, weights_path: str | None, device: str | torch.device = "cpu",
                 batch_size: int = 64):
        import timm

        self.check_weights(weights_path, model_name)
        self.device, self.batch_size = torch.device(device), batch_size
        self.model = timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay={"file": weights_path},
                                       num_classes=0, img_size=self.size).to(self.device).eval()
        config = self.model.pretrained_cfg
        self.mean = torch.tensor(config["mean"], device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(config["std"], device=self.device).view(1, 3, 1, 1)
        self.name = model_name  # fd_dinov2_features: the timm name, e.g. vit_large_patch14_dinov2.lvd142m

    @staticmethod
    def check_weights(weights_path: str | None, model_name: str) -> None:
        if weights_path is None or not os.path.isfile(weights_path):
            raise MissingWeights(f"DINOv2 weights not found at {weights_path}: fetch timm's {model_name} weights "
                                 "(a .safetensors or .pth file) and pass eval.dinov2_weights=PATH")

    @torch.no_grad()
    def __call__(self, images: np.ndarray | torch.Tensor) -> np.ndarray:
        images = torch.from_numpy(as_uint8_images(images))
        out = []
        for chunk in images.split(self.batch_size):
            x = chunk.to(self.device).permute(0, 3, 1, 2).float() / 255.0                     # b×3×H×W in [0, 1]
            x = torch.nn.functional.interpolate(x, size=(self.size, self.size), mode="bicubic", antialias=True)
            out.append(self.model((x - self.mean) / self.std).float().cpu().numpy())          # b×D
        return np.concatenate(out)                                                           # N×D
