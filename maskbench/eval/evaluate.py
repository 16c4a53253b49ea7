"""Evaluation at an eval point: validation loss at fixed t, paired samples, a grid, and the metrics.

Everything here is fixed by the data and the eval config, never by the arm or the run seed: the
held-out images and their noise for the validation loss, the prompts and their initial noise for
sampling. Two arms evaluated at the same point therefore see byte-identical inputs.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import webdataset as wds
from accelerate import Accelerator
from accelerate.utils import gather_object
from PIL import Image
from torch import nn
from tqdm import tqdm

from maskbench.config import EvalConfig
from maskbench.data.dataset import DatasetInfo
from maskbench.data.shards import BadSample, shard_urls
from maskbench.errors import ConfigError
from maskbench.eval.clip import ClipScorer, check_clip
from maskbench.eval.decode import LatentDecoder, resolve_vae
from maskbench.eval.fid import (
    DinoV2Features,
    FeatureStats,
    InceptionFeatures,
    bootstrap_counts,
    gather_to_main,
    load_stats,
    reference_stats,
)
from maskbench.eval.grid import GRID_FILE, prompt_grid
from maskbench.eval.oracle import Oracle, load_oracle
from maskbench.eval.sample import euler_sample, fixed_noise, inference_precision, to_uint8
from maskbench.eval.scorers import AlignmentScorer, ClipScoreScorer, FrechetScorer, ImageScorer
from maskbench.manifest import read_manifest
from maskbench.models.build import batch_context
from maskbench.models.objective import interpolate

T = TypeVar("T")

@dataclass
class EvalSet:
    """Held-out samples in shard order: the first N, or (one rank's part of them) those at `indices`."""
    images: torch.Tensor        # K×C×H×W in [-1, 1] (or latents)
    captions: list[str]
    meta: list[dict]
    text: dict                  # latent data: {"txtemb": K×T×D, "txtmask": K×T}; synth: {}
    indices: list[int] | None = None  # the held-out index of each row, ascending; None: 0..K-1

    def rows(self, start: int, stop: int) -> slice:
        """Where held-out samples start..stop-1 sit in this set; a rank asking for ones it does not hold is a bug."""
        first = start if self.indices is None else bisect_left(self.indices, start)
        held = range(len(self.captions)) if self.indices is None else self.indices
        if list(held[first:first + stop - start]) != list(range(start, stop)):
            raise IndexError(f"held-out samples {start}..{stop - 1} are not all in this eval set")
        return slice(first, first + stop - start)

    def batch(self, start: int, stop: int) -> dict:
        """Held-out samples start..stop-1 (indices into the split, wherever they sit in this set)."""
        rows = self.rows(start, stop)
        return {"image": self.images[rows], "caption": self.captions[rows],
                **{name: value[rows] for name, value in self.text.items()}}


def load_eval_set(data: DatasetInfo, n: int, indices: Iterable[int] | None = None) -> EvalSet:
    """Read the held-out split sequentially (no shuffling, no resampling) up to its first n usable samples, and
    keep them all or only those at `indices`: a rank holds its own share, not the whole set. Every rank reads
    (and decodes) the same n samples, so a split short of n fails alike on every rank."""
    pipeline = wds.DataPipeline(wds.SimpleShardList(shard_urls(data.val_dir)), wds.tarfile_to_samples())
    wanted = set(range(n) if indices is None else indices)
    decoded, kept, usable = [], [], 0
    for sample in pipeline:
        try:
            item = data.decode(sample), json.loads(sample["json"]) if "json" in sample else {}
        except BadSample:
            continue
        if usable in wanted:
            decoded.append(item)
            kept.append(usable)
        usable += 1
        if usable == n:
            break
    if usable < n:
        raise ConfigError(f"the held-out split {data.val_dir} has {usable} usable samples; {n} requested")
    text = {name: torch.stack([d[name] for d, _ in decoded]) for name in ("txtemb", "txtmask") if data.latent}
    return EvalSet(torch.stack([d["image"] for d, _ in decoded]), [d["caption"] for d, _ in decoded],
                   [meta for _, meta in decoded], text, None if indices is None else kept)


@dataclass
class ValidationLoss:
    """The fixed-t validation loss of the first n held-out samples, and each sample's loss behind it."""
    per_t: list[float]          # T: the mean loss over the samples at each t
    per_sample: np.ndarray      # n×T: each sample's loss at each t

    @property
    def value(self) -> float:
        """The metric (MLPerf Flux's): the mean over t of the per-t means."""
        return float(np.mean(self.per_t))

    @property
    def se(self) -> float | None:
        """Its sampling error over held-out samples: each sample's loss averaged over the t values, then
        SD / sqrt(n) (None below two samples)."""
        losses = self.per_sample.mean(axis=1)                                       # n
        return float(losses.std(ddof=1) / np.sqrt(len(losses))) if len(losses) > 1 else None


def squared_errors(model: nn.Module, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """The unmasked flow loss's squared velocity error per token, B×L×P: its mean is `flow_loss` (no
    keep_idx) bit for bit, the same tensor reduced the same way; per sample it gives the loss's error."""
    target = model.patchify(noise - x0)                                              # B×L×P
    pred = model(interpolate(x0, noise, t), t, context, mask)                        # B×L×P
    return (pred.float() - target.float()) ** 2


def ranks_of(accelerator: Accelerator | None) -> tuple[int, int]:
    """(rank, world) of an evaluation: the accelerator's processes, or one process."""
    return (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)


def run_stage(stage: Callable[[], T], accelerator: Accelerator | None) -> T:
    """This rank's part of an evaluation stage, returned once every rank has finished its own part.

    The ranks meet after each stage whether or not their part raised: a rank that failed sends its error
    (one line) and raises it; every other rank raises "evaluation failed on rank r: ...". Without this a
    failure on one rank would leave the others in the next collective until the process group's timeout.
    """
    if ranks_of(accelerator)[1] == 1:
        return stage()
    value, failure, message = None, None, None
    try:
        value = stage()
    except Exception as err:  # noqa: BLE001 - whatever it is, the other ranks must hear of it before this one ends
        failure, message = err, f"{type(err).__name__}: {err}".splitlines()[0]
    failed = [(rank, m) for rank, m in enumerate(gather_object([message])) if m is not None]
    if failure is not None:
        raise failure
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"evaluation failed on rank {rank}: {message}")
    return value


def concat_ranks(part: dict[str, np.ndarray], accelerator: Accelerator | None) -> dict[str, np.ndarray]:
    """Each rank's per-sample arrays concatenated in rank order, which is sample order (the shares are
    contiguous, `rank_share`), on every rank. A rank with no samples may send no arrays."""
    parts = gather_object([part]) if ranks_of(accelerator)[1] > 1 else [part]
    names = dict.fromkeys(name for rank_part in parts for name in rank_part)
    return {name: np.concatenate([p[name] for p in parts if name in p]) for name in names}


def measure_validation_loss(model: nn.Module, evalset: EvalSet, t_values: list[float], noise_seed: int,
                            batch_size: int, device: torch.device, n: int | None = None,
                            accelerator: Accelerator | None = None) -> ValidationLoss:
    """Unmasked rectified-flow loss at fixed t on the first n held-out samples (default: all the set holds)
    with fixed noise (MLPerf Flux's metric), per t and per sample. Under several processes each rank
    measures its share of the samples (`rank_share`) and the sums and per-sample rows are gathered."""
    n = len(evalset.captions) if n is None else n
    share = rank_share(n, *ranks_of(accelerator))
    part = run_stage(lambda: _validation_part(model, evalset, share, t_values, noise_seed, batch_size, device),
                     accelerator)
    gathered = concat_ranks(part, accelerator)
    return ValidationLoss((gathered["totals"].sum(axis=0) / n).tolist(), gathered["per_sample"])


@torch.no_grad()
def _validation_part(model: nn.Module, evalset: EvalSet, share: range, t_values: list[float], noise_seed: int,
                     batch_size: int, device: torch.device) -> dict[str, np.ndarray]:
    """One rank's share of the validation loss: per t the sum over its samples of each batch's mean loss
    times its size (1×T), and each sample's loss (S×T)."""
    totals, per_sample = np.zeros((1, len(t_values))), np.zeros((len(share), len(t_values)))  # 1×T, S×T
    for j, t_value in enumerate(t_values):
        for start in range(share.start, share.stop, batch_size):
            batch = evalset.batch(start, min(start + batch_size, share.stop))
            x0 = batch["image"].to(device)                                          # B×C×H×W
            noise = fixed_noise(range(start, start + len(x0)), tuple(x0.shape[1:]), noise_seed + 7919 * (j + 1))
            t = torch.full((len(x0),), t_value, device=device)                      # B
            context, mask = batch_context(model, batch, device)
            with inference_precision(device):
                errors = squared_errors(model, x0, noise.to(device), t, context, mask)  # B×L×P, every token
            totals[0, j] += errors.mean().item() * len(x0)
            rows = slice(start - share.start, start - share.start + len(x0))
            per_sample[rows, j] = errors.flatten(1).mean(1).double().cpu().numpy()  # B
    return {"totals": totals, "per_sample": per_sample}


def validation_loss(model: nn.Module, evalset: EvalSet, t_values: list[float], noise_seed: int,
                    batch_size: int, device: torch.device, n: int | None = None,
                    accelerator: Accelerator | None = None) -> tuple[float, list[float]]:
    """The validation loss and its per-t values (what a `val_loss_within` rule and `maskbench repro` read)."""
    measured = measure_validation_loss(model, evalset, t_values, noise_seed, batch_size, device, n, accelerator)
    return measured.value, measured.per_t


@torch.no_grad()
def generate(model: nn.Module, evalset: EvalSet, indices: range, cfg: EvalConfig, device: torch.device,
             decoder: LatentDecoder | None = None) -> torch.Tensor:
    """Samples for the held-out prompts at `indices`, uint8 N×H×W×3, from the fixed per-prompt noise.

    On latent data each batch of sampled latents is decoded right away (by the rank that sampled it),
    so from here on latent and pixel samples are the same thing: images.
    """
    shape = tuple(evalset.images.shape[1:])                                         # C×H×W (or C×h×w)
    side = decoder.resolution if decoder else shape[-1]
    out = [torch.zeros((0, side, side, 3), dtype=torch.uint8)]
    starts = range(indices.start, indices.stop, cfg.batch_size)
    bar = tqdm(starts, desc="sampling", unit="batch", leave=False, dynamic_ncols=True,
               disable=indices.start != 0 or len(starts) < 2)  # the rank holding the first prompts shows it
    for start in bar:
        stop = min(start + cfg.batch_size, indices.stop)
        noise = fixed_noise(range(start, stop), shape, cfg.noise_seed).to(device)   # B×C×H×W
        context, mask = batch_context(model, evalset.batch(start, stop), device)
        with inference_precision(device):
            x = euler_sample(model, noise, context, mask, cfg.sampler_steps, cfg.cfg_scale)
        out.append(to_uint8(decoder(x) if decoder else x))                          # B×H×W×3
    return torch.cat(out)                                                           # N×H×W×3


def samples_at(cfg: EvalConfig, point: float | None) -> int:
    """Images generated at an eval point: eval.final_n_samples at the final point (1.0, when set),
    eval.n_samples elsewhere (and when no point is named)."""
    return cfg.final_n_samples if point == 1.0 and cfg.final_n_samples is not None else cfg.n_samples


def rank_share(n: int, rank: int, world: int) -> range:
    """A contiguous slice of n items for one rank; gathering the slices in rank order restores 0..n-1."""
    return range(n * rank // world, n * (rank + 1) // world)


def save_samples(images: torch.Tensor, captions: list[str], out_dir: Path, grid_size: int) -> Path:
    """One PNG per sample (what `maskbench repro` recomputes metrics from) and a grid PNG of the first
    grid_size samples, enlarged, each with its prompt (`prompt_grid`), for people to judge by eye."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images.numpy()):
        Image.fromarray(image).save(out_dir / f"{i:05d}.png")
    shown = images[:grid_size].numpy()                                               # G×H×W×3
    grid_path = out_dir / GRID_FILE
    prompt_grid(shown, captions[:len(shown)]).save(grid_path)  # sample i was drawn for prompt i
    return grid_path


def load_samples(sample_dir: Path) -> torch.Tensor:
    files = sorted(sample_dir.glob("[0-9]*.png"))
    return torch.from_numpy(np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files]))


class Evaluator:
    """Everything an eval point needs, built once per run: the held-out set and the metric networks.

    The image metrics are its `scorers` (`image_scorers`: the synth oracle's FD and alignment, or Inception
    FID, FD-DINOv2 and CLIP on real data). Latent samples are decoded with the data's VAE first.

    Under several processes each rank evaluates its share (`rank_share`) of the prompts and of the
    validation samples, and holds only those held-out samples; per-sample values are gathered in order.
    """

    def __init__(self, data: DatasetInfo, cfg: EvalConfig, device: torch.device, scores: bool = True,
                 rank: int = 0, world: int = 1):
        """scores=False loads only what the validation loss, sampling and decoding need. This is process
        `rank` of `world`: it holds only its share of the eval set, and `evaluate` must be given those ranks."""
        self.data, self.cfg, self.device, self.rank, self.world = data, cfg, device, rank, world
        counts = {cfg.n_samples, samples_at(cfg, 1.0), cfg.val_samples}
        held = {i for n in counts for i in rank_share(n, rank, world)}  # its shares of the prompts and val samples
        self.evalset = load_eval_set(data, max(counts), sorted(held))
        self.decoder = LatentDecoder(resolve_vae(data.vae, cfg.vae), device) if data.latent else None
        self.scorers = image_scorers(data, cfg, device) if scores else []

    def evaluate(self, model: nn.Module, out_dir: Path, accelerator: Accelerator | None = None,
                 point: float | None = None) -> dict | None:
        """All metrics of one eval point, each with its sampling error, with the model in eval mode; a flat
        dict of results on the main process (None elsewhere). `point` picks the sample count (`samples_at`).

        Under several processes every rank measures the validation loss of its share of the held-out
        samples, samples its share of the prompts and scores those images (features, oracle hits, CLIP
        cosines); the per-sample values and the images are gathered in prompt order, and the main process
        turns them into metrics and writes the samples. A failure on any rank ends every rank (`run_stage`).
        """
        rank, world = self._ranks(accelerator)
        was_training = model.training
        model.eval()
        try:
            result = self.loss_metrics(model, accelerator)
            share = rank_share(samples_at(self.cfg, point), rank, world)
            images, scores = run_stage(lambda: self.sample_and_score(model, share), accelerator)
            if world > 1:  # only the main process writes the samples and scores them: only it holds them all
                gathered = gather_to_main(images, accelerator)                       # N×H×W×3, prompt order
                images = torch.from_numpy(gathered) if gathered is not None else None
            scores = concat_ranks(scores, accelerator)
            return run_stage(lambda: self._report(result, images, scores, out_dir) if rank == 0 else None,
                             accelerator)
        finally:
            model.train(was_training)

    def _ranks(self, accelerator: Accelerator | None) -> tuple[int, int]:
        """The accelerator's (rank, world), which must be those this evaluator's eval set was read for."""
        ranks = ranks_of(accelerator)
        if ranks != (self.rank, self.world):
            raise ValueError(f"this evaluator holds rank {self.rank} of {self.world}'s share of the eval set, "
                             f"not rank {ranks[0]} of {ranks[1]}'s")
        return ranks

    def _report(self, result: dict, images: torch.Tensor, scores: dict[str, np.ndarray], out_dir: Path) -> dict:
        """The main process's part: the sample PNGs and grid, and the image metrics of the gathered scores."""
        result["grid"] = str(save_samples(images, scores["caption"].tolist(), out_dir, self.cfg.grid_size))
        result.update(self.summarize(len(images), scores))
        return result

    def loss_metrics(self, model: nn.Module, accelerator: Accelerator | None = None) -> dict:
        """The fixed-t validation loss, its sampling error over held-out samples and its per-t values (on
        every rank, each measuring its share)."""
        cfg = self.cfg
        self._ranks(accelerator)
        loss = measure_validation_loss(model, self.evalset, cfg.val_t, cfg.noise_seed, cfg.batch_size, self.device,
                                       cfg.val_samples, accelerator)
        return {"val_loss": loss.value, "val_loss_se": loss.se, "val_loss_per_t": loss.per_t}

    def sample_and_score(self, model: nn.Module, share: range) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Images for the prompts at `share` (uint8 S×H×W×3), and their per-sample scores (`scores`) and
        prompts (`caption`: the grid shows them)."""
        images = generate(model, self.evalset, share, self.cfg, self.device, self.decoder)
        captions = np.asarray(self.evalset.captions[self.evalset.rows(share.start, share.stop)], dtype=str)  # S
        return images, {"caption": captions, **self.scores(images, share)}

    def scores(self, images: torch.Tensor, share: range) -> dict[str, np.ndarray]:
        """Per-sample values behind the image metrics (`ImageScorer.score`), for images of the prompts at `share`,
        under the names of the metrics they make."""
        if not len(images):  # a rank with no prompts (fewer prompts than ranks)
            return {}
        rows = self.evalset.rows(share.start, share.stop)
        captions, meta = self.evalset.captions[rows], self.evalset.meta[rows]
        return {scorer.metric: scorer.score(images, captions, meta) for scorer in self.scorers}

    def image_metrics(self, images: torch.Tensor) -> dict:
        """The image metrics of generated images for the first N prompts, in one process (`summarize`)."""
        return self.summarize(len(images), self.scores(images, range(len(images))))

    def summarize(self, n: int, scores: dict[str, np.ndarray]) -> dict:
        """Each image metric of the n samples' `scores`, with its sampling error (`*_se`; FD and CLIP by
        bootstrap over the samples, eval.bootstrap_resamples, the same resamples for every metric)."""
        resamples = self.cfg.bootstrap_resamples
        counts = bootstrap_counts(n, resamples) if resamples else None                 # R×N
        out = {}
        for scorer in self.scorers:
            out.update(scorer.summarize(scores[scorer.metric], counts))
        return out


def image_scorers(data: DatasetInfo, cfg: EvalConfig, device: torch.device) -> list[ImageScorer]:
    """The image metrics this data and eval config measure. On synth: the FD in the oracle's features against
    statistics of the whole held-out split, and the oracle's exact-scene accuracy. On real data: FID in clean-fid's
    Inception (`eval.inception_weights`) against `maskbench eval reference` statistics, and FD-DINOv2 where
    `eval.dinov2_weights` is given. CLIP scores wherever `eval.clip_model` is set."""
    scorers: list[ImageScorer] = []
    if data.synthetic:
        oracle = load_oracle(device=device)
        scorers += [FrechetScorer("fid", oracle, synth_reference_stats(data, oracle)), AlignmentScorer(oracle)]
    else:
        scorers.append(FrechetScorer("fid", InceptionFeatures(cfg.inception_weights, device),
                                     load_stats(reference_stats_path(data, cfg))))
        if cfg.dinov2_weights:
            scorers.append(FrechetScorer("fd_dinov2", DinoV2Features(cfg.dinov2_model, cfg.dinov2_weights, device),
                                         load_stats(dinov2_stats_path(data, cfg))))
    if cfg.clip_model:
        scorers.append(ClipScoreScorer(ClipScorer(cfg.clip_model, cfg.clip_weights, device)))
    return scorers


def reference_stats_path(data: DatasetInfo, cfg: EvalConfig) -> Path:
    """Inception statistics of the held-out real images: `eval.reference_stats`, or beside the val shards
    (where `maskbench eval reference VAL_DIR` writes them, for pixel and latent shards alike)."""
    return Path(cfg.reference_stats) if cfg.reference_stats else data.val_dir / "inception_stats.npz"


def dinov2_stats_path(data: DatasetInfo, cfg: EvalConfig) -> Path:
    """DINOv2 statistics live beside the Inception ones, built by the same `maskbench eval reference`."""
    return reference_stats_path(data, cfg).with_name("dinov2_stats.npz")


def synth_reference_stats(data: DatasetInfo, oracle: Oracle) -> FeatureStats:
    """Oracle statistics of the whole held-out split, computed once and kept beside its shards."""
    path = data.val_dir / "oracle_stats.npz"
    if not path.exists():
        images = to_uint8(load_eval_set(data, read_manifest(data.val_dir)["total"]).images)
        return reference_stats([images], oracle, path)
    return load_stats(path)


def check_eval_inputs(data: DatasetInfo, cfg: EvalConfig) -> None:
    """Refuse, before any training, what would make evaluation fail later (one line each).

    Real data (pixel or latent shards) must be able to compute its image metrics: a run is never
    silently reduced to the validation loss. So the VAE (latent data), the Inception weights and the
    reference statistics at the resolution the samples will have must all be there.
    """
    if cfg.final_n_samples is not None and cfg.final_n_samples < 2:
        raise ConfigError(f"eval.final_n_samples must be at least 2 (a Fréchet distance needs two samples), "
                          f"got {cfg.final_n_samples}")
    if cfg.bootstrap_resamples < 0 or cfg.bootstrap_resamples == 1:
        raise ConfigError(f"eval.bootstrap_resamples must be 0 (no bootstrap errors) or at least 2 (an SD needs "
                          f"two), got {cfg.bootstrap_resamples}")
    n_val = read_manifest(data.val_dir)["total"]
    counts = {"eval.n_samples": cfg.n_samples, "eval.final_n_samples": cfg.final_n_samples,
              "eval.val_samples": cfg.val_samples}
    if any(count is not None and count > n_val for count in counts.values()):
        named = " / ".join(f"{key}={count}" for key, count in counts.items() if count is not None)
        raise ConfigError(f"{named} exceed the {n_val} held-out prompts in {data.val_dir}")
    if data.latent:
        resolve_vae(data.vae, cfg.vae)
    if not data.synthetic:
        features = InceptionFeatures.features_name_of(cfg.inception_weights)
        _check_reference(reference_stats_path(data, cfg), features, data, "eval.reference_stats=PATH")
    if not data.synthetic and cfg.dinov2_weights:
        DinoV2Features.check_weights(cfg.dinov2_weights, cfg.dinov2_model)
        _check_reference(dinov2_stats_path(data, cfg), cfg.dinov2_model, data,
                         "eval.dinov2_weights to `maskbench eval reference`")
    if cfg.clip_model:
        check_clip(cfg.clip_model, cfg.clip_weights)


def _check_reference(path: Path, features: str, data: DatasetInfo, how: str) -> None:
    """Reference statistics exist, in the feature space the run will use, of images at the samples' size."""
    if not path.is_file():
        raise ConfigError(f"no reference statistics at {path}: build them with `maskbench eval reference "
                          f"{data.val_dir} eval.inception_weights=PT` (or pass {how})")
    stats = load_stats(path)
    if stats.features_name != features:
        raise ConfigError(f"reference statistics at {path} are {stats.features_name!r} features; this run "
                          f"computes {features!r}: rebuild them with the same weights")
    if stats.resolution and stats.resolution != data.pixel_size:
        raise ConfigError(f"reference statistics at {path} are of {stats.resolution}px images; the samples will "
                          f"be {data.pixel_size}px: rebuild them with --size {data.pixel_size}")
