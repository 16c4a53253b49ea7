"""The embedded default dataset: procedurally drawn, captioned scenes of coloured shapes.

Nothing can be downloaded on a fresh machine, so maskbench draws its own data. A scene is a
2×2 grid of cells holding 1–3 objects (shape, colour, size), each in its own cell with a little
positional jitter. The attributes are known exactly, which gives the evaluation an oracle
(`cell_labels`) and makes the captions unambiguous. Everything is deterministic from a seed and is
written as canonical shards (`maskbench.data.shards`) like any real source, with a held-out split.
"""

from __future__ import annotations

import functools
import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock
from PIL import Image, ImageDraw
from tqdm import tqdm

from maskbench.data.shards import CanonicalShardWriter
from maskbench.errors import ConfigError
from maskbench.manifest import read_manifest

SHAPES = ("circle", "square", "triangle")
COLOURS = ("red", "green", "blue", "yellow", "purple", "white")
SIZES = ("small", "large")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")  # cell order, row-major

COLOUR_RGB = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 230),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 200),
    "white": (235, 235, 235),
}
SIZE_FRACTION = {"small": 7 / 16, "large": 13 / 16}  # object extent as a fraction of its cell
JITTER_FRACTION = 2 / 16  # ±2 px in a 16 px cell
BRIGHTNESS_RANGE = (0.85, 1.0)  # a small per-object brightness jitter, so colours are not one exact value
NO_LABEL = -100  # colour/size label of an empty cell: torch's cross_entropy ignore_index by default

