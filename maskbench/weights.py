"""Every weight file a metric or the encoder loads, in one registry: `maskbench weights [check DIR]`.

maskbench downloads nothing, so each file is fetched by hand once. A folder that holds them under the
registry's file names is checked once (present, size, sha256) and then named by one setting,
`paths.weights` (or $MASKBENCH_WEIGHTS): every `eval.*_weights` option left unset takes its file from
there, and the loaders open that path as if it had been given.

A checksum is pinned only where its publisher documents one; no source found for these files documents
theirs, so they are `unpinned` (None) in the registry. `maskbench weights pin DIR` records the sha256 of
each file a folder holds in DIR/SHA256SUMS (`sha256sum -c` reads it too), once, where the files were
fetched; from then on `check` verifies every node's copy against those bytes.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cleanfid.downloads_helper import inception_url

from maskbench.errors import UserError
from maskbench.files import sha256_file, write_atomic

ENV = "MASKBENCH_WEIGHTS"  # the weights folder when paths.weights is unset
PINS = "SHA256SUMS"        # a folder's own pins (`pin`), in sha256sum's format: "<sha256>  <file>" per line


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


def read_pins(folder: Path) -> dict[str, str]:
    """file -> sha256 from the folder's SHA256SUMS (none: {}); a line that is not `<sha256>  <file>` is refused."""
    path = folder / PINS
    if not path.is_file():
        return {}
    pins = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        digest, sep, file = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise UserError(f"{path}:{number} is not a `<sha256>  <file>` line (write it with maskbench weights pin)")
        pins[file.lstrip("*")] = digest
    return pins


def pin(folder: Path, registry: tuple[WeightFile, ...] = REGISTRY) -> list[str]:
    """Write folder/SHA256SUMS with the sha256 of every registry file present (a registry pin must match
    first: `check` runs before anything is recorded); return its lines."""
    present = [entry for entry in registry if (folder / entry.file).is_file()]
    if not present:
        raise UserError(f"{folder} holds none of the registry's files (maskbench weights lists them)")
    lines = [f"{sha256_file(folder / entry.file)}  {entry.file}" for entry in present]
    write_atomic(folder / PINS, "\n".join(lines) + "\n")
    return lines


def check_file(folder: Path, entry: WeightFile, pins: dict[str, str] | None = None) -> tuple[bool, str]:
    """Whether `entry`'s file in `folder` passes (present, size, sha256: the registry's, else the folder's
    own pin from `pins`), and its one line of the check."""
    path = folder / entry.file
    if not path.is_file():
        status = "MISSING" if entry.needed else "absent"
        return not entry.needed, f"{status:8s} {entry.name}: {path} (get it from {entry.url})"
    size = path.stat().st_size
    if entry.size is not None and size != entry.size:
        return False, f"{'FAIL':8s} {entry.name}: {path} is {size} bytes, expected {entry.size}"
    expected, source = (entry.sha256, "the registry's") if entry.sha256 else ((pins or {}).get(entry.file), f"{PINS}'s")
    if expected is None:
        return True, (f"{'ok':8s} {entry.name}: {path} present, {size} bytes, unpinned (no published sha256; "
                      f"`maskbench weights pin {folder}` records this copy's)")
    digest = sha256_file(path)
    if digest != expected:
        return False, f"{'FAIL':8s} {entry.name}: {path} has sha256 {digest}, expected {expected} ({source})"
    return True, f"{'ok':8s} {entry.name}: {path} {size} bytes, sha256 matches {source}"


def check(folder: Path, registry: tuple[WeightFile, ...] = REGISTRY) -> bool:
    """Print one line per registry file; True when every needed file, and every optional one present, passes."""
    pins = read_pins(folder)
    results = [check_file(folder, entry, pins) for entry in registry]
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
        raise UserError(f"{args.folder} is not a folder (maskbench weights {args.action} DIR)")
    if args.action == "pin":
        if not check(args.folder):
            raise UserError(f"{args.folder} fails the check above: nothing pinned (new copies of pinned files: remove {PINS} first)")
        lines = pin(args.folder)
        print(f"wrote {args.folder / PINS}: {len(lines)} files pinned; `maskbench weights check` verifies them from now on")
        return 0
    return 0 if check(args.folder) else 2


def add_weights(parser: argparse.ArgumentParser) -> None:
    """`maskbench weights`: list the registry; `maskbench weights check DIR`: verify a folder."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    verify = actions.add_parser("check", help="verify a weights folder: present, size, sha256 (exit 2 on a failure)")
    verify.add_argument("folder", type=Path)
    record = actions.add_parser("pin", help=f"record the sha256 of each registry file a folder holds in FOLDER/{PINS}, "
                                             "once, where the files were fetched (after a passing check)")
    record.add_argument("folder", type=Path)
    parser.set_defaults(func=cmd_weights)
