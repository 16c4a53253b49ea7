"""The gradient-fidelity probe: the debiased cosine on gradients of known correlation, and the probe end to end."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch

from maskbench.cli import main
from maskbench.config import load_config
from maskbench.errors import ConfigError
from maskbench.results.estimators import debiased_cosine
from maskbench.runs import gradfid
from maskbench.runs.gradfid import probe_gradfid
from maskbench.runs.launch import train
from tests.conftest import FAST, tiny_overrides

DIM, N, TRUE_COS, NOISE = 2000, 16, 0.6, 0.1  # per-coordinate noise: |noise|² = 20 × |signal|²


def grams(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return a @ a.T, b @ b.T, a @ b.T


@pytest.fixture
def noisy_pair() -> tuple[np.ndarray, np.ndarray]:
    """N paired noisy gradients whose unit-norm means have cosine TRUE_COS."""
    rng = np.random.default_rng(0)
    u, v = np.linalg.qr(rng.standard_normal((DIM, 2)))[0].T                      # orthonormal, DIM each
    mean_a, mean_b = u, TRUE_COS * u + math.sqrt(1 - TRUE_COS ** 2) * v
    return (mean_a + NOISE * rng.standard_normal((N, DIM)),
            mean_b + NOISE * rng.standard_normal((N, DIM)))


def test_debiased_cosine_recovers_known_correlation_that_the_naive_one_misses(noisy_pair):
    est = debiased_cosine(*grams(*noisy_pair))
    assert est.n == N
    assert est.ci_lo <= TRUE_COS <= est.ci_hi and abs(est.cosine - TRUE_COS) < 0.1
    assert 0 < est.ci_hi - est.ci_lo < 0.4
    assert abs(est.naive) < 0.15  # noise drags the per-batch cosine towards 0, far outside the interval
    assert est.naive < est.ci_lo


def test_debiased_cosine_is_one_for_identical_routes(noisy_pair):
    a, _ = noisy_pair
    est = debiased_cosine(*grams(a, a))
    assert est.cosine == pytest.approx(1.0) and est.ci_lo == pytest.approx(1.0) and est.ci_hi == pytest.approx(1.0)


def test_debiased_cosine_is_nan_without_signal(noisy_pair):
    a, b = noisy_pair
    pure_noise = a - a.mean(0)  # mean exactly 0: the distinct-batch estimate of |E a|² is negative
    est = debiased_cosine(*grams(pure_noise, b))
    assert math.isnan(est.cosine) and math.isnan(est.ci_lo) and math.isnan(est.ci_hi)
    assert math.isfinite(est.naive)


def test_debiased_cosine_refuses_too_few_batches():
    with pytest.raises(ValueError, match="n >= 3"):
        debiased_cosine(*grams(np.ones((2, 4)), np.ones((2, 4))))


def test_group_sums_keep_the_estimate_unbiased(noisy_pair):
    """Sums of 4 batches are batches of a bigger size: the estimator on 4 group sums still finds the cosine."""
    a, b = (x.reshape(4, N // 4, DIM).sum(1) for x in noisy_pair)                # 4×DIM group sums
    est = debiased_cosine(*grams(a, b))
    assert est.n == 4 and est.ci_lo <= TRUE_COS <= est.ci_hi


BIN_COSINES = (0.999, 0.99, 0.9, 0.6)   # per-bin true cosine of a demotion route: gaps 0.001, 0.01, 0.1, 0.4


def _bin_sums(cosine: float, rng: np.random.Generator, noise: float = 0.02, n: int = 12) -> torch.Tensor:
    """n×3×DIM stacks (full, demotion route, self-floor) whose expectations have known cosines: route
    `cosine`, floor 1. Each is its unit mean plus independent per-batch noise."""
    u, v = np.linalg.qr(rng.standard_normal((DIM, 2)))[0].T                      # orthonormal, DIM each
    means = np.stack([u, cosine * u + math.sqrt(1 - cosine ** 2) * v, u])       # 3×DIM
    return torch.from_numpy(means + noise * rng.standard_normal((n, 3, DIM))).float()


def test_certifier_passes_exactly_the_bins_whose_gap_is_surely_below_eps() -> None:
    """Bins 0-1 (gaps 0.001, 0.01) are below eps 0.05 by far more than the noise, bins 2-3 (0.1, 0.4) far
    above it: exactly the first two pass, and they form one window. The floor's gap is about 0."""
    rng = np.random.default_rng(0)
    routes = (gradfid.demote_step(0.75), gradfid.FLOOR)
    edges = gradfid.t_bins(len(BIN_COSINES))
    rows = [row for cosine, t_bin in zip(BIN_COSINES, edges)
            for row in gradfid.bin_rows(_bin_sums(cosine, rng), np.zeros(2), routes, t_bin, 12, len(BIN_COSINES))]
    demoted = [row for row in rows if row["route"] == "demote0.75"]
    assert [row["gap"] for row in demoted] == pytest.approx([1 - c for c in BIN_COSINES], abs=0.01)
    assert all(row["gap"] < row["gap_hi"] < row["gap"] + 0.03 for row in demoted)
    assert all(abs(row["gap"]) < 0.01 for row in rows if row["route"] == "native2")
    assert gradfid.certify(rows, eps=0.05) == [{"ratio": 0.75, "t": [0.0, 0.5], "priority": 0}]
    assert gradfid.certify(rows, eps=0.2) == [{"ratio": 0.75, "t": [0.0, 0.75], "priority": 0}]
    assert gradfid.certify(rows, eps=0.5) == [{"ratio": 0.75, "t": [0.0, 1.0], "priority": 0}]


