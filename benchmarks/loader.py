"""Loader throughput per shard format: make_loader with 0/1/2 workers beside raw tar reading.

Three formats, each generated here so the benchmark needs no download:
  png     the 32 px synth shards (`maskbench data synth`), decoded with decode_image_caption;
  jpeg    256×256 RGB JPEG (quality 90) synth scenes on a random texture, so they compress like
          photos rather than flat shapes, decoded with decode_image_caption;
  latent  random fp16 arrays in the exact layout `maskbench data encode` writes (4×32×32 latent,
          77×1024 text embedding, text_tokens, manifest `latent` block), decoded with decode_latent_text.
Each loader run reports its start-up (first_batch_s: worker spawn and shuffle-buffer fill) apart
from its steady rate (samples_per_s over the batches after the first), and sets that rate beside the
default run's training consumption (batch 64 / --step-seconds): a loader slower than the trainer
stalls it. Also times a png resume at step --batches, whose start-up seeks to the saved position
(reading at most one shuffle block and the start of its shard, decoding one batch).
Prints a table and writes results/loader.csv; the shards go to a temp dir unless --data keeps them.
Then, from the latent rate of one worker, how many workers a GPU needs to keep DiT-B/2 and DiT-XL/2
fed at 256 px (4×32×32 latents) unmasked and at 75% masking: the samples/s a GPU consumes at an
assumed MFU (--mfu) of its bf16 peak (--gpu, the table in maskbench/train/mfu.py), over the analytic
training FLOPs of a sample; written to results/loader_workers.csv.

    python benchmarks/loader.py [--data DIR] [--batches 100] [--max-seconds 8] [--step-seconds 0.156]
    python benchmarks/loader.py --smoke      # toy sizes, seconds: checks that the script runs
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image
from results_csv import write_rows  # benchmarks/ is on sys.path when a script runs

from maskbench.config.presets import PRESETS
from maskbench.data.encode import LATENT_DTYPE
from maskbench.data.loader import make_loader
from maskbench.data.pack import commit_unit, merge_parts
from maskbench.data.shards import (
    TAR_MTIME,
    CanonicalShardWriter,
    decode_image_caption,
    decode_latent_text,
    encode_npy,
    shard_entry,
    shard_urls,
)
from maskbench.data.synth import caption, render, sample_scene, write_synth
from maskbench.manifest import read_manifest
from maskbench.train.flops import train_step_flops
from maskbench.train.mfu import table_peak

FIELDS = ("format", "reader", "num_workers", "batch_size", "first_batch_s", "samples", "seconds", "samples_per_s",
          "samples_per_s_per_worker", "vs_trainer")
GPU_MODELS, GPU_MASKS = ("dit_b2", "dit_xl2"), (0.0, 0.75)
TRAIN_BATCH = 64  # the default run's global batch, consumed once per --step-seconds
SHARD_SIZE = 500
SHUFFLE_BUFFER = 1_000  # samples per shuffle block: make_loader's default
JPEG_SIZE, JPEG_QUALITY = 256, 90
LATENT_SHAPE, TEXT_SHAPE = (4, 32, 32), (77, 1024)  # C×h×w of a 256 px image through an f8 VAE; T×D of ViT-H-14
BENCH_VERSION = "bench-loader-v1"


# ----------------------------------------------------------------------------- data


def _reusable(out_dir: Path, params: dict) -> bool:
    """True when out_dir holds shards made with these parameters (a kept --data DIR), False when absent."""
    if not out_dir.exists():
        return False
    try:
        filters = read_manifest(out_dir)["filters"]
    except ValueError:
        filters = None
    if filters != params:
        raise ValueError(f"{out_dir} holds other or incomplete shards; remove it or pick another --data")
    return True


def _textures(rng: np.random.Generator, n: int = 16) -> list[np.ndarray]:
    """Smooth colour fields plus grain (H×W×3 uint8): blended under a scene, JPEG sizes become photo-like."""
    textures = []
    for _ in range(n):
        coarse = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
        smooth = np.asarray(coarse.resize((JPEG_SIZE, JPEG_SIZE), Image.BICUBIC), dtype=np.float32)  # H×W×3
        textures.append(np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8))
    return textures


def write_jpeg_shards(out_dir: Path, n: int, seed: int = 0) -> Path:
    """n captioned 256 px JPEG samples as canonical shards, written by CanonicalShardWriter."""
    params = {"n": n, "seed": seed, "size": JPEG_SIZE, "quality": JPEG_QUALITY}
    if _reusable(out_dir, params):
        return out_dir
    rng = np.random.default_rng(seed)
    textures = _textures(rng)
    with CanonicalShardWriter(out_dir, source="bench-jpeg", packer_version=BENCH_VERSION, filters=params,
                              maxcount=SHARD_SIZE) as writer:
        for index in range(n):
            scene = sample_scene(rng)
            image = render(scene, rng, JPEG_SIZE) // 2 + textures[rng.integers(len(textures))] // 2  # H×W×3
            buffer = io.BytesIO()
            Image.fromarray(image).save(buffer, format="JPEG", quality=JPEG_QUALITY)
            writer.write(f"{index:09d}", buffer.getvalue(), "jpg", caption(scene), {"width": JPEG_SIZE, "height": JPEG_SIZE})
    return out_dir


def _latent_sample(key: str, rng: np.random.Generator) -> dict[str, bytes]:
    """One sample with the fields and dtypes of `maskbench data encode` output, random values."""
    scene = sample_scene(rng)
    text_tokens = int(rng.integers(8, TEXT_SHAPE[0] + 1))
    meta = {"source": "bench-latent", "id": key, "width": JPEG_SIZE, "height": JPEG_SIZE, "text_tokens": text_tokens}
    return {
        "__key__": key,
        "latent.npy": encode_npy(rng.standard_normal(LATENT_SHAPE, dtype=np.float32).astype(LATENT_DTYPE)),
        "txtemb.npy": encode_npy(rng.standard_normal(TEXT_SHAPE, dtype=np.float32).astype(LATENT_DTYPE)),
        "txt": caption(scene).encode("utf-8"),
        "json": json.dumps(meta).encode("utf-8"),
    }


def write_latent_shards(out_dir: Path, n: int, seed: int = 0) -> Path:
    """n random latent samples, committed per shard and merged into a manifest as encode.py does."""
    params = {"n": n, "seed": seed}
    if _reusable(out_dir, params):
        return out_dir
    latent = {"vae": "random", "scaling_factor": 1.0, "shift_factor": 0.0, "resolution": JPEG_SIZE,
              "channels": LATENT_SHAPE[0], "size": LATENT_SHAPE[1], "text_model": "ViT-H-14", "text_weights": None,
              "text_len": TEXT_SHAPE[0], "text_dim": TEXT_SHAPE[1], "dtype": np.dtype(LATENT_DTYPE).name}
    header = {"source": "bench-latent", "packer_version": BENCH_VERSION, "filters": params, "latent": latent}
    rng = np.random.default_rng(seed)
    for shard, start in enumerate(range(0, n, SHARD_SIZE)):
        stem = f"shard-{shard:06d}"
        tmp, name = out_dir / f".tmp-{stem}", f"{stem}.tar"
        tmp.mkdir(parents=True)
        with wds.TarWriter(str(tmp / name), encoder=False, mtime=TAR_MTIME) as sink:
            for index in range(start, min(start + SHARD_SIZE, n)):
                sink.write(_latent_sample(f"{index:09d}", rng))
        count = min(SHARD_SIZE, n - start)
        shards = [shard_entry(tmp / name, count)]
        commit_unit(out_dir, stem, tmp, {"shards": shards, "total": count, "skipped": {}})
    merge_parts(out_dir, header, {})
    return out_dir


# ----------------------------------------------------------------------------- timing


def raw_tar_read(shard_dir: Path) -> tuple[int, float]:
    """Samples and seconds to read every member's bytes: the ceiling for any tar-based loader."""
    start, samples = time.perf_counter(), 0
    for url in shard_urls(shard_dir):
        with tarfile.open(url, "r|") as tar:
            for member in tar:
                tar.extractfile(member).read()
                samples += member.name.endswith(".txt")
    return samples, time.perf_counter() - start


