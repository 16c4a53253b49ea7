"""Train-step time at mask 0 and 0.75, beside the analytic FLOPs ratio, and the MFU of each step.

The budget is counted in FLOPs, but the work the count leaves out (norms, activations, gathers, the
optimizer, the text encoder's share) does not shrink in proportion, so a masked step costs more time
than its FLOPs share. This measures by how much on this machine, and how close a step gets to the
device peak (`maskbench.train.mfu`: a GPU's spec sheet, else a measured GEMM peak). `cpu_mfu` is the
CPU reference point: 32×32×4 latents, patch 2, width 256, depth 8, mixer depth 2, batch 16. Each model's two
rows are appended to --out the moment it is timed (benchmarks/stream.py), with the peak memory its steps reached
on a GPU: a run cut short, or out of memory on a later model, keeps the models it finished.

    python benchmarks/step_time.py [--models tiny dit_s2 cpu_mfu dit_b2 dit_xl2] [--device cpu|cuda] [--steps 10]
                                   [--warmup 2] [--batch N] [--threads N]
    python benchmarks/step_time.py --smoke      # one step of tiny at batch 2: checks that the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from stream import announce, append_csv_row, fresh  # benchmarks/ is on sys.path when a script runs

from maskbench.config.presets import PRESETS, ModelConfig
from maskbench.models.dit import DiT
from maskbench.models.inputs import StepInputs
from maskbench.models.kernels import gather_tokens
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import interpolate, velocity_loss
from maskbench.models.text import VOCAB_SIZE, SynthTextEncoder
from maskbench.train.flops import train_step_flops
from maskbench.train.mfu import device_peak

# name -> (model, image size, channels, context dim, context length, synth text encoder, default batch)
SETTINGS = {
    "tiny": (PRESETS["tiny"](), 32, 3, 64, 32, True, 64),          # synth pixels, trainable text encoder
    "dit_s2": (PRESETS["dit_s2"](), 32, 4, 1024, 77, False, 8),    # 256px latents, precomputed CLIP-H tokens
    "cpu_mfu": (ModelConfig(name="cpu_mfu", patch_size=2, width=256, depth=8, heads=4, mixer_depth=2),
                32, 4, 1024, 77, False, 16),
    # GPU sizes (benchmarks/device/gpu_bench.sh): DiT-B/2 and DiT-XL/2 on 256 px latents (L=256 tokens). The step
    # here is eager, bf16 autocast. What it holds on the device, counted on the CPU under bf16 autocast with
    # torch.autograd.graph.saved_tensors_hooks (tensors saved for backward, batch 2 less batch 1, depth 2 less 1):
    #   dit_b2:  180.5M parameters x 16 B (fp32 weights, grads, AdamW's two moments) = 2.9 GB, bf16 weight copies
    #            0.4 GB; 13.0 MB a block a sample x 12 blocks + 2.1 MB = 0.16 GB a sample. Batch 256 (as in DiT):
    #            3.3 + 256 x 0.16 = 44 GB of 80.
    #   dit_xl2: 936.5M parameters (its cross-attention and text layers included) x 16 B = 15.0 GB, bf16 copies
    #            1.9 GB; 19.5 MB a block a sample x 28 blocks + 3.1 MB = 0.55 GB a sample (the issue's ~0.6), so
    #            batch 256 would need 17 + 140 = 157 GB. Batch 64: 17 + 64 x 0.55 = 52 GB of 80, room for the
    #            allocator's slack and an estimate 50% low. Mask 0.75 saves 0.15 GB a sample: less.
    # The peak each model reached is recorded (`peak_memory_gib`, torch.cuda.max_memory_allocated).
    "dit_b2": (PRESETS["dit_b2"](), 32, 4, 1024, 77, False, 256),
    "dit_xl2": (PRESETS["dit_xl2"](), 32, 4, 1024, 77, False, 64),
}
DEFAULT_MODELS = ("tiny", "dit_s2", "cpu_mfu")  # the CPU's; dit_b2 and dit_xl2 by name
MASK_RATIOS = (0.0, 0.75)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_seconds(name: str, batch: int, steps: int, warmup: int, device: torch.device) -> dict[float, list[float]]:
    """Seconds of each timed fwd + bwd + AdamW step per mask ratio, on random data (no data loading).

    The mask ratios alternate step by step on one model, so load drift on a shared machine hits
    both alike and their time ratio stays meaningful even when the absolute times do not.
    """
    cfg, image, channels, context_dim, context_len, synth_text, _ = SETTINGS[name]
    text = SynthTextEncoder(cfg.text_width, cfg.text_depth, context_len) if synth_text else None
    model = DiT(cfg, image, channels, context_dim, text).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    if synth_text:
        context = torch.randint(0, VOCAB_SIZE, (batch, context_len), device=device)
    else:
        context = torch.randn(batch, context_len, context_dim, device=device)
    context_mask = torch.ones(batch, context_len, dtype=torch.bool, device=device)
    generator = torch.Generator().manual_seed(0)
    times: dict[float, list[float]] = {ratio: [] for ratio in MASK_RATIOS}
    for step in range(warmup + steps):
        for mask_ratio in MASK_RATIOS:
            x0 = torch.randn(batch, channels, image, image, device=device)
            noise, t = torch.randn_like(x0), torch.rand(batch, device=device)
            keep = random_keep_idx(batch, model.seq_len, mask_ratio, generator, device)
            drop = torch.rand(batch, device=device) < 0.1
            _sync(device)
            start = time.perf_counter()
            x_t = interpolate(x0, noise, t)                                              # B×C×H×W
            target = model.patchify(noise - x0)                                          # B×L×(p·p·C)
            if keep is not None:
                target = gather_tokens(target, keep, impl=cfg.kernels)                   # B×K×(p·p·C)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = velocity_loss(model(x_t, t, context, context_mask, drop, StepInputs(keep)), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            _sync(device)
            if step >= warmup:
                times[mask_ratio].append(time.perf_counter() - start)
    return times


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory torch allocated on the GPU since the last reset; None on the CPU (not measured there)."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def measured(name: str, batch: int, steps: int, warmup: int, device: torch.device, peak: float) -> list[dict]:
    """One model's two rows, each with the peak memory its steps reached (both ratios: the unmasked one's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = step_seconds(name, batch, steps, warmup, device)
    return [{**row, "peak_memory_gib": peak_memory_gib(device)} for row in result_rows(name, batch, times, peak, device)]


