"""REPA: the loss against a hand computation, the tap and the kept-token targets, the frozen encoder, the counted
FLOPs, the options' refusals and a short training run of each REPA arm (the encoder's pretraining and the random
control: test_repa_pretrain.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from maskbench.config import load_config
from maskbench.config.presets import ModelConfig, decoder_width
from maskbench.data.dataset import DatasetInfo
from maskbench.errors import ConfigError
from maskbench.eval import oracle
from maskbench.models.dit import DiT
from maskbench.models.inputs import StepInputs
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import windowed_flow_loss
from maskbench.models.text import SynthTextEncoder
from maskbench.results.rows import read_rows
from maskbench.runs.launch import train
from maskbench.train import repa
from maskbench.train.flops import repa_step_flops, train_step_flops, vit_forward_flops
from tests.conftest import FAST, new_trainer, randomized, tiny_overrides

B = 2


def _model(**fields) -> DiT:
    cfg = ModelConfig(width=32, heads=2, text_width=32, text_depth=1, text_len=8, **fields)
    return DiT(cfg, 32, 3, cfg.text_width, SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len))


def _inputs(model: DiT) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    x0 = torch.rand(B, 3, 32, 32, generator=gen) * 2 - 1
    noise = torch.randn(B, 3, 32, 32, generator=gen)
    ids = torch.randint(1, 50, (B, model.cfg.text_len), generator=gen)
    return x0, noise, torch.rand(B, generator=gen), ids, torch.ones(B, model.cfg.text_len, dtype=torch.bool)


def _repa(model: DiT, depth: int, weight: float = 0.5) -> repa.Repa:
    return repa.Repa(model, depth, repa.frozen(repa.load_synth_encoder()), weight)


def _loss(model: DiT, alignment: repa.Repa | None, mask_ratio: float) -> torch.Tensor:
    x0, noise, t, ids, mask = _inputs(model)
    keep = random_keep_idx(B, model.seq_len, mask_ratio, generator=torch.Generator().manual_seed(2))
    return windowed_flow_loss(model, x0, noise, t, ids, mask, torch.zeros(B, dtype=torch.bool),
                              StepInputs(keep, repa=alignment))


def test_repa_loss_is_the_negative_cosine_averaged_over_tokens_and_samples() -> None:
    projected = np.array([[[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]], [[3.0, 4.0], [-1.0, 0.0], [2.0, 2.0]]])  # 2×3×2
    target = np.array([[[2.0, 0.0], [0.0, 1.0], [0.0, -1.0]], [[3.0, 4.0], [1.0, 0.0], [1.0, 0.0]]])
    cosines = [1.0, 1 / math.sqrt(2), -1.0, 1.0, -1.0, 1 / math.sqrt(2)]  # by hand, token by token
    loss = repa.repa_loss(torch.tensor(projected), torch.tensor(target))
    assert loss.item() == pytest.approx(-sum(cosines) / 6)


@pytest.mark.parametrize("depth, mask_ratio", [(1, 0.0), (2, 0.75), (3, 0.75)])
def test_alignment_reads_the_tapped_block_at_the_kept_positions(depth: int, mask_ratio: float) -> None:
    """λ·(−cos) of the projected output of block `depth` (mixer 1, backbone 2, decoder 3) against the encoder's
    8×8 features of x0 at the positions that block saw: the kept ones in the masked backbone, all in the others."""
    model = randomized(_model(mixer_depth=1, depth=1, decoder_depth=1), std=0.05)
    alignment = _repa(model, depth)
    seen = []
    repa.aligned_block(model, depth).register_forward_hook(lambda module, args, out: seen.append(out))
    x0, _, t, ids, mask = _inputs(model)
    keep = random_keep_idx(B, model.seq_len, mask_ratio, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(x0, t, ids, mask, inputs=StepInputs(keep))
        term = alignment(x0, keep)
    features = alignment.encoder(x0).flatten(2).transpose(1, 2)                      # B×64×64
    positions = keep if depth == 2 and keep is not None else torch.arange(64).expand(B, -1)
    target = torch.stack([features[b, positions[b]] for b in range(B)])
    expected = -torch.nn.functional.cosine_similarity(alignment.projector(seen[0]), target, dim=-1).mean()
    assert seen[0].shape[1] == positions.shape[1] and term.item() == pytest.approx(0.5 * expected.item(), rel=1e-5)


def test_alignment_gradient_reaches_the_projector_and_the_blocks_up_to_the_aligned_one_only() -> None:
    model = randomized(_model(depth=3), std=0.05)
    alignment = _repa(model, depth=2)
    x0, _, t, ids, mask = _inputs(model)
    model(x0, t, ids, mask)
    alignment(x0, None).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in alignment.projector.parameters())
    grads = [sum(p.grad.abs().sum() for p in block.parameters() if p.grad is not None) for block in model.blocks]
    assert grads[0] > 0 and grads[1] > 0 and grads[2] == 0
    assert all(p.grad is None for p in alignment.encoder.parameters())


def test_repa_off_leaves_the_loss_unchanged_and_on_adds_its_term() -> None:
    model = randomized(_model(depth=2), std=0.05)
    plain = _loss(model, None, 0.75)
    alignment = _repa(model, depth=1)
    with_repa = _loss(model, alignment, 0.75)
    assert with_repa.item() != plain.item()
    alignment.hook.remove()
    assert _loss(model, None, 0.75).item() == plain.item()


def test_trainer_keeps_the_encoder_frozen_and_out_of_optimizer_ema_and_checkpoint(tmp_path, synth_root) -> None:
    parts = new_trainer(load_config(["arm=repa", *tiny_overrides(tmp_path, synth_root)])).parts
    encoder, projector = parts.repa.encoder, parts.repa.projector
    assert not encoder.training and not any(p.requires_grad for p in encoder.parameters())
    optimized = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in encoder.parameters()}
    assert {id(p) for p in projector.parameters()} <= optimized
    ema = {id(p) for p in parts.ema.model.parameters()}
    assert not ema & {id(p) for p in [*encoder.parameters(), *projector.parameters()]}
    assert len(list(parts.ema.model.parameters())) == len(list(parts.net.parameters()))
    assert all(key.startswith("projector.") for key in parts.repa.state_dict())


def test_a_repa_step_trains_the_projector(tmp_path, synth_root) -> None:
    cfg = load_config(["arm=repa", *tiny_overrides(tmp_path, synth_root)])
    trainer = new_trainer(cfg)
    repa = trainer.parts.repa
    before = [p.detach().clone() for p in repa.projector.parameters()]
    encoder_before = [p.detach().clone() for p in repa.encoder.parameters()]
    batch = next(iter(trainer.streams.open(0, {})[0]))
    loss, _ = trainer.stepper.stream_loss(batch, trainer.progress.schedule.phases[0], 0, 0)
    loss.backward()
    trainer.parts.optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, repa.projector.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(encoder_before, repa.encoder.parameters()))


@pytest.mark.parametrize("mixer_depth, depth, mask_ratio", [(1, 1, 0.0), (1, 2, 0.75), (0, 1, 0.75)])
def test_projector_and_encoder_flops_match_the_flop_counter(mixer_depth: int, depth: int, mask_ratio: float) -> None:
    """The REPA step (model forward + backward, projector, encoder forward) counted against FlopCounterMode."""
    model = _model(mixer_depth=mixer_depth, depth=2)
    alignment = _repa(model, depth)
    x0, _, t, ids, mask = _inputs(model)
    keep = random_keep_idx(B, model.seq_len, mask_ratio, generator=torch.Generator().manual_seed(2))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(x0, t, ids, mask, inputs=StepInputs(keep))
        (out.square().mean() + alignment(x0, keep)).backward()
    analytic = (train_step_flops(model.cfg, 32, 3, 32, 8, B, mask_ratio, text_encoder=True)
                + repa_step_flops(model.cfg, 32, B, mask_ratio, depth, repa.projector_hidden(32),
                                  alignment.encoder.out_dim, repa.SynthEncoder.forward_flops(1)))
    assert analytic == pytest.approx(counter.get_total_flops(), rel=0.01)


@pytest.mark.parametrize("depth", [2, 3])
def test_a_narrow_maskdit_decoder_block_is_aligned_and_counted_at_its_own_width(depth: int) -> None:
    """MaskDiT's decoder runs narrower than the model (config/presets.py decoder_width): the projector reads the
    aligned block's width, and its FLOPs (what the alignment adds to a step, against FlopCounterMode) follow."""
    model = randomized(_model(depth=2, decoder_depth=1), std=0.05)
    width = repa.aligned_width(model.cfg, depth)
    assert width == (model.cfg.width if depth == 2 else decoder_width(model.cfg)) and decoder_width(model.cfg) < 32
    alignment = _repa(model, depth)
    x0, _, t, ids, mask = _inputs(model)
    keep = random_keep_idx(B, model.seq_len, 0.5, generator=torch.Generator().manual_seed(2))
    counted = []
    for align in (False, True):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            out = model(x0, t, ids, mask, inputs=StepInputs(keep))
            (out.square().mean() + (alignment(x0, keep) if align else 0)).backward()
        counted.append(counter.get_total_flops())
    analytic = repa_step_flops(model.cfg, 32, B, 0.5, depth, repa.projector_hidden(32), alignment.encoder.out_dim,
                               repa.SynthEncoder.forward_flops(1))
    assert alignment.projector[0].in_features == width
    assert analytic == pytest.approx(counted[1] - counted[0], rel=0.01)