def loader_read(shard_dir: Path, decode: Callable[[dict], dict], batch_size: int, num_workers: int,
                max_batches: int, max_seconds: float, resume: dict | None = None,
                shuffle_buffer: int = SHUFFLE_BUFFER) -> tuple[float, int, float]:
    """Seconds to the first batch, then the batches drawn after it and their seconds.

    The first batch carries the start-up (worker spawn, each stream reading its first shuffle block,
    a resume's seek to `resume`); the batches after it give the steady rate a trainer sees, drawn
    until `max_batches` in all or `max_seconds`, so slow formats still finish in bounded time.
    """
    start = time.perf_counter()
    batches = iter(make_loader(shard_dir, batch_size=batch_size, seed=0, num_workers=num_workers,
                               start_step=resume["step"] if resume else 0, resume=resume, decode=decode,
                               shuffle_buffer=shuffle_buffer))
    next(batches)
    first = time.perf_counter()
    drawn = 0
    while drawn < max_batches - 1 and time.perf_counter() - first < max_seconds:
        next(batches)
        drawn += 1
    return first - start, drawn, time.perf_counter() - first


def row(fmt: str, reader: str, num_workers: int | str, batch_size: int | str, first_batch_s: float | str,
        samples: int, seconds: float, trainer_rate: float) -> dict:
    rate = samples / seconds
    return dict(format=fmt, reader=reader, num_workers=num_workers, batch_size=batch_size,
                first_batch_s=first_batch_s if isinstance(first_batch_s, str) else round(first_batch_s, 3),
                samples=samples, seconds=round(seconds, 3), samples_per_s=round(rate),
                samples_per_s_per_worker=round(rate / num_workers) if isinstance(num_workers, int) and num_workers else "-",
                vs_trainer=round(rate / trainer_rate, 2))


