"""End-to-end training on a small synth dataset: determinism, resume, corrupt data, learning."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

from maskbench.cli import main
from maskbench.config import load_config
from maskbench.results.rows import COLUMNS, read_rows
from maskbench.runs.launch import train
from tests.conftest import SMALL_EVAL, tiny_overrides


def _run(tmp: Path, synth_root: Path, *extra: str) -> Path:
    return train(load_config(tiny_overrides(tmp, synth_root, *extra)))


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict:
    return load_file(run_dir / "checkpoints" / "point-1" / "model.safetensors")


# Two phases (20 masked steps, 2 unmasked) and a cooled horizon (eval points 0.5 and 1, its branch 1 unmasked step);
# no eval metric is read: the smallest evaluation.
REFERENCE = ("arm=mask75_then0", "budget.flops=1.5e9", *SMALL_EVAL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, synth_root) -> Path:
    """The REFERENCE run, trained once: what the same-seed, resume and compile tests each compare a run with."""
    return _run(tmp_path_factory.mktemp("reference"), synth_root, *REFERENCE)


def test_same_seed_gives_identical_loss_trace(tmp_path, synth_root, reference):
    a = reference
    b = _run(tmp_path / "b", synth_root, *REFERENCE)
    assert a.name == b.name
    assert len(_losses(a)) > 5 and _losses(a) == _losses(b)
    c = _run(tmp_path / "c", synth_root, *REFERENCE, "seed=1", "train.stop_at_step=4")  # its first 4 steps
    assert len(_losses(c)) == 4 and _losses(c) != _losses(a)[:4]


def test_stop_mid_phase_and_resume_is_bit_identical(tmp_path, synth_root, reference):
    full = reference
    stopped = _run(tmp_path / "resumed", synth_root, *REFERENCE, "train.stop_at_step=3")
    assert not (stopped / "done.json").exists()
    assert json.loads((stopped / "checkpoints" / "step-00000003" / "meta.json").read_text())["step"] == 3
    resumed = _run(tmp_path / "resumed", synth_root, *REFERENCE)
    assert resumed == stopped and (resumed / "done.json").exists()
    assert _losses(resumed) == _losses(full)
    wa, wb = _weights(full), _weights(resumed)
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    ema_a = (full / "checkpoints" / "point-1" / "custom_checkpoint_0.pkl").read_bytes()
    ema_b = (resumed / "checkpoints" / "point-1" / "custom_checkpoint_0.pkl").read_bytes()
    assert ema_a == ema_b


def test_a_resume_decodes_no_sample_before_its_position(tmp_path, synth_root, monkeypatch):
    """Resuming seeks: the resumed process decodes exactly the samples of the steps it has left, whether it
    resumes early or late (a replay would decode every earlier step's batch again)."""
    import maskbench.train.streams as streams

    decoded, real_decoder = [], streams.loader_decoder

    def counting_decoder(data, model_cfg):
        decode = real_decoder(data, model_cfg)
        return lambda sample: decoded.append(sample["__key__"]) or decode(sample)

    monkeypatch.setattr(streams, "loader_decoder", counting_decoder)
    extra = ("arm=mask0", "eval.points=[1.0]", "budget.flops=2e9", *SMALL_EVAL, "data.num_workers=0")  # decoded here
    _run(tmp_path, synth_root, *extra, "train.stop_at_step=2")
    # one run, resumed early (at step 2, stopped again at 9) and late (at 9, to its end)
    for start, stop in ((2, 9), (9, None)):
        decoded.clear()
        resumed = _run(tmp_path, synth_root, *extra, *([f"train.stop_at_step={stop}"] if stop else []))
        steps = len(_losses(resumed))
        assert steps == stop if stop else steps > 9, steps  # stopped at 9, or trained on to its end
        assert len(decoded) == (steps - start) * 8, (start, steps, len(decoded))


# Two eval points and the tiny evaluation in full (8 samples, the bootstrap, the grid).
FINISHED = ("arm=mask75", "budget.flops=1e9")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, synth_root) -> Path:
    """The FINISHED run, trained once, in ROOT/runs with its rows in ROOT/leaderboard.csv. Read only."""
    return _run(tmp_path_factory.mktemp("finished"), synth_root, *FINISHED)


def test_finished_run_is_not_retrained(tmp_path, synth_root, capsys, finished):
    root = shutil.copytree(finished.parent.parent, tmp_path / "root")
    run_dir = root / "runs" / finished.name
    before = (run_dir / "metrics.jsonl").read_text()
    assert main(["run", *tiny_overrides(root, synth_root, *FINISHED)]) == 0
    assert "not retraining" in capsys.readouterr().out
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_run_writes_checkpoints_grid_metrics_and_leaderboard_rows(finished):
    run_dir = finished
    names = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert {"point-0.5", "point-1"} <= names  # and the trunk's checkpoint at the 0.5 horizon's fork
    assert all(name.startswith("step-") for name in names - {"point-0.5", "point-1"})
    for point in ("point-0.5", "point-1"):
        assert (run_dir / "samples" / point / "grid.png").stat().st_size > 0
        assert len(list((run_dir / "samples" / point).glob("0*.png"))) == 8
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert {"loss", "lr", "grad_norm", "mask_ratio", "flops", "seconds", "data_wait"} <= first.keys()
    assert first["mask_ratio"] == 0.75
    rows = read_rows([finished.parent.parent / "leaderboard.csv"])
    assert [r["point"] for r in rows] == [0.5, 1.0]
    assert all(r["arm"] == "mask75" and r["val_loss"] > 0 and r["train_flops"] > 0 for r in rows)
    assert all(r["fid_features"] == "oracle-synth-v1" and r["fid"] > 0 and r["fid_n"] == 8 for r in rows)
    assert all(0.0 <= r["align_acc"] <= 1.0 and r["clip_score"] is None for r in rows)
    assert rows[-1]["train_flops"] <= 1e9


