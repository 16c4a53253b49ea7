"""Bandwidth of token drop and restore on a GPU: the fused Triton kernels against torch.gather.

DiT-XL/2 shapes (D=1152; 256 px -> L=256 tokens, 512 px -> L=1024), batch 256, mask 0.5 and 0.75,
bf16, forward and backward, for three implementations:
  triton        maskbench's fused kernels (impl="triton")
  torch-expand  maskbench's torch reference: gather/scatter with an expand-ed index (impl="torch")
  torch-repeat  what MaskDiT, MDT and MicroDiT do: the index .repeat-ed to a B×K×D int64 tensor
Bandwidth = the bytes the operation has to move at least / median time (CUDA events, L2 flushed,
`triton.testing.do_bench`), so all three are measured against the same bytes; % of peak is against
the device's HBM bandwidth (a table of known GPUs, else a large device-to-device copy).
Positions are fixed (DiT's sin-cos, no gradient); the mask token is learned. Writes results/kernels.csv.

    python benchmarks/kernels.py [--out results/kernels.csv]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from results_csv import write_rows  # benchmarks/ is on sys.path when a script runs

from maskbench.models.kernels import gather_tokens, scatter_tokens

D = 1152                      # DiT-XL/2 width
BATCH = 256
SEQ_LENS = (256, 1024)        # 256 px and 512 px images: 32² and 64² latents in 2×2 patches
MASK_RATIOS = (0.5, 0.75)
DTYPE = torch.bfloat16
INDEX_BYTES = 8               # int64 keep_idx

# Peak HBM bandwidth in GB/s, matched in order against torch.cuda.get_device_name().
PEAK_GBPS = [("H200", 4800.0), ("H100 80GB HBM3", 3350.0), ("H100 SXM", 3350.0),
             ("A100-SXM4-80GB", 2039.0), ("A100 80GB", 1935.0), ("A100", 1555.0)]

Drop = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Restore = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]


def drop_repeat(x: torch.Tensor, keep_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The peers' drop: the index is materialised over D on every call."""
    index = keep_idx.unsqueeze(-1).repeat(1, 1, x.shape[-1])                  # B×K×D int64
    return torch.gather(x, 1, index) + pos[keep_idx]                          # B×K×D


def restore_repeat(x_kept: torch.Tensor, keep_idx: torch.Tensor, seq_len: int, fill: torch.Tensor,
                   pos: torch.Tensor) -> torch.Tensor:
    """The peers' restore, with the same result as scatter_tokens."""
    B, K, D = x_kept.shape
    index = keep_idx.unsqueeze(-1).repeat(1, 1, D)                            # B×K×D int64
    return (fill + pos).expand(B, seq_len, D).scatter(1, index, x_kept)      # B×L×D


IMPLS: dict[str, tuple[Drop, Restore]] = {
    "triton": (partial(gather_tokens, impl="triton"), partial(scatter_tokens, impl="triton")),
    "torch-expand": (partial(gather_tokens, impl="torch"), partial(scatter_tokens, impl="torch")),
    "torch-repeat": (drop_repeat, restore_repeat),
}


def min_bytes(op: str, direction: str, B: int, L: int, K: int) -> int:
    """The traffic no implementation can avoid: rows read and written once, positions and index once."""
    s = DTYPE.itemsize
    kept, full, index = B * K * D * s, B * L * D * s, B * K * INDEX_BYTES
    return index + {("drop", "fwd"): 2 * kept + L * D * s,          # x rows, pos -> out rows
                    ("drop", "bwd"): kept + full,                    # grad rows -> grad_x (zeros included)
                    ("restore", "fwd"): kept + full + L * D * s + D * s,   # rows, pos, fill -> B×L×D
                    ("restore", "bwd"): full + kept + D * s}[(op, direction)]  # grad -> grad_x, grad_fill


