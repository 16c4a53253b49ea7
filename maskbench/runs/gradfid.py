"""`maskbench probe gradfid RUN_DIR`: does token dropping preserve the training signal, per noise level?

A masked (or downscaled) step is a cheaper estimate of the full-token gradient only if its expected
gradient points the same way. For each t bin this probe computes, on the same batches, noise and t,
the gradient of the full-token loss and of each cheap route (random 50% / 75% masks, SPRINT's
structured 75% mask, ×2 downscaling on pixel data), and reports the debiased cosine between their
expectations (`debiased_cosine`) with a jackknife interval. The weights are the run's RAW trained
weights (not the EMA): the question is about the gradient of the model being trained.

Every bin reuses the same n batches of training data, so the bins of a route differ only in t and
noise. A bin holds m group sums of (routes + 1) flattened fp32 gradients on the CPU until their Gram
matrices are formed: m · (routes + 1) · params · 4 bytes. m = n (each batch its own group) when that
fits under `max_memory_gb` (0.6 GB for the tiny model at n = 16); a larger model sums batch i into
group i mod m instead, with m as large as fits and at least 3. A group sum is one bigger batch, so the
estimator and its jackknife run unchanged on the m sums: memory no longer grows with n, at the price of
fewer distinct pairs (the point estimate drops the within-group pairs, the interval has m − 1 degrees
of freedom). The cosine does not depend on the groups' sizes: every pair product carries the same
size weights in the numerator and denominator.
"""

from __future__ import annotations

import csv
import functools
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from maskbench.config import ConfigError, RunConfig, load_run_config
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.data.shards import make_loader
from maskbench.models.build import batch_context, build_model, loader_decoder
from maskbench.models.dit import DiT
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import downscale, flow_loss
from maskbench.results.stats import debiased_cosine
from maskbench.train.checkpoint import RunDir
from maskbench.train.schedule import step_generators

CSV_FIELDS = ("route", "mask_ratio", "t_lo", "t_hi", "n_batches", "groups", "cosine", "ci_lo", "ci_hi",
              "naive_cosine")
GRAM_CHUNK = 1 << 18  # parameters per fp64 Gram update: bounds the fp64 copy at groups·(1+R)·2 MiB


@dataclass(frozen=True)
class Route:
    """A cheaper way to compute a training gradient, compared against the full-token one."""
    name: str
    mask_ratio: float = 0.0
    structured: bool = False
    downscale: int = 1


MASK_ROUTES = (Route("mask50", 0.5), Route("mask75", 0.75), Route("sprint75", 0.75, structured=True))
DOWNSCALE_ROUTE = Route("down2", downscale=2)


def routes_for(data: DatasetInfo) -> tuple[Route, ...]:
    """Every mask route; downscaling only on pixel data (latent shards hold no downscaled latents)."""
    return MASK_ROUTES if data.latent else (*MASK_ROUTES, DOWNSCALE_ROUTE)


def load_trained_model(run: RunDir, cfg: RunConfig, data: DatasetInfo, device: torch.device) -> tuple[DiT, Path]:
    """The run's model with the raw weights of its latest checkpoint, in train mode (no dropout in the DiT)."""
    ckpt = run.latest_checkpoint()
    if ckpt is None:
        raise ConfigError(f"{run.root} has no checkpoint yet; train it first (`maskbench run ...`)")
    model = build_model(cfg.model, data)
    model.load_state_dict(run.raw_weights(ckpt))
    return model.to(device).train(), ckpt


def probe_batches(cfg: RunConfig, data: DatasetInfo, n: int, batch_size: int, seed: int) -> list[dict]:
    """n training batches read once, from a loader seeded like a training stream but with the probe's seed."""
    loader = make_loader(data.train_source, batch_size=batch_size, seed=seed, decode=loader_decoder(data, cfg.model),
                         max_bad_fraction=cfg.data.max_bad_fraction, shuffle_buffer=cfg.data.shuffle_buffer)
    return list(itertools.islice(loader, n))


