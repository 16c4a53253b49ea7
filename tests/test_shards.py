"""Canonical shard writer, manifest, safe decoding (`data/shards.py`) and the deterministic loader that resumes
by seeking (`data/loader.py`)."""

import hashlib
import io
import itertools
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import tarfile
import traceback
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image
from webdataset.tariterators import tar_file_iterator

from maskbench.data import loader as shard_loader
from maskbench.data.loader import LOADER_STREAMS, TooManyBadSamples, auto_workers, make_loader
from maskbench.data.shards import (
    BadSample,
    CanonicalShardWriter,
    decode_image,
    decode_image_caption,
    decode_npy,
    decode_text,
    shard_urls,
)
from maskbench.data.synth import write_synth
from maskbench.errors import ConfigError
from maskbench.files import sha256_file, write_atomic, write_json_atomic
from maskbench.manifest import FORMAT, read_manifest

PNG = (np.arange(4 * 5 * 3) * 7 % 256).astype(np.uint8).reshape(4, 5, 3)


def png_bytes(image: np.ndarray = PNG) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def good_members(key: str) -> list[tuple[str, bytes]]:
    return [(f"{key}.json", b"{}"), (f"{key}.png", png_bytes()), (f"{key}.txt", f"caption {key}".encode())]


def write_tar(path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def raw_shard_dir(root, tars: dict[str, list[tuple[str, bytes]]]):
    """A shard dir of hand-made (possibly broken) tars, with a manifest listing them."""
    root.mkdir()
    for name, members in tars.items():
        write_tar(root / name, members)
    shards = [{"name": name, "count": 0, "sha256": "", "bytes": 0} for name in tars]
    (root / "manifest.json").write_text(json.dumps({"format": FORMAT, "shards": shards, "total": 1}))
    return root


def take(loader, n: int) -> list[dict]:
    return list(itertools.islice(loader, n))


def keys(batches: list[dict]) -> list[list[str]]:
    return [b["key"] for b in batches]


SYNTH_SHARD = 32


@pytest.fixture(scope="module")
def synth_train(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("synth") / "d", n_train=96, n_val=8, shard_size=SYNTH_SHARD) / "train"


@pytest.fixture(scope="module")
def synth_other(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("synth") / "o", n_train=48, n_val=8, seed=3, shard_size=16) / "train"


LOADER = dict(batch_size=4, seed=0, shuffle_buffer=16)


# ----------------------------------------------------------------------------- writer


def test_writer_writes_canonical_samples_and_manifest(tmp_path):
    out = tmp_path / "shards"
    with CanonicalShardWriter(out, source="test", packer_version="t1", filters={"min_side": 4}, maxcount=2) as writer:
        for i in range(5):
            extra = {"latent.npy": b"\x93NUMPY"} if i == 0 else None
            writer.write(f"{i:09d}", png_bytes(), "png", f"caption {i}", {"width": 5, "height": 4, "score": i}, extra)
        writer.skip("too_small", 3)
        writer.skip("empty_caption")
    manifest = read_manifest(out)
    assert manifest["format"] == FORMAT and manifest["source"] == "test" and manifest["packer_version"] == "t1"
    assert manifest["filters"] == {"min_side": 4}
    assert manifest["total"] == 5 and manifest["skipped"] == {"empty_caption": 1, "too_small": 3}
    assert [s["name"] for s in manifest["shards"]] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert [s["count"] for s in manifest["shards"]] == [2, 2, 1]
    for shard, url in zip(manifest["shards"], shard_urls(out)):
        data = open(url, "rb").read()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest() and shard["bytes"] == len(data)
    with tarfile.open(shard_urls(out)[0]) as tar:
        names = tar.getnames()
        assert names == ["000000000.json", "000000000.latent.npy", "000000000.png", "000000000.txt"] + [
            "000000001.json", "000000001.png", "000000001.txt"
        ]
        meta = json.loads(tar.extractfile("000000001.json").read())
        assert meta == {"source": "test", "id": "000000001", "width": 5, "height": 4, "score": 1}
        assert tar.extractfile("000000001.txt").read() == b"caption 1"
        assert tar.extractfile("000000001.png").read() == png_bytes()


def test_writer_rejects_bad_input_and_leaves_no_manifest_on_error(tmp_path):
    meta = {"width": 5, "height": 4}
    with pytest.raises(RuntimeError, match="boom"):
        with CanonicalShardWriter(tmp_path / "a", source="t", packer_version="1", filters={}) as writer:
            for bad in (
                dict(key="a.b"),
                dict(image_ext="gif"),
                dict(caption="  "),
                dict(meta={"width": 5}),
                dict(meta={**meta, "id": "x"}),
                dict(extra={"txt": b"x"}),
            ):
                args = dict(key="k", image_bytes=png_bytes(), image_ext="png", caption="c", meta=meta) | bad
                with pytest.raises(ValueError):
                    writer.write(**args)
            writer.write("k", png_bytes(), "png", "c", meta)
            raise RuntimeError("boom")
    assert not (tmp_path / "a" / "manifest.json").exists()
    with pytest.raises(ValueError, match="already holds shards"):
        CanonicalShardWriter(tmp_path / "a", source="t", packer_version="1", filters={})
    with pytest.raises(ValueError, match="no shard manifest"):
        read_manifest(tmp_path / "a")
    with pytest.raises(ValueError, match="no shard manifest"):
        shard_urls(tmp_path / "missing")


def test_atomic_writes_replace_whole_files_and_leave_no_temporary_one(tmp_path):
    path = tmp_path / "f.json"
    write_atomic(path, "old")
    write_atomic(path, b"\x00new")
    assert path.read_bytes() == b"\x00new"
    write_json_atomic(path, {"b": 1, "a": [1]})
    assert path.read_text() == '{\n  "b": 1,\n  "a": [\n    1\n  ]\n}\n'
    write_json_atomic(path, {"b": 1, "a": 2}, indent=1, sort_keys=True, newline=False)
    assert path.read_text() == '{\n "a": 2,\n "b": 1\n}'
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]
    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- decoding


