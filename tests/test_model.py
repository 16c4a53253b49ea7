"""The token-dropping DiT, its masks and its synth text encoder, on tiny CPU sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from maskbench.config.presets import PRESETS, ModelConfig, check_model, tiny
from maskbench.models.dit import DiT
from maskbench.models.inputs import StepInputs
from maskbench.models.masking import keep_count, random_keep_idx
from maskbench.models.text import SynthTextEncoder

IMAGE, CHANNELS, BATCH = 16, 3, 3  # 4×4 token grid at patch 4
CAPTIONS = ["a small red circle", "a large blue square above a small green triangle and a red circle", "a yellow star"]


def _cfg(**overrides) -> ModelConfig:
    small = dict(width=32, depth=2, heads=2, text_width=16, text_depth=1, text_len=12)
    return dataclasses.replace(tiny(), **{**small, **overrides})


def _model(cfg: ModelConfig, randomize: bool = True) -> DiT:
    """A tiny DiT with the synth text encoder; randomize=True fills the zero-initialised adaLN/output
    weights too, since a freshly initialised DiT outputs zeros and would make any equality trivial."""
    torch.manual_seed(0)
    model = DiT(cfg, IMAGE, CHANNELS, cfg.text_width, SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len))
    if randomize:
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(std=0.1)
    return model


def _inputs(model: DiT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = model.text_encoder.tokenize(CAPTIONS)
    return torch.randn(BATCH, CHANNELS, IMAGE, IMAGE), torch.rand(BATCH), ids, mask


def test_presets_build_the_dit_sizes() -> None:
    sizes = {name: (c.depth, c.width, c.heads, c.patch_size, c.mixer_depth)
             for name, c in ((n, f()) for n, f in PRESETS.items())}
    assert sizes == {"tiny": (4, 128, 4, 4, 0), "tiny_deep": (13, 68, 4, 4, 0), "micro_xxs": (4, 32, 2, 4, 1),
                     "micro_xs": (4, 64, 2, 4, 1),
                     "micro_s": (4, 128, 4, 4, 1), "micro_m": (6, 192, 6, 4, 1), "dit_s2": (12, 384, 6, 2, 0),
                     "dit_b2": (12, 768, 12, 2, 0), "dit_l2": (24, 1024, 16, 2, 0), "dit_xl2": (28, 1152, 16, 2, 0),
                     "microdit_xl2": (28, 1024, 16, 2, 6)}


@pytest.mark.parametrize("mixer_depth", [0, 1])
def test_output_has_one_prediction_per_kept_token(mixer_depth: int) -> None:
    model = _model(_cfg(mixer_depth=mixer_depth))
    x, t, ids, mask = _inputs(model)
    keep = random_keep_idx(BATCH, model.seq_len, 0.75, torch.Generator().manual_seed(0))
    assert model(x, t, ids, mask).shape == (BATCH, 16, 4 * 4 * CHANNELS)
    assert model(x, t, ids, mask, inputs=StepInputs(keep)).shape == (BATCH, 4, 4 * 4 * CHANNELS)


def test_precomputed_context_without_text_encoder() -> None:
    model = DiT(_cfg(), IMAGE, 4, context_dim=24)
    context, context_mask = torch.randn(2, 7, 24), torch.ones(2, 7, dtype=torch.bool)  # 7 precomputed text tokens
    out = model(torch.randn(2, 4, IMAGE, IMAGE), torch.rand(2), context, context_mask)
    assert out.shape == (2, 16, 4 * 4 * 4)


def test_fresh_model_predicts_zero() -> None:
    """adaLN-Zero: the zero-initialised final layer makes a fresh DiT output exactly 0."""
    model = _model(_cfg(), randomize=False)
    assert torch.count_nonzero(model(*_inputs(model))) == 0


def test_patchify_round_trip_and_token_order() -> None:
    model = _model(_cfg())
    x = torch.randn(2, CHANNELS, IMAGE, IMAGE)
    tokens = model.patchify(x)
    assert tokens.shape == (2, 16, 4 * 4 * CHANNELS)
    assert torch.equal(model.unpatchify(tokens), x)
    # token 6 is grid cell (row 1, col 2) in PatchEmbed's raster order; values are (p, p, C) channel-last
    assert torch.equal(tokens[:, 6].reshape(2, 4, 4, CHANNELS), x[:, :, 4:8, 8:12].permute(0, 2, 3, 1))


@pytest.mark.parametrize("mask_ratio", [0.5, 0.75, 0.9])
def test_keep_idx_is_sorted_unique_and_the_same_size_for_every_sample(mask_ratio: float) -> None:
    keep = random_keep_idx(8, 64, mask_ratio, torch.Generator().manual_seed(1))
    assert keep.shape == (8, keep_count(64, mask_ratio)) == (8, round(64 * (1 - mask_ratio)))
    assert torch.all(keep[:, 1:] > keep[:, :-1])  # strictly ascending, so also unique
    assert keep.min() >= 0 and keep.max() < 64
    assert len({tuple(row.tolist()) for row in keep}) > 1  # samples get different masks


def test_mask_ratio_zero_keeps_every_token() -> None:
    assert random_keep_idx(4, 64, 0.0) is None


def test_structured_keep_idx_keeps_one_token_per_2x2_group() -> None:
    keep = random_keep_idx(16, 8 * 6, 0.75, torch.Generator().manual_seed(2), grid=(8, 6), structured=True)
    assert keep.shape == (16, 12)
    assert torch.all(keep[:, 1:] > keep[:, :-1])
    group = (keep // 6 // 2) * 3 + (keep % 6) // 2  # which 2×2 group each kept token falls in
    assert torch.equal(group.sort(dim=1).values, torch.arange(12).expand(16, 12))
    cell = (keep // 6 % 2) * 2 + keep % 6 % 2
    assert len(cell.unique()) == 4  # the kept cell inside a group is random, not always the same corner


def test_keep_idx_is_deterministic_under_a_seeded_generator() -> None:
    def draw(seed: int, structured: bool) -> torch.Tensor:
        return random_keep_idx(4, 64, 0.75, torch.Generator().manual_seed(seed), grid=(8, 8), structured=structured)

    for structured in (False, True):
        assert torch.equal(draw(3, structured), draw(3, structured))
        assert not torch.equal(draw(3, structured), draw(4, structured))


@pytest.mark.parametrize("seq_len, kwargs, message", [
    (64, dict(mask_ratio=1.0), r"\[0, 1\)"),
    (64, dict(mask_ratio=-0.1), r"\[0, 1\)"),
    (64, dict(mask_ratio=0.5, grid=(8, 8), structured=True), "needs mask_ratio 0.75"),
    (48, dict(mask_ratio=0.75, grid=(8, 8), structured=True), r"h\*w = 48"),
    (12, dict(mask_ratio=0.75, grid=(3, 4), structured=True), "even"),
])
def test_bad_mask_arguments_raise(seq_len: int, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        random_keep_idx(2, seq_len, **kwargs)


@pytest.mark.parametrize("mixer_depth", [0, 2])
def test_masked_forward_equals_full_forward_at_kept_tokens_without_a_backbone(mixer_depth: int) -> None:
    """With no backbone blocks after the drop, tokens never attend to each other after it, so dropping
    must not change a kept token's prediction (this checks the gather, positions and ordering)."""
    model = _model(_cfg(depth=0, mixer_depth=mixer_depth))
    x, t, ids, mask = _inputs(model)
    keep = random_keep_idx(BATCH, model.seq_len, 0.75, torch.Generator().manual_seed(0))
    full = model(x, t, ids, mask)
    rows = torch.arange(BATCH)[:, None]
    torch.testing.assert_close(model(x, t, ids, mask, inputs=StepInputs(keep)), full[rows, keep])


