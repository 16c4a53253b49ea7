"""Long skips (Skip-DiT / U-ViT fusion) and ScaleLong's scalings: CS order, the 1/sqrt(2) control, the LS gate."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from maskbench.config import load_config
from maskbench.config.presets import PRESETS, ModelConfig, check_model
from maskbench.errors import ConfigError
from maskbench.models.dit import DiT, LongSkipFusion, SkipGate, long_skip_pairs, skip_scales
from maskbench.models.inputs import StepInputs
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import interpolate
from maskbench.models.text import SynthTextEncoder
from maskbench.runs.launch import train
from tests.conftest import SMALL_EVAL, randomized, tiny_overrides

B, IMAGE = 3, 16  # a 4×4 token grid at patch 4
GATE_IMAGE = 32   # 8×8 = 64 tokens: the gate has 64 // 16 = 4 hidden units


def _model(image_size: int = IMAGE, **fields) -> DiT:
    cfg = ModelConfig(width=32, heads=2, text_width=32, text_depth=1, text_len=8, **fields)
    torch.manual_seed(0)
    return DiT(cfg, image_size, 3, cfg.text_width, SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len))


def _inputs(model: DiT, size: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(B, 3, size, size, generator=gen), torch.randn(B, 3, size, size, generator=gen)
    t = torch.rand(B, generator=gen)
    ids, mask = model.text_encoder.tokenize(["a red circle", "two blue squares", "a green triangle"])
    return interpolate(x0, noise, t), t, ids, mask


def _record(model: DiT) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """Hooks: every backbone block's output, and the input of each fusion Linear (by fusing block)."""
    outputs, fused = [], {}
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: outputs.append(out))
    for index, skip in model.long_skips.items():
        skip.proj.register_forward_pre_hook(lambda module, args, index=index: fused.update({int(index): args[0]}))
    return outputs, fused


def test_long_skips_pair_block_i_with_block_depth_minus_1_minus_i() -> None:
    assert long_skip_pairs(4) == [(2, 1), (3, 0)]  # Skip-DiT's halves: block 2 fuses the block just before it
    assert long_skip_pairs(5) == [(3, 1), (4, 0)]  # the middle block 2 would fuse itself: no skip
    assert long_skip_pairs(1) == []


def _uvit_reference(outdepth: int, kappa: float) -> dict[int, tuple[int, float]]:
    """ScaleLong's U-ViT loop (libs/uvit.py 240-263) on block indices: in-blocks 0 .. outdepth-1 push their
    outputs, the mid block (index outdepth) runs, out-block j (index outdepth+1+j) pops one and scales it by
    kappa ** (outdepth - 1 - j). Returns {fusing block: (source block, coefficient)}."""
    skips = list(range(outdepth))
    return {outdepth + 1 + j: (skips.pop(), kappa ** (outdepth - 1 - j)) for j in range(outdepth)}


def test_depth_13_is_uvits_depth_12_with_its_mid_block_and_kappa_scales() -> None:
    """tiny_deep's 13 blocks are U-ViT's "depth 12": 6 in-blocks, a mid block that fuses nothing, 6 out-blocks,
    each fusing an in-block's output with ScaleLong's CS coefficient; never the running tokens themselves."""
    assert PRESETS["tiny_deep"]().depth == 13
    model = randomized(_model(depth=13, long_skip="concat", skip_scale="kappa", skip_kappa=0.5), std=0.3)
    reference = _uvit_reference(6, 0.5)
    assert {block: source for block, source in long_skip_pairs(13)} == {b: s for b, (s, _) in reference.items()}
    assert {int(b): skip.scale for b, skip in model.long_skips.items()} == {b: k for b, (_, k) in reference.items()}
    outputs, fused = _record(model)
    model(*_inputs(model, IMAGE))
    assert 6 not in fused  # the mid block
    for block, (source, kappa) in reference.items():  # block 7 fuses in-block 5 at 0.5^5 ... block 12 block 0 at 1
        assert source < block - 1  # a skip crosses at least the mid block
        torch.testing.assert_close(fused[block], torch.cat([outputs[block - 1], kappa * outputs[source]], dim=-1))


