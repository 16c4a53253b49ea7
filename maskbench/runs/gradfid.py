"""`maskbench probe gradfid RUN_DIR`: does token dropping preserve the training signal, per noise level?

A masked (or demoted) step is a cheaper estimate of the full-token gradient only if its expected
gradient points the same way. For each t bin this probe computes, on the same batches, noise and t,
the gradient of the full-token loss and of each cheap route (random 50% / 75% masks, SPRINT's
structured 75% mask, demotion to each ratio: the resized image on pixels, the shards' demoted latents
on latent data), and reports the debiased cosine between their expectations (`debiased_cosine`) with
a jackknife interval. The weights are the run's RAW trained weights (not the EMA): the question is
about the gradient of the model being trained.

Two controls, after anima_lora's tier-routing probe: a self-floor (a second native gradient on fresh
noise, the gap two estimates of one expectation show) and, on latents, the VAE round trip (decode and
re-encode at native size), whose gap is the encoder chain's and is subtracted from every demotion
route's. `certify` turns the bins where a route's gap is surely below EPS into a route table.

anima's own protocol is computed beside it (`anima_gaps`; sorryhyun/anima_lora
`project/sigma_lowres/bench/sigma_probe/stats.py`, `ArmStatter.stats`): per batch, the route's gap is the
cosine of the two native estimates minus the route's mean cosine to them, averaged over batches with its
standard error, and a route passes where that gap is within the re-encode control's band (`certify`
with protocol "anima"). It is not debiased: gradient noise lowers both cosines, so its gap depends on the
batch size, which is why it is compared with a control measured on the same batches.

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
import scipy.stats
import torch
import yaml
from tqdm import tqdm

from maskbench.config import RunConfig, load_run_config
from maskbench.config.presets import LEARNED_SKIP_SCALES, ModelConfig
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.data.demote import ratio_key
from maskbench.data.encode import vae_latents
from maskbench.data.loader import make_loader
from maskbench.errors import ConfigError
from maskbench.eval.decode import LatentDecoder, resolve_vae
from maskbench.models.build import batch_context, build_model, loader_decoder
from maskbench.models.dit import DiT
from maskbench.models.inputs import StepInputs
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import demote, flow_loss
from maskbench.results.estimators import debiased_cosine, jackknife_se
from maskbench.train.checkpoint import RunDir
from maskbench.train.switch import flat_grad

CSV_FIELDS = ("route", "mask_ratio", "ratio", "t_lo", "t_hi", "n_batches", "groups", "cosine", "ci_lo", "ci_hi",
              "naive_cosine", "gap", "gap_hi", "anima_gap", "anima_gap_hi")
PROTOCOLS = ("maskbench", "anima")  # which gap `certify` reads: debiased (gap_hi) or anima's (anima_gap_hi)
GRAM_CHUNK = 1 << 18  # parameters per fp64 Gram update: bounds the fp64 copy at groups·(1+R)·2 MiB


@dataclass(frozen=True)
class ProbeStep:
    """A cheaper way to compute a training gradient, compared against the full-token one.

    `control` marks the two routes that measure the probe rather than a saving: "floor", a second
    native gradient on fresh noise (the gap two estimates of the same expectation show), and, on
    latent data, "roundtrip", the native latent decoded and re-encoded by the VAE (the encoder
    chain's own gap, which a demoted latent carries too and which is subtracted from it).
    """
    name: str
    mask_ratio: float = 0.0
    structured: bool = False
    ratio: float = 1.0   # demoted side / native side: < 1 is a demotion route
    control: str = ""


MASK_STEPS = (ProbeStep("mask50", 0.5), ProbeStep("mask75", 0.75), ProbeStep("sprint75", 0.75, structured=True))
FLOOR, ROUNDTRIP = ProbeStep("native2", control="floor"), ProbeStep("roundtrip", control="roundtrip")


def probe_generator(seed: int, t_bin: int, batch: int) -> torch.Generator:
    """One generator for every draw of a probe batch (t, noise, masks). The probe compares estimators on
    the same draws and is not an arm, so it keeps the key of its first release: its committed CSVs
    (`results/gradfid_*.csv`) reproduce."""
    return torch.Generator().manual_seed((seed * 1_000_003 + t_bin) * 10_000_019 + batch)


def demote_step(ratio: float) -> ProbeStep:
    """`down2` for ×2 (the name earlier probe tables use), `demote0.75` for any other ratio."""
    factor = 1 / ratio
    return ProbeStep(f"down{factor:g}" if factor.is_integer() else f"demote{ratio:g}", ratio=ratio)


def steps_for(data: DatasetInfo, model: ModelConfig, ratios: tuple[float, ...] | None = None) -> tuple[ProbeStep, ...]:
    """Every mask route, a demotion route per ratio, the self-floor and (latents) the round-trip control.

    Default ratios: ×2 on pixels; on latent shards the ratios they were encoded with (`--demote`),
    since a demoted latent is the VAE's encoding of the resized image, not a resized latent. A model
    with a learned skip gate has none by default: its gate is defined on the native token grid only
    (training refuses demoted steps for it too), so asking for one is refused before any work.
    """
    native_only = model.skip_scale in LEARNED_SKIP_SCALES
    if ratios and native_only:
        raise ConfigError(f"model.skip_scale={model.skip_scale}'s gate is defined on the native token grid: "
                          "this run has no demotion routes to probe (drop --demote)")
    if ratios is None:
        ratios = () if native_only else (tuple(float(key) for key, _ in data.demoted) if data.latent else (0.5,))
    return (*MASK_STEPS, *map(demote_step, ratios), FLOOR, *((ROUNDTRIP,) if data.latent else ()))


def latest_checkpoint(run: RunDir) -> Path:
    """The run's latest checkpoint; a run without one is refused."""
    ckpt = run.latest_checkpoint()
    if ckpt is None:
        raise ConfigError(f"{run.root} has no checkpoint yet; train it first (`maskbench run ...`)")
    return ckpt


def load_trained_model(ckpt: Path, cfg: RunConfig, data: DatasetInfo, device: torch.device) -> DiT:
    """The run's model with the raw weights of checkpoint `ckpt`, in train mode (no dropout in the DiT)."""
    model = build_model(cfg.model, data)
    model.load_state_dict(RunDir.raw_weights(ckpt))
    return model.to(device).train()


def probe_batches(cfg: RunConfig, data: DatasetInfo, n: int, batch_size: int, seed: int) -> list[dict]:
    """n training batches read once, from a loader seeded like a training stream but with the probe's seed."""
    loader = make_loader(data.train_source, batch_size=batch_size, seed=seed, decode=loader_decoder(data, cfg.model),
                         max_bad_fraction=cfg.data.max_bad_fraction, shuffle_buffer=cfg.data.shuffle_buffer)
    return list(itertools.islice(loader, n))


def step_grads(model: DiT, batch: dict, routes: tuple[ProbeStep, ...], t_bin: tuple[float, float],
                generator: torch.Generator, mae_weight: float, device: torch.device) -> torch.Tensor:
    """(1 + routes)×P gradients on one batch: the full-token one first, then each route's, on the same x0/noise/t.

    A demotion route's x0 is the batch's demoted latent on latent data (`batch["demoted"]`), the resized
    image on pixels; the round-trip control reads `batch["roundtrip"]` (`with_roundtrip`).
    """
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
        if route.control == "floor":
            fresh = torch.randn(x0.shape, generator=generator).to(device)          # B×C×H×W
            grads.append(flat_grad(model, loss(x0, fresh)))
        elif route.control == "roundtrip":
            grads.append(flat_grad(model, loss(batch["roundtrip"].to(device), noise)))
        elif route.ratio < 1:
            given = batch["demoted"][ratio_key(route.ratio)] if "demoted" in batch else None  # B×C×s×s
            grads.append(flat_grad(model, loss(*demote(x0, noise, route.ratio, model.patch_size, generator, given))))
        else:
            keep_idx = random_keep_idx(b, model.seq_len, route.mask_ratio, generator=generator, device=device,
                                       grid=model.grid, structured=route.structured)  # B×K
            grads.append(flat_grad(model, loss(x0, noise, inputs=StepInputs(keep_idx=keep_idx))))
    return torch.stack(grads).cpu()                                                # (1+R)×P, on the host


def with_roundtrip(batches: list[dict], data: DatasetInfo, vae: str | None, device: torch.device) -> list[dict]:
    """Each batch with `roundtrip`: its latents decoded to images and encoded again at the native size."""
    decoder = LatentDecoder(resolve_vae(data.vae, vae), device)
    spec = decoder.spec
    out = []
    for batch in batches:
        with torch.no_grad():
            images = decoder(batch["image"]).clamp(-1, 1)                           # B×3×H×W, as a stored image
            again = vae_latents(decoder.vae, images.to(device), spec.scaling_factor, spec.shift_factor)  # B×C×h×w
        out.append({**batch, "roundtrip": again.half().float().cpu()})              # stored as fp16, as encoded
    return out


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
                  device: torch.device | None = None, max_memory_gb: float = 16.0,
                  ratios: tuple[float, ...] | None = None, vae: str | None = None) -> list[dict]:
    """Write RUN_DIR/probe/gradfid.csv and gradfid.png; return the rows (one per route × t bin).

    `ratios`: the demotion routes (default `steps_for`'s); `vae`: the VAE folder of latent data in
    place of the recorded one (the round-trip control runs it)."""
    if bins < 1 or batches < 3 or batch_size < 1:
        raise ConfigError(f"need bins >= 1, batches >= 3 (the jackknife drops one of >= 3) and batch size >= 1; "
                         f"got {bins}, {batches}, {batch_size}")
    run = RunDir(Path(run_dir))
    cfg = load_run_config(run.root)
    planned = resolve_dataset(cfg.data, cfg.paths.data, create=False)  # the checks first: nothing generated yet
    routes = steps_for(planned, cfg.model, ratios)
    for route in routes:
        if route.ratio < 1:
            planned.demoted_size(route.ratio, cfg.model.patch_size)  # refuses a ratio the latents lack
    ckpt = latest_checkpoint(run)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = resolve_dataset(cfg.data, cfg.paths.data)  # synth is regenerated identically if deleted
    model = load_trained_model(ckpt, cfg, data, device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    groups = group_count(batches, (1 + len(routes)) * params * 4, max_memory_gb)
    data_batches = probe_batches(cfg, data, batches, batch_size, seed)
    if ROUNDTRIP in routes:
        data_batches = with_roundtrip(data_batches, data, vae, device)
    rows = []
    with tqdm(total=bins * batches, desc=f"gradfid {run.root.name}", unit="batch", dynamic_ncols=True) as bar:
        for k, t_bin in enumerate(t_bins(bins)):
            sums = torch.zeros(groups, 1 + len(routes), params)                        # m×(1+R)×P
            naive, anima = [], []
            for i, batch in enumerate(data_batches):
                generator = probe_generator(seed, k, i)  # bin k, batch i
                stack = step_grads(model, batch, routes, t_bin, generator, cfg.train.mae_weight, device)
                g = gram(stack)                                                    # (1+R)×(1+R), once per batch
                naive.append(cosines_to_full(g))
                anima.append(anima_gaps(g, routes))
                sums[i % groups] += stack
                bar.update()
            rows += bin_rows(sums, np.mean(naive, axis=0), routes, t_bin, batches, bins, anima=np.array(anima))
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


def cosines_to_full(g: np.ndarray) -> np.ndarray:
    """R per-batch cosines between each route's gradient and the full one, from the (1+R)×(1+R) Gram matrix."""
    return g[0, 1:] / np.sqrt(g[0, 0] * np.diag(g)[1:])


def anima_gaps(g: np.ndarray, routes: tuple[ProbeStep, ...]) -> np.ndarray:
    """R per-batch gaps of anima's protocol from the (1+R)×(1+R) Gram matrix of a batch's gradient stack: cos(full, native2) − the mean of the route's
    cosines to the two (NaN for the self-floor itself, which is one of the two).

    The routes share the full gradient's noise (maskbench pairs its draws), where anima draws each arm its
    own; the average over both native estimates is anima's all the same."""
    cos = g / np.sqrt(np.outer(np.diag(g), np.diag(g)))                           # (1+R)×(1+R)
    f = 1 + routes.index(FLOOR)                                                    # the second native estimate
    gaps = cos[0, f] - (cos[0, 1:] + cos[f, 1:]) / 2                               # R
    gaps[f - 1] = np.nan
    return gaps


def bin_rows(sums: torch.Tensor, naive: np.ndarray, routes: tuple[ProbeStep, ...], t_bin: tuple[float, float],
             n_batches: int, n_bins: int, level: float = 0.95, anima: np.ndarray | None = None) -> list[dict]:
    """One row per route from a bin's m group sums (m×(1+R)×P), via one fp64 Gram matrix of all of them.

    `naive` is each route's mean per-batch cosine, taken before the batches were summed into groups.
    gap = 1 − debiased cosine; a demotion route's gap has the round-trip control's subtracted when there
    is one (both on the same batches, so the difference's jackknife runs on paired leave-one-outs).
    gap_hi is its one-sided upper bound at `level`, Bonferroni-corrected over the `n_bins` bins tested.
    `anima` (batches×R, `anima_gaps`) gives anima_gap, its mean over batches, and anima_gap_hi, the same
    one-sided bound from its standard error; NaN without it.
    """
    m, stack = sums.shape[:2]
    g = gram(sums.reshape(m * stack, -1)).reshape(m, stack, m, stack)              # group, route, group, route
    fits = [debiased_cosine(g[:, 0, :, 0], g[:, r, :, r], g[:, 0, :, r]) for r in range(1, stack)]
    control = next((fit for route, fit in zip(routes, fits) if route.control == "roundtrip"), None)
    z = scipy.stats.norm.ppf(1 - (1 - level) / n_bins)
    if anima is None:
        anima = np.full((2, len(routes)), np.nan)
    anima_mean, anima_se = anima.mean(axis=0), anima.std(axis=0, ddof=1) / np.sqrt(len(anima))  # R, R
    rows = []
    for route, est, naive_cosine, a_gap, a_se in zip(routes, fits, naive, anima_mean, anima_se):
        gap, loo = 1 - est.cosine, 1 - np.array(est.loo)                            # scalar, m
        if route.ratio < 1 and control is not None:
            gap, loo = gap - (1 - control.cosine), loo - (1 - np.array(control.loo))
        rows.append({"route": route.name, "mask_ratio": route.mask_ratio, "ratio": route.ratio, "t_lo": t_bin[0],
                     "t_hi": t_bin[1], "n_batches": n_batches, "groups": est.n, "cosine": est.cosine,
                     "ci_lo": est.ci_lo, "ci_hi": est.ci_hi, "naive_cosine": float(naive_cosine), "gap": float(gap),
                     "gap_hi": float(gap + z * jackknife_se(loo)),                 # NaN stays NaN: never certified
                     "anima_gap": float(a_gap), "anima_gap_hi": float(a_gap + z * a_se)})
    return rows


def certify(rows: list[dict], eps: float, protocol: str = "maskbench") -> list[dict]:
    """The route table the probe certifies: per demotion ratio, each run of contiguous bins that pass.

    "maskbench": a bin passes where gap_hi < eps. "anima": where anima_gap_hi < eps + the round-trip
    control's anima_gap_hi in that bin (the re-encode band; on pixels, with no control, eps alone).

    Deeper demotion (smaller ratio) gets the higher priority, so where windows overlap a sample takes
    the cheapest route certified for its t (anima's stacked router). Returns `train.demote_routes` entries.
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown probe protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    band = {(r["t_lo"], r["t_hi"]): r["anima_gap_hi"] for r in rows if r.get("route") == ROUNDTRIP.name}

    def passes(row: dict) -> bool:
        if protocol == "anima":
            return row["anima_gap_hi"] < eps + band.get((row["t_lo"], row["t_hi"]), 0.0)
        return row["gap_hi"] < eps

    table = []
    for ratio in sorted({row["ratio"] for row in rows if row["ratio"] < 1}):
        bins = sorted((row["t_lo"], row["t_hi"], passes(row)) for row in rows if row["ratio"] == ratio)
        for passed, run in itertools.groupby(bins, key=lambda b: b[2]):
            if passed:
                run = list(run)
                table.append({"ratio": ratio, "t": [run[0][0], run[-1][1]]})
    ranks = {ratio: rank for rank, ratio in enumerate(sorted({r["ratio"] for r in table}, reverse=True))}
    return [{**route, "priority": ranks[route["ratio"]]} for route in table]


def write_arm(path: Path, table: list[dict], eps: float, source: str, protocol: str = "maskbench") -> None:
    """An arm file `maskbench run arm=PATH` takes: mask 0 throughout, the certified routes, per-sample gate."""
    how = f"eps {eps:g}" + ("" if protocol == "maskbench" else f", {protocol}'s protocol")
    arm = {"arm": {"name": path.stem, "description": f"demotion routes certified by gradfid at {how} on {source}",
                   "phases": [{"mask_ratio": 0.0, "fraction": 1.0}]},
           "train": {"demote_routes": table, "demote_gate": "sample"}}
    flag = "" if protocol == "maskbench" else f" --protocol {protocol}"
    path.write_text(f"# written by `maskbench probe gradfid --certify {eps:g}{flag}` on {source}\n"
                    + yaml.safe_dump(arm, sort_keys=False))


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
    """ProbeStep × t bin, colour = debiased cosine, each cell annotated with its value ± half the interval.

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