def measure(args: argparse.Namespace, data: Path, trainer_rate: float) -> list[dict]:
    """Every format's raw-tar and make_loader rows, then the png resume row."""
    formats = {
        "png": (write_synth(data / "png", n_train=args.n_png, n_val=256, shard_size=2_000) / "train", decode_image_caption),
        "jpeg": (write_jpeg_shards(data / "jpeg", args.n_jpeg), decode_image_caption),
        "latent": (write_latent_shards(data / "latent", args.n_latent), decode_latent_text),
    }
    rows = []
    for fmt, (shard_dir, decode) in formats.items():
        rows.append(row(fmt, "raw_tar", "-", "-", "-", *raw_tar_read(shard_dir), trainer_rate))
        for workers in args.workers:
            first, drawn, seconds = loader_read(shard_dir, decode, args.batch_size, workers, args.batches, args.max_seconds,
                                                shuffle_buffer=args.shuffle_buffer)
            rows.append(row(fmt, "make_loader", workers, args.batch_size, first, drawn * args.batch_size, seconds, trainer_rate))
    # Resume at step = batches from the state saved there: the first batch's time is the seek's.
    png_dir, decode = formats["png"]
    loader = make_loader(png_dir, batch_size=args.batch_size, seed=0, decode=decode, shuffle_buffer=args.shuffle_buffer)
    for _ in zip(range(args.batches), loader):
        pass
    first, _, _ = loader_read(png_dir, decode, args.batch_size, 0, 1, 0.0, resume=loader.state_dict(),
                              shuffle_buffer=args.shuffle_buffer)
    rows.append(row("png", f"resume_to_step_{args.batches}", 0, args.batch_size, first, args.batch_size, first,
                    trainer_rate))
    return rows