def test_dinov2_forward_flops_match_the_flop_counter() -> None:
    """timm's DINOv2-B layout (one block, random weights: no file needed) on a 4×4 patch grid."""
    import timm

    vit = timm.create_model(repa.DINOV2_MODEL, pretrained=False, num_classes=0, img_size=56, depth=1).eval()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        vit.forward_features(torch.randn(B, 3, 56, 56))
    expected = vit_forward_flops(B, 16, vit.num_prefix_tokens, repa.DINOV2_PATCH, repa.DINOV2_WIDTH, 1, repa.DINOV2_MLP)
    assert expected == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_depth_and_projector_scale_from_the_authors_defaults() -> None:
    presets = {"dit_xl2": (28, 8), "micro_s": (5, 2), "tiny": (4, 2), "dit_b2": (12, 4)}
    for name, (blocks, depth) in presets.items():
        cfg = load_config([f"model={name}"]).model
        assert (repa.block_count(cfg), repa.default_depth(cfg)) == (blocks, depth)
    assert (repa.projector_hidden(1152), repa.projector_hidden(128)) == (2048, 228)


def test_the_shipped_synth_encoder_is_not_the_oracle_and_reads_patches() -> None:
    encoder = repa.load_synth_encoder()
    assert encoder(torch.zeros(1, 3, 32, 32)).shape == (1, 64, 8, 8)
    seeds, metadata = {}, {}
    for path in (repa.SYNTH_WEIGHTS, oracle.WEIGHTS_PATH):
        with safe_open(str(path), framework="pt") as f:
            metadata[path.name] = f.metadata()
            seeds[path.name] = json.loads(f.metadata()["train"])["seed"]
    assert seeds == {"repa_synth_v2.safetensors": 1, "oracle_synth_v1.safetensors": 0}
    assert metadata["repa_synth_v2.safetensors"]["labels"] == "none"                 # pretrained on pixels alone
    assert sorted(p.name for p in repa.SYNTH_WEIGHTS.parent.glob("repa_synth_*")) == ["repa_synth_v2.safetensors"]


