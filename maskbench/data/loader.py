"""The training loader: endless, reproducible, resumable batches from canonical (or latent) shards.

It resamples shards forever and shuffles their samples in blocks, from RNGs derived from
(seed, rank, stream) and the position in the stream, so a run is reproducible and a resume seeks to
a saved position instead of replaying the samples before it. It never trusts shard contents:
nothing is unpickled (webdataset's default decoders would), and bad samples are skipped and counted
by reason instead of crashing a long run, up to a bad fraction past which it stops with
`TooManyBadSamples`. Its workers leave a job-wide stop signal to the training process. The shard
format and its decoders are `maskbench.data.shards`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing
import multiprocessing.synchronize
import multiprocessing.util
import os
import signal
import tarfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from webdataset.tariterators import base_plus_ext, tar_file_iterator

from maskbench.data.shards import BadSample, Skip, decode_image_caption, group_samples, shard_urls
from maskbench.manifest import read_manifest

_SHARDS, _BLOCKS, _MIX = range(3)  # what a stream's generator is for: the word after (seed, rank, stream) in its seed
MIX_CHUNK = 1024  # mix draws per generator: resuming at draw m regenerates one chunk, not m draws
LOADER_STREAMS = 8  # streams each loader interleaves; its worker count divides this, so data order does not depend on it


def worker_counts() -> list[int]:
    """The worker counts a loader accepts: 0 (the training process reads) or a divisor of LOADER_STREAMS."""
    return [0] + [w for w in range(1, LOADER_STREAMS + 1) if LOADER_STREAMS % w == 0]


def auto_workers(cpus: int, loaders: int) -> int:
    """Workers per loader from the CPUs this process may use, shared by the `loaders` it opens (one per
    micro-batch stream), keeping one CPU for the training process: the largest accepted count that fits."""
    fits = (cpus - 1) // max(loaders, 1)
    return max(w for w in worker_counts() if w <= max(fits, 0))



class TooManyBadSamples(RuntimeError):
    """The bad fraction of a loader stream passed max_bad_fraction: the data, not the run, needs fixing."""


class BadSampleCounter:
    """Samples seen and skipped (by reason) in one loader stream; raises past the allowed bad fraction.

    `seen` and `bad` restore a resumed stream's counts (`ShardLoader.state_dict`).
    """

    def __init__(self, max_bad_fraction: float, min_samples: int, seen: int = 0,
                 bad: Mapping[str, int] | None = None) -> None:
        self.max_bad_fraction, self.min_samples = max_bad_fraction, min_samples
        self.seen = seen
        self.bad: Counter[str] = Counter(bad or {})

    def add(self, reason: str | None = None) -> None:
        """Count one sample read, bad under `reason` or good when None."""
        self.seen += 1
        if reason is not None:
            self.bad[reason] += 1
        n_bad = sum(self.bad.values())
        if self.seen >= self.min_samples and n_bad > self.max_bad_fraction * self.seen:
            raise TooManyBadSamples(
                f"{n_bad} of {self.seen} samples were bad ({dict(self.bad)}), above max_bad_fraction="
                f"{self.max_bad_fraction}; check the shards (maskbench data verify)"
            )


def _rng(*key: int) -> np.random.Generator:
    """A generator seeded by (seed, rank, stream, purpose, index...): randomness that is a function of
    position, so a resume recreates it without making the draws before."""
    return np.random.default_rng([int(k) for k in key])


def _webdataset_split(name: str) -> tuple[str | None, str]:
    """webdataset's key rule (`base_plus_ext`), field lower-cased; the key is None for a name without a field."""
    key, fieldname = base_plus_ext(name)
    return key, (fieldname or "").lower()


def _shard_items(url: str) -> Iterator[dict | Skip]:
    """One shard's raw samples (`group_samples`, as bytes) and skips, in archive order.

    Read with webdataset's tar_file_iterator, not `pack.iter_tar_samples`: every member must reach
    `decode` as bytes, pickle fields included (decode decides, nothing is unpickled), and that one
    refuses them. A truncated or unreadable tar ends the shard there with Skip("truncated_tar"),
    losing the sample being read.
    """
    try:
        with open(url, "rb") as stream:
            members = ((*_webdataset_split(m["fname"]), m["data"]) for m in tar_file_iterator(stream))
            for item in group_samples(members):
                yield item if isinstance(item, Skip) else {"__key__": item[0], "__url__": url, **item[1]}
    except (tarfile.TarError, EOFError, OSError):
        yield Skip("truncated_tar")


