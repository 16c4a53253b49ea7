"""This rank's data streams: the global batch `train.batch_size` is split over S data streams, and stream
s = rank · micro-batches + micro-batch reads its own disjoint share of the shards (`data.loader.stream_shards`)
and draws its own t, noise, dropout and mask (`schedule.step_generator`, keyed by the stream). What a step trains
on depends on S only: 2 processes × 1 micro-batch and 1 process × 2 micro-batches run the same steps (up to float
summation order). S is `train.data_streams` where set, whatever the process count (each process then runs its
share as micro-batches), else processes × `train.grad_accum` (`stream_layout`). A loader opens at its saved
position, so a resumed run reads exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import os

from accelerate import Accelerator
from accelerate.utils import gather_object

from maskbench.config import RunConfig, TrainConfig
from maskbench.data.dataset import DatasetInfo
from maskbench.data.loader import ShardLoader, auto_workers, make_loader, worker_counts
from maskbench.errors import ConfigError
from maskbench.models.build import loader_decoder


def stream_layout(train: TrainConfig, n_processes: int) -> tuple[int, int]:
    """(data streams S of the global batch, micro-batches per process). With `train.data_streams` S is the
    config's on any process count that divides it, so runs on 1, 2 or 8 processes pair; else processes ×
    grad_accum, which pairs only with runs of the same stream count."""
    if train.data_streams is None:
        return n_processes * train.grad_accum, train.grad_accum
    if train.data_streams % n_processes:
        raise ConfigError(f"train.data_streams={train.data_streams} must be divisible by the {n_processes} "
                          "processes (each runs an equal share of the streams as micro-batches)")
    return train.data_streams, train.data_streams // n_processes


def loader_workers(asked: int | None, loaders: int) -> int:
    """Workers per loader: `data.num_workers` when set (a count the loader accepts), else sized from the CPUs
    this process may use, shared with the other processes on its node (torchrun's LOCAL_WORLD_SIZE)."""
    if asked is not None:
        if asked not in worker_counts():
            raise ConfigError(f"data.num_workers must be one of {worker_counts()} (they divide the loader's "
                              f"streams, so the data is the same for each), got {asked}")
        return asked
    cpus = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return auto_workers(cpus, loaders)


class Streams:
    """This rank's streams, one per micro-batch: `ids`, loaders opened at a step, and their positions."""

    def __init__(self, cfg: RunConfig, data: DatasetInfo, acc: Accelerator) -> None:
        self.count, accum = stream_layout(cfg.train, acc.num_processes)
        self.cfg, self.data, self.acc = cfg, data, acc
        self.ids = range(acc.process_index * accum, (acc.process_index + 1) * accum)
        self.num_workers = loader_workers(cfg.data.num_workers, accum)

    def open(self, step: int, positions: dict[int, dict]) -> list[ShardLoader]:
        """One loader per stream of this rank, each starting at `step` from its position in `positions` (a
        stream's `ShardLoader.state_dict()`; none: from the start), without re-reading the samples before it."""
        cfg = self.cfg
        decode = loader_decoder(self.data, cfg.model)
        return [make_loader(self.data.train_source, batch_size=cfg.train.batch_size // self.count,
                            seed=cfg.seed, rank=stream, world_size=self.count, num_workers=self.num_workers,
                            start_step=step, resume=positions.get(stream), decode=decode,
                            max_bad_fraction=cfg.data.max_bad_fraction, shuffle_buffer=cfg.data.shuffle_buffer,
                            pin_memory=cfg.train.pin_memory and self.acc.device.type == "cuda")
                for stream in self.ids]

    def positions(self, loaders: list[ShardLoader]) -> dict[int, dict]:
        """Every stream's loader position, of every rank (gathered: the main process writes checkpoints)."""
        mine = {stream: loader.state_dict() for stream, loader in zip(self.ids, loaders)}
        if self.acc.num_processes > 1:
            mine = {k: v for part in gather_object([mine]) for k, v in part.items()}
        return mine