def test_each_fusing_block_receives_the_paired_blocks_output() -> None:
    model = _model(depth=6, long_skip="concat_ln")
    assert list(model.long_skips) == ["3", "4", "5"]
    outputs, received = [], {}
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: outputs.append(out))
    for index, skip in model.long_skips.items():
        skip.register_forward_hook(lambda module, args, out, index=index: received.update({int(index): args[1]}))
    model(*_inputs(model, IMAGE))
    for block, source in long_skip_pairs(6):
        assert received[block] is outputs[source]


def test_fusion_is_concat_then_norm_then_linear() -> None:
    for fusion, has_norm in (("concat_ln", True), ("concat", False)):
        skip = _model(depth=2, long_skip=fusion).long_skips["1"]
        x, s = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
        cat = torch.cat([x, s], dim=-1)
        expected = skip.proj(torch.nn.functional.layer_norm(cat, (64,), skip.norm.weight, skip.norm.bias, 1e-6)
                             if has_norm else cat)
        torch.testing.assert_close(skip(x, s), expected)


def _uvit_cs_scales(depth: int, kappa: float) -> dict[int, float]:
    """ScaleLong's CS rule as its U-ViT loop runs it, on depth // 2 in-blocks: {source block: its coefficient}."""
    return dict(_uvit_reference(depth // 2, kappa).values())


@pytest.mark.parametrize("depth", [2, 4, 5, 8, 12, 13])
def test_kappa_scales_follow_scalelongs_order_innermost_damped_most(depth: int) -> None:
    model = _model(depth=depth, long_skip="concat", skip_scale="kappa", skip_kappa=0.7)
    by_source = {source: model.long_skips[str(block)].scale for block, source in long_skip_pairs(depth)}
    expected = _uvit_cs_scales(depth, 0.7)
    assert by_source == pytest.approx(expected)
    assert by_source[0] == 1.0 and by_source[depth // 2 - 1] == pytest.approx(0.7 ** (depth // 2 - 1))
    assert skip_scales(model.cfg) == [expected[source] for _, source in long_skip_pairs(depth)]


def test_fixed_scale_multiplies_the_skip_before_the_fusion() -> None:
    model = randomized(_model(depth=8, long_skip="concat", skip_scale="kappa", skip_kappa=0.5), std=0.3)
    outputs, fused = _record(model)
    model(*_inputs(model, IMAGE))
    for block, source in long_skip_pairs(8):  # block 4 fuses block 3 (innermost, 0.5^3) ... block 7 block 0 (1)
        expected = torch.cat([outputs[block - 1], 0.5 ** source * outputs[source]], dim=-1)
        torch.testing.assert_close(fused[block], expected)
    constant = _model(depth=8, long_skip="concat", skip_scale="constant")
    assert [skip.scale for skip in constant.long_skips.values()] == pytest.approx([2 ** -0.5] * 4)


def _gate_by_hand(gate: SkipGate, skip: torch.Tensor, keep_idx: torch.Tensor | None, seq_len: int) -> torch.Tensor:
    """σ(W₂·ReLU(W₁·m + b₁) + b₂) with m the per-token channel means on the full grid (0 where dropped)."""
    full = torch.zeros(skip.shape[0], seq_len)
    positions = keep_idx if keep_idx is not None else torch.arange(seq_len).expand(skip.shape[0], -1)
    for b in range(skip.shape[0]):
        for k, position in enumerate(positions[b].tolist()):
            full[b, position] = skip[b, k].sum() / skip.shape[-1]
    fc1, fc2 = gate.mlp.fc1, gate.mlp.fc2
    hidden = torch.clamp(full @ fc1.weight.T + fc1.bias, min=0)
    gates = torch.sigmoid(hidden @ fc2.weight.T + fc2.bias)                     # B×L
    return torch.stack([gates[b, positions[b]] for b in range(skip.shape[0])])[..., None]


@pytest.mark.parametrize("mask_ratio", [0.0, 0.75])
def test_gate_is_a_token_mlp_over_the_skips_channel_means(mask_ratio: float) -> None:
    gate = randomized(_model(GATE_IMAGE, depth=2, long_skip="concat", skip_scale="learned_shared"), std=0.3).long_skip_gates[0]
    assert (gate.mlp.fc1.weight.shape, gate.mlp.fc2.weight.shape) == ((4, 64), (64, 4))  # L = 64, L // 16 = 4
    keep = random_keep_idx(B, 64, mask_ratio, torch.Generator().manual_seed(1)) if mask_ratio else None
    skip = torch.randn(B, 64 if keep is None else keep.shape[1], 32)
    out = gate(skip, keep)
    assert out.shape == (B, skip.shape[1], 1) and bool(((out > 0) & (out < 1)).all())
    torch.testing.assert_close(out, _gate_by_hand(gate, skip, keep, 64))


@pytest.mark.parametrize(("scale", "gates"), [("learned_shared", 1), ("learned_per_skip", 3)])
def test_each_skip_is_multiplied_by_its_gate_computed_from_the_skip(scale: str, gates: int) -> None:
    model = randomized(_model(GATE_IMAGE, depth=6, long_skip="concat", skip_scale=scale), std=0.3)
    assert len(model.long_skip_gates) == gates
    assert all(skip.scale == 1.0 for skip in model.long_skips.values())
    outputs, fused = _record(model)
    keep = random_keep_idx(B, model.seq_len, 0.5, torch.Generator().manual_seed(2))
    model(*_inputs(model, GATE_IMAGE), inputs=StepInputs(keep))
    for j, (block, source) in enumerate(long_skip_pairs(6)):  # j-th skip fused, innermost first
        gate = model.long_skip_gates[j if gates > 1 else 0]
        skip = outputs[source]                                                   # B×K×D
        expected = torch.cat([outputs[block - 1], _gate_by_hand(gate, skip, keep, model.seq_len) * skip], dim=-1)
        torch.testing.assert_close(fused[block], expected)


def test_skip_init_uvit_is_trunc_normal_and_an_unknown_one_is_refused() -> None:
    """U-ViT inits every Linear trunc_normal(0.02) with zero bias (libs/uvit.py 214-218); the rest of the model
    keeps DiT's init. A name init_skips does not know must stop the build, not fall back to DiT's xavier."""
    dit, uvit = _model(depth=13, long_skip="concat"), _model(depth=13, long_skip="concat", skip_init="uvit")
    weights = torch.cat([skip.proj.weight.detach().flatten() for skip in uvit.long_skips.values()])  # 6 × 32×64
    assert 0.018 < float(weights.std()) < 0.022 and float(weights.abs().max()) < 0.1
    assert all(not skip.proj.bias.any() for skip in uvit.long_skips.values())
    assert float(torch.cat([s.proj.weight.detach().flatten() for s in dit.long_skips.values()]).std()) > 0.1  # xavier
    others = [name for name, _ in dit.named_parameters() if not name.startswith("long_skips")]
    assert all(torch.equal(dit.get_parameter(n), uvit.get_parameter(n)) for n in others)
    with pytest.raises(ValueError, match=re.escape("model.skip_init must be dit|skipdit|uvit|identity; got 'xavier'")):
        check_model(ModelConfig(depth=5, long_skip="concat", skip_init="xavier"))  # the config's one line
    with pytest.raises(ValueError, match="'xavier' is not a valid SkipInit"):
        _model(depth=5, long_skip="concat", skip_init="xavier")  # a config built by hand: the build stops too
    with pytest.raises(ValueError, match="'xavier' is not a valid SkipInit"):
        dit.init_skips("xavier")


def test_an_unknown_long_skip_fusion_is_refused_not_built_as_concat() -> None:
    with pytest.raises(ValueError, match=re.escape("model.long_skip must be none|concat_ln|concat; got 'unet'")):
        check_model(ModelConfig(depth=5, long_skip="unet"))
    with pytest.raises(ValueError, match="'unet' is not a valid LongSkipKind"):
        _model(depth=5, long_skip="unet")
    with pytest.raises(ValueError, match="'unet' is not a valid LongSkipKind"):
        LongSkipFusion(8, "unet", 1.0)


def test_default_model_has_no_long_skip_layers() -> None:
    model = _model(depth=4)
    assert len(model.long_skips) == 0 and len(model.long_skip_gates) == 0
    assert not any("skip" in name for name, _ in model.named_parameters())


def test_long_skip_parameters_are_all_under_long_skip() -> None:
    """One name prefix for every long-skip layer, so they can be selected (frozen, logged) by name."""
    model = _model(GATE_IMAGE, depth=4, long_skip="concat_ln", skip_scale="learned_per_skip")
    plain = _model(GATE_IMAGE, depth=4)
    extra = {name for name, _ in model.named_parameters()} - {name for name, _ in plain.named_parameters()}
    assert extra and all(name.startswith("long_skip") for name in extra)
    assert {name.split(".")[0] for name in extra} == {"long_skips", "long_skip_gates"}


def test_a_gate_on_too_few_tokens_is_refused_where_the_input_size_is_known() -> None:
    """The learned gate has tokens // 16 hidden units: 32 px at patch 16 is 4 tokens, none."""
    with pytest.raises(ValueError, match="needs at least 16 tokens"):
        _model(GATE_IMAGE, long_skip="concat", skip_scale="learned_shared", patch_size=16)


def test_a_downscaled_input_is_refused_by_the_gate() -> None:
    model = _model(GATE_IMAGE, depth=2, long_skip="concat", skip_scale="learned_shared")
    with pytest.raises(ValueError, match="native 8×8 token grid"):
        model(*_inputs(model, GATE_IMAGE // 2))


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.skip_scale=kappa"], "model.skip_scale=kappa scales long skips: set model.long_skip"),
    (["model.long_skip=concat", "model.skip_kappa=0.3"], "skip_kappa=0.3 does nothing without model.skip_scale"),
    (["arm=lsc_scalelong", "model.skip_kappa=1.5"], r"skip_kappa must be in \(0, 1\]"),
    (["model.long_skip=concat", "model.skip_scale=scalelong"], "Invalid value 'scalelong', expected one of"),
    (["arm=lsc_scalelong_ls", "train.downscale_window=[0.0,0.25]"], "gate is defined on the native token grid"),
])
def test_scalelong_options_that_cannot_mean_what_they_say_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_the_scalelong_family_composes_on_the_deep_preset() -> None:
    sets = {arm: load_config([f"arm={arm}", "model=tiny_deep"]).model for arm in
            ("lsc_uvit", "lsc_const", "lsc_scalelong", "lsc_scalelong_ls")}
    assert {arm: (m.depth, m.long_skip, m.skip_scale, m.skip_init) for arm, m in sets.items()} == {
        "lsc_uvit": (13, "concat", "none", "uvit"), "lsc_const": (13, "concat", "constant", "uvit"),
        "lsc_scalelong": (13, "concat", "kappa", "uvit"), "lsc_scalelong_ls": (13, "concat", "learned_shared", "uvit")}
    assert len(long_skip_pairs(sets["lsc_scalelong"].depth)) == 6
    assert load_config(["arm=lsc_scalelong", "model=tiny_deep", "model.skip_kappa=0.9"]).model.skip_kappa == 0.9


def test_per_skip_gates_train_on_masked_steps(tmp_path, synth_root) -> None:
    arm = tmp_path / "ls_half.yaml"
    arm.write_text("arm:\n  phases: [{mask_ratio: 0.5, fraction: 1.0}]\n"
                   "model:\n  long_skip: concat\n  skip_scale: learned_per_skip\n")
    cfg = load_config([f"arm={arm}", *tiny_overrides(tmp_path, synth_root, "model.depth=4", *SMALL_EVAL)])
    run = train(cfg)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps and all(step["mask_ratio"] == 0.5 and step["loss"] > 0 for step in steps)
    half, final = (load_file(run / "checkpoints" / f"point-{point:g}" / "model.safetensors") for point in (0.5, 1.0))
    gates = {f"long_skip_gates.{j}.mlp.fc{k}.{p}" for j in (0, 1) for k in (1, 2) for p in ("weight", "bias")}
    assert {name for name in final if name.startswith("long_skip_gates")} == gates
    assert all(not torch.equal(half[name], final[name]) for name in gates)  # the gates get gradients