def workers_per_gpu(per_worker_rate: float, gpu: str, mfu: float) -> list[dict]:
    """Loader workers one GPU needs for each (model, mask ratio) at 256 px latents (TEXT_SHAPE context)."""
    peak = table_peak(gpu, "bf16")
    rows = []
    for name in GPU_MODELS:
        for ratio in GPU_MASKS:
            flops = train_step_flops(PRESETS[name](), LATENT_SHAPE[-1], LATENT_SHAPE[0], TEXT_SHAPE[1], TEXT_SHAPE[0],
                                     batch=1, mask_ratio=ratio, text_encoder=False)
            demand = peak * mfu / flops                                                # samples/s one GPU trains on
            rows.append(dict(model=name, mask_ratio=ratio, gpu=gpu, mfu=mfu, train_gflop_per_sample=round(flops / 1e9, 2),
                             gpu_samples_per_s=round(demand), loader_samples_per_s_per_worker=round(per_worker_rate),
                             workers_needed=math.ceil(demand / per_worker_rate)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=None, help="keep (and reuse) the shards here; default a temp dir")
    parser.add_argument("--n-png", type=int, default=10_000)
    parser.add_argument("--n-jpeg", type=int, default=3_000)
    parser.add_argument("--n-latent", type=int, default=2_000)
    parser.add_argument("--batches", type=int, default=100, help="batches per loader run, at most")
    parser.add_argument("--max-seconds", type=float, default=8.0, help="per loader run, after its first batch")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--shuffle-buffer", type=int, default=SHUFFLE_BUFFER, help="samples per shuffle block")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--gpu", default="H100", help="a name in maskbench/train/mfu.py's peak table")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation of the GPU")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: a few batches of each format")
    parser.add_argument("--step-seconds", type=float, default=0.156,
                        help="step time of the default run (batch 64); 0.156 is the masked tiny step on 2 CPU cores")
    parser.add_argument("--out", type=Path, default=Path("results/loader.csv"))
    args = parser.parse_args()
    if args.smoke:
        args.n_png, args.n_jpeg, args.n_latent, args.batches, args.max_seconds, args.batch_size = 64, 16, 64, 2, 0.5, 8
        args.shuffle_buffer = 16  # a block of 16 samples, not 1,000 read from a 16-sample shard 63 times over
        args.workers = [0, 1]
    if args.step_seconds <= 0 or args.max_seconds <= 0 or args.batches < 2:
        parser.error("--step-seconds and --max-seconds must be positive and --batches at least 2")

    trainer_rate = TRAIN_BATCH / args.step_seconds
    print(f"load average {os.getloadavg()[0]:.2f}; trainer consumes {TRAIN_BATCH} / {args.step_seconds} s "
          f"= {trainer_rate:.0f} samples/s (vs_trainer = loader rate / this)")
    if args.data is None:
        with tempfile.TemporaryDirectory(prefix="maskbench-loader-") as tmp:
            rows = measure(args, Path(tmp), trainer_rate)
    else:
        rows = measure(args, args.data, trainer_rate)

    write_rows(args.out, rows, FIELDS)
    for r in rows:
        print("  ".join(f"{k}={r[k]}" for k in FIELDS))
    in_workers = [r for r in rows if r["format"] == "latent" and r["reader"] == "make_loader" and r["num_workers"]]
    if in_workers:  # the fewest workers: the per-worker rate before they compete for this machine's cores
        needs = workers_per_gpu(min(in_workers, key=lambda r: r["num_workers"])["samples_per_s_per_worker"],
                                args.gpu, args.mfu)
        needs_out = args.out.with_name(args.out.stem + "_workers.csv")
        write_rows(needs_out, needs)
        for r in needs:
            print(f"{r['model']} mask {r['mask_ratio']:g} on {r['gpu']} at MFU {r['mfu']:g}: {r['gpu_samples_per_s']} "
                  f"samples/s -> {r['workers_needed']} workers of {r['loader_samples_per_s_per_worker']} latent samples/s")
        print(f"wrote {needs_out}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
