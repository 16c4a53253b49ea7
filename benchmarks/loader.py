"""Loader throughput on the synth shards: make_loader with 0/1/2 workers beside raw tar reading.

Also times a resume, whose start-up replays (reads and decodes) the skipped batches.
Prints a table and writes results/loader.csv.

    python benchmarks/loader.py [--data data/bench-synth] [--batches 100] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import tarfile
import time
from pathlib import Path

from maskbench.data.shards import make_loader, shard_urls
from maskbench.data.synth import write_synth

FIELDS = ("reader", "num_workers", "batch_size", "samples", "seconds", "samples_per_s")


def raw_tar_read(shard_dir: Path) -> tuple[int, float]:
    """Samples and seconds to read every member's bytes: the ceiling for any tar-based loader."""
    start, samples = time.perf_counter(), 0
    for url in shard_urls(shard_dir):
        with tarfile.open(url, "r|") as tar:
            for member in tar:
                tar.extractfile(member).read()
                samples += member.name.endswith(".txt")
    return samples, time.perf_counter() - start


def loader_read(shard_dir: Path, batches: int, batch_size: int, num_workers: int, start_step: int = 0) -> float:
    """Seconds to draw `batches` batches, start-up (worker spawn, shuffle fill, resume skip) included."""
    start = time.perf_counter()
    loader = make_loader(shard_dir, batch_size=batch_size, seed=0, num_workers=num_workers, start_step=start_step)
    for _ in itertools.islice(loader, batches):
        pass
    return time.perf_counter() - start


def row(reader: str, num_workers: int | str, batch_size: int | str, samples: int, seconds: float) -> dict:
    return dict(reader=reader, num_workers=num_workers, batch_size=batch_size, samples=samples,
                seconds=round(seconds, 3), samples_per_s=round(samples / seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench-synth"))
    parser.add_argument("--n-train", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("results/loader.csv"))
    args = parser.parse_args()

    shard_dir = write_synth(args.data, n_train=args.n_train, n_val=256, shard_size=2_000) / "train"
    samples, seconds = raw_tar_read(shard_dir)
    rows = [row("raw_tar", "-", "-", samples, seconds)]
    n = args.batches * args.batch_size
    for workers in args.workers:
        seconds = loader_read(shard_dir, args.batches, args.batch_size, workers)
        rows.append(row("make_loader", workers, args.batch_size, n, seconds))
    # Resume at step = batches: the first batch arrives only after replaying `batches` of them.
    resume = loader_read(shard_dir, 1, args.batch_size, 0, start_step=args.batches)
    rows.append(row(f"resume_to_step_{args.batches}", 0, args.batch_size, n + args.batch_size, resume))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print("  ".join(f"{k}={r[k]}" for k in FIELDS))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
