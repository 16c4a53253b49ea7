"""Train-step time at mask 0 and 0.75, beside the analytic FLOPs ratio.

The budget is counted in FLOPs, but the work the count leaves out (norms, activations, gathers, the
optimizer, the text encoder's share) does not shrink in proportion, so a masked step costs more time
than its FLOPs share. This measures by how much on this machine, and how close a step gets to a
measured GEMM peak.

    python benchmarks/step_time.py [--models tiny dit_s2] [--steps 10] [--warmup 2] [--batch N] [--threads N]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from maskbench.models.dit import DiT, PRESETS
from maskbench.models.kernels import gather_tokens
from maskbench.models.masking import random_keep_idx
from maskbench.models.text import SynthTextEncoder
from maskbench.train.flops import train_step_flops

# name -> (image size, channels, context dim, context length, synth text encoder, default batch)
SETTINGS = {
    "tiny": (32, 3, 64, 32, True, 64),          # synth pixels with the trainable text encoder
    "dit_s2": (32, 4, 1024, 77, False, 8),      # 256px latents with precomputed CLIP-H text tokens
}
MASK_RATIOS = (0.0, 0.75)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gemm_peak_gflops(device: torch.device, n: int = 2048, reps: int = 10) -> float:
    """Median fp32 GFLOP/s of an n×n matmul: the denominator of MFU where no spec sheet applies."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    times = []
    for _ in range(reps + 1):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times[1:]) / 1e9


def step_seconds(name: str, batch: int, steps: int, warmup: int, device: torch.device) -> dict[float, list[float]]:
    """Seconds of each timed fwd + bwd + AdamW step per mask ratio, on random data (no data loading).

    The mask ratios alternate step by step on one model, so load drift on a shared machine hits
    both alike and their time ratio stays meaningful even when the absolute times do not.
    """
    image, channels, context_dim, context_len, synth_text, _ = SETTINGS[name]
    cfg = PRESETS[name]()
    text = SynthTextEncoder(cfg.text_width, cfg.text_depth, context_len) if synth_text else None
    model = DiT(cfg, image, channels, context_dim, text).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if synth_text:
        context = torch.randint(0, 49408, (batch, context_len), device=device)
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
            x_t = x0 + t[:, None, None, None] * (noise - x0)                            # B×C×H×W
            target = model.patchify(noise - x0)                                          # B×L×(p·p·C)
            if keep is not None:
                target = gather_tokens(target, keep, impl=cfg.kernels)                   # B×K×(p·p·C)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = F.mse_loss(model(x_t, t, context, context_mask, keep, drop).float(), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            _sync(device)
            if step >= warmup:
                times[mask_ratio].append(time.perf_counter() - start)
    return times


def result_rows(name: str, batch: int, times: dict[float, list[float]], peak: float, device: torch.device
                ) -> list[dict]:
    """One CSV row per mask ratio: median seconds, analytic FLOPs, throughput, and the two ratios."""
    image, channels, context_dim, context_len, synth_text, _ = SETTINGS[name]
    seconds = {ratio: statistics.median(times[ratio]) for ratio in MASK_RATIOS}
    flops = {ratio: train_step_flops(PRESETS[name](), image, channels, context_dim, context_len, batch, ratio,
                                     synth_text) for ratio in MASK_RATIOS}
    full, masked = MASK_RATIOS
    return [dict(model=name, device=str(device), batch=batch, mask_ratio=ratio,
                 median_step_s=round(seconds[ratio], 5), train_gflop=round(flops[ratio] / 1e9, 3),
                 gflop_per_s=round(flops[ratio] / seconds[ratio] / 1e9, 2), gemm_peak_gflop_per_s=round(peak, 2),
                 mfu=round(flops[ratio] / seconds[ratio] / 1e9 / peak, 4),
                 time_ratio=round(seconds[masked] / seconds[full], 4), flops_ratio=round(flops[masked] / flops[full], 4))
            for ratio in MASK_RATIOS]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mask ratio")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=None, help="batch for every model (default: per model)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("results/step_time.csv"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = gemm_peak_gflops(device)
    print(f"device {device}, {torch.get_num_threads()} threads, fp32 GEMM peak {peak:.1f} GFLOP/s")
    rows = []
    for name in args.models:
        batch = args.batch or SETTINGS[name][-1]
        full, masked = result_rows(name, batch, step_seconds(name, batch, args.steps, args.warmup, device), peak, device)
        rows += [full, masked]
        print(f"{name:7s} batch {batch:3d}: mask 0 {full['median_step_s']:.4f} s ({full['gflop_per_s']:.1f} GFLOP/s), "
              f"mask 0.75 {masked['median_step_s']:.4f} s ({masked['gflop_per_s']:.1f} GFLOP/s); "
              f"time ratio {full['time_ratio']:.3f} vs FLOPs ratio {full['flops_ratio']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