def peak_gbps() -> tuple[float, str]:
    """The device's HBM bandwidth from the table, else measured with a 2 GiB device-to-device copy."""
    name = torch.cuda.get_device_name()
    for key, gbps in PEAK_GBPS:
        if key in name:
            return gbps, "spec"
    src = torch.empty(2 ** 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return round(2 * src.numel() / median_ms(lambda: dst.copy_(src)) / 1e6, 1), "measured-copy"


def median_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call (CUDA events around each call, L2 flushed in between)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


@dataclass
class Case:
    """One shape: random activations, fixed positions, a learned mask token, sorted random keep indices."""

    L: int
    mask_ratio: float

    def __post_init__(self) -> None:
        self.K = round(self.L * (1 - self.mask_ratio))
        bf16 = dict(device="cuda", dtype=DTYPE)
        self.keep_idx = torch.rand(BATCH, self.L, device="cuda").argsort(1)[:, :self.K].sort(1).values  # B×K
        self.x = torch.randn(BATCH, self.L, D, **bf16, requires_grad=True)                             # B×L×D
        self.x_kept = torch.randn(BATCH, self.K, D, **bf16, requires_grad=True)                        # B×K×D
        self.pos = torch.randn(self.L, D, **bf16)                                                      # L×D
        self.fill = torch.randn(D, **bf16, requires_grad=True)                                         # D

    def forward(self, op: str, impl: str) -> tuple[Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]:
        """The op's forward call on this case, and the inputs it differentiates."""
        drop, restore = IMPLS[impl]
        if op == "drop":
            return partial(drop, self.x, self.keep_idx, self.pos), (self.x,)
        return partial(restore, self.x_kept, self.keep_idx, self.L, self.fill, self.pos), (self.x_kept, self.fill)


def time_op(case: Case, op: str, impl: str) -> dict[str, float]:
    """Forward and backward milliseconds; the backward replays a retained graph."""
    forward, wrt = case.forward(op, impl)
    out = forward()
    backward = partial(torch.autograd.grad, out, wrt, torch.randn_like(out), retain_graph=True)
    return {"fwd": median_ms(forward), "bwd": median_ms(backward)}


def check_agrees(case: Case) -> None:
    """Refuse to time an implementation that gives another answer than the torch reference."""
    for op in ("drop", "restore"):
        expected = case.forward(op, "torch-expand")[0]()
        for impl in IMPLS:
            if not torch.equal(case.forward(op, impl)[0](), expected):
                raise SystemExit(f"{impl} {op} disagrees with the torch reference at L={case.L} K={case.K}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernels.csv"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py: skipped, no CUDA device (the Triton kernels are GPU kernels)")
        return
    peak, peak_source = peak_gbps()
    device = torch.cuda.get_device_name()
    rows = []
    for L in SEQ_LENS:
        for mask_ratio in MASK_RATIOS:
            case = Case(L, mask_ratio)
            check_agrees(case)
            for impl in IMPLS:
                for op in ("drop", "restore"):
                    for direction, ms in time_op(case, op, impl).items():
                        gbps = min_bytes(op, direction, BATCH, L, case.K) / ms / 1e6
                        rows.append({"device": device, "op": op, "pass": direction, "impl": impl,
                                     "batch": BATCH, "seq_len": L, "kept": case.K, "width": D,
                                     "mask_ratio": mask_ratio, "dtype": str(DTYPE).removeprefix("torch."),
                                     "ms": round(ms, 4), "gb_per_s": round(gbps, 1),
                                     "pct_peak": round(100 * gbps / peak, 1), "peak_gb_per_s": peak,
                                     "peak_source": peak_source})
                        print(f"{op:8s}{direction:4s} L={L:5d} mask={mask_ratio:.2f} {impl:13s}"
                              f"{ms:8.3f} ms {gbps:8.0f} GB/s {100 * gbps / peak:5.1f}% of {peak:.0f}")
    write_rows(args.out, rows)
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