SYNTH_VERSION = "synth-v1"


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str
    position: str

    def __post_init__(self) -> None:
        for name, allowed in (("shape", SHAPES), ("colour", COLOURS), ("size", SIZES), ("position", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; expected one of {allowed}")


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]

    def __post_init__(self) -> None:
        positions = [o.position for o in self.objects]
        if not positions:
            raise ValueError("a scene needs at least one object")
        if positions != sorted(set(positions), key=POSITIONS.index):
            raise ValueError(f"objects must sit in distinct cells listed in cell order {POSITIONS}; got {positions}")


def sample_scene(rng: np.random.Generator, min_objects: int = 1, max_objects: int = 3) -> Scene:
    """Draw 1–3 (by default) objects with uniform attributes in distinct, uniformly chosen cells."""
    if not 1 <= min_objects <= max_objects <= len(POSITIONS):
        raise ConfigError(f"need 1 <= min_objects <= max_objects <= {len(POSITIONS)}; got {min_objects}, {max_objects}")
    n = int(rng.integers(min_objects, max_objects + 1))
    cells = np.sort(rng.permutation(len(POSITIONS))[:n])
    attributes = rng.integers(0, (len(SHAPES), len(COLOURS), len(SIZES)), size=(n, 3))  # n×3 indices
    return Scene(
        tuple(
            SceneObject(SHAPES[shape], COLOURS[colour], SIZES[size], POSITIONS[cell])
            for cell, (shape, colour, size) in zip(cells, attributes)
        )
    )


@functools.cache
def _stamp(shape: str, extent: int) -> np.ndarray:
    """The shape's extent×extent boolean mask, drawn once with PIL and reused for every object."""
    image = Image.new("1", (extent, extent))
    draw = ImageDraw.Draw(image)
    box = (0, 0, extent - 1, extent - 1)
    if shape == "circle":
        draw.ellipse(box, fill=1)
    elif shape == "square":
        draw.rectangle(box, fill=1)
    else:  # triangle, pointing up
        draw.polygon([(0, extent - 1), (extent - 1, extent - 1), ((extent - 1) / 2, 0)], fill=1)
    return np.asarray(image)


def render(scene: Scene, rng: np.random.Generator, image_size: int = 32) -> np.ndarray:
    """Draw the scene on a black canvas; `rng` supplies the position and brightness jitter. -> H×W×3 uint8."""
    if image_size < 16 or image_size % 2:
        raise ConfigError(f"image_size must be even and at least 16; got {image_size}")
    cell = image_size // 2
    canvas = np.zeros((image_size, image_size, 3), dtype=np.uint8)
    jitter = rng.random((len(scene.objects), 3))  # per object: x, y offsets and brightness in [0, 1)
    for obj, (u, v, w) in zip(scene.objects, jitter):
        extent = round(SIZE_FRACTION[obj.size] * cell)
        slack = (cell - extent) // 2
        reach = min(round(JITTER_FRACTION * cell), slack)  # jitter never pushes the object out of its cell
        row, col = divmod(POSITIONS.index(obj.position), 2)
        x0 = col * cell + slack + int(u * (2 * reach + 1)) - reach
        y0 = row * cell + slack + int(v * (2 * reach + 1)) - reach
        brightness = BRIGHTNESS_RANGE[0] + w * (BRIGHTNESS_RANGE[1] - BRIGHTNESS_RANGE[0])
        fill = np.round(np.array(COLOUR_RGB[obj.colour]) * brightness).astype(np.uint8)  # (3,)
        canvas[y0 : y0 + extent, x0 : x0 + extent][_stamp(obj.shape, extent)] = fill
    return canvas


def caption(scene: Scene) -> str:
    """'a large red circle at the top left and a small blue square at the bottom right' (cell order)."""
    phrases = [f"a {o.size} {o.colour} {o.shape} at the {o.position}" for o in scene.objects]
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def scene_to_json(scene: Scene) -> dict:
    """The scene as the JSON-able dict stored in each sample's KEY.json (under "objects")."""
    return {"objects": [dict(vars(o)) for o in scene.objects]}


def scene_from_json(d: dict) -> Scene:
    """Inverse of `scene_to_json`; accepts a whole KEY.json dict (extra keys are ignored)."""
    if "objects" not in d:
        raise ValueError("scene JSON has no 'objects' list")
    return Scene(tuple(SceneObject(**o) for o in d["objects"]))


def cell_labels(scene: Scene) -> dict[str, np.ndarray]:
    """Per-cell targets for the oracle, each int64 of shape (len(POSITIONS),).

    "shape" is the shape index + 1 with 0 for an empty cell, so the oracle also learns emptiness;
    "colour" and "size" are attribute indices with NO_LABEL (-100, cross_entropy's default
    ignore_index) for an empty cell, where they mean nothing.
    """
    labels = {
        "shape": np.zeros(len(POSITIONS), dtype=np.int64),
        "colour": np.full(len(POSITIONS), NO_LABEL, dtype=np.int64),
        "size": np.full(len(POSITIONS), NO_LABEL, dtype=np.int64),
    }
    for obj in scene.objects:
        cell = POSITIONS.index(obj.position)
        labels["shape"][cell] = SHAPES.index(obj.shape) + 1
        labels["colour"][cell] = COLOURS.index(obj.colour)
        labels["size"][cell] = SIZES.index(obj.size)
    return labels


def png_bytes(image: np.ndarray) -> bytes:
    """Encode an H×W×3 uint8 image losslessly (PNG), so shards hold exactly what was rendered."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_split(
    out_dir: Path, rng: np.random.Generator, n: int, params: dict, shard_size: int, progress: tqdm
) -> None:
    """Draw, render and write `n` samples of one split from its own RNG stream."""
    with CanonicalShardWriter(
        out_dir, source="synth", packer_version=SYNTH_VERSION, filters=params, maxcount=shard_size
    ) as writer:
        for index in range(n):
            scene = sample_scene(rng, params["min_objects"], params["max_objects"])
            image = render(scene, rng, params["image_size"])
            meta = {"width": params["image_size"], "height": params["image_size"], **scene_to_json(scene)}
            writer.write(f"{index:09d}", png_bytes(image), "png", caption(scene), meta)
            progress.update()


def _split_params(split: str, n: int, seed: int, image_size: int, min_objects: int, max_objects: int) -> dict:
    return dict(split=split, n=n, seed=seed, image_size=image_size, min_objects=min_objects, max_objects=max_objects)


def _is_complete(out_dir: Path, expected: dict[str, dict]) -> bool:
    """True when every split has a manifest written by this packer version with these parameters."""
    for split, params in expected.items():
        try:
            manifest = read_manifest(out_dir / split)
        except ValueError:
            return False
        if manifest["packer_version"] != SYNTH_VERSION or manifest["filters"] != params:
            return False
    return True


def write_synth(
    out_dir: str | os.PathLike,
    n_train: int = 50_000,
    n_val: int = 2_000,
    seed: int = 0,
    image_size: int = 32,
    min_objects: int = 1,
    max_objects: int = 3,
    shard_size: int = 5_000,
) -> Path:
    """Write out_dir/train and out_dir/val canonical shard dirs; return out_dir.

    Idempotent and safe to call from concurrent runs: a file lock serialises writers, a complete
    dataset with the same parameters is returned at once, and output is built in a temporary
    sibling directory (removed on failure) renamed into place only when both splits are done, so
    a crash never leaves something that looks complete. Train and val draw from independent
    streams spawned from `seed`.
    """
    if n_train < 1 or n_val < 1:
        raise ConfigError(f"n_train and n_val must be positive; got {n_train}, {n_val}")
    out = Path(out_dir)
    expected = {
        split: _split_params(split, n, seed, image_size, min_objects, max_objects)
        for split, n in (("train", n_train), ("val", n_val))
    }
    sample_scene(np.random.default_rng(0), min_objects, max_objects)  # validate arguments before any work
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where a folder of datasets should be
        raise ConfigError(f"{out.parent} is not a folder (paths.data names the folder synth datasets go in)") from None
    with FileLock(str(out) + ".lock"):
        if _is_complete(out, expected):
            return out
        if out.exists():
            raise ConfigError(f"{out} is not a synth dataset with these parameters; remove it or pick another dir")
        streams = np.random.SeedSequence(seed).spawn(len(expected))
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
            staging = Path(tmp) / out.name
            with tqdm(total=n_train + n_val, desc=f"synth {out.name}", unit="img") as progress:
                for (split, params), stream in zip(expected.items(), streams):
                    rng = np.random.default_rng(stream)
                    _write_split(staging / split, rng, params["n"], params, shard_size, progress)
            os.replace(staging, out)
    return out


ORACLE_IMAGE_SIZE = 32  # the side the networks trained on synth scenes read


def renderer_params() -> dict:
    """Everything about the renderer that a network trained on its scenes depends on (the oracle, REPA's synth
    encoder); stored with their weights and checked on load."""
    return {
        "packer_version": SYNTH_VERSION,
        "image_size": ORACLE_IMAGE_SIZE,
        "shapes": list(SHAPES),
        "colours": list(COLOURS),
        "sizes": list(SIZES),
        "positions": list(POSITIONS),
        "colour_rgb": {name: list(rgb) for name, rgb in COLOUR_RGB.items()},
        "size_fraction": SIZE_FRACTION,
        "jitter_fraction": JITTER_FRACTION,
        "brightness_range": list(BRIGHTNESS_RANGE),
    }
