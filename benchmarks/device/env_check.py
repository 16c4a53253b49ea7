"""The device check's first step: what this machine is, and whether everything maskbench imports is there.

    python benchmarks/device/env_check.py --out env.json [--cpu]

Writes Python's and each package's version (the kit's wheels and the image's own), and on a GPU the device's
name, multiprocessors, memory and capability, a bf16 matrix product checked against fp32 and timed (TFLOP/s,
against the H200's measured ~790), and a device-to-device copy (GB/s, against its measured ~4300). Exit 1 when
a package does not import, or (without --cpu) when CUDA is not usable.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

# module -> distribution: the kit's (benchmarks/device/kit-requirements.txt), then the image's that maskbench uses
MODULES = {"diffusers": "diffusers", "webdataset": "webdataset", "cleanfid": "clean-fid", "open_clip": "open_clip_torch",
           "hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime", "ftfy": "ftfy",
           "torch": "torch", "torchvision": "torchvision", "triton": "triton", "accelerate": "accelerate",
           "timm": "timm", "huggingface_hub": "huggingface_hub", "numpy": "numpy", "scipy": "scipy", "PIL": "pillow",
           "matplotlib": "matplotlib", "safetensors": "safetensors", "yaml": "pyyaml", "tqdm": "tqdm",
           "filelock": "filelock", "maskbench.cli": None}
OPTIONAL = {"triton"}  # the CPU dry run does without it (the Triton kernels then run as torch ops)


def versions() -> tuple[dict, list[str]]:
    found, problems = {}, []
    for module, dist in MODULES.items():
        try:
            loaded = importlib.import_module(module)
        except Exception as err:  # any import failure is the finding
            found[module] = None
            if module not in OPTIONAL:
                problems.append(f"import {module}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            continue
        try:
            found[module] = importlib.metadata.version(dist) if dist else "(this checkout)"
        except importlib.metadata.PackageNotFoundError:
            found[module] = getattr(loaded, "__version__", "?")
        found[f"{module}_from"] = str(Path(getattr(loaded, "__file__", "") or "").parent)
    return found, problems


def gpu() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    out = {"name": props.name, "multiprocessors": props.multi_processor_count,
           "memory_gib": round(props.total_memory / 2**30, 1), "capability": f"{props.major}.{props.minor}",
           "device_count": torch.cuda.device_count(), "cuda": torch.version.cuda,
           "bf16_supported": torch.cuda.is_bf16_supported()}
    a, b = (torch.randn(1024, 1024, device="cuda") for _ in range(2))
    out["bf16_matmul_max_rel_err"] = float(((a.bfloat16() @ b.bfloat16()).float() - a @ b).abs().max()
                                           / (a @ b).abs().max())
    n = 8192
    x, y = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        x @ y
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        x @ y
    end.record()
    torch.cuda.synchronize()
    out["bf16_matmul_tflops"] = round(10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12, 1)
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    out["copy_gb_per_s"] = round(5 * 2 * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9, 1)  # read + write
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="the CPU dry run: no GPU expected")
    args = parser.parse_args()
    tick = time.perf_counter()
    found, problems = versions()
    report = {"python": platform.python_version(), "executable": sys.executable, "packages": found}
    import torch

    report["cuda_available"] = torch.cuda.is_available()
    if report["cuda_available"]:
        try:
            report["gpu"] = gpu()
        except Exception as err:
            problems.append(f"CUDA: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    elif not args.cpu:
        problems.append("CUDA is not available to torch")
    report["problems"] = problems
    report["seconds"] = round(time.perf_counter() - tick, 1)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    for problem in problems:
        print(f"env_check: Error: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