def test_decode_image_caption_maps_pixels_to_unit_range():
    sample = {"__key__": "k", "png": png_bytes(), "txt": b" a caption \n", "json": b"{}"}
    out = decode_image_caption(sample)
    assert out["caption"] == "a caption" and out["key"] == "k"
    assert out["image"].shape == (3, 4, 5) and out["image"].dtype == torch.float32
    assert torch.equal(((out["image"] + 1) * 127.5).round().to(torch.uint8), torch.from_numpy(PNG).permute(2, 0, 1))


@pytest.mark.parametrize(
    "sample, reason",
    [
        ({"__key__": "k", "txt": b"c"}, "missing_image"),
        ({"__key__": "k", "png": png_bytes()}, "missing_caption"),
        ({"__key__": "k", "png": png_bytes(), "txt": b" \n"}, "empty_caption"),
        ({"__key__": "k", "png": png_bytes(), "txt": b"\xff\xfe"}, "non_utf8_text"),
        ({"__key__": "k", "png": png_bytes()[:30], "txt": b"c"}, "undecodable_image"),
        ({"__key__": "k", "jpg": b"GIF89a....", "txt": b"c"}, "undecodable_image"),
    ],
)
def test_decode_image_caption_names_what_is_wrong(sample, reason):
    with pytest.raises(BadSample) as info:
        decode_image_caption(sample)
    assert info.value.reason == reason


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_decoders_refuse_pickled_arrays_and_oversized_images(monkeypatch):
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(BadSample, match="bad_npy"):
        decode_npy(buffer.getvalue())
    buffer = io.BytesIO()
    np.save(buffer, np.ones((2, 3), dtype=np.float16))
    assert decode_npy(buffer.getvalue()).shape == (2, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 19)
    with pytest.raises(BadSample, match="image_too_large"):
        decode_image(png_bytes())
    assert decode_text("héllo".encode()) == "héllo"


# ----------------------------------------------------------------------------- loader


def test_loader_yields_collated_batches_deterministically(synth_train):
    batches = take(make_loader(synth_train, **LOADER), 6)
    assert batches[0]["image"].shape == (4, 3, 32, 32) and -1.0 <= batches[0]["image"].min() < 0.0
    assert all(isinstance(c, str) and c.startswith("a ") for c in batches[0]["caption"])
    again = take(make_loader(synth_train, **LOADER), 6)
    assert keys(batches) == keys(again)
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(batches, again))
    other_seed = take(make_loader(synth_train, **{**LOADER, "seed": 1}), 6)
    other_rank = take(make_loader(synth_train, **LOADER, rank=1, world_size=2), 6)
    assert keys(other_seed) != keys(batches) and keys(other_rank) != keys(batches)
    assert len({k for b in batches for k in b["key"]}) > 12  # a shuffled mix, not one shard in order


def resume_after(shard_dir, k: int, n: int, **kwargs) -> tuple[list[dict], list[dict]]:
    """Batches k..k+n-1 of an uninterrupted loader, and n batches of one resumed from its state after k."""
    loader = make_loader(shard_dir, **kwargs)
    batches = iter(loader)
    take(batches, k)
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint stores it
    following = take(batches, n)
    return following, take(make_loader(shard_dir, **kwargs, start_step=k, resume=state), n)


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert keys(a) == keys(b)
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(a, b, strict=True))
    assert [x["data_stats"] for x in a] == [y["data_stats"] for y in b]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("k", [1, 5])
