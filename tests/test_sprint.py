"""SPRINT's architecture (arm sprint75): the sparse-dense fusion, the fixed mask token and path drop, each checked
against SPRINT's own steps (snap-research/Sprint src/models/sit.py 541-563, 625-656) written out by hand."""

from __future__ import annotations

import pytest
import torch

from maskbench.config import load_config
from maskbench.config.presets import ModelConfig
from maskbench.errors import ConfigError
from maskbench.models.dit import DiT, idle_parameters
from maskbench.models.inputs import StepInputs
from maskbench.models.masking import draw_path_drop, random_keep_idx
from maskbench.models.objective import interpolate
from maskbench.models.text import SynthTextEncoder
from tests.conftest import randomized

B, IMAGE = 3, 16  # a 4×4 token grid at patch 4
SPRINT = dict(structured_mask=True, mixer_depth=1, decoder_depth=1, sparse_fusion=True, path_drop=0.1)


def _model(**fields) -> DiT:
    cfg = ModelConfig(width=32, heads=2, text_width=32, text_depth=1, text_len=8, depth=2, **fields)
    torch.manual_seed(0)
    return DiT(cfg, IMAGE, 3, cfg.text_width, SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len))


def _inputs(model: DiT) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(B, 3, IMAGE, IMAGE, generator=gen), torch.randn(B, 3, IMAGE, IMAGE, generator=gen)
    t = torch.rand(B, generator=gen)
    ids, mask = model.text_encoder.tokenize(["a red circle", "two blue squares", "a green triangle"])
    return interpolate(x0, noise, t), t, ids, mask


def _sprint_decoder_input(deep: torch.Tensor, dense: torch.Tensor, ids_keep: torch.Tensor, mask_token: torch.Tensor,
                          drop: torch.Tensor, proj: torch.nn.Linear) -> torch.Tensor:
    """SPRINT's steps between the deep path and the decoder, as sit.py writes them: `restore_full_sequence`
    (the kept tokens then L-K mask tokens, put in place by gathering with ids_restore, the inverse of the
    permutation cat[ids_keep, ids_remove]), the path drop's torch.where, then renoise_linear(cat[x, x_clone])."""
    Bn, L, D = dense.shape
    K = ids_keep.shape[1]
    ids_remove = torch.stack([torch.tensor([i for i in range(L) if i not in set(row.tolist())]) for row in ids_keep])
    ids_restore = torch.argsort(torch.cat([ids_keep, ids_remove], dim=1), dim=1)              # B×L
    x = torch.cat([deep, mask_token.expand(Bn, L - K, D)], dim=1)                            # B×L×D
    x = torch.gather(x, 1, ids_restore[..., None].expand(-1, -1, D))                          # B×L×D
    x = torch.where(drop[:, None, None], mask_token.expand(Bn, L, D), x)
    return proj(torch.cat([x, dense], dim=-1))


def _record(model: DiT) -> dict[str, torch.Tensor]:
    """Hooks: the dense path (mixer output), the deep path (last backbone block's output), the decoder's input."""
    seen: dict[str, torch.Tensor] = {}
    model.mixer[-1].register_forward_hook(lambda module, args, out: seen.update(dense=out))
    model.blocks[-1].register_forward_hook(lambda module, args, out: seen.update(deep=out))
    model.decoder[0].register_forward_pre_hook(lambda module, args: seen.update(decoder_in=args[0]))
    return seen