def _shard_sequence(urls: list[str], key: tuple[int, ...], draw: int,
                    item: int) -> Iterator[tuple[int, int, dict | Skip]]:
    """(draw, index in its shard, item) of a source's endless shard sequence, from item `item` of draw `draw` on.

    Draw d is a shard drawn with replacement (as webdataset's resampling, so streams never run dry
    unevenly) by a generator seeded by (key, d), so starting at a draw makes none of the draws before.
    The items of that first shard before `item` are read, not decoded: a duplicate key is one seen
    earlier in its archive.
    """
    for d in itertools.count(draw):
        url = urls[_rng(*key, d).integers(len(urls))]
        items = enumerate(_shard_items(url))
        for i, sample in itertools.islice(items, item if d == draw else 0, None):
            yield d, i, sample


class _SourceStream:
    """One source's raw samples in one stream, shuffled block by block so that the order is a function of position.

    The source's shard sequence is cut into blocks of `block_size` samples (a block may span shards),
    each emitted in the order of a permutation seeded by where it starts. `position` ({"draw", "item",
    "offset"}: the block that starts at item `item` of shard draw `draw`, and how many of its samples
    were taken) is restored by reading that block, and its first shard up to it, and emitting only the
    samples left: nothing before the position is decoded, and resuming costs the same at any step.
    A block's skips (duplicate keys, truncation) are counted as it is read, so not when it is re-read
    to resume inside it: the restored counts hold them.
    """

    def __init__(self, urls: list[str], key: tuple[int, ...], source: int, block_size: int,
                 counter: BadSampleCounter, position: Mapping[str, int] | None = None) -> None:
        self.urls, self.key, self.source, self.block_size, self.counter = urls, key, source, block_size, counter
        self.position = dict(position or {"draw": 0, "item": 0, "offset": 0})

    def __iter__(self) -> Iterator[dict]:
        items = _shard_sequence(self.urls, (*self.key, _SHARDS, self.source), self.position["draw"], self.position["item"])
        offset = self.position["offset"]
        while True:
            (draw, item), block = self._read_block(items, count_skips=offset == 0)
            order = _rng(*self.key, _BLOCKS, self.source, draw, item).permutation(len(block))  # block_size
            for taken in range(offset + 1, len(block) + 1):
                self.position = {"draw": draw, "item": item, "offset": taken}
                yield block[order[taken - 1]]
            offset = 0

    def _read_block(self, items: Iterator[tuple[int, int, dict | Skip]],
                    count_skips: bool) -> tuple[tuple[int, int], list[dict]]:
        """Where the next block starts (draw, item), and its `block_size` raw samples in archive order."""
        start, block = None, []
        while len(block) < self.block_size:
            draw, item, sample = next(items)  # endless
            start = start or (draw, item)
            if not isinstance(sample, Skip):
                block.append(sample)
            elif count_skips:
                self.counter.add(sample.reason)
        return start, block


def _decode_samples(
    samples: Iterator[dict], decode: Callable[[dict], dict | None], counter: BadSampleCounter
) -> Iterator[dict]:
    for sample in samples:
        try:
            decoded = decode(sample)
        except BadSample as bad:
            counter.add(bad.reason)
            continue
        if decoded is None:
            counter.add("rejected_by_decode")
            continue
        counter.add()
        yield decoded


@dataclass
class _ShardStream(IterableDataset):
    """One rank's batches, interleaved from `LOADER_STREAMS` deterministic streams whatever the worker count.

    Stream w of rank r draws shards, block orders and mix sources from generators seeded by (seed, r,
    w) and a position; batch i of an uninterrupted run comes from stream i % S. The DataLoader hands
    out batches round-robin from its W workers (W divides S), so worker j plays, in turn, the streams
    of batches j, j + W, j + 2W, ... The data a run sees is then the same with 0, 1, 2, 4 or 8 workers
    (a machine's CPU count sizes them), and a resume at step s starts worker j at batch s + j, each
    stream from its saved state in `resume` (its beginning if it has none).
    """

    sources: list[list[str]]  # the shard urls of each source (one source unless mixing)
    weights: list[float]      # sampling probability of each source
    batch_size: int
    seed: int
    rank: int
    start_step: int
    resume: dict[int, dict]   # stream -> its `data_stats` as of the last batch consumed before start_step
    decode: Callable[[dict], dict | None]
    max_bad_fraction: float
    min_samples: int
    shuffle_buffer: int

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self._interleave(itertools.count(self.start_step + worker, n_workers))

    def _interleave(self, batch_indices: Iterator[int]) -> Iterator[dict]:
        """The batches at `batch_indices`, batch i from stream i % LOADER_STREAMS (each built when first read)."""
        streams: dict[int, Iterator[dict]] = {}
        for i in batch_indices:
            stream = i % LOADER_STREAMS
            if stream not in streams:
                streams[stream] = _Stream(self, stream, self.resume.get(stream)).batches()
            yield next(streams[stream])


