"""Bandwidth of token drop and restore on a GPU: the fused Triton kernels against torch.gather.

DiT-XL/2 shapes (D=1152; 256 px -> L=256 tokens, 512 px -> L=1024), batch 256, mask 0.5 and 0.75,
bf16, forward and backward, for three implementations:
  triton        maskbench's fused kernels (impl="triton")
  torch-expand  maskbench's torch reference: gather/scatter with an expand-ed index (impl="torch")
  torch-repeat  what MaskDiT, MDT and MicroDiT do: the index .repeat-ed to a B×K×D int64 tensor
Bandwidth = the bytes the operation has to move at least / median time (CUDA events, L2 flushed,
`triton.testing.do_bench`), so all three are measured against the same bytes; % of peak is against
the device's HBM bandwidth (a table of known GPUs, else a large device-to-device copy), and % of copy against a
2 GiB device-to-device copy measured in the same run (on an H200 about 4.3 TB/s of the 4.8 on its spec sheet).
Positions are fixed (DiT's sin-cos, no gradient); the mask token is learned. Before timing a shape, every
implementation must agree with the torch reference, forward and backward. Writes results/kernels.csv.

    python benchmarks/kernels.py [--out results/kernels.csv] [--quick]
    python benchmarks/kernels.py --smoke    # toy shapes, fp32, CPU ok (Triton interpreted): checks that it runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from stream import announce, append_csv_row, fresh  # benchmarks/ is on sys.path when a script runs

from maskbench.models.kernels import gather_tokens, scatter_tokens, triton_available


@dataclass(frozen=True)
class Shapes:
    """The sizes a run times: batch, sequence lengths, width and dtype."""

    batch: int
    seq_lens: tuple[int, ...]
    width: int
    dtype: torch.dtype


FULL = Shapes(256, (256, 1024), 1152, torch.bfloat16)  # DiT-XL/2 at 256 px and 512 px: 32² and 64² latents, 2×2 patches
QUICK = Shapes(256, (256,), 1152, torch.bfloat16)      # --quick (the device check): 256 px only
SMOKE = Shapes(3, (8,), 8, torch.float32)              # fp32: Triton's interpreter has no bf16
MASK_RATIOS = (0.5, 0.75)
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


def min_bytes(op: str, direction: str, case: Case) -> int:
    """The traffic no implementation can avoid: rows read and written once, positions and index once."""
    B, L, K, D, s = case.batch, case.L, case.K, case.width, case.dtype.itemsize
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
    return round(2 * src.numel() / median_ms(lambda: dst.copy_(src), src.device) / 1e6, 1), "measured-copy"


def copy_gbps() -> float:
    """A 2 GiB device-to-device copy's GB/s, read + write: what the device moves in practice (H200: ~4300 of a
    4800 spec), the ceiling a gather or scatter can come near."""
    src = torch.empty(2 ** 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return round(2 * src.numel() / median_ms(lambda: dst.copy_(src), src.device) / 1e6, 1)


def median_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call: on a GPU, CUDA events around each call with L2 flushed in between
    (`triton.testing.do_bench`); on the CPU (smoke runs) the wall clock of a few calls."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    seconds = []
    for _ in range(5):
        tick = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - tick)
    return statistics.median(seconds) * 1e3


@dataclass
class Case:
    """One shape: random activations, fixed positions, a learned mask token, sorted random keep indices, and
    the output gradients the backward passes are checked with."""

    L: int
    mask_ratio: float
    shapes: Shapes
    device: torch.device

    def __post_init__(self) -> None:
        self.K = round(self.L * (1 - self.mask_ratio))
        self.batch, self.width, self.dtype = self.shapes.batch, self.shapes.width, self.shapes.dtype
        B, L, K, D = self.batch, self.L, self.K, self.width
        like = dict(device=self.device, dtype=self.dtype)
        self.keep_idx = torch.rand(B, L, device=self.device).argsort(1)[:, :K].sort(1).values  # B×K
        self.x = torch.randn(B, L, D, **like, requires_grad=True)                             # B×L×D
        self.x_kept = torch.randn(B, K, D, **like, requires_grad=True)                        # B×K×D
        self.pos = torch.randn(L, D, **like)                                                  # L×D
        self.fill = torch.randn(D, **like, requires_grad=True)                                # D
        self.grad_out = {"drop": torch.randn(B, K, D, **like), "restore": torch.randn(B, L, D, **like)}

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
    backward = partial(torch.autograd.grad, out, wrt, case.grad_out[op], retain_graph=True)
    return {"fwd": median_ms(forward, case.device), "bwd": median_ms(backward, case.device)}


def run_op(case: Case, op: str, impl: str) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The op's output and the gradients of its differentiable inputs for the case's output gradient."""
    forward, wrt = case.forward(op, impl)
    out = forward()
    return out.detach(), torch.autograd.grad(out, wrt, case.grad_out[op])


