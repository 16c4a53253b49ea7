"""What each training step writes: its line in `metrics.jsonl` (and a tracker's scalars), with fingerprints
of what it read and drew, so a reader can check that two arms of one seed shared their data and draws.

`metrics.jsonl` is the record a run is judged by; the fingerprints are computed where the tensors live
(no host copy) and gathered with the step's one host read.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import IO

import torch
from accelerate import Accelerator

from maskbench.config import TrainConfig
from maskbench.train.guard import guard_name
from maskbench.train.progress import Progress
from maskbench.train.schedule import ScheduledPhase
from maskbench.train.tracking import log_step


def batch_digest(batch: dict) -> int:
    """crc32 of a batch's sample keys: a per-step fingerprint of what a stream read, cheap to log and gather."""
    return zlib.crc32("\n".join(batch["key"]).encode())


DIGEST_PRIME = 2**31 - 1  # fingerprints are exact int64 arithmetic modulo this prime, and fit a float64


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """An exact 31-bit fingerprint of a tensor's bytes, computed where the tensor lives (no host copy or
    sync): Σ_i (word_i mod p)·(i + 1) mod p over its 32-bit words. Each product stays below 2^62 and
    the sum of < 2^32 reduced terms below 2^63, so int64 never overflows."""
    words = x.detach().contiguous().flatten()
    words = (words.view(torch.int32) if words.element_size() == 4 else words.to(torch.int32)).long()  # N
    index = torch.arange(1, words.numel() + 1, device=words.device) % DIGEST_PRIME                  # N
    return ((words % DIGEST_PRIME) * index % DIGEST_PRIME).sum() % DIGEST_PRIME


def draw_digest(*draws: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One fingerprint of a step's shared draws (t, caption dropout, noise), on `device`: the log shows
    that two arms with one seed drew the same."""
    digest = torch.zeros((), dtype=torch.long, device=device)
    for draw in draws:
        digest = (digest * 31 + fingerprint(draw).to(device)) % DIGEST_PRIME
    return digest


class StepLog:
    """A run's step lines: the trunk's in `metrics.jsonl` (appended to on resume), a branch's in its own file. Each
    line goes to a tracker too, on the trunk. Only the main process writes a line."""

    def __init__(self, path: Path, mode: str, accelerator: Accelerator, train: TrainConfig) -> None:
        self.accelerator, self.train = accelerator, train
        self.file: IO[str] = open(path, mode)  # closed by the `with` this log is used in

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.file.close()

    def flush(self) -> None:
        self.file.flush()

    def write(self, progress: Progress, phase: ScheduledPhase, out: dict, lr: float, extra: dict) -> None:
        """The step just taken as one line. `out`: what `step.Stepper` returned; `extra`: the diagnostics and a
        rule's check."""
        state = progress.counters
        if not self.accelerator.is_main_process:
            return
        record = {
            "step": state.step - 1, "mask_ratio": phase.mask_ratio, "loss": out["loss"],
            "lr": lr, "grad_norm": out["grad_norm"],
            "flops": state.flops, "seconds": state.train_seconds, "data_wait": out["data_wait"],
            "data_digest": out["data_digest"], "draw_digest": out["draw_digest"],
            "bad_samples": state.bad_samples, "skipped_nonfinite": state.skipped_nonfinite, **extra}
        if guard_name(self.train) is not None:
            record["skipped_grad_norm"] = state.skipped_grad_norm
        self.file.write(json.dumps(record) + "\n")
        if self.train.log_with != "none" and progress.branch is None:
            log_step(self.accelerator, record, state.step)
