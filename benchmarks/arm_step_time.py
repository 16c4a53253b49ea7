"""Seconds per training step of every shipped arm, per phase, beside its analytic FLOPs.

The leaderboard's compute-to-target is exact on the FLOPs axis; on the hours axis it depends on what
a FLOP of each arm costs in time on a device: long skips add concatenations and norms, a decoder adds
a full-length block, a downscaled sample runs a short sequence, a masked step keeps the text encoder
and the optimizer at full cost. This measures seconds per TFLOP of each (arm, phase) relative to
mask0 on one model in one process, with the arms interleaved step by step so that load drift on a
shared machine hits all of them alike. Every step is the trainer's loss (`windowed_flow_loss`) with
its random t, caption dropout and masks, on random data, then backward and AdamW.

    python benchmarks/arm_step_time.py [--arms mask0 lsc ...] [--steps 10] [--warmup 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from results_csv import write_rows  # benchmarks/ is on sys.path when a script runs

from maskbench.config import RunConfig, known_arms, load_config
from maskbench.data.dataset import DatasetInfo, resolve_dataset
from maskbench.models.build import build_model
from maskbench.models.dit import DiT
from maskbench.models.masking import random_keep_idx
from maskbench.models.text import VOCAB_SIZE
from maskbench.train.schedule import batch_step_flops
from maskbench.models.objective import in_window, sample_t, windowed_flow_loss


class ArmStep:
    """One arm's model, optimizer and a fixed random batch, stepping at one of its phases' mask ratio."""

    def __init__(self, arm: str, device: torch.device) -> None:
        self.cfg: RunConfig = load_config([f"arm={arm}"])
        self.data: DatasetInfo = resolve_dataset(self.cfg.data, self.cfg.paths.data, create=False)
        torch.manual_seed(0)
        self.model: DiT = build_model(self.cfg.model, self.data).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
        b, d = self.cfg.train.batch_size, self.data
        self.x0 = torch.randn(b, d.channels, d.image_size, d.image_size, device=device)   # B×C×H×W
        self.context = torch.randint(0, VOCAB_SIZE, (b, self.cfg.model.text_len), device=device)  # B×T
        self.context_mask = torch.ones_like(self.context, dtype=torch.bool)             # B×T
        self.device = device

    def step(self, mask_ratio: float, generator: torch.Generator) -> tuple[float, int]:
        """(seconds, analytic FLOPs) of one fwd + bwd + AdamW step with fresh t, dropout, masks and noise."""
        cfg, model, b = self.cfg, self.model, self.cfg.train.batch_size
        t = sample_t(b, generator, torch.device("cpu")).to(self.device)                 # B
        drop = (torch.rand(b, generator=generator) < cfg.train.caption_dropout).to(self.device)  # B
        keep_idx = random_keep_idx(b, model.seq_len, mask_ratio, generator=generator, device=self.device,
                                   grid=model.grid, structured=cfg.model.structured_mask)
        noise = torch.randn_like(self.x0)                                               # B×C×H×W
        flops = batch_step_flops(cfg, self.data, mask_ratio, int(in_window(t, cfg.train.downscale_window).sum()))
        _sync(self.device)
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = windowed_flow_loss(model, self.x0, noise, t, self.context, self.context_mask, keep_idx, drop,
                                      cfg.train.downscale_window, cfg.train.downscale_factor, cfg.train.mae_weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        _sync(self.device)
        return time.perf_counter() - start, flops


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(arms: list[str], steps: int, warmup: int, device: torch.device) -> list[dict]:
    """Median seconds and mean FLOPs per step of every (arm, distinct phase mask ratio), interleaved."""
    runners = {arm: ArmStep(arm, device) for arm in arms}
    cases = [(arm, ratio) for arm in arms for ratio in dict.fromkeys(p.mask_ratio for p in runners[arm].cfg.arm.phases)]
    generator = torch.Generator().manual_seed(0)
    samples: dict[tuple[str, float], list[tuple[float, int]]] = {case: [] for case in cases}
    for step in range(warmup + steps):
        for arm, ratio in cases:
            result = runners[arm].step(ratio, generator)
            if step >= warmup:
                samples[arm, ratio].append(result)
    rows = []
    for (arm, ratio), timed in samples.items():
        seconds = statistics.median(s for s, _ in timed)
        flops = statistics.fmean(f for _, f in timed)
        rows.append(dict(arm=arm, mask_ratio=ratio, device=str(device), batch=runners[arm].cfg.train.batch_size,
                         params=sum(p.numel() for p in runners[arm].model.parameters()),
                         median_step_s=round(seconds, 5), train_gflop=round(flops / 1e9, 3),
                         s_per_tflop=round(seconds / flops * 1e12, 4)))
    baseline = next(row["s_per_tflop"] for row in rows if row["arm"] == "mask0" and row["mask_ratio"] == 0.0)
    for row in rows:
        row["time_per_flop_vs_mask0"] = round(row["s_per_tflop"] / baseline, 4)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=known_arms(), help="shipped arms (mask0, the baseline, is added)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per (arm, phase)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--out", type=Path, default=Path("results/arm_step_time.csv"))
    args = parser.parse_args(argv)
    arms = list(dict.fromkeys(["mask0", *args.arms]))
    device = torch.device(args.device)
    print(f"device {device}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    rows = measure(arms, args.steps, args.warmup, device)
    for row in rows:
        print(f"{row['arm']:18s} mask {row['mask_ratio']:<5g} {row['median_step_s']:.4f} s/step "
              f"{row['train_gflop']:8.2f} GFLOP  {row['time_per_flop_vs_mask0']:.3f}× mask0's time per FLOP")
    write_rows(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