class _Stream:
    """One data stream of a `_ShardStream`: its sources read, decoded, mixed and batched, and its state.

    The state a batch carries (`data_stats`: the stream's cumulative seen/bad counts and its position)
    is the stream's just after that batch: samples are pulled one at a time, never ahead.
    """

    def __init__(self, spec: _ShardStream, stream: int, saved: Mapping | None) -> None:
        self.spec, self.stream = spec, stream
        self.counter = BadSampleCounter(spec.max_bad_fraction, spec.min_samples,
                                        **({"seen": saved["seen"], "bad": saved["bad"]} if saved else {}))
        position = saved["position"] if saved else {"drawn": 0, "sources": [None] * len(spec.sources)}
        self.drawn = position["drawn"]  # mix draws made
        key = (spec.seed, spec.rank, stream)
        self.sources = [_SourceStream(urls, key, source, spec.shuffle_buffer, self.counter, source_position)
                        for source, (urls, source_position) in enumerate(zip(spec.sources, position["sources"]))]

    def state(self) -> dict:
        return {"stream": self.stream, "seen": self.counter.seen, "bad": dict(self.counter.bad),
                "position": {"drawn": self.drawn, "sources": [source.position for source in self.sources]}}

    def batches(self) -> Iterator[dict]:
        """Collated batches, each with `data_stats`: worker processes can only report through the batches."""
        decoded = [_decode_samples(iter(source), self.spec.decode, self.counter) for source in self.sources]
        samples = decoded[0] if len(decoded) == 1 else self._mix(decoded)
        while True:
            batch = default_collate(list(itertools.islice(samples, self.spec.batch_size)))
            batch["data_stats"] = self.state()
            yield batch

    def _mix(self, sources: list[Iterator[dict]]) -> Iterator[dict]:
        """Interleave endless sample streams, drawing the source of each sample with the given weights.

        Draw m comes from chunk m // MIX_CHUNK of generators seeded by the stream and the chunk, so a
        resume at draw m regenerates one chunk. (webdataset's RandomMix draws from Python's global
        `random`, so it is not reproducible.)
        """
        while True:
            chunk, first = divmod(self.drawn, MIX_CHUNK)
            rng = _rng(self.spec.seed, self.spec.rank, self.stream, _MIX, chunk)
            for source in rng.choice(len(sources), size=MIX_CHUNK, p=self.spec.weights)[first:]:
                self.drawn += 1
                yield next(sources[source])