def test_a_trained_point_fills_every_schema_column_it_knows_and_no_other(finished):
    """The row a run writes (`record.leaderboard_row`, kept as written in eval.jsonl) names each column of the
    leaderboard schema, `source` empty (a reference row's only): a column declared and never written is refused
    by `leaderboard.complete_row` before the row is written (one written and never declared, `append_rows`
    refuses)."""
    record = json.loads((finished / "eval.jsonl").read_text().splitlines()[-1])
    written = {key for key in record if key in COLUMNS}
    assert written == set(COLUMNS) and record["source"] is None


def _add_corrupt_samples(src: Path, dst: Path) -> None:
    """Copy the dataset, and put undecodable / captionless / non-UTF-8 samples at the start of every
    training shard: whichever shard the loader draws first, its first block holds them."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "train" / "manifest.json").read_text())
    for index, entry in enumerate(manifest["shards"]):
        shard = dst / "train" / entry["name"]
        with tarfile.open(shard) as tar:
            good = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        key = f"9{index:02d}"
        bad = {f"{key}0.png": b"not a png", f"{key}0.txt": b"a red circle", f"{key}1.png": _a_png(src),
               f"{key}1.txt": b"", f"{key}2.png": _a_png(src), f"{key}2.txt": b"\xff\xfe bad"}
        with tarfile.open(shard, "w") as tar:
            for name, data in [*bad.items(), *((m.name, data) for m, data in good)]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        entry.update(count=entry["count"] + 3, sha256="", bytes=shard.stat().st_size)
        manifest["total"] += 3
    (dst / "train" / "manifest.json").write_text(json.dumps(manifest))


def _a_png(src: Path) -> bytes:
    with tarfile.open(next((src / "val").glob("*.tar"))) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".png"))
        return tar.extractfile(member).read()


def test_corrupt_samples_are_skipped_and_counted(tmp_path, synth_root):
    data = tmp_path / "corrupt"
    _add_corrupt_samples(synth_root, data)
    run_dir = train(load_config(tiny_overrides(tmp_path, synth_root, "arm=mask0", f"data.path={data}",
                                               "data.max_bad_fraction=0.99", "budget.flops=1e9", *SMALL_EVAL,
                                               "eval.points=[1.0]", "data.shuffle_buffer=8")))  # a block: a batch
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["bad_samples"].get("undecodable_image", 0) > 0
    assert last["bad_samples"].get("empty_caption", 0) > 0 and last["bad_samples"].get("non_utf8_text", 0) > 0
    assert (run_dir / "done.json").exists()


@pytest.mark.slow
def test_short_run_lowers_validation_loss(tmp_path, synth_root):
    # 64 steps: the val loss falls to ~0.65 of the first point's (3 seeds; 3e10's 194 steps: ~0.61)
    run_dir = _run(tmp_path, synth_root, "arm=mask0", "budget.flops=1e10", "eval.points=[0.05,1.0]",
                   "train.lr=2e-3", "eval.n_samples=2", "eval.bootstrap_resamples=0", "eval.grid_size=1",
                   "data.num_workers=0")
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["val_loss"] < 0.9 * evals[0]["val_loss"], evals


def test_rank_shares_cover_the_prompts_in_order():
    from maskbench.eval.evaluate import rank_share

    for n, world in ((8, 2), (7, 3), (2, 4)):
        shares = [rank_share(n, rank, world) for rank in range(world)]
        assert [i for share in shares for i in share] == list(range(n))


def test_the_loader_tokenizes_captions_off_the_training_step(synth_root):
    import functools

    import torch

    from maskbench.data.loader import make_loader
    from maskbench.data.shards import decode_image_caption
    from maskbench.models.text import tokenize, with_token_ids

    decode = functools.partial(with_token_ids, decode=decode_image_caption, context_len=24)
    batch = next(iter(make_loader(synth_root / "train", batch_size=4, seed=0, shuffle_buffer=8, decode=decode)))
    ids, mask = tokenize(batch["caption"], 24)
    assert torch.equal(batch["txtids"], ids) and torch.equal(batch["txtmask"], mask)


def test_compiled_training_matches_eager(tmp_path, synth_root, monkeypatch, reference):
    """train.compile=true trains through the torch.compile wrapper (an OptimizedModule, which has no truth
    value); dynamo's eager backend stands in for inductor so the check costs seconds, not a C++ build."""
    import functools

    import torch

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    eager = _losses(reference)
    compiled = _losses(_run(tmp_path / "compiled", synth_root, *REFERENCE, "train.compile=true"))
    assert len(compiled) == len(eager) > 5
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