@pytest.mark.parametrize("masked", [True, False])
def test_fusion_and_path_drop_match_sprints_steps(masked: bool) -> None:
    model = randomized(_model(**SPRINT), std=0.1)
    seen = _record(model)
    keep = random_keep_idx(B, model.seq_len, 0.75, torch.Generator().manual_seed(1), grid=model.grid,
                           structured=True) if masked else None
    drop = torch.tensor([False, True, False])
    out = model(*_inputs(model), inputs=StepInputs(keep, drop_path=drop))
    assert out.shape == (B, model.seq_len, 4 * 4 * 3)  # a prediction for every token
    ids_keep = keep if masked else torch.arange(model.seq_len).expand(B, -1)
    expected = _sprint_decoder_input(seen["deep"], seen["dense"], ids_keep, model.sparse_fusion.mask_token, drop,
                                     model.sparse_fusion.proj)
    torch.testing.assert_close(seen["decoder_in"], expected)
    # the dropped sample's decoder sees the mask token and the dense path only
    fixed = model.sparse_fusion.proj(torch.cat([model.sparse_fusion.mask_token.expand_as(seen["dense"][1]),
                                                seen["dense"][1]], dim=-1))
    torch.testing.assert_close(seen["decoder_in"][1], fixed)


def test_path_drop_changes_only_the_dropped_samples() -> None:
    model = randomized(_model(**SPRINT), std=0.1)
    inputs = _inputs(model)
    keep = random_keep_idx(B, model.seq_len, 0.75, torch.Generator().manual_seed(1), grid=model.grid, structured=True)
    plain = model(*inputs, inputs=StepInputs(keep))
    dropped = model(*inputs, inputs=StepInputs(keep, drop_path=torch.tensor([False, True, False])))
    torch.testing.assert_close(dropped[[0, 2]], plain[[0, 2]])
    assert not torch.allclose(dropped[1], plain[1])


def test_the_mask_token_is_fixed_and_saved() -> None:
    """SPRINT's mask token has requires_grad=False (sit.py 420), drawn N(0, 0.02²) (sit.py 509): a buffer here,
    so no phase (mask 0 included) leaves a parameter idle, and it travels with the checkpoint."""
    model = _model(**SPRINT)
    token = model.sparse_fusion.mask_token
    assert "sparse_fusion.mask_token" in model.state_dict() and token.std() > 0
    assert all("mask_token" not in name for name, _ in model.named_parameters()) and model.mask_token is None
    assert idle_parameters(model.cfg, 0.0) == idle_parameters(model.cfg, 0.75) == []
    drop = torch.tensor([True, False, False])  # one caption dropped (null_context), one deep path dropped
    randomized(model, std=0.1)(*_inputs(model), drop, StepInputs(drop_path=drop)).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_path_drop_draws_from_its_own_generator() -> None:
    chance = ModelConfig(**SPRINT).path_drop
    first = draw_path_drop(20_000, chance, torch.Generator().manual_seed(3))
    assert torch.equal(first, draw_path_drop(20_000, chance, torch.Generator().manual_seed(3)))
    assert 0.09 < first.float().mean() < 0.11
    assert draw_path_drop(8, ModelConfig().path_drop, torch.Generator().manual_seed(3)) is None


def test_path_drop_needs_the_fusion() -> None:
    model = _model(mixer_depth=1, decoder_depth=1)
    with pytest.raises(ValueError, match="drop_path"):
        model(*_inputs(model), inputs=StepInputs(drop_path=torch.tensor([True, False, False])))


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.sparse_fusion=true", "model.mixer_depth=0", "model.decoder_depth=1"], "needs a dense path"),
    (["model.sparse_fusion=true", "model.mixer_depth=1"], "needs a dense path"),
    (["model.path_drop=0.1"], "set model.sparse_fusion=true"),
    (["arm=sprint75", "model.path_drop=1.0"], r"path_drop must be in \[0, 1\)"),
])
def test_sprint_options_that_cannot_mean_what_they_say_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_the_sprint_arms() -> None:
    full, pattern = load_config(["arm=sprint75"]).model, load_config(["arm=sprint75_pattern"]).model
    assert (full.structured_mask, full.mixer_depth, full.decoder_depth, full.sparse_fusion, full.path_drop) == (
        True, 1, 1, True, 0.1)
    assert (pattern.structured_mask, pattern.decoder_depth, pattern.sparse_fusion) == (True, 0, False)
