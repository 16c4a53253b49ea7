"""One maskbench command with the device check's instruments (benchmarks/device/instruments.py).

    python benchmarks/device/wrap.py [--dynamo-out JSON] [--backend inductor|aot_eager|eager] [--gloo] -- ARGS...

runs `maskbench ARGS...` (the same `maskbench.cli.main` as `python -m maskbench`) and writes Dynamo's counts of
that process and the peak GPU memory it allocated (None without CUDA) to JSON (per rank under torchrun: RANK is
put before the suffix). --gloo: under torchrun, every rank on the one GPU over gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from instruments import DynamoCounts, gloo_on_one_gpu, peak_memory_gib, use_backend  # this script's folder first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dynamo-out", type=Path)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--gloo", action="store_true")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.args[1:] if args.args[:1] == ["--"] else args.args
    counts = DynamoCounts()
    use_backend(args.backend)
    if args.gloo:
        gloo_on_one_gpu()
    from maskbench.cli import main as maskbench

    try:
        return maskbench(argv)
    finally:
        if args.dynamo_out is not None:
            out = args.dynamo_out
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                out = out.with_name(f"{out.stem}.rank{os.environ['RANK']}{out.suffix}")
            out.write_text(json.dumps({"backend": args.backend, "command": argv[:1], **counts.summary(),
                                       "peak_memory_gib": peak_memory_gib()}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
