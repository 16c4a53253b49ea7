"""Training on latent shards: `maskbench run data.path=<latent root>` reads channels and sizes from the data."""

from __future__ import annotations

import json
from pathlib import Path

from maskbench.config import load_config
from maskbench.data.encode import EncodeOptions, encode
from maskbench.results.leaderboard import read_rows
from maskbench.train.loop import train


def test_short_training_run_on_latent_shards(tmp_path: Path, opts: EncodeOptions, shards: Path) -> None:
    root = tmp_path / "latent"
    encode(shards, root / "train", opts, progress=False)
    encode(shards, root / "val", opts, progress=False)   # a real run encodes a held-out split here
    overrides = [
        f"paths.runs={tmp_path / 'runs'}", f"paths.leaderboard={tmp_path / 'lb.csv'}", f"data.path={root}",
        "data.name=brushdata", "model.patch_size=2", "model.width=32", "model.depth=1", "model.heads=2",
        "train.batch_size=2", "budget.flops=2e8", "eval.points=[1.0]", "eval.n_samples=2", "eval.val_samples=4",
        "eval.sampler_steps=2", "data.shuffle_buffer=4",
    ]
    run_dir = train(load_config(overrides))
    config = (run_dir / "config.yaml").read_text()
    assert "brushdata" in run_dir.name and (run_dir / "done.json").exists()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) >= 2 and all(s["loss"] > 0 for s in steps)
    rows = read_rows([tmp_path / "lb.csv"])
    assert len(rows) == 1 and rows[0]["resolution"] == 16 and rows[0]["val_loss"] > 0 and rows[0]["fid"] is None
    assert "patch_size: 2" in config