def flat_grad(model: DiT, loss: torch.Tensor) -> torch.Tensor:
    """Every trainable parameter's gradient as one fp32 CPU vector (zeros for parameters a route skips)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return torch.cat([g.reshape(-1) for g in grads]).float().cpu()               # P


def route_grads(model: DiT, batch: dict, routes: tuple[Route, ...], t_bin: tuple[float, float],
                generator: torch.Generator, mae_weight: float, device: torch.device) -> torch.Tensor:
    """(1 + routes)×P gradients on one batch: the full-token one first, then each route's, on the same x0/noise/t."""
    x0 = batch["image"].to(device)                                                 # B×C×H×W
    b = x0.shape[0]
    lo, hi = t_bin
    t = (lo + (hi - lo) * torch.rand(b, generator=generator)).to(device)          # B, uniform in the bin
    noise = torch.randn(x0.shape, generator=generator).to(device)                  # B×C×H×W
    context, context_mask = batch_context(model, batch, device)                    # B×T(×D), B×T
    loss = functools.partial(flow_loss, model, t=t, context=context, context_mask=context_mask,
                             mae_weight=mae_weight)
    grads = [flat_grad(model, loss(x0, noise))]
    for route in routes:
        if route.downscale > 1:
            grads.append(flat_grad(model, loss(*downscale(x0, noise, route.downscale))))
            continue
        keep_idx = random_keep_idx(b, model.seq_len, route.mask_ratio, generator=generator, device=device,
                                   grid=model.grid, structured=route.structured)  # B×K
        grads.append(flat_grad(model, loss(x0, noise, keep_idx=keep_idx)))
    return torch.stack(grads)                                                      # (1+R)×P


def t_bins(n_bins: int) -> list[tuple[float, float]]:
    """n uniform bins over (0, 1)."""
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    return [(float(lo), float(hi)) for lo, hi in itertools.pairwise(edges)]