def test_bonferroni_widens_the_bound_with_the_bins_tested() -> None:
    """The same bin's upper bound is z(1 − 0.05/K)·se above its gap: wider with 8 bins than with 1."""
    stack = _bin_sums(0.9, np.random.default_rng(1))
    routes = (gradfid.demote_step(0.75), gradfid.FLOOR)
    one, eight = (gradfid.bin_rows(stack, np.zeros(2), routes, (0.0, 1.0), 12, k)[0] for k in (1, 8))
    assert one["gap"] == eight["gap"]
    ratio = (eight["gap_hi"] - eight["gap"]) / (one["gap_hi"] - one["gap"])
    assert ratio == pytest.approx(scipy.stats.norm.ppf(1 - 0.05 / 8) / scipy.stats.norm.ppf(0.95))


def test_roundtrip_gap_is_subtracted_from_demotion_routes_only() -> None:
    """A route as far from full as the round trip is (cos 0.9 both) has a corrected gap of about 0; the
    mask route beside them keeps its own gap."""
    rng = np.random.default_rng(2)
    u, v = np.linalg.qr(rng.standard_normal((DIM, 2)))[0].T
    off = 0.9 * u + math.sqrt(1 - 0.81) * v
    means = np.stack([u, off, off, off])                                         # full, demote, mask, roundtrip
    stack = torch.from_numpy(means + 0.02 * rng.standard_normal((12, 4, DIM))).float()
    routes = (gradfid.demote_step(0.75), gradfid.ProbeStep("mask50", 0.5), gradfid.ROUNDTRIP)
    demoted, masked, _ = gradfid.bin_rows(stack, np.zeros(3), routes, (0.0, 1.0), 12, 1)
    assert abs(demoted["gap"]) < 0.01 and masked["gap"] == pytest.approx(0.1, abs=0.01)


def test_certified_routes_give_deeper_demotion_the_priority_and_split_at_failing_bins() -> None:
    def row(ratio, t_lo, gap_hi):
        return {"ratio": ratio, "t_lo": t_lo, "t_hi": t_lo + 0.25, "gap_hi": gap_hi}
    rows = [row(0.75, 0.0, 0.01), row(0.75, 0.25, 0.2), row(0.75, 0.5, 0.01), row(0.75, 0.75, 0.01),
            row(0.5, 0.0, math.nan), row(0.5, 0.25, 0.2), row(0.5, 0.5, 0.2), row(0.5, 0.75, 0.01),
            row(1.0, 0.0, 0.0)]                                                 # a control: never a route
    assert gradfid.certify(rows, 0.05) == [{"ratio": 0.5, "t": [0.75, 1.0], "priority": 1},
                                           {"ratio": 0.75, "t": [0.0, 0.25], "priority": 0},
                                           {"ratio": 0.75, "t": [0.5, 1.0], "priority": 0}]


