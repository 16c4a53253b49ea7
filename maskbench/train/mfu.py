"""Model FLOPs utilisation: analytic training FLOPs ÷ (training seconds × devices × device peak).

The numerator is the same analytic count that sizes the budget (`maskbench.train.flops`), so MFU says
how much of the hardware the recipe used, not how many FLOPs the kernels happened to execute (fused
attention recomputes QKᵀ in backward; that work is not counted). The denominator is the vendor's
dense peak for known GPUs at the precision the matmuls run in, and a measured GEMM peak elsewhere
(CPUs, unlisted GPUs): there is no spec sheet for a shared 2-core VM, and a measured peak makes CPU
MFU mean "fraction of what this machine's BLAS reaches on large matmuls".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from filelock import FileLock

from maskbench.errors import ConfigError
from maskbench.files import write_atomic

# Dense (no sparsity) peak FLOP/s per device. Checked in order: the first name contained in
# torch.cuda.get_device_name wins, so variants come before their family.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 66.9e12},   # SXM
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}


def mfu(flops: float, seconds: float, n_devices: int, peak_flops: float) -> float:
    """Fraction of the devices' peak that `flops` of model work in `seconds` of training used."""
    if seconds <= 0 or n_devices < 1 or peak_flops <= 0:
        raise ValueError(f"MFU needs seconds > 0, n_devices >= 1 and peak > 0; got {seconds}, {n_devices}, "
                         f"{peak_flops}")
    return flops / (seconds * n_devices * peak_flops)


def table_peak(device_name: str, precision: str) -> float | None:
    """The spec-sheet peak of a known GPU at `precision` (bf16|fp16|tf32|fp32), or None if not listed."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}; got {precision!r}")
    for name, peaks in PEAK_FLOPS.items():
        if name in device_name:
            return peaks.get(precision)
    return None


def matmul_precision(mixed_precision: str, device: torch.device) -> str:
    """The precision the training matmuls run in: the autocast dtype, else tf32 if CUDA allows it."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def measure_gemm_peak(device: str = "cpu", precision: str = "fp32", n: int | None = None, reps: int = 10) -> float:
    """Median FLOP/s of n×n matmuls at `precision` on `device`, measured once per process.

    n defaults to 1024 on CPU (large enough to reach BLAS peak, small enough to take about a
    second on two cores) and 8192 on GPUs (tensor cores need big tiles to saturate).
    """
    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 1024)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        a = torch.randn(n, n, device=dev, dtype=DTYPES[precision])
        b = torch.randn(n, n, device=dev, dtype=DTYPES[precision])
        times = []
        for _ in range(reps + 1):  # the first call warms up (allocator, BLAS dispatch), not timed
            _sync(dev)
            start = time.perf_counter()
            torch.mm(a, b)
            _sync(dev)
            times.append(time.perf_counter() - start)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * n ** 3 / statistics.median(times[1:])


def peak_cache_path() -> Path:
    """Where measured peaks are kept, one file per machine ($MASKBENCH_CACHE, else ~/.cache/maskbench)."""
    return Path(os.environ.get("MASKBENCH_CACHE", Path.home() / ".cache" / "maskbench")) / "gemm_peak.json"


def device_model(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (/proc/cpuinfo's on Linux, else `platform`'s x86_64 or arm64):
    another CPU model has another peak, and may round differently (results/fair/PLAN.md, sitting 7)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _machine_key(device: torch.device, precision: str) -> str:
    """What a measured peak depends on: the device model, the precision, the thread count, torch."""
    return f"{device.type}:{device_model(device)}|{precision}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def cached_gemm_peak(device: torch.device, precision: str, remeasure: bool = False) -> float:
    """This machine's GEMM peak, measured once (a long, robust run) and then read from the cache.

    Measuring in every process made a shared 2-core VM's peak, and so its MFU, vary by 2× between runs
    (146 to 324 GFLOP/s for one machine): one careful measurement per machine keeps MFU comparable.
    A measurement taken while other work loads the machine is too low for good; the entry records the
    load average it was taken under, and `maskbench bench peak --remeasure` replaces it.
    """
    path, key = peak_cache_path(), _machine_key(device, precision)
    _read_cache(path)  # a file there that is not the cache is refused before the lock file is made
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        cache = _read_cache(path)
        if remeasure or key not in cache:
            load = os.getloadavg()[0]
            n = 8192 if device.type == "cuda" else 2048
            rounds = [measure_gemm_peak.__wrapped__(str(device), precision, n=n, reps=5) for _ in range(3)]
            cache[key] = {"flops": max(rounds), "n": n, "rounds": rounds, "load_avg_1min": load,
                          "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            write_atomic(path, json.dumps(cache, indent=2))
    return cache[key]["flops"]


def _read_cache(path: Path) -> dict:
    """The peaks measured so far; a file there that is not this cache is refused, not overwritten."""
    if not path.is_file():
        return {}
    try:
        cache = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not a GEMM peak cache (not JSON: {err}); move it away") from None
    if not isinstance(cache, dict):
        raise ConfigError(f"{path} is not a GEMM peak cache (not a JSON object); move it away")
    return cache


def device_peak(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from: 'table:<GPU>' or 'measured:<cache file>')."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name, precision)
        if peak is not None:
            return peak, f"table:{name}"
    return cached_gemm_peak(device, precision), f"measured:{peak_cache_path()}"


def bench_peak_main(argv: list[str] | None = None) -> int:
    """`maskbench bench peak`: print the MFU denominator of this machine, measured and (GPUs) tabled."""
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(prog="maskbench bench peak", description=bench_peak_main.__doc__)
    parser.add_argument("--device", default=default_device, help=f"torch device (default {default_device})")
    parser.add_argument("--precision", default="fp32" if default_device == "cpu" else "bf16", choices=list(DTYPES))
    parser.add_argument("--remeasure", action="store_true",
                        help="measure again and replace the cached figure (do it on a quiet machine)")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise ConfigError(f"--device {args.device}: {str(err).splitlines()[0]}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    measured = cached_gemm_peak(device, args.precision, remeasure=args.remeasure)
    print(f"{device} {args.precision}: measured GEMM peak {measured / 1e12:.3f} TFLOP/s "
          f"({torch.get_num_threads()} CPU threads; cached in {peak_cache_path()})")
    if device.type == "cuda":
        peak = table_peak(torch.cuda.get_device_name(device), args.precision)
        listed = f"{peak / 1e12:.1f} TFLOP/s" if peak else "not listed"
        print(f"{torch.cuda.get_device_name(device)} spec-sheet dense peak: {listed} (used for MFU when listed)")
    return 0
