"""The shipped synth oracle: accuracy on held-out scenes, a meaningful feature space, reproducible training."""

import numpy as np
import pytest
import torch
from scipy import linalg

from maskbench.data import synth
from maskbench.eval.fid import FeatureStats
from maskbench.eval.oracle import ORACLE_NAME, Oracle, load_oracle, render_batch, save_oracle, train_oracle

HELD_OUT_SEED = 2024  # the shipped weights were trained from seed 0


@pytest.fixture(scope="module")
def oracle():
    return load_oracle()


@pytest.fixture(scope="module")
def held_out():
    return render_batch(np.random.default_rng(HELD_OUT_SEED), 1000)


def test_shipped_oracle_exact_scene_accuracy(oracle, held_out):
    images, scenes = held_out
    assert oracle.alignment(images, scenes) >= 0.95


def test_alignment_fails_on_the_wrong_prompts(oracle, held_out):
    images, scenes = held_out
    assert oracle.alignment(images, scenes[1:] + scenes[:1]) < 0.2


def test_predict_uses_cell_label_format(oracle):
    scene = synth.Scene((synth.SceneObject("triangle", "blue", "large", "bottom left"),))
    image = synth.render(scene, np.random.default_rng(0))[None]  # 1×32×32×3
    predicted = oracle.predict(torch.from_numpy(image))
    for name, labels in synth.cell_labels(scene).items():
        np.testing.assert_array_equal(predicted[name][0], labels)


def test_fd_real_vs_real_far_below_real_vs_noise(oracle, held_out):
    real_images = held_out[0]
    other_images = render_batch(np.random.default_rng(HELD_OUT_SEED + 1), 1000)[0]
    noise_images = np.random.default_rng(0).integers(0, 256, size=real_images.shape, dtype=np.uint8)
    real, other, noise = (
        FeatureStats.from_features(oracle(x), oracle.name) for x in (real_images, other_images, noise_images)
    )
    assert real.features_name == ORACLE_NAME and oracle.features(real_images).shape == (1000, 128)
    fd_real, fd_noise = real.frechet_distance(other), real.frechet_distance(noise)
    assert fd_real < 0.05 * fd_noise
    scipy_fd = ((real.mu - noise.mu) ** 2).sum() + np.trace(real.sigma) + np.trace(noise.sigma)
    scipy_fd -= 2 * np.trace(linalg.sqrtm(real.sigma @ noise.sigma).real)
    assert fd_noise == pytest.approx(scipy_fd, rel=1e-6)


def test_oracle_rejects_other_image_sizes(oracle):
    with pytest.raises(ValueError, match="32×32"):
        oracle.features(np.zeros((2, 64, 64, 3), np.uint8))


def test_training_is_reproducible_from_seed():
    first, again, other = (train_oracle(seed, n_train=64, steps=3, batch_size=8) for seed in (0, 0, 1))
    for name, tensor in first.state_dict().items():
        torch.testing.assert_close(tensor, again.state_dict()[name], rtol=0, atol=0)
    assert not torch.equal(first.heads["shape"].weight, other.heads["shape"].weight)


def test_load_refuses_weights_for_other_synth_parameters(tmp_path, monkeypatch):
    path = tmp_path / "oracle.safetensors"
    save_oracle(train_oracle(0, n_train=16, steps=1, batch_size=4), path, {"seed": 0})
    assert isinstance(load_oracle(path), Oracle)
    changed = {**synth.renderer_params(), "sizes": ["tiny", "huge"]}
    monkeypatch.setattr(synth, "renderer_params", lambda: changed)
    with pytest.raises(ValueError, match="other synth parameters"):
        load_oracle(path)
