"""data=mix: several shard roots sampled by weight, reproducibly."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from maskbench.config import load_config
from maskbench.data.loader import make_loader
from maskbench.data.shards import decode_image_caption
from maskbench.data.synth import write_synth
from maskbench.runs.launch import train
from tests.conftest import SMALL_EVAL, tiny_overrides


def _with_url(sample: dict) -> dict:
    return {**decode_image_caption(sample), "url": sample["__url__"]}


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """A second synth root (another seed, half the size), read by both tests."""
    return write_synth(tmp_path_factory.mktemp("mix") / "other", n_train=256, n_val=32, seed=7, shard_size=128)


def test_mixed_loader_draws_sources_by_weight_reproducibly(synth_root, other):
    sources = [(synth_root / "train", 3.0), (other / "train", 1.0)]
    loader = partial(make_loader, sources, batch_size=32, seed=0, shuffle_buffer=16, decode=_with_url)
    urls = [url for _, batch in zip(range(16), loader()) for url in batch["url"]]
    share = sum(str(other) in url for url in urls) / len(urls)
    assert 0.18 < share < 0.32, share          # 1/(3+1) = 0.25 of 512 draws
    again = [url for _, batch in zip(range(16), loader()) for url in batch["url"]]
    assert again == urls


def test_run_on_a_mix(tmp_path, synth_root, other):
    mix = f"data.mix=[{{path: {synth_root}, weight: 0.5}}, {{path: {other}, weight: 0.5}}]"
    run_dir = train(load_config(tiny_overrides(tmp_path, synth_root, "data=mix", mix, "eval.points=[1.0]", *SMALL_EVAL)))
    assert run_dir.name.startswith("mask75_then0-mix-") and (run_dir / "done.json").exists()
    assert json.loads((run_dir / "eval.jsonl").read_text())["dataset"] == "mix"
