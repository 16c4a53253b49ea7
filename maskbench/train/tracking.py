"""Experiment tracking through accelerate's trackers: TensorBoard or Weights & Biases, off by default.

`metrics.jsonl` and `eval.jsonl` stay the record a run is judged by; a tracker is a view for people
watching runs: per-step loss, lr, grad norm, mask ratio and FLOPs, and per eval point the metrics and
the sample grid. TensorBoard needs no network (its event files go under the run directory).
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    from accelerate import Accelerator

def flat_scalars(tree: dict, prefix: str = "") -> dict[str, int | float | str | bool]:
    """A nested config as flat `a.b.c` keys with scalar values (what TensorBoard's hparams accept)."""
    out: dict = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_scalars(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def log_step(accelerator: Accelerator, record: dict, step: int) -> None:
    """The scalars of one metrics.jsonl line (loss, lr, grad norm, mask ratio, FLOPs, seconds, data wait)."""
    keys = ("loss", "lr", "grad_norm", "mask_ratio", "flops", "seconds", "data_wait")
    accelerator.log({f"train/{key}": record[key] for key in keys}, step=step)


def log_eval(accelerator: Accelerator, result: dict, step: int) -> None:
    """One eval point's numeric metrics and its sample grid, at the training step it was taken."""
    scalars = {f"eval/{key}": value for key, value in result.items()
               if isinstance(value, numbers.Real) and not isinstance(value, bool)}
    accelerator.log(scalars, step=step)
    grid = np.asarray(Image.open(result["grid"]).convert("RGB"))                   # H×W×3 uint8
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image("eval/samples", grid, global_step=step, dataformats="HWC")
        else:
            tracker.log_images({"eval/samples": [grid]}, step=step)
