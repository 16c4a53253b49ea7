"""REPA's synth encoder is pretrained on pixels alone (no scene, label or evaluation code), its pretraining FLOPs
travel in its weights file, and the random-encoder control arm aligns to a seeded, untrained copy of it."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from maskbench.config import load_config
from maskbench.data.dataset import DatasetInfo
from maskbench.errors import ConfigError
from maskbench.eval import repa_probe
from maskbench.train import repa, repa_pretrain
from tests.test_layers import imports

SYNTH = DatasetInfo("synth", Path("train"), Path("val"), image_size=32, channels=3, latent=False, context_dim=0,
                    context_len=0, synthetic=True)
REAL = DatasetInfo("sa1b", Path("train"), Path("val"), image_size=32, channels=3, latent=False, context_dim=0,
                   context_len=0)


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.state_dict().values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------ no labels
def test_pretraining_takes_images_only_and_imports_no_evaluation() -> None:
    parameters = inspect.signature(repa_pretrain.pretrain_synth_encoder).parameters
    assert next(iter(parameters)) == "images"
    assert not [name for name in parameters if any(word in name for word in ("label", "scene", "caption", "oracle"))]
    used = imports(Path(repa_pretrain.__file__))
    assert not [name for name in used if name.startswith("maskbench.eval")]
    assert "maskbench.data.synth" in used                # the pixels come from the renderer, the scenes are dropped


def test_render_images_returns_pixels_only() -> None:
    images = repa_pretrain.render_images(seed=3, n=4)
    assert isinstance(images, torch.Tensor) and images.shape == (4, 3, 32, 32)
    assert images.min() >= -1 and images.max() <= 1 and (images > -1).any()
    assert torch.equal(images, repa_pretrain.render_images(seed=3, n=4))


def test_a_few_steps_on_a_tiny_image_tensor_train_the_encoder_deterministically() -> None:
    images = repa_pretrain.render_images(seed=5, n=8)
    start = _weights(repa.init_synth_encoder(2))
    runs = [_weights(repa_pretrain.pretrain_synth_encoder(images, seed=2, steps=2, batch_size=4, pairs=16))
            for _ in range(2)]
    assert _same(runs[0], runs[1]) and not _same(runs[0], start)


def test_views_are_shifted_copies_and_matched_patches_show_the_same_place() -> None:
    images = torch.full((3, 3, 32, 32), -1.0)
    images[:, :, 13, 18] = 1.0                                                     # one lit pixel at (13, 18)
    view, shift, inside = repa_pretrain.augment(images, torch.Generator().manual_seed(0))
    found = view.sum(1).flatten(1).argmax(1)
    assert torch.equal(torch.stack([found // 32, found % 32], 1), torch.tensor([13, 18]) + shift)
    assert inside.all()
    _, _, inside = repa_pretrain.augment(images, torch.Generator().manual_seed(0), local=True)
    assert (inside.sum(1) < 64).all() and (inside.sum(1) >= 4).all()
    shift_a, shift_b = torch.tensor([[0, 0], [-4, 3]]), torch.tensor([[4, -4], [2, 3]])
    pairs = repa_pretrain.matched_patches(shift_a, shift_b)
    grid, patch = repa_pretrain.GRID, repa_pretrain.PATCH
    for image, a, b in pairs.tolist():
        centre_a = torch.tensor(divmod(a, grid)) * patch + 1.5 - shift_a[image]    # in image pixels
        centre_b = torch.tensor(divmod(b, grid)) * patch + 1.5 - shift_b[image]
        assert (centre_a - centre_b).abs().max() <= patch / 2
    assert len(repa_pretrain.matched_patches(shift_a, shift_a)) == 2 * grid * grid


def test_info_nce_ignores_other_places_of_the_same_image() -> None:
    za = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    zb = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    loss_same, top1 = repa_pretrain.info_nce(za, zb, torch.tensor([0, 0, 1]), 0.1)
    loss_apart, _ = repa_pretrain.info_nce(za, zb, torch.tensor([0, 1, 2]), 0.1)
    assert top1 == 1 and loss_same < loss_apart                   # rows 0 and 1 are no negatives of each other


# ---------------------------------------------------------------------------------------- pretraining FLOPs
def test_pretrain_flops_count_two_views_forward_and_backward() -> None:
    args = repa_pretrain.PretrainArgs(steps=10, batch_size=4, pairs=8)
    encoder_only = 3 * args.steps * 2 * args.batch_size * repa.SynthEncoder.forward_flops(1)
    count = repa_pretrain.pretrain_flops(args)
    assert encoder_only < count < 1.2 * encoder_only
    doubled = repa_pretrain.pretrain_flops(repa_pretrain.PretrainArgs(steps=20, batch_size=4, pairs=8))
    assert doubled == 2 * count


def test_pretrain_flops_are_written_to_and_read_back_from_the_weights_file(tmp_path) -> None:
    path = tmp_path / "encoder.safetensors"
    repa.save_synth_encoder(repa.init_synth_encoder(0), path, {"seed": 0}, 123_456_789)
    assert repa.synth_pretrain_flops(path) == 123_456_789
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["pretrain_flops"] == "123456789" and f.metadata()["labels"] == "none"
    bare = tmp_path / "bare.safetensors"
    save_file(repa.init_synth_encoder(0).state_dict(), str(bare), metadata=repa.synth_metadata({"seed": 0}))
    with pytest.raises(ConfigError, match="pretrain_flops"):
        repa.synth_pretrain_flops(bare)


def test_the_shipped_file_records_its_own_pretraining_and_flops() -> None:
    with safe_open(str(repa.SYNTH_WEIGHTS), framework="pt") as f:
        metadata = f.metadata()
    args = repa_pretrain.PretrainArgs(**json.loads(metadata["train"]))
    assert metadata["encoder"] == repa.SYNTH_ENCODER == "repa-synth-v2" and metadata["labels"] == "none"
    assert repa.synth_pretrain_flops() == repa_pretrain.pretrain_flops(args) > 0
    assert args == repa_pretrain.PretrainArgs()                      # the defaults rebuild the shipped file


def test_encoder_pretrain_flops_per_arm_and_data() -> None:
    shipped = repa.synth_pretrain_flops()
    assert repa.encoder_pretrain_flops(load_config(["arm=mask0"]), SYNTH) == 0
    assert repa.encoder_pretrain_flops(load_config(["arm=repa"]), SYNTH) == shipped > 1e12
    assert repa.encoder_pretrain_flops(load_config(["arm=repa_random"]), SYNTH) == 0
    assert repa.encoder_pretrain_flops(load_config(["arm=repa_random"]), REAL) == 0
    dinov2 = load_config(["arm=repa", "train.repa_encoder=/weights/dinov2.pth"])
    assert math.isnan(repa.encoder_pretrain_flops(dinov2, REAL))                  # unknown, not made up


# ---------------------------------------------------------------------------------------- the random arm
def test_the_random_arm_aligns_to_a_seeded_untrained_copy_of_the_synth_encoder() -> None:
    cfg = load_config(["arm=repa_random"])
    assert (cfg.arm.name, cfg.train.repa_weight, cfg.train.repa_encoder) == ("repa_random", 0.5, "random")
    choice = repa.encoder_choice(cfg, SYNTH)
    state = torch.random.get_rng_state()
    encoder = repa.load_encoder(choice, (8, 8))
    assert torch.equal(state, torch.random.get_rng_state())                  # building it draws nothing global
    assert choice == repa.RANDOM and isinstance(encoder, repa.SynthEncoder)
    assert not encoder.training and not any(p.requires_grad for p in encoder.parameters())
    weights = _weights(encoder)
    assert _same(weights, _weights(repa.load_encoder(choice, (8, 8))))
    assert _same(weights, _weights(repa.init_synth_encoder(repa.RANDOM_SEED)))
    assert not _same(weights, _weights(repa.init_synth_encoder(repa.RANDOM_SEED + 1)))
    assert not _same(weights, _weights(repa.load_synth_encoder()))
    assert (repa.encoder_dim(choice), repa.encoder_flops(choice, (8, 8))) == (64, repa.SynthEncoder.forward_flops(1))


def test_random_on_real_pixels_is_a_random_dinov2_of_the_default_encoders_size() -> None:
    choice = repa.encoder_choice(load_config(["arm=repa_random"]), REAL)
    assert choice == repa.RANDOM_DINOV2
    assert (repa.encoder_dim(choice), repa.encoder_flops(choice, (4, 4))) == (
        repa.DINOV2_WIDTH, repa.DinoV2Encoder.forward_flops(1, (4, 4)))
    state = torch.random.get_rng_state()
    encoder = repa.load_encoder(choice, (2, 2))                    # no weights file needed; seeded as the synth one
    assert torch.equal(state, torch.random.get_rng_state()) and not any(p.requires_grad for p in encoder.parameters())
    with torch.no_grad():
        assert encoder(torch.zeros(1, 3, 32, 32)).shape == (1, repa.DINOV2_WIDTH, 2, 2)


# ------------------------------------------------------------------------------------------- the probe
def test_the_probe_reads_labels_only_to_score_a_frozen_encoder() -> None:
    encoder = repa.init_synth_encoder(0)
    before = _weights(encoder)
    accuracy = repa_probe.linear_probe(encoder, n_train=16, n_test=8, steps=3)
    assert set(accuracy) == {"cell", "object"} and all(set(v) == {"shape", "colour", "size"} for v in accuracy.values())
    assert all(0 <= a <= 1 for v in accuracy.values() for a in v.values()) and _same(before, _weights(encoder))