def group_count(batches: int, stack_bytes: int, max_memory_gb: float) -> int:
    """How many group sums of (1+R)×P gradients (`stack_bytes` each) to hold: all batches if they fit, else >= 3."""
    groups = min(batches, int(max_memory_gb * 1e9 // stack_bytes))
    if groups < 3:
        raise ConfigError(f"the probe holds at least 3 gradient stacks of {stack_bytes / 1e9:.2f} GB for this "
                          f"model; raise --max-memory-gb to {3 * stack_bytes / 1e9:.1f} or more")
    return groups


def probe_gradfid(run_dir: str | Path, bins: int = 8, batches: int = 16, batch_size: int = 32, seed: int = 0,
                  device: torch.device | None = None, max_memory_gb: float = 16.0) -> list[dict]:
    """Write RUN_DIR/probe/gradfid.csv and gradfid.png; return the rows (one per route × t bin)."""
    if bins < 1 or batches < 3 or batch_size < 1:
        raise ConfigError(f"need bins >= 1, batches >= 3 (the jackknife drops one of >= 3) and batch size >= 1; "
                         f"got {bins}, {batches}, {batch_size}")
    run = RunDir(Path(run_dir))
    cfg = load_run_config(run.root)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = resolve_dataset(cfg.data, cfg.paths.data)  # synth is regenerated identically if deleted
    model, ckpt = load_trained_model(run, cfg, data, device)
    routes = routes_for(data)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    groups = group_count(batches, (1 + len(routes)) * params * 4, max_memory_gb)
    data_batches = probe_batches(cfg, data, batches, batch_size, seed)
    rows = []
    with tqdm(total=bins * batches, desc=f"gradfid {run.root.name}", unit="batch", dynamic_ncols=True) as bar:
        for k, t_bin in enumerate(t_bins(bins)):
            sums = torch.zeros(groups, 1 + len(routes), params)                        # m×(1+R)×P
            naive = []
            for i, batch in enumerate(data_batches):
                generator = step_generators(seed, k, i, torch.device("cpu"))[0]  # bin k, batch i
                stack = route_grads(model, batch, routes, t_bin, generator, cfg.train.mae_weight, device)
                naive.append(cosines_to_full(stack))
                sums[i % groups] += stack
                bar.update()
            rows += bin_rows(sums, np.mean(naive, axis=0), routes, t_bin, batches)
    out = run.root / "probe"
    out.mkdir(exist_ok=True)
    write_csv(out / "gradfid.csv", rows)
    plot_heatmap(out / "gradfid.png", rows, f"{run.root.name} ({ckpt.name}): debiased cos(full, route), "
                                            f"{batches}×{batch_size} samples per bin")
    return rows


def gram(vectors: torch.Tensor) -> np.ndarray:
    """V×V inner products of V fp32 vectors, accumulated in fp64 a chunk of coordinates at a time."""
    out = torch.zeros(vectors.shape[0], vectors.shape[0], dtype=torch.float64)
    for chunk in vectors.split(GRAM_CHUNK, dim=1):
        chunk = chunk.double()                                                     # V×c
        out += chunk @ chunk.T
    return out.numpy()


def cosines_to_full(stack: torch.Tensor) -> np.ndarray:
    """R per-batch cosines between each route's gradient and the full one, from a (1+R)×P stack."""
    g = gram(stack)                                                                # (1+R)×(1+R)
    return g[0, 1:] / np.sqrt(g[0, 0] * np.diag(g)[1:])


def bin_rows(sums: torch.Tensor, naive: np.ndarray, routes: tuple[Route, ...], t_bin: tuple[float, float],
             n_batches: int) -> list[dict]:
    """One row per route from a bin's m group sums (m×(1+R)×P), via one fp64 Gram matrix of all of them.

    `naive` is each route's mean per-batch cosine, taken before the batches were summed into groups."""
    m, stack = sums.shape[:2]
    g = gram(sums.reshape(m * stack, -1)).reshape(m, stack, m, stack)              # group, route, group, route
    rows = []
    for r, route in enumerate(routes, start=1):
        est = debiased_cosine(g[:, 0, :, 0], g[:, r, :, r], g[:, 0, :, r])
        rows.append({"route": route.name, "mask_ratio": route.mask_ratio, "t_lo": t_bin[0], "t_hi": t_bin[1],
                     "n_batches": n_batches, "groups": est.n, "cosine": est.cosine, "ci_lo": est.ci_lo,
                     "ci_hi": est.ci_hi, "naive_cosine": float(naive[r - 1])})
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def format_table(rows: list[dict]) -> str:
    """Debiased cosine per route (lines) and t bin (columns); '-' where the signal is below the noise."""
    bins = list(dict.fromkeys(f"{row['t_lo']:.2g}-{row['t_hi']:.2g}" for row in rows))
    lines = [f"{'route':10s}" + "".join(f"{b:>10s}" for b in bins)]
    for route in dict.fromkeys(row["route"] for row in rows):
        cells = ["-" if math.isnan(row["cosine"]) else f"{row['cosine']:.3f}" for row in rows if row["route"] == route]
        lines.append(f"{route:10s}" + "".join(f"{cell:>10s}" for cell in cells))
    return "\n".join(lines)


def plot_heatmap(path: Path, rows: list[dict], title: str) -> None:
    """Route × t bin, colour = debiased cosine, each cell annotated with its value ± half the interval.

    The colour scale is fixed to [0, 1] so maps of different runs compare at a glance, with its
    contrast where fidelity is decided (near 1); a negative cosine gets the lowest colour, its cell says it.
    """
    routes = list(dict.fromkeys(row["route"] for row in rows))
    bins = list(dict.fromkeys((row["t_lo"], row["t_hi"]) for row in rows))
    cell = {(row["route"], (row["t_lo"], row["t_hi"])): row for row in rows}
    values = np.array([[cell[r, b]["cosine"] for b in bins] for r in routes])     # routes×bins
    fig, ax = plt.subplots(figsize=(1.2 * len(bins) + 2.5, 0.7 * len(routes) + 1.6), layout="constrained")
    image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for (i, route), (j, t_bin) in itertools.product(enumerate(routes), enumerate(bins)):
        ax.text(j, i, cell_text(cell[route, t_bin]), ha="center", va="center", fontsize=8, color="white",
                bbox={"facecolor": "black", "alpha": 0.25, "linewidth": 0})
    ax.set_xticks(range(len(bins)), [f"{lo:.2g}–{hi:.2g}" for lo, hi in bins])
    ax.set_yticks(range(len(routes)), routes)
    ax.set_xlabel("t bin (0 = data, 1 = noise)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="debiased cosine")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cell_text(row: dict) -> str:
    """'0.83\\n±0.05'; 'n/a' when the signal is below the noise; the value alone when its interval is."""
    if math.isnan(row["cosine"]):
        return "n/a"
    half = (row["ci_hi"] - row["ci_lo"]) / 2
    return f"{row['cosine']:.2f}" if math.isnan(half) else f"{row['cosine']:.2f}\n±{half:.2f}"
