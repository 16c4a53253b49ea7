"""Evaluation split over ranks: 2 CPU processes (gloo) give one process's metrics, each rank holds and scores
only its share of the eval set, and a failure on one rank ends both with one line naming it.

The two ranks are started as plain processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT), not under torchrun,
whose agent would kill the surviving rank itself: as on two nodes, each rank must end on its own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maskbench.config import load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.eval import standins
from maskbench.eval.evaluate import Evaluator, load_eval_set
from maskbench.models.build import build_model
from tests.conftest import randomized, tiny_overrides

RTOL = 1e-5  # float summation order: per-t loss sums added across ranks; observed identical on CPU
REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("rank_eval_worker.py")
# batches of 8 fall on the rank boundary, so both runs sample and measure the same batches
EVAL = ("eval.n_samples=16", "eval.val_samples=16", "eval.batch_size=8", "eval.bootstrap_resamples=20")


def two_ranks(out: Path, overrides: list[str], *flags: str) -> list[subprocess.CompletedProcess]:
    """Run tests/rank_eval_worker.py as ranks 0 and 1 of a gloo group; each one's exit code and output."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    command = [sys.executable, str(WORKER), str(out), *flags, "--", *overrides]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=150) for rank in ranks]  # a hang fails here, not in a timed assert
    finally:
        for rank in ranks:
            rank.kill()
    return [subprocess.CompletedProcess(command, rank.returncode, *output) for rank, output in zip(ranks, outputs)]


def test_two_ranks_give_one_process_metrics_each_scoring_its_share(tmp_path: Path, synth_root: Path) -> None:
    overrides = tiny_overrides(tmp_path, synth_root, *EVAL, f"eval.clip_model={standins.write_clip(tmp_path / 'clip')}")
    cfg = load_config(overrides)
    data = resolve_dataset(cfg.data, cfg.paths.data)
    one = Evaluator(data, cfg.eval, torch.device("cpu")).evaluate(randomized(build_model(cfg.model, data), 0.05),
                                                                  tmp_path / "one")
    done = two_ranks(tmp_path, overrides)
    assert all(rank.returncode == 0 for rank in done), done[0].stderr[-3000:] + done[1].stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    two = ranks[0]["result"]
    assert ranks[1]["result"] is None and list(two) == list(one)
    for name, value in one.items():
        if name != "grid":
            assert two[name] == (value if isinstance(value, str) else pytest.approx(value, rel=RTOL)), name
    assert {"fid_se", "clip_score_se", "val_loss_se", "align_acc"} <= one.keys() and one["fid_n"] == 16
    assert [rank["scored"] for rank in ranks] == [[8], [8]]  # each rank scored its own half of the images
    assert len(list((tmp_path / "samples").glob("[0-9]*.png"))) == 16 and Path(two["grid"]).is_file()


def test_a_failure_on_one_rank_ends_both_naming_it(tmp_path: Path, synth_root: Path) -> None:
    done = two_ranks(tmp_path, tiny_overrides(tmp_path, synth_root, *EVAL), "--fail")
    assert [rank.returncode != 0 for rank in done] == [True, True]
    assert done[1].stderr.strip().splitlines()[-1].endswith("ValueError: injected on rank 1")  # torch adds "[rank1]: "
    last = done[0].stderr.strip().splitlines()[-1]
    assert last.endswith("RuntimeError: evaluation failed on rank 1: ValueError: injected on rank 1"), last


def test_each_rank_holds_only_its_shares_of_the_prompts_and_val_samples(tmp_path: Path, synth_root: Path) -> None:
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "eval.n_samples=12", "eval.val_samples=16"))
    data = resolve_dataset(cfg.data, cfg.paths.data)
    whole = load_eval_set(data, 16)
    # rank 0: prompts 0-5, val samples 0-7; rank 1: prompts 6-11, val samples 8-15
    for rank, held in ((0, range(8)), (1, range(6, 16))):
        evalset = Evaluator(data, cfg.eval, torch.device("cpu"), scores=False, rank=rank, world=2).evalset
        assert evalset.indices == list(held) and len(evalset.images) == len(held)
        assert torch.equal(evalset.images, whole.images[held.start:held.stop])
        assert evalset.captions == whole.captions[held.start:held.stop]
        assert evalset.meta == whole.meta[held.start:held.stop]
