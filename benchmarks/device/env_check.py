"""The device check's first step: what this machine is, and whether everything maskbench imports is there.

    python benchmarks/device/env_check.py --out env.jsonl [--cpu]

Writes one JSON line per finding the moment it exists (benchmarks/stream.py), so a step cut by its time limit keeps
what it found: Python's version, then each package's version, where it was imported from and its import seconds
(the kit's wheels and the image's own), all before anything touches the GPU; then whether CUDA is usable, and on a
GPU the device's name, multiprocessors, memory and capability, a bf16 matrix product checked against fp32 and timed
(TFLOP/s, against the H200's measured ~790), and a device-to-device copy (GB/s, against its measured ~4300).
benchmarks/gpu_check_report.py assembles the lines into the report's `env`. Exit 1 when a package does not import,
or (without --cpu) when CUDA is not usable.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for stream
from stream import announce, append_json_line, fresh  # noqa: E402

# module -> distribution: the kit's (benchmarks/device/kit-requirements.txt), then the image's that maskbench uses
MODULES = {"diffusers": "diffusers", "webdataset": "webdataset", "cleanfid": "clean-fid", "open_clip": "open_clip_torch",
           "hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime", "ftfy": "ftfy",
           "torch": "torch", "torchvision": "torchvision", "triton": "triton", "accelerate": "accelerate",
           "timm": "timm", "huggingface_hub": "huggingface_hub", "numpy": "numpy", "scipy": "scipy", "PIL": "pillow",
           "matplotlib": "matplotlib", "safetensors": "safetensors", "yaml": "pyyaml", "tqdm": "tqdm",
           "filelock": "filelock", "maskbench.cli": None}
OPTIONAL = {"triton"}  # the CPU dry run does without it (the Triton kernels then run as torch ops)


def first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def package(module: str, dist: str | None) -> dict:
    """One module imported: its distribution's version, where it came from and the seconds its import took (the
    first import of a module pays for the modules it imports), or the problem."""
    tick = time.perf_counter()
    try:
        loaded = importlib.import_module(module)
    except Exception as err:  # any import failure is the finding
        record = {"part": "package", "module": module, "version": None}
        return record if module in OPTIONAL else {**record, "problem": f"import {module}: {first_line(err)}"}
    seconds = round(time.perf_counter() - tick, 2)
    try:
        version = importlib.metadata.version(dist) if dist else "(this checkout)"
    except importlib.metadata.PackageNotFoundError:
        version = getattr(loaded, "__version__", "?")
    return {"part": "package", "module": module, "version": version, "seconds": seconds,
            "from": str(Path(getattr(loaded, "__file__", "") or "").parent)}


def device() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "capability": f"{props.major}.{props.minor}",
            "device_count": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "bf16_supported": torch.cuda.is_bf16_supported()}


def cuda_seconds(fn: Callable[[], object], repeat: int, warmup: int) -> float:
    """Seconds of `repeat` calls of fn after `warmup`, timed by CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def bf16_matmul() -> dict:
    """A bf16 product's error against fp32 (1024²), and an 8192³ product's TFLOP/s (mean of 10 after 3)."""
    import torch

    a, b = (torch.randn(1024, 1024, device="cuda") for _ in range(2))
    error = float(((a.bfloat16() @ b.bfloat16()).float() - a @ b).abs().max() / (a @ b).abs().max())
    n = 8192
    x, y = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seconds = cuda_seconds(lambda: x @ y, repeat=10, warmup=3)
    return {"bf16_matmul_max_rel_err": error, "bf16_matmul_tflops": round(10 * 2 * n**3 / seconds / 1e12, 1)}


def copy() -> dict:
    """A 2 GiB device-to-device copy's GB/s, read + write (mean of 5 after 1)."""
    import torch

    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_seconds(lambda: dst.copy_(src), repeat=5, warmup=1)
    return {"copy_gb_per_s": round(5 * 2 * src.numel() / seconds / 1e9, 1)}


GPU_PARTS: dict[str, Callable[[], dict]] = {"device": device, "bf16_matmul": bf16_matmul, "copy": copy}


def write(out: Path, record: dict) -> str | None:
    """Append the record and print it; its problem, if it has one."""
    append_json_line(out, record)
    print(json.dumps(record), flush=True)
    return record.get("problem")


def gpu_records(cpu: bool) -> list[dict]:
    """Whether CUDA is usable, then (if it is) each GPU part, each its own record; a failing part is a problem."""
    import torch

    available = torch.cuda.is_available()
    cuda = {"part": "cuda", "cuda_available": available}
    if not available:
        return [cuda if cpu else {**cuda, "problem": "CUDA is not available to torch"}]
    records = [cuda]
    for name, measure in GPU_PARTS.items():
        try:
            records.append({"part": name, **measure()})
        except Exception as err:
            records.append({"part": name, "problem": f"CUDA: {first_line(err)}"})
            break
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON lines file")
    parser.add_argument("--cpu", action="store_true", help="the CPU dry run: no GPU expected")
    args = parser.parse_args()
    out = fresh(args.out)
    announce(2 + len(MODULES) + len(GPU_PARTS), "findings: Python, each package, CUDA, each GPU measurement")
    problems = [write(out, {"part": "python", "python": platform.python_version(), "executable": sys.executable})]
    problems += [write(out, package(module, dist)) for module, dist in MODULES.items()]
    problems += [write(out, record) for record in gpu_records(args.cpu)]
    problems = [p for p in problems if p]
    for problem in problems:
        print(f"env_check: Error: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