def test_anima_gap_is_the_native_pair_cosine_minus_the_routes_mean_cosine_to_them() -> None:
    """By hand: full (1, 0, 0), route (0.6, 0, 0.8), second native (0.8, 0.6, 0): cos(full, native2) = 0.8,
    cos(full, route) = 0.6, cos(native2, route) = 0.48, so the gap is 0.8 − (0.6 + 0.48)/2 = 0.26; the
    self-floor has none (it is one of the two native estimates)."""
    stack = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.0, 0.8], [0.8, 0.6, 0.0]])      # full, route, native2
    gaps = gradfid.anima_gaps(gradfid.gram(stack), (gradfid.demote_step(0.5), gradfid.FLOOR))
    assert gaps[0] == pytest.approx(0.26) and math.isnan(gaps[1])


def test_anima_gap_columns_are_the_batch_mean_and_its_bonferroni_bound() -> None:
    stack = _bin_sums(0.9, np.random.default_rng(3))
    per_batch = np.array([[0.1, np.nan], [0.3, np.nan], [0.2, np.nan], [0.4, np.nan]])  # 4 batches × 2 routes
    routes = (gradfid.demote_step(0.75), gradfid.FLOOR)
    row = gradfid.bin_rows(stack, np.zeros(2), routes, (0.0, 1.0), 12, 8, anima=per_batch)[0]
    se = np.std([0.1, 0.3, 0.2, 0.4], ddof=1) / 2
    assert row["anima_gap"] == pytest.approx(0.25)
    assert row["anima_gap_hi"] == pytest.approx(0.25 + scipy.stats.norm.ppf(1 - 0.05 / 8) * se)


def test_anima_protocol_certifies_within_the_round_trip_band_and_eps_alone_on_pixels() -> None:
    """Latents: a bin passes where its anima bound is below the round trip's bound in that bin + eps (0.03 <
    0.05 + 0.01 passes, 0.09 does not), whatever the debiased gap says; pixels (no round trip): eps alone."""
    def row(route, ratio, t_lo, anima_hi, gap_hi=0.2):
        return {"route": route, "ratio": ratio, "t_lo": t_lo, "t_hi": t_lo + 0.5, "gap_hi": gap_hi,
                "anima_gap_hi": anima_hi}
    demoted = [row("demote0.5", 0.5, 0.0, 0.03), row("demote0.5", 0.5, 0.5, 0.09)]
    band = [row("roundtrip", 1.0, 0.0, 0.05), row("roundtrip", 1.0, 0.5, 0.05)]
    assert gradfid.certify(demoted + band, 0.01, "anima") == [{"ratio": 0.5, "t": [0.0, 0.5], "priority": 0}]
    assert gradfid.certify(demoted + band, 0.01) == []                            # the debiased gap: 0.2
    assert gradfid.certify(demoted, 0.01, "anima") == []                          # no band: 0.03 >= 0.01
    assert gradfid.certify(demoted, 0.05, "anima") == [{"ratio": 0.5, "t": [0.0, 0.5], "priority": 0}]
    with pytest.raises(ConfigError, match="unknown probe protocol 'anim'"):
        gradfid.certify(demoted, 0.05, "anim")


def test_group_count_holds_every_batch_when_it_fits_and_refuses_below_three():
    gb = 1e9
    assert gradfid.group_count(16, int(0.1 * gb), max_memory_gb=16) == 16
    assert gradfid.group_count(16, int(3 * gb), max_memory_gb=16) == 5
    with pytest.raises(ConfigError, match="raise --max-memory-gb to 21.0"):
        gradfid.group_count(16, int(7 * gb), max_memory_gb=16)


def test_gram_in_chunks_equals_the_fp64_product(monkeypatch):
    monkeypatch.setattr(gradfid, "GRAM_CHUNK", 7)
    vectors = torch.randn(5, 100)
    exact = vectors.double() @ vectors.double().T
    np.testing.assert_allclose(gradfid.gram(vectors), exact.numpy(), rtol=1e-12)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, paired_runs) -> Path:
    """A tiny trained synth mask0 run (test_paired_draws' own), copied: the probe writes into it."""
    return Path(shutil.copytree(paired_runs["mask0"], tmp_path_factory.mktemp("gradfid") / paired_runs["mask0"].name))


