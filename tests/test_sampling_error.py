"""Each metric's own sampling error at an eval point, and the final point's own sample count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from maskbench.config import load_config
from maskbench.data.dataset import resolve_dataset
from maskbench.eval.clip import clip_metrics
from maskbench.eval.evaluate import Evaluator, measure_validation_loss
from maskbench.eval.fid import FeatureStats, bootstrap_counts, bootstrap_frechet, frechet_distance
from maskbench.eval.sample import fixed_noise
from maskbench.eval.scorers import binomial_se, frechet_metrics
from maskbench.models.build import batch_context, build_model
from maskbench.models.objective import flow_loss
from tests.conftest import randomized, tiny_overrides


@pytest.mark.parametrize("n, dim", [(60, 8), (20, 64)])  # more rows than dimensions, and fewer (rank-deficient)
def test_each_bootstrap_distance_is_frechet_distance_of_its_resample(n, dim):
    rng = np.random.default_rng(0)
    reference = FeatureStats.from_features(rng.normal(size=(300, dim)), "f")
    features = rng.normal(size=(n, dim)) * 1.3 + 0.2
    counts = np.concatenate([np.ones((1, n), dtype=int), bootstrap_counts(n, 3)])  # the sample itself, 3 resamples
    expected = []
    for row in counts:
        drawn = features[np.repeat(np.arange(n), row)]                             # n×F, rows repeated
        expected.append(frechet_distance(drawn.mean(0), np.cov(drawn, rowvar=False), reference.mu, reference.sigma))
    np.testing.assert_allclose(bootstrap_frechet(features, reference, counts), expected, rtol=1e-6)


def shifted_gaussian_se(n: int) -> float:
    """fid_se of n samples of N(0.5, I) in 8 dimensions against N(0, I) statistics (fixed seeds)."""
    rng = np.random.default_rng(n)
    reference = FeatureStats(np.zeros(8), np.eye(8), 10**6, "f")
    return frechet_metrics("fid", rng.normal(0.5, 1.0, size=(n, 8)), "f", reference, bootstrap_counts(n, 200))["fid_se"]


def test_fd_bootstrap_error_is_reproducible_and_shrinks_as_one_over_sqrt_n():
    """With the generated mean off the reference's, FD = |δ|² + ... moves at first order with the sample
    mean, so its SD falls as 1/sqrt(n): 4× from 64 to 1024 samples. The band allows the bootstrap SD's own
    error (~5% each at 200 resamples, 3 SDs of the ratio) and the 1/n terms that still count at n = 64."""
    assert shifted_gaussian_se(64) == shifted_gaussian_se(64)
    assert 4 / 1.4 < shifted_gaussian_se(64) / shifted_gaussian_se(1024) < 4 * 1.4


def test_fd_bootstrap_error_estimates_the_sd_of_fd_over_independent_sample_sets():
    rng = np.random.default_rng(5)
    reference = FeatureStats(np.zeros(8), np.eye(8), 10**6, "f")
    fresh = [frechet_metrics("fid", rng.normal(0.5, 1.0, size=(64, 8)), "f", reference, None)["fid"] for _ in range(200)]
    assert shifted_gaussian_se(64) == pytest.approx(np.std(fresh, ddof=1), rel=0.25)  # each SD known to ~5-10%


def test_fd_errors_are_reported_only_when_resampled_and_the_interval_brackets_the_resamples():
    rng = np.random.default_rng(3)
    features, reference = rng.normal(size=(40, 4)) + 1.0, FeatureStats(np.zeros(4), np.eye(4), 1000, "f")
    plain = frechet_metrics("fid", features, "f", reference, None)
    counts = bootstrap_counts(40, 50)
    full = frechet_metrics("fid", features, "f", reference, counts)
    resampled = bootstrap_frechet(features, reference, counts)
    assert plain == {"fid": full["fid"]} and full["fid_se"] == pytest.approx(resampled.std(ddof=1))
    assert resampled.min() <= full["fid_ci"][0] < full["fid_ci"][1] <= resampled.max()


def test_clip_score_error_is_the_bootstrap_sd_of_the_mean():
    cosines = np.random.default_rng(4).normal(0.3, 0.05, size=400)
    counts = bootstrap_counts(400, 400)
    scores = clip_metrics(cosines, counts)
    assert scores["clip_score_se"] == pytest.approx(np.std(100 * counts @ cosines / 400, ddof=1))
    assert scores["clip_score_se"] == pytest.approx(100 * cosines.std(ddof=1) / np.sqrt(400), rel=0.15)  # SD/√n


def test_align_error_is_binomial():
    assert binomial_se(0.25, 16) == pytest.approx(np.sqrt(0.25 * 0.75 / 16))
    assert binomial_se(1.0, 16) == 0.0


def test_val_loss_error_matches_a_hand_computation(tmp_path: Path, synth_root: Path) -> None:
    """The value stays flow_loss over batches bit for bit; the error is over samples of their mean over t."""
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "eval.val_samples=5", "eval.val_t=[0.25,0.75]"))
    data = resolve_dataset(cfg.data, cfg.paths.data)
    torch.manual_seed(0)
    model = randomized(build_model(cfg.model, data), 0.05).eval()
    evaluator = Evaluator(data, cfg.eval, torch.device("cpu"), scores=False)
    ev, evalset = cfg.eval, evaluator.evalset
    measured = measure_validation_loss(model, evalset, ev.val_t, ev.noise_seed, 3, torch.device("cpu"), 5)
    batch_means, per_sample = [], np.zeros((5, 2))
    with torch.no_grad():
        for j, t_value in enumerate(ev.val_t):
            total = 0.0
            for start, stop in ((0, 3), (3, 5)):                                    # batches of 3
                batch = evalset.batch(start, stop)
                noise = fixed_noise(range(start, stop), tuple(batch["image"].shape[1:]), ev.noise_seed + 7919 * (j + 1))
                context, mask = batch_context(model, batch, torch.device("cpu"))
                t = torch.full((stop - start,), t_value)
                total += flow_loss(model, batch["image"], noise, t, context, mask).item() * (stop - start)
                for i in range(stop - start):                                       # each sample alone
                    per_sample[start + i, j] = flow_loss(model, batch["image"][i:i + 1], noise[i:i + 1], t[i:i + 1],
                                                         context[i:i + 1], mask[i:i + 1]).item()
            batch_means.append(total / 5)
    assert measured.per_t == batch_means and measured.value == float(np.mean(batch_means))
    assert measured.se == pytest.approx(per_sample.mean(1).std(ddof=1) / np.sqrt(5), rel=1e-4)


def test_final_n_samples_is_used_at_the_final_point_only(tmp_path: Path, synth_root: Path) -> None:
    cfg = load_config(tiny_overrides(tmp_path, synth_root, "eval.n_samples=4", "eval.final_n_samples=12",
                                     "eval.val_samples=4", "eval.bootstrap_resamples=20"))
    data = resolve_dataset(cfg.data, cfg.paths.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, data).eval()
    evaluator = Evaluator(data, cfg.eval, torch.device("cpu"))
    results = {point: evaluator.evaluate(model, tmp_path / f"samples-{point}", point=point) for point in (0.5, 1.0, None)}
    assert {point: r["fid_n"] for point, r in results.items()} == {0.5: 4, 1.0: 12, None: 4}
    assert len(list((tmp_path / "samples-1.0").glob("[0-9]*.png"))) == 12
    final = results[1.0]
    assert final["align_acc_se"] == binomial_se(final["align_acc"], 12)
    assert final["fid_se"] > 0 and final["val_loss_se"] > 0 and len(final["fid_ci"]) == 2