def test_backbone_attention_sees_only_kept_tokens() -> None:
    """Without patch-mixer blocks the drop comes first: a dropped patch's pixels reach no output, while a kept
    patch's pixels reach every other kept token of its sample through the backbone's self-attention."""
    model = _model(_cfg(mixer_depth=0))
    x, t, ids, mask = _inputs(model)
    keep = random_keep_idx(BATCH, model.seq_len, 0.75, torch.Generator().manual_seed(0))
    out = model(x, t, ids, mask, inputs=StepInputs(keep))                                              # B×K×P

    def with_patch_changed(token: int) -> torch.Tensor:
        """The output after adding 1 to every pixel of sample 0's patch `token`."""
        (row, col), p = divmod(token, model.grid[1]), model.patch_size
        changed = x.clone()
        changed[0, :, row * p:(row + 1) * p, col * p:(col + 1) * p] += 1
        return model(changed, t, ids, mask, inputs=StepInputs(keep))

    dropped = next(i for i in range(model.seq_len) if i not in keep[0])
    assert torch.equal(with_patch_changed(dropped), out)
    moved = with_patch_changed(keep[0, 0].item())
    assert all(not torch.allclose(moved[0, k], out[0, k]) for k in range(1, keep.shape[1]))
    assert torch.equal(moved[1:], out[1:])