def result_rows(name: str, batch: int, times: dict[float, list[float]], peak: float, device: torch.device
                ) -> list[dict]:
    """One CSV row per mask ratio: median seconds, analytic FLOPs, throughput, MFU, and the two ratios.

    The fastest step is recorded too: on a shared machine it is the closest estimate of the unloaded time.
    """
    cfg, image, channels, context_dim, context_len, synth_text, _ = SETTINGS[name]
    seconds = {ratio: statistics.median(times[ratio]) for ratio in MASK_RATIOS}
    fastest = {ratio: min(times[ratio]) for ratio in MASK_RATIOS}
    flops = {ratio: train_step_flops(cfg, image, channels, context_dim, context_len, batch, ratio, synth_text)
             for ratio in MASK_RATIOS}
    full, masked = MASK_RATIOS
    return [dict(model=name, device=str(device), batch=batch, mask_ratio=ratio,
                 median_step_s=round(seconds[ratio], 5), min_step_s=round(fastest[ratio], 5),
                 train_gflop=round(flops[ratio] / 1e9, 3), gflop_per_s=round(flops[ratio] / seconds[ratio] / 1e9, 2),
                 peak_gflop_per_s=round(peak / 1e9, 2), mfu=round(flops[ratio] / seconds[ratio] / peak, 4),
                 time_ratio=round(seconds[masked] / seconds[full], 4),
                 min_time_ratio=round(fastest[masked] / fastest[full], 4),
                 flops_ratio=round(flops[masked] / flops[full], 4))
            for ratio in MASK_RATIOS]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(SETTINGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mask ratio")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=None, help="batch for every model (default: per model)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    parser.add_argument("--smoke", action="store_true", help="tiny, batch 2, one step per mask ratio")
    parser.add_argument("--out", type=Path, default=Path("results/step_time.csv"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.batch, args.steps, args.warmup = ["tiny"], 2, 1, 0
    if args.threads:
        torch.set_num_threads(args.threads)

    out = fresh(args.out)
    announce(2 * len(args.models), "rows: mask 0 and 0.75 of each model, each model's two as it finishes")
    device = torch.device(args.device)
    precision = "bf16" if device.type == "cuda" else "fp32"  # the step autocasts to bf16 on GPUs only
    peak, source = device_peak(device, precision)
    print(f"device {device}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}, "
          f"{precision} peak {peak / 1e9:.1f} GFLOP/s ({source})")
    for name in args.models:
        batch = args.batch or SETTINGS[name][-1]
        full, masked = measured(name, batch, args.steps, args.warmup, device, peak)
        append_csv_row(out, full)
        append_csv_row(out, masked)
        print(f"{name:7s} batch {batch:3d}: mask 0 {full['median_step_s']:.4f} s (MFU {full['mfu']:.1%}), "
              f"mask 0.75 {masked['median_step_s']:.4f} s (MFU {masked['mfu']:.1%}); "
              f"time ratio {full['time_ratio']:.3f} (fastest steps {full['min_time_ratio']:.3f}) "
              f"vs FLOPs ratio {full['flops_ratio']:.3f}"
              + (f"; peak memory {full['peak_memory_gib']} GiB" if device.type == "cuda" else ""), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