def test_probe_writes_map_of_every_route_and_bin(run_dir, capsys):
    assert main(["probe", "gradfid", str(run_dir), "--bins", "2", "--batches", "4", "--batch-size", "16"]) == 0
    assert "gradfid.png" in capsys.readouterr().out
    with open(run_dir / "probe" / "gradfid.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["route"], r["t_lo"]) for r in rows} == {(route, t_lo) for route in ("mask50", "mask75", "sprint75",
                                                                                     "down2", "native2")
                                                        for t_lo in ("0.0", "0.5")}
    for row in rows:
        cosine, lo, hi = float(row["cosine"]), float(row["ci_lo"]), float(row["ci_hi"])
        assert row["n_batches"] == row["groups"] == "4" and -1.5 <= cosine <= 1.5 and lo <= cosine <= hi
    assert (run_dir / "probe" / "gradfid.png").stat().st_size > 0


def test_probe_is_deterministic_and_pairs_routes_with_the_full_gradient(run_dir, monkeypatch):
    """Same seed, same rows; a 'route' that keeps every token sees the same x0/noise/t, so its cosine is 1."""
    monkeypatch.setattr(gradfid, "MASK_STEPS", (gradfid.ProbeStep("mask0", 0.0),))
    rows = probe_gradfid(run_dir, bins=1, batches=3, batch_size=4)
    assert [r["route"] for r in rows] == ["mask0", "down2", "native2"]
    assert rows[0]["cosine"] == pytest.approx(1.0) and rows[0]["naive_cosine"] == pytest.approx(1.0)
    np.testing.assert_equal(probe_gradfid(run_dir, bins=1, batches=3, batch_size=4), rows)  # NaN == NaN here


def test_cli_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["probe", "gradfid", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["probe", "gradfid", str(tmp_path), "--batches", "2"]) == 2
    assert "batches >= 3" in capsys.readouterr().err
    assert main(["probe", "gradfid", str(tmp_path), "--protocol", "anim"]) == 2      # before any work
    assert capsys.readouterr().err.strip().endswith("--protocol must be one of maskbench, anima, got 'anim'")


def test_a_learned_gate_run_is_probed_on_its_native_grid_only(tmp_path, synth_root, capsys):
    """ScaleLong's LS gate exists only on the native token grid: the probe leaves demotion out by
    default (it failed mid-probe before) and refuses an explicit --demote before any work."""
    gated = train(load_config(tiny_overrides(tmp_path, synth_root, "arm=lsc_scalelong_ls", "eval.points=[1.0]",
                                             "budget.flops=1e9", *FAST)))  # the probe reads the weights only
    rows = probe_gradfid(gated, bins=1, batches=3, batch_size=4)
    assert [r["route"] for r in rows] == ["mask50", "mask75", "sprint75", "native2"]
    assert main(["probe", "gradfid", str(gated), "--batches", "3", "--demote", "0.5"]) == 2
    assert "native token grid" in capsys.readouterr().err


def test_a_memory_cap_sums_batches_into_groups(run_dir, monkeypatch):
    """Under a cap that holds 3 gradient stacks, 6 batches go into 3 groups; the per-batch cosine is unchanged."""
    monkeypatch.setattr(gradfid, "MASK_STEPS", (gradfid.ProbeStep("mask0", 0.0), gradfid.ProbeStep("mask75", 0.75)))
    free = probe_gradfid(run_dir, bins=1, batches=6, batch_size=4)
    params = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[0])["params"]
    stack_gb = 5 * params * 4 / 1e9                                               # full + 4 routes, fp32
    capped = probe_gradfid(run_dir, bins=1, batches=6, batch_size=4, max_memory_gb=3.5 * stack_gb)
    assert [r["groups"] for r in free] == [6] * 4 and [r["groups"] for r in capped] == [3] * 4
    assert all(r["n_batches"] == 6 for r in capped)
    assert capped[0]["cosine"] == pytest.approx(1.0)  # the identical route, whatever the grouping
    assert [r["naive_cosine"] for r in capped] == pytest.approx([r["naive_cosine"] for r in free])
    assert capped[1]["cosine"] != free[1]["cosine"]   # fewer, bigger groups: another estimate of the same cosine
