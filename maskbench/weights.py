"""Every weight file a metric or the encoder loads, in one registry: `maskbench weights [check DIR]`.

maskbench downloads nothing, so each file is fetched by hand once. A folder that holds them under the
registry's file names is checked once (present, size, sha256) and then named by one setting,
`paths.weights` (or $MASKBENCH_WEIGHTS): every `eval.*_weights` option left unset takes its file from
there, and the loaders open that path as if it had been given.

A checksum is pinned only where its publisher documents one; no source found for these files documents
theirs, so they are `unpinned` (None): checked for presence (and size, when known) only.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cleanfid.downloads_helper import inception_url

from maskbench.errors import UserError
from maskbench.files import sha256_file

ENV = "MASKBENCH_WEIGHTS"  # the weights folder when paths.weights is unset


@dataclass(frozen=True)
class WeightFile:
    name: str
    file: str                      # path inside the weights folder
    url: str                       # where to obtain it (fetched by hand: nothing is downloaded)
    used_by: str                   # the options that take it
    size: Optional[int] = None     # bytes, where a source documents it
    sha256: Optional[str] = None   # the published checksum; None = unpinned
    fills: Optional[str] = None    # the EvalConfig field paths.weights fills when unset
    arch: Optional[tuple[str, str]] = None  # (EvalConfig field, value): filled only for this architecture
    needed: bool = True            # `check` fails without it; an optional file adds a metric when present


REGISTRY: tuple[WeightFile, ...] = (
    WeightFile("inception", "inception-2015-12-05.pt", inception_url,
               "eval.inception_weights on run, eval and eval reference (FID, clean-fid's TorchScript)",
               fills="inception_weights"),
    WeightFile("clip-vit-h-14", "open_clip_vit_h14.bin",
               "https://huggingface.co/laion/CLIP-ViT-H-14-laion2B-s32B-b79K/blob/main/open_clip_pytorch_model.bin",
               "eval.clip_weights with eval.clip_model=ViT-H-14 (CLIP score), data encode --text-weights",
               fills="clip_weights", arch=("clip_model", "ViT-H-14")),
    WeightFile("dinov2-vitl14", "vit_large_patch14_dinov2.lvd142m.safetensors",
               "https://huggingface.co/timm/vit_large_patch14_dinov2.lvd142m/blob/main/model.safetensors",
               "eval.dinov2_weights on run, eval and eval reference (FD-DINOv2, timm)",
               fills="dinov2_weights", arch=("dinov2_model", "vit_large_patch14_dinov2.lvd142m"), needed=False),
    WeightFile("dinov2-vitb14", "vit_base_patch14_dinov2.lvd142m.safetensors",
               "https://huggingface.co/timm/vit_base_patch14_dinov2.lvd142m/blob/main/model.safetensors",
               "train.repa_encoder (REPA's frozen encoder on real pixel data, timm; read from paths.weights when unset)",
               needed=False),
    WeightFile("vae-sd-ft-ema", "sd-vae-ft-ema/diffusion_pytorch_model.safetensors",
               "https://huggingface.co/stabilityai/sd-vae-ft-ema (this file and config.json, into sd-vae-ft-ema/)",
               "data encode --vae (the folder); eval.vae"),
)


def weights_folder(setting: str | None) -> str | None:
    """The weights folder: paths.weights, else $MASKBENCH_WEIGHTS, else none."""
    return setting or os.environ.get(ENV) or None


def check_file(folder: Path, entry: WeightFile) -> tuple[bool, str]:
    """Whether `entry`'s file in `folder` passes (present, size, sha256), and its one line of the check."""
    path = folder / entry.file
    if not path.is_file():
        status = "MISSING" if entry.needed else "absent"
        return not entry.needed, f"{status:8s} {entry.name}: {path} (get it from {entry.url})"
    size = path.stat().st_size
    if entry.size is not None and size != entry.size:
        return False, f"{'FAIL':8s} {entry.name}: {path} is {size} bytes, expected {entry.size}"
    if entry.sha256 is None:
        return True, f"{'ok':8s} {entry.name}: {path} present, {size} bytes, unpinned (no published sha256)"
    digest = sha256_file(path)
    if digest != entry.sha256:
        return False, f"{'FAIL':8s} {entry.name}: {path} has sha256 {digest}, expected {entry.sha256}"
    return True, f"{'ok':8s} {entry.name}: {path} {size} bytes, sha256 matches"


def check(folder: Path, registry: tuple[WeightFile, ...] = REGISTRY) -> bool:
    """Print one line per registry file; True when every needed file, and every optional one present, passes."""
    results = [check_file(folder, entry) for entry in registry]
    for _, line in results:
        print(line)
    return all(passed for passed, _ in results)


def table(registry: tuple[WeightFile, ...] = REGISTRY) -> list[str]:
    """The registry as readable lines: one block per file."""
    lines = []
    for entry in registry:
        size = f"{entry.size} bytes" if entry.size is not None else "size not published"
        lines += [f"{entry.name}{'' if entry.needed else ' (optional)'}",
                  f"  file     {entry.file}  ({size})",
                  f"  sha256   {entry.sha256 or 'unpinned'}",
                  f"  used by  {entry.used_by}",
                  f"  from     {entry.url}"]
    return lines


def cmd_weights(args: argparse.Namespace) -> int:
    if args.action is None:
        print("\n".join(table()))
        print(f"\nPut them in one folder under these names; paths.weights=DIR (or {ENV}=DIR) points the metrics at it.")
        return 0
    if not args.folder.is_dir():
        raise UserError(f"{args.folder} is not a folder (maskbench weights check DIR)")
    return 0 if check(args.folder) else 2


def add_weights(parser: argparse.ArgumentParser) -> None:
    """`maskbench weights`: list the registry; `maskbench weights check DIR`: verify a folder."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    verify = actions.add_parser("check", help="verify a weights folder: present, size, sha256 (exit 2 on a failure)")
    verify.add_argument("folder", type=Path)
    parser.set_defaults(func=cmd_weights)