def test_caption_dropout_changes_only_dropped_samples_and_ignores_their_caption() -> None:
    model = _model(_cfg())
    x, t, ids, mask = _inputs(model)
    kept = model(x, t, ids, mask, drop_context=torch.tensor([False, False, False]))
    dropped = model(x, t, ids, mask, drop_context=torch.tensor([False, True, False]))
    torch.testing.assert_close(dropped[[0, 2]], kept[[0, 2]])
    assert not torch.allclose(dropped[1], kept[1])
    other_ids, other_mask = model.text_encoder.tokenize(["a purple hexagon"] * BATCH)
    dropped_other = model(x, t, other_ids, other_mask, drop_context=torch.tensor([False, True, False]))
    torch.testing.assert_close(dropped_other[1], dropped[1])  # unconditional: the caption is ignored


def test_all_parameters_get_gradients_after_a_couple_of_steps() -> None:
    model = _model(_cfg(mixer_depth=1), randomize=False)
    x, t, ids, mask = _inputs(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        keep = random_keep_idx(BATCH, model.seq_len, 0.75, torch.Generator().manual_seed(step))
        target = model.patchify(torch.randn_like(x))[torch.arange(BATCH)[:, None], keep]   # B×K×(p·p·C)
        optimizer.zero_grad()
        pred = model(x, t, ids, mask, torch.tensor([True, False, False]), StepInputs(keep))              # B×K×(p·p·C)
        loss = (pred - target).square().mean()
        loss.backward()
        optimizer.step()
    silent = [name for name, p in model.named_parameters() if p.grad is None or not torch.any(p.grad != 0)]
    assert silent == []


def test_bf16_autocast_forward() -> None:
    model = _model(_cfg())
    x, t, ids, mask = _inputs(model)
    keep = random_keep_idx(BATCH, model.seq_len, 0.75)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, ids, mask, torch.tensor([True, False, False]), StepInputs(keep))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_text_encoder_masks_padding_and_keeps_its_table_out_of_checkpoints() -> None:
    encoder = SynthTextEncoder(width=16, depth=1, context_len=12)
    ids, mask = encoder.tokenize(CAPTIONS)
    assert ids.shape == mask.shape == (BATCH, 12)
    assert mask[0].tolist() == [True] * 6 + [False] * 6  # <sot> a small red circle <eot>
    assert mask[1].all()  # truncated caption: every position is real, ending in <eot>
    with torch.no_grad():
        out = encoder(ids, mask)
        repadded = encoder(torch.where(mask, ids, 123), mask)
    torch.testing.assert_close(repadded[mask], out[mask])
    assert "token_table" not in encoder.state_dict()
    again = SynthTextEncoder(width=16, depth=1, context_len=12)
    assert torch.equal(again.token_table, encoder.token_table)
    assert not any(p is encoder.token_table for p in encoder.parameters())


@pytest.mark.parametrize("build, message", [
    (lambda: DiT(_cfg(), 18, 3, 16), "does not divide the 18-pixel input"),
    (lambda: check_model(_cfg(heads=3)), "heads"),
    (lambda: DiT(_cfg(), IMAGE, 3, 99, SynthTextEncoder(16, 1, 12)), "text encoder width"),
])
def test_bad_model_arguments_raise(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_bad_input_shapes_raise() -> None:
    model = _model(_cfg())
    x, t, ids, mask = _inputs(model)
    with pytest.raises(ValueError, match="keep_idx"):
        model(x, t, ids, mask, inputs=StepInputs(torch.zeros(BATCH, 17, dtype=torch.long)))
    with pytest.raises(ValueError, match="expected x of shape"):
        model(x[:, :, :8], t, ids, mask)

