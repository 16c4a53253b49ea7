"""`maskbench sample RUN --prompt TEXT`: images from a trained run's EMA weights, the first thing a user tries
after training.

The same sampler, noise convention and decoding the evaluation uses (Euler, CFG, `fixed_noise` per image
index, the latent shards' VAE), so what one sees here is what the run's eval points scored. On latent data
the prompt is embedded by the text tower the shards were encoded with (the latent manifest names it and its
weights file; `--text-weights` points elsewhere).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from maskbench.config import load_run_config
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.data.encode import TextTower
from maskbench.errors import ConfigError
from maskbench.eval.decode import LatentDecoder, resolve_vae
from maskbench.eval.grid import prompt_grid
from maskbench.eval.sample import euler_sample, fixed_noise, inference_precision, to_uint8
from maskbench.manifest import read_manifest
from maskbench.models.build import build_model
from maskbench.models.dit import DiT
from maskbench.runs.reevaluate import load_point
from maskbench.train.checkpoint import RunDir


def prompt_context(model: DiT, data: DatasetInfo, prompts: list[str], text_weights: str | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, mask) for the prompts: token ids for the synth text encoder, else the shards' text tower's
    per-token features (B×T×D), as `data encode` stored them for the training captions."""
    if model.text_encoder is not None:
        ids, mask = model.text_encoder.tokenize(prompts)
        return ids.to(device), mask.to(device)
    latent = read_manifest(data.val_dir).get("latent", {})
    weights = text_weights or latent.get("text_weights")
    if weights is not None and not Path(weights).is_file():
        raise ConfigError(f"text tower weights not found: {weights} (give --text-weights PATH, the open_clip "
                          f"checkpoint of {latent.get('text_model')} the shards were encoded with)")
    tower = TextTower(latent["text_model"], weights).to(device).eval()
    with torch.no_grad():
        context = tower(tower.tokenizer(prompts).to(device)).float()                # B×T×D
    return context, torch.ones(context.shape[:2], dtype=torch.bool, device=device)


def sample_run(run_dir: str | Path, prompts: list[str], n: int = 16, point: float | None = None,
               out: str | Path | None = None, seed: int = 0, steps: int | None = None,
               cfg_scale: float | None = None, text_weights: str | None = None) -> Path:
    """Draw n images (the prompts repeated in turn) from the run's EMA weights at `point` (default: its last
    saved point); write them as one grid PNG (default RUN/samples/sample-<point>.png) and return its path."""
    images, captions, point = draw(run_dir, prompts, n, point, seed, steps, cfg_scale, text_weights)
    path = Path(out) if out else Path(run_dir) / "samples" / f"sample-{point:g}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    prompt_grid(images, captions).save(path)
    return path


def draw(run_dir: str | Path, prompts: list[str], n: int = 16, point: float | None = None, seed: int = 0,
         steps: int | None = None, cfg_scale: float | None = None, text_weights: str | None = None,
         device: torch.device | None = None) -> tuple[np.ndarray, list[str], float]:
    """(n×H×W×3 uint8 images, their captions, the point sampled) from the run's EMA weights; image i starts from
    `fixed_noise` (seed, i), as the evaluation's sample i starts from (eval.noise_seed, i)."""
    run = RunDir(Path(run_dir))
    if not run.env.is_file() or not run.saved_points():
        raise ConfigError(f"{run.root} has no saved eval point to sample from: train it first")
    if n < 1 or not prompts:
        raise ConfigError("give at least one --prompt and --n >= 1")
    cfg = load_run_config(run.root)
    point = run.saved_points()[-1] if point is None else point
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = resolve_dataset(cfg.data, cfg.paths.data)  # synth is regenerated identically if deleted
    model = build_model(cfg.model, data).to(device).eval()
    load_point(run, point, model)
    captions = [prompts[i % len(prompts)] for i in range(n)]
    context, mask = prompt_context(model, data, captions, text_weights, device)
    noise = fixed_noise(range(n), (data.channels, data.image_size, data.image_size), seed).to(device)  # n×C×H×W
    with inference_precision(device):
        x = euler_sample(model, noise, context, mask, steps or cfg.eval.sampler_steps,
                         cfg.eval.cfg_scale if cfg_scale is None else cfg_scale)
    if data.latent:
        x = LatentDecoder(resolve_vae(data.vae, None), device)(x)
    return to_uint8(x).numpy(), captions, point