def test_resume_from_the_saved_state_gives_the_batches_of_an_uninterrupted_run(synth_train, num_workers, k):
    # with 2 workers, the state is of the batches received, not of those the workers prefetched; after
    # k=1 batch, stream 1 has none and starts from its beginning
    following, resumed = resume_after(synth_train, k, 4, **LOADER, num_workers=num_workers)
    assert_same_batches(resumed, following)
    assert [b["data_stats"]["stream"] for b in following] == [i % LOADER_STREAMS for i in range(k, k + 4)]


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_the_batches_do_not_depend_on_the_worker_count(synth_train, num_workers):
    """The worker count is sized from each machine's CPUs, so it must not choose the data: batch i
    comes from stream i % LOADER_STREAMS whoever reads it, and a state saved under one count resumes
    under another."""
    alone = take(make_loader(synth_train, **LOADER), 10)
    assert_same_batches(take(make_loader(synth_train, **LOADER, num_workers=num_workers), 10), alone)
    first = make_loader(synth_train, **LOADER)
    take(first, 3)
    resumed = make_loader(synth_train, **LOADER, num_workers=num_workers, start_step=3, resume=first.state_dict())
    assert_same_batches(take(resumed, 7), alone[3:])


def test_a_worker_count_that_does_not_divide_the_streams_is_refused(synth_train):
    with pytest.raises(ValueError, match=f"num_workers must be 0 or divide the {LOADER_STREAMS}"):
        make_loader(synth_train, **LOADER, num_workers=3)


def test_a_resumed_mix_draws_the_sources_of_an_uninterrupted_one(synth_train, synth_other):
    following, resumed = resume_after([(synth_train, 3.0), (synth_other, 1.0)], 7, 4, **LOADER)
    assert_same_batches(resumed, following)
    assert all(len(b["data_stats"]["position"]["sources"]) == 2 for b in resumed)


@pytest.mark.parametrize("k", [2, 300])
def test_a_resume_decodes_nothing_before_its_position_whatever_the_step(synth_train, monkeypatch, k):
    """Resuming decodes exactly the samples after the saved position, and reads (not decodes) at most
    one shuffle block and the shard it starts in, the same at step 2 as at step 300."""
    decoded, members = [], []

    def recording(sample: dict) -> dict:
        decoded.append((sample["__url__"], sample["__key__"]))
        return decode_image_caption(sample)

    def counting(stream):
        for member in tar_file_iterator(stream):
            members.append(member["fname"])
            yield member

    monkeypatch.setattr(shard_loader, "tar_file_iterator", counting)
    loader = make_loader(synth_train, **LOADER, decode=recording)
    batches = iter(loader)
    take(batches, k)
    state, position = loader.state_dict(), len(decoded)
    take(batches, 3)
    following = decoded[position:]
    decoded.clear()
    members.clear()
    take(make_loader(synth_train, **LOADER, start_step=k, resume=state, decode=recording), 1)
    assert decoded == following[:LOADER["batch_size"]]  # one batch's decodes, the next after the position
    # members of at most the shard the block starts in and one block (3 per sample), and the one
    # read ahead to see where the last sample ends
    assert len(members) <= 3 * (SYNTH_SHARD + LOADER["shuffle_buffer"]) + 1


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_job_wide_stop_signal_leaves_the_workers_serving(synth_train, stop):
    """Slurm's preemption, Ctrl-C or `pkill -f` signal the workers as well as the trainer; the workers
    must keep serving batches so the trainer can finish its step and checkpoint (a dead worker fails
    the trainer's next batch, before it can save)."""
    expected = keys(take(make_loader(synth_train, **LOADER, num_workers=2), 5))
    before = {child.pid for child in multiprocessing.active_children()}
    batches = iter(make_loader(synth_train, **LOADER, num_workers=2))
    first = [next(batches)["key"]]
    workers = [child for child in multiprocessing.active_children() if child.pid not in before]
    assert len(workers) == 2
    for worker in workers:
        os.kill(worker.pid, stop)
    assert first + [next(batches)["key"] for _ in range(4)] == expected
    assert all(worker.is_alive() for worker in workers)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_before_a_worker_set_its_handlers_does_not_kill_it(synth_train, stop, monkeypatch):
    """The window the test above can only hit by chance, made certain: every worker signals itself before
    its handlers are installed. Workers are born with the stop signals blocked, so the signal waits and
    meets the handler; repeated, so a race would show."""
    real = shard_loader._defer_stop_signals

    def signalled_first(*args) -> None:
        os.kill(os.getpid(), stop)  # before the handlers: with the default action this would kill the worker
        real(*args)

    monkeypatch.setattr(shard_loader, "_defer_stop_signals", signalled_first)
    expected = keys(take(make_loader(synth_train, **LOADER, num_workers=2), 3))
    for _ in range(5):
        assert keys(take(make_loader(synth_train, **LOADER, num_workers=2), 3)) == expected