def test_a_synth_encoder_file_of_another_version_is_refused(tmp_path) -> None:
    path = tmp_path / "old.safetensors"
    metadata = {**repa.synth_metadata({"seed": 1}), "encoder": "repa-synth-v1"}
    save_file(repa.init_synth_encoder(1).state_dict(), str(path), metadata=metadata)
    with pytest.raises(ConfigError, match="repa_pretrain --train"):
        repa.load_synth_encoder(path)


@pytest.mark.parametrize("overrides, message", [
    (["train.repa_weight=-1"], "train.repa_weight must be >= 0"),
    (["train.repa_depth=2"], "do nothing without train.repa_weight"),
    (["train.repa_weight=0.5", "train.repa_depth=6"], "must be a block from 1 to 5"),
    (["train.repa_weight=0.5", "arm=mask0", "train.demote_routes=[{ratio: 0.5, t: [0.5, 1.0]}]"], "demote_routes"),
])
def test_bad_repa_options_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config(overrides)
    assert "\n" not in str(err.value)


def test_latent_data_is_refused_in_one_line() -> None:
    cfg = load_config(["arm=repa"])
    latent = DatasetInfo("latents", Path("train"), Path("val"), image_size=32, channels=4, latent=True,
                         context_dim=1024, context_len=77)
    with pytest.raises(ConfigError, match="latent shards carry none") as err:
        repa.encoder_choice(cfg, latent)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arm", ["repa", "repa_mask75_then0", "repa_random"])
def test_repa_arm_trains(tmp_path, synth_root, arm: str) -> None:
    # The encoder costs ~2 steps of the test's 32-wide model (~5% of micro_s's): a budget for a few steps of each.
    run = train(load_config([f"arm={arm}", *tiny_overrides(tmp_path, synth_root, "budget.flops=4e9", *FAST)]))
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps and all(math.isfinite(step["loss"]) for step in steps)
    # the encoder's pretraining, outside the budget, in every row: the shipped file's count; 0 for the random control
    spent = {row["encoder_flops"] for row in read_rows([str(tmp_path / "leaderboard.csv")])}
    assert spent == ({0.0} if arm == "repa_random" else {repa.synth_pretrain_flops()}) and spent != {None}
