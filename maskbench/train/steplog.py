"""What each training step writes: its line in `metrics.jsonl` (and a tracker's scalars), with fingerprints
of what it read and drew, so a reader can check that two arms of one seed shared their data and draws.

`metrics.jsonl` is the record a run is judged by; the fingerprints are computed where the tensors live
(no host copy) and gathered with the step's one host read.
"""

from __future__ import annotations

import json
import zlib
from typing import IO, TYPE_CHECKING

import torch

from maskbench.train.guard import guard_name
from maskbench.train.schedule import PhasePlan
from maskbench.train.tracking import log_step

if TYPE_CHECKING:
    from maskbench.train.loop import Trainer


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


def write_step(trainer: Trainer, phase: PhasePlan, out: dict, extra: dict, log: IO[str]) -> None:
    """The step just taken as one `metrics.jsonl` line in `log` (rank 0 only), and to a tracker on the trunk.
    `out`: what `Trainer.train_step` returned; `extra`: the diagnostics and a rule's check."""
    state, cfg = trainer.state, trainer.cfg
    if not trainer.accelerator.is_main_process:
        return
    record = {
        "step": state.step - 1, "mask_ratio": phase.mask_ratio, "loss": out["loss"],
        "lr": trainer.scheduler.get_last_lr()[0], "grad_norm": out["grad_norm"],
        "flops": state.flops, "seconds": state.train_seconds, "data_wait": out["data_wait"],
        "data_digest": out["data_digest"], "draw_digest": out["draw_digest"],
        "bad_samples": state.bad_samples, "skipped_nonfinite": state.skipped_nonfinite, **extra}
    if guard_name(cfg.train) is not None:
        record["skipped_grad_norm"] = state.skipped_grad_norm
    log.write(json.dumps(record) + "\n")
    if cfg.train.log_with != "none" and trainer.branch is None:
        log_step(trainer.accelerator, record, state.step)