def check_agrees(case: Case, impls: list[str]) -> None:
    """Refuse to time an implementation that gives another answer than the torch reference: the forward bit for
    bit, the gradients to the dtype's rounding (grad_fill sums the batch in another order)."""
    for op in ("drop", "restore"):
        expected_out, expected_grads = run_op(case, op, "torch-expand")
        for impl in impls:
            out, grads = run_op(case, op, impl)
            where = f"{impl} {op} disagrees with the torch reference at L={case.L} K={case.K}"
            if not torch.equal(out, expected_out):
                raise SystemExit(f"{where}, forward")
            for got, want in zip(grads, expected_grads):
                try:
                    torch.testing.assert_close(got, want)
                except AssertionError as err:
                    raise SystemExit(f"{where}, backward: {str(err).splitlines()[0]}") from None


def interpreter_problem(shapes: Shapes, device: torch.device) -> str | None:
    """On the CPU the Triton kernels run in Triton's interpreter, which some triton and numpy releases cannot
    run (triton 3.6 with numpy >= 2.4: "only 0-dimensional arrays can be converted to Python scalars"): None
    when one small drop and restore run there, else the error's first line."""
    try:
        run_op(Case(shapes.seq_lens[0], MASK_RATIOS[0], shapes, device), "drop", "triton")
        run_op(Case(shapes.seq_lens[0], MASK_RATIOS[0], shapes, device), "restore", "triton")
    except Exception as err:  # the interpreter's own error class differs between releases
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
    return None


@dataclass(frozen=True)
class Bandwidth:
    """What a row's GB/s is set against: the device, its peak (and where the figure comes from), a measured copy."""

    device: str
    peak: float | None
    peak_source: str
    copy: float | None

    @classmethod
    def measure(cls, cuda: bool) -> Bandwidth:
        if not cuda:
            return cls("cpu", None, "none: no HBM on a CPU", None)
        return cls(torch.cuda.get_device_name(), *peak_gbps(), copy_gbps())


def row(case: Case, op: str, direction: str, impl: str, ms: float, against: Bandwidth) -> dict:
    """One timed op of one case: its bandwidth and its share of the peak and of the copy."""
    gbps = min_bytes(op, direction, case) / ms / 1e6
    return {"device": against.device, "op": op, "pass": direction, "impl": impl, "batch": case.batch,
            "seq_len": case.L, "kept": case.K, "width": case.width, "mask_ratio": case.mask_ratio,
            "dtype": str(case.dtype).removeprefix("torch."), "ms": round(ms, 4), "gb_per_s": round(gbps, 1),
            "pct_peak": round(100 * gbps / against.peak, 1) if against.peak else None,
            "peak_gb_per_s": against.peak, "peak_source": against.peak_source, "copy_gb_per_s": against.copy,
            "pct_copy": round(100 * gbps / against.copy, 1) if against.copy else None}


def usable_impls(shapes: Shapes, device: torch.device) -> list[str]:
    """The implementations this machine can time: Triton's only where it compiles, or its interpreter works."""
    impls = [impl for impl in IMPLS if impl != "triton" or triton_available()]
    if "triton" in impls and device.type == "cpu" and (problem := interpreter_problem(shapes, device)):
        impls.remove("triton")  # on a GPU the kernels are compiled: there a failure fails the check below
        print(f"benchmarks/kernels.py: Triton's interpreter fails here ({problem})")
    if "triton" not in impls:
        print("benchmarks/kernels.py: triton is not usable here; timing the torch implementations only")
    return impls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/kernels.csv"))
    parser.add_argument("--smoke", action="store_true", help="toy shapes, fp32, CPU ok: checks that the script runs")
    parser.add_argument("--quick", action="store_true", help="256 px shapes only (L=256): the device check's")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("benchmarks/kernels.py: skipped, no CUDA device (the Triton kernels are GPU kernels)")
        return
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first used, which is later
    shapes = SMOKE if args.smoke else QUICK if args.quick else FULL
    device = torch.device("cuda" if cuda else "cpu")
    impls = usable_impls(shapes, device)
    out = fresh(args.out)
    announce(len(shapes.seq_lens) * len(MASK_RATIOS) * len(impls) * 4, "rows: shape, implementation, op and pass")
    against = Bandwidth.measure(cuda)
    rows = 0
    for L in shapes.seq_lens:
        for mask_ratio in MASK_RATIOS:
            case = Case(L, mask_ratio, shapes, device)
            check_agrees(case, impls)
            for impl in impls:
                for op in ("drop", "restore"):
                    for direction, ms in time_op(case, op, impl).items():
                        append_csv_row(out, timed := row(case, op, direction, impl, ms, against))
                        rows += 1
                        print(f"{op:8s}{direction:4s} L={L:5d} mask={mask_ratio:.2f} {impl:13s}{ms:8.3f} ms "
                              f"{timed['gb_per_s']:8.1f} GB/s"
                              + (f" {timed['pct_peak']:5.1f}% of {against.peak:.0f}" if against.peak else "")
                              + (f", {timed['pct_copy']:5.1f}% of a copy's {against.copy:.0f}" if against.copy
                                 else ""), flush=True)
    print(f"wrote {out} ({rows} rows)")


if __name__ == "__main__":
    main()