class ShardLoader:
    """The batches of `make_loader`, the bad-sample counts they carried, and the position to resume from.

    `state_dict()` is where each stream stands after the last batch this loader yielded (not what
    workers prefetched), as JSON-serialisable ints and strings, no sample data:
        {"shape": {seed, rank, world_size, batch_size, streams, shuffle_buffer, data},
         "step": batches yielded since the run began (start_step + this loader's),
         "streams": [{"stream": w, "seen": n, "bad": {reason: n},
                      "position": {"drawn": mix draws, "sources": [{"draw", "item", "offset"}, ...]}}, ...]}
    Pass it back as `make_loader(..., start_step=state["step"], resume=state)`.
    """

    def __init__(self, loader: DataLoader, shape: dict, start_step: int, resumed: dict[int, dict]) -> None:
        self.loader, self.shape, self.start_step, self.resumed = loader, shape, start_step, resumed
        self.step = start_step
        self.stats: dict[int, dict] = dict(resumed)  # stream -> its latest `data_stats`

    def __iter__(self) -> Iterator[dict]:
        self.step, self.stats = self.start_step, dict(self.resumed)  # each iteration restarts at start_step
        with _workers_born_deaf() if self.loader.num_workers else contextlib.nullcontext():
            batches = iter(self.loader)  # forks the workers
        for batch in batches:
            self.stats[batch["data_stats"]["stream"]] = batch["data_stats"]
            self.step += 1
            yield batch

    def state_dict(self) -> dict:
        return {"shape": self.shape, "step": self.step, "streams": [self.stats[w] for w in sorted(self.stats)]}

    def seen(self) -> int:
        return sum(s["seen"] for s in self.stats.values())

    def bad_counts(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for s in self.stats.values():
            total.update(s["bad"])
        return dict(total)


def _data_digest(manifests: list[dict], weights: list[float]) -> str:
    """What a resume state's positions index into: each source's shards (names and contents) and weight."""
    shards = [[(shard["name"], shard["sha256"]) for shard in manifest["shards"]] for manifest in manifests]
    return hashlib.sha256(json.dumps([shards, weights]).encode()).hexdigest()[:16]


def _resumed_streams(resume: Mapping, shape: dict, start_step: int) -> dict[int, dict]:
    """The saved stream states of `resume`, refused unless a loader of this shape saved them at `start_step`."""
    saved = resume.get("shape", {})
    differs = [f"{name} {saved.get(name)!r} != {value!r}" for name, value in shape.items() if saved.get(name) != value]
    if resume.get("step") != start_step:
        differs.append(f"saved at step {resume.get('step')!r}, not start_step={start_step}")
    if differs:
        raise ValueError(f"resume state does not fit this loader ({'; '.join(differs)}): resume with the same "
                         "shards, seed, rank, world_size, batch_size and shuffle_buffer, at its step")
    return {stats["stream"]: stats for stats in resume["streams"]}


def make_loader(
    shard_dir: str | os.PathLike | Sequence[tuple[str | os.PathLike, float]],
    *,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    start_step: int = 0,
    resume: Mapping | None = None,
    decode: Callable[[dict], dict | None] = decode_image_caption,
    max_bad_fraction: float = 0.05,
    min_samples: int = 1_000,
    shuffle_buffer: int = 1_000,
    pin_memory: bool = False,
) -> ShardLoader:
    """An endless, reproducible stream of collated batches from a canonical (or latent) shard dir.

    Rank r of `world_size` data streams resamples its own shards, `stream_shards`, with replacement
    from its own seeded stream (so streams never run dry unevenly), and shuffles their samples in
    blocks of `shuffle_buffer` (the samples held in memory, as raw bytes, per source and worker).
    `decode` turns a raw sample (bytes per field, plus `__key__`/`__url__`) into a dict of tensors
    and strings, raising `BadSample(reason)` or returning None to skip it. Each batch carries
    `data_stats` (its stream's cumulative seen/bad counts and position); `ShardLoader.bad_counts()`
    sums the counts. Beyond `min_samples` read by a stream, a bad fraction above `max_bad_fraction`
    raises `TooManyBadSamples`.

    Resuming at `start_step` needs `resume`, the `ShardLoader.state_dict()` saved after `start_step`
    batches by a loader of the same shards, seed, rank, world_size, batch_size, num_workers and
    shuffle_buffer (anything else is refused; the worker count may differ): each stream seeks to its saved position and counts,
    reading at most one block and the start of its first shard and decoding nothing before it, so
    resuming costs the same at any step, and the batches are exactly batches start_step, ... of an
    uninterrupted run. Each new iteration of the loader restarts from `start_step`: iterate it once
    per run. `pin_memory` returns page-locked tensors, so copies to a GPU can be non-blocking.
    `shard_dir` may instead be a list of (shard dir, weight): each sample then comes from one of those
    sources, drawn with probability proportional to its weight (`data=mix`).
    """
    if batch_size < 1 or start_step < 0 or shuffle_buffer < 1:
        raise ValueError("batch_size and shuffle_buffer must be positive, start_step non-negative")
    if num_workers < 0 or (num_workers and LOADER_STREAMS % num_workers):
        raise ValueError(f"num_workers must be 0 or divide the {LOADER_STREAMS} loader streams "
                         f"({', '.join(map(str, worker_counts()))}); got {num_workers}")
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size; got rank={rank}, world_size={world_size}")
    if not 0.0 <= max_bad_fraction < 1.0:
        raise ValueError(f"max_bad_fraction must be in [0, 1); got {max_bad_fraction}")
    if start_step and resume is None:
        raise ValueError(f"start_step={start_step} needs resume=<ShardLoader.state_dict() saved at that step>")
    mix = [(shard_dir, 1.0)] if isinstance(shard_dir, (str, os.PathLike)) else list(shard_dir)
    manifests = [read_manifest(directory) for directory, _ in mix]
    for (directory, weight), manifest in zip(mix, manifests):
        if manifest["total"] == 0:
            raise ValueError(f"{directory} holds no samples")
        if not weight > 0:
            raise ValueError(f"mix weight of {directory} must be positive, got {weight}")
    total = sum(weight for _, weight in mix)
    weights = [weight / total for _, weight in mix]
    shape = {"seed": seed, "rank": rank, "world_size": world_size, "batch_size": batch_size,
             "streams": LOADER_STREAMS, "shuffle_buffer": shuffle_buffer, "data": _data_digest(manifests, weights)}
    resumed = _resumed_streams(resume, shape, start_step) if resume is not None else {}
    dataset = _ShardStream(
        [stream_shards(shard_urls(directory), rank, world_size) for directory, _ in mix],
        weights, batch_size=batch_size, seed=seed, rank=rank, start_step=start_step, resume=resumed,
        decode=decode, max_bad_fraction=max_bad_fraction, min_samples=min_samples, shuffle_buffer=shuffle_buffer,
    )
    worker_init = partial(_defer_stop_signals, _exiting_event(os.getpid())) if num_workers else None
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                        worker_init_fn=worker_init)
    return ShardLoader(loader, shape, start_step, resumed)


