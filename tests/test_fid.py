"""Fréchet distance, feature statistics, offline Inception loading, multi-rank gathering."""

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from cleanfid.fid import get_files_features
from cleanfid.inception_torchscript import InceptionV3W
from PIL import Image
from scipy import linalg
from torch import nn

from maskbench.eval.fid import (
    FeatureStats,
    InceptionFeatures,
    MissingWeights,
    frechet_distance,
    frechet_of_features,
    load_stats,
    reference_stats,
    save_stats,
)


def scipy_fd(a: np.ndarray, b: np.ndarray) -> float:
    """The textbook formula with scipy's sqrtm, as an independent reference."""
    mu1, mu2, s1, s2 = a.mean(0), b.mean(0), np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(linalg.sqrtm(s1 @ s2).real))


def test_frechet_distance_matches_scipy_sqrtm():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(400, 32))
    b = rng.normal(size=(300, 32)) @ rng.normal(size=(32, 32)) * 0.5 + 0.3
    ours = frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))
    assert ours == pytest.approx(scipy_fd(a, b), rel=1e-6)
    assert ours > 1.0


def test_frechet_distance_rank_deficient_is_real_and_zero_on_itself():
    """Fewer samples than dimensions (256 samples of 2048-d Inception features at eval)."""
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(20, 64)), rng.normal(size=(20, 64))
    s = np.cov(a, rowvar=False)
    assert frechet_distance(a.mean(0), s, a.mean(0), s) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance(a.mean(0), s, b.mean(0), np.cov(b, rowvar=False)) == pytest.approx(scipy_fd(a, b), rel=1e-6)


@pytest.mark.parametrize(("rows", "dim"), [(20, 64), (300, 32)])  # fewer rows than dimensions, and more
def test_the_distance_of_feature_rows_is_the_textbook_one(rows, dim):
    """`frechet_of_features` (an N×N eigen-decomposition where N < F) against scipy's sqrtm and `frechet_distance`."""
    rng = np.random.default_rng(3)
    a = rng.normal(size=(rows, dim))
    b = rng.normal(size=(400, dim)) @ rng.normal(size=(dim, dim)) * 0.5 + 0.3
    reference = FeatureStats.from_features(b, "f")
    ours = frechet_of_features(a, reference, "f")
    assert ours == pytest.approx(scipy_fd(a, b), rel=1e-6)
    # With N < F, the F×F path takes square roots of F - N + 1 rounding-level eigenvalues (|λ| ~ 1e-14 here: ~3e-6 in
    # all); the N×N one has none of them. Beyond that the two agree.
    assert ours == pytest.approx(reference.frechet_distance(FeatureStats.from_features(a, "f")), rel=1e-7)
    with pytest.raises(ValueError, match="cannot compare 'f' features with 'g' features"):
        frechet_of_features(a, reference, "g")


def test_frechet_distance_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


def test_stats_roundtrip_and_feature_name_guard(tmp_path):
    rng = np.random.default_rng(2)
    stats = FeatureStats.from_features(rng.normal(size=(50, 8)), "oracle-synth-v1")
    path = tmp_path / "stats" / "ref.npz"
    save_stats(path, stats)
    loaded = load_stats(path)
    assert loaded.n == 50 and loaded.features_name == "oracle-synth-v1"
    np.testing.assert_array_equal(loaded.sigma, stats.sigma)
    assert loaded.frechet_distance(stats) == pytest.approx(0.0, abs=1e-9)
    other = FeatureStats(stats.mu, stats.sigma, 50, "inception-2015-12-05-clean")
    with pytest.raises(ValueError, match="cannot compare"):
        stats.frechet_distance(other)


class _TinyLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, kernel_size=13, stride=13)
        self.fc = nn.Linear(16, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))[:, :, None, None]  # B×2048×1×1 like pool3