EXIT_WITH_LIVE_WORKERS = """
import multiprocessing, sys
from maskbench.data.loader import make_loader

LIVE = []


def train():
    LIVE.append(iter(make_loader(sys.argv[1], batch_size=4, seed=0, shuffle_buffer=16, num_workers=2)))
    next(LIVE[0])  # then exit with the iterator, and so its workers, still alive

if __name__ == "__main__":
    if sys.argv[2] == "main":
        train()
    else:
        child = multiprocessing.Process(target=train)
        child.start()
        child.join()
        sys.exit(child.exitcode)
"""


@pytest.mark.parametrize("trainer", ["main", "child"])
def test_a_trainer_exits_promptly_with_its_workers_still_alive(synth_train, tmp_path, trainer):
    """At exit, multiprocessing SIGTERMs the workers and joins them: workers that ignored SIGTERM for a
    job-wide stop must still end then, in the main process or a trainer run in a child process."""
    script = tmp_path / "exit_with_live_workers.py"
    script.write_text(EXIT_WITH_LIVE_WORKERS)
    done = subprocess.run([sys.executable, str(script), str(synth_train), trainer],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "killed by signal" not in done.stderr and "Exception ignored" not in done.stderr


def corrupt_shard_dir(tmp_path):
    """Good samples (g*), samples each bad in one way (b0-b3, a repeated b4) and a tar cut inside sample t06."""
    good = [m for i in range(12) for m in good_members(f"g{i:02d}")]
    truncated = tmp_path / "t.tar"
    write_tar(truncated, [m for i in range(12) for m in good_members(f"t{i:02d}")])
    bad = (
        good_members("b0")[:1] + [("b0.png", b"not an image"), ("b0.txt", b"c")]
        + good_members("b1")[:2] + [("b1.txt", b"   ")]
        + good_members("b2")[:2] + [("b2.txt", b"\xff\xfe caption")]
        + good_members("b3")[:2]  # no caption
        + good_members("b4") + good_members("b5") + good_members("b4")  # b4 again: duplicate key
    )
    shard_dir = raw_shard_dir(
        tmp_path / "shards",
        {"good.tar": good, "bad.tar": bad, "cut.tar": []},
    )
    (shard_dir / "cut.tar").write_bytes(truncated.read_bytes()[: 3 * 1024 * 5 + 700])  # cut inside sample 6
    return shard_dir


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_samples_are_skipped_and_counted(tmp_path, num_workers):
    loader = make_loader(corrupt_shard_dir(tmp_path), **LOADER, num_workers=num_workers, max_bad_fraction=0.5)
    batches = take(loader, 40)
    delivered = {k for b in batches for k in b["key"]}
    assert delivered <= {f"g{i:02d}" for i in range(12)} | {f"t{i:02d}" for i in range(5)} | {"b4", "b5"}
    assert {"g00", "t00", "b4", "b5"} <= delivered  # the first b4 is fine; its repeat is the duplicate
    assert set(loader.bad_counts()) == {
        "undecodable_image", "empty_caption", "non_utf8_text", "missing_caption", "duplicate_key", "truncated_tar"
    }
    assert sum(loader.bad_counts().values()) < loader.seen()


def test_a_resumed_stream_skips_and_counts_the_bad_samples_of_an_uninterrupted_one(tmp_path):
    # resuming at every step of the first blocks lands inside blocks holding skips counted as they were
    # read (duplicate key, truncation) and bad samples counted as decoded: counted once, as uninterrupted
    shard_dir = corrupt_shard_dir(tmp_path)
    loader = partial(make_loader, shard_dir, **LOADER, max_bad_fraction=0.5)
    full = take(loader(), 14 * LOADER_STREAMS)  # 14 batches of each stream
    assert {"duplicate_key", "truncated_tar", "undecodable_image"} <= set(full[-1]["data_stats"]["bad"])
    for k in range(1, 12 * LOADER_STREAMS, 3):  # 3 and the stream count are coprime: every stream, many depths
        first = loader()
        take(first, k)
        assert_same_batches(take(loader(start_step=k, resume=first.state_dict()), 3), full[k:k + 3])


def test_a_resume_state_of_another_loader_is_refused(synth_train, synth_other):
    loader = make_loader(synth_train, **LOADER)
    take(loader, 3)
    state = loader.state_dict()
    for change in (dict(batch_size=8), dict(seed=1), dict(shuffle_buffer=8), dict(world_size=3)):
        with pytest.raises(ValueError, match="resume state does not fit this loader"):
            make_loader(synth_train, **{**LOADER, **change}, start_step=3, resume=state)
    with pytest.raises(ValueError, match="resume state does not fit this loader .*data"):
        make_loader(synth_other, **LOADER, start_step=3, resume=state)
    with pytest.raises(ValueError, match="saved at step 3, not start_step=4"):
        make_loader(synth_train, **LOADER, start_step=4, resume=state)
    with pytest.raises(ValueError, match="needs resume"):
        make_loader(synth_train, **LOADER, start_step=3)


def test_loader_groups_members_by_the_rule_packing_and_verify_use(tmp_path):
    # A repeated field starts a new group (so the first occurrence wins and the repeat is a
    # duplicate key), and a member name without a field is dropped rather than crashing the loader.
    members = good_members("a") + [("a.txt", b"again"), ("nofield", b"x")] + good_members("b")
    loader = make_loader(raw_shard_dir(tmp_path / "shards", {"r.tar": members}), **LOADER)
    batches = take(loader, 3)
    assert {(k, c) for b in batches for k, c in zip(b["key"], b["caption"])} == {("a", "caption a"), ("b", "caption b")}
    assert set(loader.bad_counts()) == {"duplicate_key"}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_too_many_bad_samples_stops_the_run(tmp_path, num_workers):
    members = [m for i in range(20) for m in good_members(f"g{i:02d}")[:2] + [(f"g{i:02d}.txt", b"")]]
    members += good_members("ok")
    shard_dir = raw_shard_dir(tmp_path / "shards", {"empty.tar": members})
    loader = make_loader(shard_dir, **LOADER, num_workers=num_workers, max_bad_fraction=0.2, min_samples=30)
    with pytest.raises(TooManyBadSamples, match="empty_caption") as stopped:
        take(loader, 5)
    # The traceback's frames hold the DataLoader's iterator in a cycle: cleared, its workers shut down now (as a
    # trainer's exit ends them), not when the garbage collector next runs, from inside which the shutdown waits
    # out a 5 s join per worker in whatever test comes later.
    traceback.clear_frames(stopped.tb)


class CreatesMarker:
    """A pickle payload whose loading creates a file: the proof that something unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_members_are_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(CreatesMarker(str(marker)))
    members = [m for i in range(8) for m in good_members(f"g{i}") + [(f"g{i}.pickle", payload), (f"g{i}.pyd", payload)]]
    shard_dir = raw_shard_dir(tmp_path / "shards", {"p.tar": members})

    def keep_raw(sample: dict) -> dict:
        return {**decode_image_caption(sample), "pickle": sample["pickle"], "pyd": sample["pyd"]}

    for decode in (decode_image_caption, keep_raw):
        batches = take(make_loader(shard_dir, **LOADER, decode=decode), 3)
        assert len(batches) == 3
    assert batches[0]["pickle"] == [payload] * 4 and batches[0]["pyd"] == [payload] * 4  # still bytes
    assert not marker.exists()
    pickle.loads(payload)  # the control: this payload does act when unpickled
    assert marker.exists()


def test_make_loader_rejects_bad_arguments(synth_train, tmp_path):
    with pytest.raises(ValueError, match="rank"):
        make_loader(synth_train, batch_size=4, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="max_bad_fraction"):
        make_loader(synth_train, batch_size=4, seed=0, max_bad_fraction=1.0)
    with pytest.raises(ValueError, match="no shard manifest"):
        make_loader(tmp_path / "nothing", batch_size=4, seed=0)


def test_workers_are_sized_from_the_cpus_and_divide_the_streams():
    from maskbench.train.streams import loader_workers  # the trainer's choice, from what the loader accepts
    assert [auto_workers(cpus, loaders=1) for cpus in (1, 2, 3, 4, 6, 9, 16, 64)] == [0, 1, 2, 2, 4, 8, 8, 8]
    assert auto_workers(16, loaders=4) == 2  # 15 CPUs for 4 micro-batch loaders: 3 each, 2 divides the streams
    assert loader_workers(4, loaders=1) == 4
    with pytest.raises(ConfigError, match="data.num_workers must be one of"):
        loader_workers(3, loaders=1)