@cache
def _exiting_event(pid: int) -> multiprocessing.synchronize.Event:
    """An event process `pid` (a trainer) sets as it exits, shared with its loader workers.

    When a process exits, multiprocessing SIGTERMs its daemonic children (DataLoader workers) and
    joins them; a worker that ignored that SIGTERM would make the exit wait forever. multiprocessing
    runs its finalizers of non-negative exit priority just before it signals the children, so this
    one tells the workers in time. Keyed by pid: a forked child that trains has its own exit.
    """
    event = multiprocessing.Event()
    multiprocessing.util.Finalize(None, event.set, exitpriority=0)
    return event


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _workers_born_deaf() -> Iterator[None]:
    """Block the stop signals in this thread while the DataLoader forks its workers.

    A forked child inherits the mask, so a job-wide signal that reaches a worker before its handlers
    exist stays pending instead of killing it; `_defer_stop_signals` installs them, then unblocks (and
    the pending signal meets the handler). The trainer's own pending signal arrives when its mask is
    restored here. This needs the fork start method (Linux's default before Python 3.14): a spawned or
    forkserver worker starts with the default mask.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _defer_stop_signals(parent_exiting: multiprocessing.synchronize.Event, _worker_id: int) -> None:
    """Loader workers leave a job-wide stop to the training process, and exit with it.

    Ctrl-C, `kill -- -PGID`, `pkill -f` and Slurm's scancel/preemption signal every process of the
    job, workers included. A worker that died of it would make the trainer fail on its next batch
    before it could save (torch raises "DataLoader worker ... exited unexpectedly"), losing the run
    since its last checkpoint. So workers ignore SIGINT and ignore SIGTERM until the training process
    is exiting (`_exiting_event`); then SIGTERM ends them. A trainer killed outright is noticed by
    torch's watchdog in each worker.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, partial(_end_if_parent_exiting, parent_exiting))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # born blocked (`_workers_born_deaf`)


def _end_if_parent_exiting(parent_exiting: multiprocessing.synchronize.Event, _signum: int, _frame: Any) -> None:
    """Exit cleanly (status 0) when the exiting trainer asks: a worker dead of a signal would make
    torch's SIGCHLD handler raise in the trainer's exit path ("worker is killed by signal")."""
    if parent_exiting.is_set():
        os._exit(0)  # nothing to flush: the trainer owns the queues, and it is going away


def stream_shards(urls: list[str], rank: int, world_size: int) -> list[str]:
    """The shards data stream `rank` of `world_size` resamples: every world_size-th one, when there are enough.

    Disjoint shares mean no sample is drawn by two streams, so the ranks of one global step never
    train on the same sample. With fewer shards than streams every stream resamples all shards
    (independent streams, repeats across ranks possible); with a count that does not divide evenly,
    samples of the smaller shares are drawn more often. Both are warned about: repack with more shards.
    """
    if len(urls) % world_size:
        warnings.warn(f"{len(urls)} shards do not split evenly over {world_size} data streams: "
                      + ("streams share shards, so a sample can appear on two ranks in one step"
                         if len(urls) < world_size else "some shards are drawn more often than others")
                      + "; repack with a multiple of the stream count", stacklevel=3)
    return urls[rank::world_size] if len(urls) >= world_size else urls
