"""The embedded synthetic dataset: scenes, rendering, captions, labels, and its shards."""

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from maskbench.data import synth
from maskbench.data.shards import shard_urls
from maskbench.data.synth import (
    COLOUR_RGB,
    NO_LABEL,
    POSITIONS,
    Scene,
    SceneObject,
    caption,
    cell_labels,
    render,
    sample_scene,
    scene_from_json,
    scene_to_json,
    write_synth,
)
from maskbench.manifest import read_manifest

SMALL = dict(n_train=40, n_val=12, image_size=32, shard_size=16)


def read_samples(shard_dir) -> list[dict[str, bytes]]:
    """Every sample of a shard dir as {"key", ext: bytes}, in shard order."""
    samples: dict[str, dict] = {}
    for url in shard_urls(shard_dir):
        with tarfile.open(url) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {"key": key})[ext] = tar.extractfile(member).read()
    return list(samples.values())


def cell_view(image: np.ndarray, position: str) -> np.ndarray:
    half = image.shape[0] // 2
    row, col = divmod(POSITIONS.index(position), 2)
    return image[row * half : (row + 1) * half, col * half : (col + 1) * half]


def test_sample_scene_is_deterministic_and_respects_bounds():
    scenes_a = [sample_scene(np.random.default_rng(7), 2, 3) for _ in range(3)]
    rng = np.random.default_rng(7)
    assert sample_scene(rng, 2, 3) == scenes_a[0]
    counts = {len(sample_scene(rng, 2, 3).objects) for _ in range(200)}
    assert counts == {2, 3}
    with pytest.raises(ValueError, match="min_objects"):
        sample_scene(rng, 0, 3)
    with pytest.raises(ValueError, match="min_objects"):
        sample_scene(rng, 3, 5)


def test_caption_lists_objects_in_cell_order():
    red = SceneObject("circle", "red", "large", "top left")
    blue = SceneObject("square", "blue", "small", "bottom right")
    green = SceneObject("triangle", "green", "small", "top right")
    assert caption(Scene((red,))) == "a large red circle at the top left"
    assert caption(Scene((red, blue))) == (
        "a large red circle at the top left and a small blue square at the bottom right"
    )
    assert caption(Scene((red, green, blue))) == (
        "a large red circle at the top left, a small green triangle at the top right"
        " and a small blue square at the bottom right"
    )
    with pytest.raises(ValueError, match="distinct cells"):
        Scene((blue, red))
    with pytest.raises(ValueError, match="unknown colour"):
        SceneObject("circle", "pink", "large", "top left")


def test_render_draws_each_object_in_its_own_cell_with_its_colour():
    rng = np.random.default_rng(0)
    for _ in range(50):
        scene = sample_scene(rng)
        image = render(scene, rng, image_size=32)
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        occupied = {o.position: o for o in scene.objects}
        for position in POSITIONS:
            pixels = cell_view(image, position).reshape(-1, 3)
            lit = pixels[pixels.any(axis=1)]
            if position not in occupied:
                assert len(lit) == 0
                continue
            obj = occupied[position]
            target = np.array(COLOUR_RGB[obj.colour], dtype=float)
            assert np.allclose(lit / target, lit[0] / target, atol=0.02)  # one hue, scaled by brightness
            assert 0.84 <= (lit[0] / target).mean() <= 1.01
            expected_small = obj.size == "small"
            assert (len(lit) < 60) == expected_small  # small ≤ 7×7 = 49 px, large ≥ ~100 px


def test_render_shapes_differ_in_area():
    rng = np.random.default_rng(0)
    areas = {
        shape: (render(Scene((SceneObject(shape, "white", "large", "top left"),)), rng).any(axis=2)).sum()
        for shape in synth.SHAPES
    }
    assert areas["square"] == 13 * 13
    assert areas["triangle"] < areas["circle"] < areas["square"]


def test_cell_labels():
    scene = Scene(
        (SceneObject("triangle", "purple", "small", "top right"), SceneObject("circle", "red", "large", "bottom right"))
    )
    labels = cell_labels(scene)
    assert labels["shape"].tolist() == [0, 3, 0, 1]
    assert labels["colour"].tolist() == [NO_LABEL, 4, NO_LABEL, 0]
    assert labels["size"].tolist() == [NO_LABEL, 0, NO_LABEL, 1]


def test_scene_json_round_trip():
    scene = sample_scene(np.random.default_rng(3), 3, 3)
    stored = json.loads(json.dumps({"source": "synth", **scene_to_json(scene)}))
    assert scene_from_json(stored) == scene
    with pytest.raises(ValueError, match="unknown shape"):
        scene_from_json({"objects": [{"shape": "star", "colour": "red", "size": "small", "position": "top left"}]})


def test_write_synth_shards_hold_the_scenes_they_describe(tmp_path):
    out = write_synth(tmp_path / "synth", seed=5, **SMALL)
    manifest = read_manifest(out / "train")
    assert manifest["total"] == 40 and [s["count"] for s in manifest["shards"]] == [16, 16, 8]
    assert read_manifest(out / "val")["total"] == 12
    # The train stream is the first child of SeedSequence(seed): replaying it reproduces every sample.
    rng = np.random.default_rng(np.random.SeedSequence(5).spawn(2)[0])
    for sample in read_samples(out / "train"):
        scene = sample_scene(rng)
        expected = render(scene, rng)
        meta = json.loads(sample["json"])
        assert meta["source"] == "synth" and meta["id"] == sample["key"] and meta["width"] == meta["height"] == 32
        assert scene_from_json(meta) == scene
        assert sample["txt"].decode() == caption(scene)
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(sample["png"]))), expected)


def test_write_synth_is_deterministic_and_splits_differ(tmp_path):
    a = write_synth(tmp_path / "a", seed=1, **SMALL)
    b = write_synth(tmp_path / "b", seed=1, **SMALL)
    c = write_synth(tmp_path / "c", seed=2, **SMALL)
    for split in ("train", "val"):
        assert read_samples(a / split) == read_samples(b / split)
        assert [s["sha256"] for s in read_manifest(a / split)["shards"]] == [
            s["sha256"] for s in read_manifest(b / split)["shards"]
        ]
    assert read_samples(a / "train") != read_samples(c / "train")
    train_pngs = {s["png"] for s in read_samples(a / "train")}
    val_pngs = [s["png"] for s in read_samples(a / "val")]
    assert not train_pngs.intersection(val_pngs)


def test_write_synth_is_idempotent_and_never_trusts_partial_output(tmp_path, monkeypatch):
    out = tmp_path / "synth"
    real_write_split = synth._write_split

    def crash_on_val(out_dir, *args):
        if out_dir.name == "val":
            raise RuntimeError("simulated crash")
        real_write_split(out_dir, *args)

    monkeypatch.setattr(synth, "_write_split", crash_on_val)
    with pytest.raises(RuntimeError, match="simulated crash"):
        write_synth(out, **SMALL)
    assert not out.exists()  # the half-written dataset stayed in its temporary directory
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".lock"]  # which was removed

    monkeypatch.setattr(synth, "_write_split", real_write_split)
    write_synth(out, **SMALL)
    stamp = (out / "train" / "manifest.json").stat().st_mtime_ns

    def must_not_write(*args):
        raise AssertionError("a complete dataset was rewritten")

    monkeypatch.setattr(synth, "_write_split", must_not_write)
    assert write_synth(out, **SMALL) == out
    assert (out / "train" / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="is not a synth dataset with these parameters"):
        write_synth(out, **{**SMALL, "n_train": 41})