class _TinyInception(nn.Module):
    """Same TorchScript interface as inception-2015-12-05.pt: a `layers` submodule on 299×299 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _TinyLayers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@pytest.fixture
def tiny_inception(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "inception-2015-12-05.pt"
    torch.jit.script(_TinyInception()).save(str(path))
    return path


def test_inception_features_match_clean_fid_pipeline(tiny_inception, tmp_path):
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(5, 32, 32, 3), dtype=np.uint8)
    files = []
    for i, image in enumerate(images):
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(image).save(files[-1])
    clean_fid_model = InceptionV3W(str(tmp_path), download=False)
    expected = get_files_features(
        files, model=clean_fid_model, num_workers=0, batch_size=2, device="cpu", mode="clean", verbose=False
    )

    ours = InceptionFeatures(str(tiny_inception), device="cpu", batch_size=2)(torch.from_numpy(images))
    assert ours.shape == (5, 2048)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)

    stats = reference_stats([images[:3], images[3:]], InceptionFeatures(str(tiny_inception)), tmp_path / "ref.npz")
    assert stats.n == 5 and load_stats(tmp_path / "ref.npz").features_name == "inception-2015-12-05-clean"


@pytest.mark.parametrize("path", [None, "/nonexistent/inception-2015-12-05.pt"])
def test_missing_inception_weights_names_file_and_option(path):
    with pytest.raises(MissingWeights) as info:
        InceptionFeatures(path)
    message = str(info.value)
    assert "\n" not in message
    assert "inception-2015-12-05.pt" in message and "eval.inception_weights=PATH" in message
    assert message.count("https://") == 1


def test_inception_rejects_float_images(tiny_inception):
    with pytest.raises(ValueError, match="uint8"):
        InceptionFeatures(str(tiny_inception))(np.zeros((1, 32, 32, 3), np.float32))


GATHER_SCRIPT = """
import json, os, sys
import numpy as np, torch
from accelerate import Accelerator
from maskbench.eval.fid import gather_to_main
# the process group through a file in the test's folder (no port to pick); Accelerate takes it from the env as torchrun's
torch.distributed.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=int(os.environ["RANK"]),
                                     world_size=int(os.environ["WORLD_SIZE"]))
acc = Accelerator(cpu=True)
rank = acc.process_index
held = []  # the rows each gather call leaves on this rank: its send, and on the main process what it receives
original = torch.distributed.gather
def counting(tensor, gather_list=None, dst=0):
    held.append(tensor.shape[0] + sum(t.shape[0] for t in gather_list or []))
    return original(tensor, gather_list, dst=dst)
torch.distributed.gather = counting
local = np.stack([np.full(4, 10 * rank + i, dtype=np.float32) for i in range(5 - 2 * rank)])  # 5 rows, then 3
gathered = gather_to_main(local, acc, chunk=2)
json.dump({"gathered": None if gathered is None else gathered[:, 0].tolist(), "held": held},
          open(f"{sys.argv[1]}-{rank}.json", "w"))
acc.wait_for_everyone()
acc.end_training()  # destroy the process group, so no rank exits mid-collective
"""


def test_only_the_main_process_gathers_the_rows_in_rank_order_a_chunk_at_a_time(tmp_path):
    """Uneven shares (5 rows and 3), 2 rows a round: rank 0 gets all 8 in order, rank 1 nothing; no gather call
    holds more than a round's rows on either rank (2 sent, plus 2 × 2 received on rank 0)."""
    script = tmp_path / "gather.py"
    script.write_text(textwrap.dedent(GATHER_SCRIPT))
    out = tmp_path / "gathered"
    # the 2 ranks started as torchrun starts them (its env), without a launcher process of their own
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank-{rank}.err" for rank in (0, 1)]
    ranks = []
    for rank, log in enumerate(logs):
        with log.open("w") as stderr:
            ranks.append(subprocess.Popen([sys.executable, str(script), str(out), str(tmp_path / "store")],
                                          env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stderr=stderr))
    deadline = time.monotonic() + 120
    try:  # as torchrun's launcher: until both exit, or one fails (the other would wait for it)
        while any(p.poll() is None for p in ranks) and not any(p.poll() for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    main, other = (json.loads((tmp_path / f"gathered-{rank}.json").read_text()) for rank in (0, 1))
    assert main["gathered"] == [0, 1, 2, 3, 4, 10, 11, 12] and other["gathered"] is None
    assert main["held"] == [2 + 2 * 2] * 3 and other["held"] == [2] * 3  # 3 rounds: ceil(5 / 2)
