"""The device check's first step: what this machine is, and whether every module the later steps use imports.

    python benchmarks/device/env_check.py --out env.jsonl [--cpu]

Writes one JSON line per finding the moment it exists (benchmarks/stream.py), so a step cut by its time limit keeps
what it found: Python's version; then, before anything touches the GPU, each module the later steps import (`IMPORTS`:
the models, the train loop, evaluation with its CLIP and Inception stand-ins, data encode, repro) with its import
seconds and the version and folder of every third-party package that import loaded (open_clip's transformers and
timm among them; a package an import loads only when it is installed is recorded "not installed" when it is not);
then whether CUDA is usable, and on a GPU the device's name, multiprocessors, memory and capability, a bf16 matrix
product checked against fp32 and timed (TFLOP/s, against the H200's measured ~790), and a device-to-device copy
(GB/s, against its measured ~4300). benchmarks/gpu_check_report.py assembles the lines into the report's `env`.
Exit 1 when a module does not import, or (without --cpu) when CUDA is not usable.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for stream
from stream import announce, append_json_line, fresh  # noqa: E402

# What the later steps import, in the order they first need it (an import pays for the modules it loads first, so
# a package shows under the first import that loaded it): module, or module:name for a lazy attribute (diffusers
# loads its models on first use), and the steps that use it. maskbench imports diffusers and open_clip lazily,
# inside the functions that need them: importing maskbench.cli alone would leave them unproven.
IMPORTS = {
    "torch": "every step",
    "triton": "kernels, train (the Triton kernels, Inductor)",
    "maskbench.cli": "every maskbench command (hydra, omegaconf, clean-fid)",
    "maskbench.models.kernels": "kernels",
    "maskbench.eval.standins": "standins",
    "diffusers:AutoencoderKL": "standins, encode, train's sample decoding (the VAE)",
    "open_clip": "standins, train's CLIP score (open_clip loads transformers when it is installed)",
    "maskbench.data.synth": "synth",
    "maskbench.data.encode": "encode",
    "maskbench.eval.reference": "reference",
    "maskbench.models.dit": "train, arms, ddp, step_time (DiT on timm's layers)",
    "maskbench.train.loop": "train, arms, ddp, arm_step_time",
    "maskbench.runs.launch": "train, arms, run",
    "maskbench.eval.evaluate": "train's evaluation (FID, CLIP score, validation loss)",
    "maskbench.data.loader": "train, arms, loader (webdataset)",
    "maskbench.runs.repro": "repro",
}
OPTIONAL = {"triton"}  # the CPU dry run does without it (the Triton kernels then run as torch ops)
# Packages an import loads only when they are installed: recorded either way, "not installed" when absent.
IF_INSTALLED = {"triton": ("triton",), "open_clip": ("transformers",)}
NOT_INSTALLED = "not installed"


def first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): open_clip_torch and open-clip-torch are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def folder(module: ModuleType) -> str:
    """Where a module was imported from: its file's folder, or a namespace package's first folder."""
    if getattr(module, "__file__", None):
        return str(Path(module.__file__).parent)
    return next(iter(getattr(module, "__path__", [])), "")


def version_of(dist: str) -> str | None:
    """The installed version of a distribution, None when this Python finds none."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def loaded_packages(before: set[str], owners: dict[str, list[str]]) -> dict[str, dict]:
    """Each third-party distribution whose top-level module is in sys.modules now and was not in `before`: its
    version and folder (maskbench itself, this checkout, is not third-party)."""
    new = sorted({name for name in sys.modules if "." not in name} - before, key=lambda n: (n.startswith("_"), n))
    found: dict[str, dict] = {}
    for name in new:
        for dist in owners.get(name, []) if name != "maskbench" else []:
            found.setdefault(canonical(dist), {"version": version_of(dist) or "?", "from": folder(sys.modules[name])})
    return found


def absent(module: str, seen: set[str]) -> dict[str, dict]:
    """The packages `module` loads only when installed that no import so far has loaded (`seen`): not installed,
    or installed where this Python looks but not loaded by it."""
    versions = {dist: version_of(dist) for dist in IF_INSTALLED.get(module, ()) if dist not in seen}
    return {dist: {"version": version, "from": None, "loaded": False} if version else
            {"version": NOT_INSTALLED, "from": None} for dist, version in versions.items()}


def import_record(spec: str, used_by: str, owners: dict[str, list[str]], seen: set[str]) -> dict:
    """One import of IMPORTS: its seconds and the packages it loaded, or its problem."""
    module, _, attribute = spec.partition(":")
    record = {"part": "import", "module": spec, "for": used_by}
    before = {name for name in sys.modules if "." not in name}
    tick = time.perf_counter()
    try:
        loaded = importlib.import_module(module)
        if attribute:
            getattr(loaded, attribute)
    except Exception as err:  # any import failure is the finding
        if module not in OPTIONAL:
            record["problem"] = f"import {spec}: {first_line(err)}"
    record["seconds"] = round(time.perf_counter() - tick, 2)
    packages = loaded_packages(before, owners)
    return {**record, "packages": {**packages, **absent(module, seen | set(packages))}}


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
    announce(2 + len(IMPORTS) + len(GPU_PARTS), "findings: Python, each import, CUDA, each GPU measurement")
    problems = [write(out, {"part": "python", "python": platform.python_version(), "executable": sys.executable})]
    owners, seen = importlib.metadata.packages_distributions(), set()
    for spec, used_by in IMPORTS.items():
        record = import_record(spec, used_by, owners, seen)
        seen |= set(record["packages"])
        problems.append(write(out, record))
    problems += [write(out, record) for record in gpu_records(args.cpu)]
    problems = [p for p in problems if p]
    for problem in problems:
        print(f"env_check: Error: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
