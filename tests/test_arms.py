"""The literature arms: MaskDiT's decoder + MAE loss, SPRINT, downscaled steps (long skips: test_long_skips.py)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from maskbench.cli import main
from maskbench.config import DemoteWindow, load_config, run_id
from maskbench.config.identity import HASHED_WHEN_SET
from maskbench.config.presets import ModelConfig, decoder_width
from maskbench.data.dataset import resolve_dataset
from maskbench.errors import ConfigError
from maskbench.models import objective
from maskbench.models.dit import DiT
from maskbench.models.inputs import Demotion, StepInputs
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import downscale, flow_loss, in_window, interpolate, mae_target, windowed_flow_loss
from maskbench.models.text import SynthTextEncoder
from maskbench.runs.launch import train
from maskbench.train.diagnostics import BlockNorms, named_blocks
from maskbench.train.schedule import downscaled_count, make_schedule
from tests.conftest import FAST, new_trainer, randomized, tiny_overrides

B = 3


def _model(**fields) -> DiT:
    cfg = ModelConfig(width=32, heads=2, text_width=32, text_depth=1, text_len=8, **fields)
    return DiT(cfg, 16, 3, cfg.text_width, SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len))


def _inputs(model: DiT, size: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(B, 3, size, size, generator=gen)
    noise = torch.randn(B, 3, size, size, generator=gen)
    t = torch.rand(B, generator=gen)
    ids, mask = model.text_encoder.tokenize(["a red circle", "two blue squares", "a green triangle"])
    return x0, noise, t, ids, mask


def _sample_mse(model: DiT, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, ids: torch.Tensor,
                mask: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """B: each sample's unmasked velocity MSE, written out: x_t on the straight path, target v = noise - x0."""
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    pred = model(x_t, t, ids, mask, drop)                                          # B×L×P
    return ((pred - model.patchify(noise - x0)) ** 2).mean(dim=(1, 2))             # B


# ------------------------------------------------------------------------------------- MaskDiT decoder + MAE
def test_decoder_predicts_every_token_and_the_mae_term_reads_only_dropped_ones() -> None:
    model = randomized(_model(depth=2, decoder_depth=1), std=0.1)
    x0, noise, t, ids, mask = _inputs(model)
    keep = random_keep_idx(B, model.seq_len, 0.5, torch.Generator().manual_seed(1))
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    pred = model(x_t, t, ids, mask, inputs=StepInputs(keep))
    assert pred.shape == (B, model.seq_len, 4 * 4 * 3)
    kept = torch.zeros(B, model.seq_len, dtype=torch.bool)
    kept[torch.arange(B)[:, None], keep] = True
    velocity = ((pred - model.patchify(noise - x0))[kept] ** 2).mean()   # v = noise - x0 on kept tokens only
    mae = ((pred - mae_target(model.patchify(x_t)))[~kept] ** 2).mean()  # normalised x_t on dropped ones only
    torch.testing.assert_close(flow_loss(model, x0, noise, t, ids, mask, inputs=StepInputs(keep)), velocity)
    torch.testing.assert_close(flow_loss(model, x0, noise, t, ids, mask, inputs=StepInputs(keep), mae_weight=0.1),
                               velocity + 0.1 * mae)


def test_maskdit_refills_dropped_slots_and_adds_positions_to_every_decoder_token() -> None:
    """MaskDiT's decoder input (models/maskdit.py 538-545): the DecoderLayer's narrow output of the kept tokens in
    place, the learned mask token in the dropped slots, then `decoder_pos_embed` added to every token; and the drop
    comes right after the patch embedding (475-483), so maskdit50 runs no mixer even on micro_s."""
    model = randomized(_model(depth=2, decoder_depth=1), std=0.1)
    seen = {}
    model.decoder_layer.register_forward_hook(lambda module, args, out: seen.update(deep=args[0], narrow=out))
    model.decoder[0].register_forward_pre_hook(lambda module, args: seen.update(decoder_in=args[0]))
    x0, noise, t, ids, mask = _inputs(model)
    keep = random_keep_idx(B, model.seq_len, 0.5, torch.Generator().manual_seed(1))
    model(interpolate(x0, noise, t), t, ids, mask, inputs=StepInputs(keep))
    assert seen["deep"].shape == (B, keep.shape[1], 32) and seen["narrow"].shape == (B, keep.shape[1], 16)
    expected = model.mask_token.expand(B, model.seq_len, -1).clone()
    for b in range(B):
        expected[b, keep[b]] = seen["narrow"][b]
    torch.testing.assert_close(seen["decoder_in"], expected + model.decoder_pos_embed)
    model(interpolate(x0, noise, t), t, ids, mask)  # unmasked: MaskDiT adds the decoder positions all the same
    torch.testing.assert_close(seen["decoder_in"], seen["narrow"] + model.decoder_pos_embed)
    assert load_config(["arm=maskdit50"]).model.mixer_depth == 0 < load_config(["arm=mask0"]).model.mixer_depth


def test_maskdit_decoder_layer_narrows_the_tokens_as_the_authors_build_it() -> None:
    """MaskDiT's DecoderLayer (models/maskdit.py 195-213): LayerNorm, adaLN shift/scale from the model-width
    condition, Linear width -> decoder width; then the decoder blocks, mask token, positions and final layer at the
    decoder width, conditioned at the model width (309-331). Zeroed at init as the final layer (403-408)."""
    model = _model(depth=2, decoder_depth=1)                               # width 32: 32·512/1152 -> 16
    layer, block = model.decoder_layer, model.decoder[0]
    assert (layer.linear.in_features, layer.linear.out_features) == (32, 16)
    assert (layer.adaLN_modulation[-1].in_features, layer.adaLN_modulation[-1].out_features) == (32, 64)
    assert layer.linear.weight.abs().sum() == layer.adaLN_modulation[-1].weight.abs().sum() == 0
    assert (block.attn.qkv.in_features, block.adaLN_modulation[-1].in_features, block.cross_attn.kv.in_features) == (
        16, 32, 32)                                                        # narrow tokens, model-width c and text
    assert model.mask_token.shape == (16,) and model.decoder_pos_embed.shape == (model.seq_len, 16)
    assert model.final_layer.linear.in_features == 16 and model.final_layer.adaLN_modulation[-1].in_features == 32
    x0, noise, t, ids, mask = _inputs(model)
    model = randomized(model, std=0.1)
    keep = random_keep_idx(B, model.seq_len, 0.5, torch.Generator().manual_seed(1))
    pred = model(interpolate(x0, noise, t), t, ids, mask, inputs=StepInputs(keep))
    assert pred.shape == (B, model.seq_len, 4 * 4 * 3)
    loss = flow_loss(model, x0, noise, t, ids, mask, inputs=StepInputs(keep), mae_weight=0.1)
    loss.backward()
    assert all(p.grad is not None for p in [*layer.parameters(), model.mask_token, *model.blocks[0].parameters()])
    assert model.decoder_pos_embed.requires_grad is False and "decoder_pos_embed" not in model.state_dict()
    small = model(interpolate(x0, noise, t)[..., ::2, ::2], t, ids, mask)  # a demoted grid: decoder positions filtered
    assert small.shape == (B, model.seq_len // 4, 4 * 4 * 3)


def test_maskdit_decoder_width_defaults_to_the_authors_ratio_and_is_validated() -> None:
    """512 of 1152 (models/maskdit.py 310, 661-662), rounded to a multiple of 4 and of the heads; the shipped
    arms narrow it to 0.3125 of the width so as to stay within the leaderboard's size tolerance; SPRINT's decoder
    stays full width (snap-research/Sprint src/models/sit.py 411-441); a ratio the decoder cannot use is refused."""
    assert decoder_width(ModelConfig(width=1152, heads=16, decoder_depth=8)) == 512  # DiT-XL/2's: theirs exactly
    assert decoder_width(ModelConfig(width=128, heads=4, decoder_depth=1)) == 56
    assert decoder_width(load_config(["arm=maskdit50", "model=tiny"]).model) == 40
    assert decoder_width(load_config(["arm=maskdit50", "model=dit_s2"]).model) == 120  # 384 · 0.3125, 12 | 120
    assert decoder_width(load_config(["arm=maskdit50", "model=tiny", "model.decoder_ratio=0.5"]).model) == 64
    assert decoder_width(load_config(["arm=sprint75"]).model) == load_config(["arm=sprint75"]).model.width
    for overrides, match in [(["model.decoder_ratio=0.5"], "decoder_depth"),
                             (["arm=sprint75", "model.decoder_ratio=0.5"], "SPRINT"),
                             (["arm=maskdit50", "model.decoder_ratio=1.5"], "in \\(0, 1\\]"),
                             (["arm=maskdit50", "model.decoder_ratio=0"], "in \\(0, 1\\]")]:
        with pytest.raises(ConfigError, match=match):
            load_config(overrides)
    # the width names the run: maskdit50 runs from before the DecoderLayer were full width; ratios that round to
    # one width are one run
    default = load_config(["arm=maskdit50", "model=tiny"])
    assert run_id(default) == run_id(load_config(["arm=maskdit50", "model=tiny", "model.decoder_ratio=0.32"]))
    assert run_id(default) != run_id(load_config(["arm=maskdit50", "model=tiny", "model.decoder_ratio=0.5"]))


def test_mae_target_normalises_each_patch() -> None:
    target = mae_target(torch.randn(2, 5, 48) * 3 + 7)
    torch.testing.assert_close(target.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(target.var(-1, unbiased=False), torch.ones(2, 5), atol=1e-4, rtol=0)


def test_mae_weight_needs_a_decoder() -> None:
    with pytest.raises(ConfigError, match="decoder_depth"):
        load_config(["train.mae_weight=0.1"])
    model = _model(depth=2)
    x0, noise, t, ids, mask = _inputs(model)
    with pytest.raises(ValueError, match="decoder_depth"):
        flow_loss(model, x0, noise, t, ids, mask, inputs=StepInputs(random_keep_idx(B, model.seq_len, 0.5)), mae_weight=0.1)


# ------------------------------------------------------------------------------------------------- SPRINT
def test_sprint_arm_keeps_one_token_per_2x2_group_and_refuses_other_ratios() -> None:
    cfg = load_config(["arm=sprint75"])
    assert cfg.model.structured_mask and [p.mask_ratio for p in cfg.arm.phases] == [0.75, 0.0]
    keep = random_keep_idx(4, 64, 0.75, torch.Generator().manual_seed(0), grid=(8, 8), structured=True)
    groups = (keep // 8 // 2) * 4 + (keep % 8) // 2                  # which 2×2 group each kept token is in
    assert all(sorted(row.tolist()) == list(range(16)) for row in groups)
    with pytest.raises(ConfigError, match="structured_mask"):
        load_config(["arm=mask75_then0", "model.structured_mask=true", "arm.phases=[{mask_ratio: 0.5}]"])


# ------------------------------------------------------------------------------------------ downscaled steps
def test_window_gate_selects_the_samples_whose_t_lies_inside() -> None:
    t = torch.tensor([0.0, 0.59, 0.6, 0.8, 1.0])
    assert in_window(t, [0.6, 1.0]).tolist() == [False, False, True, True, True]
    assert not in_window(t, []).any()


def test_downscale_box_filters_images_and_keeps_noise_standard_normal() -> None:
    x0 = torch.arange(16.0).view(1, 1, 4, 4)
    low, _ = downscale(x0, torch.zeros_like(x0), 2)
    assert low.flatten().tolist() == [2.5, 4.5, 10.5, 12.5]
    _, noise = downscale(torch.zeros(64, 3, 32, 32), torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0)), 2)
    assert noise.shape == (64, 3, 16, 16) and abs(noise.std().item() - 1) < 0.02


def test_model_runs_downscaled_inputs_on_the_pooled_positions() -> None:
    model = _model(depth=1)
    x0, noise, t, ids, mask = _inputs(model, size=8)
    assert model(x0, t, ids, mask).shape == (B, 4, 48)             # 2×2 tokens instead of 4×4
    pooled = model.positions(2, 2)
    torch.testing.assert_close(pooled[0], model.pos_embed.view(4, 4, -1)[:2, :2].mean((0, 1)))
    assert model(torch.randn(B, 3, 12, 12), t, ids, mask).shape == (B, 9, 48)   # a non-integer ratio: 3×3 tokens
    for bad in (10, 20):                                    # not whole patches; larger than native
        with pytest.raises(ValueError, match="smaller whole number"):
            model(torch.randn(B, 3, bad, bad), t, ids, mask)


def test_windowed_loss_is_the_sample_mean_of_the_downscaled_and_full_parts() -> None:
    model = randomized(_model(depth=1), std=0.1)
    x0, noise, _, ids, mask = _inputs(model)
    t = torch.tensor([0.2, 0.7, 0.9])                       # inside the window [0.6, 1]: samples 1 and 2
    drop = torch.tensor([False, True, False])
    full = _sample_mse(model, x0, noise, t, ids, mask, drop)                       # B, 16×16 pixels
    low = _sample_mse(model, *downscale(x0, noise, 2), t, ids, mask, drop)         # B, 8×8 pixels
    route = [DemoteWindow(0.5, [0.6, 1.0])]
    routed = StepInputs(demotion=Demotion(route))
    torch.testing.assert_close(windowed_flow_loss(model, x0, noise, t, ids, mask, drop, routed),
                               torch.stack([full[0], low[1], low[2]]).mean())
    torch.testing.assert_close(windowed_flow_loss(model, x0, noise, t, ids, mask, drop), full.mean())


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_planned_downscaled_counts_match_what_training_runs(tmp_path, synth_root, monkeypatch, grad_accum) -> None:
    """The FLOPs plan predicts, from the seed alone, how many samples of each step train at low resolution."""
    cfg = load_config(["arm=downscale_window", *tiny_overrides(tmp_path, synth_root, "train.downscale_window=[0.3,1.0]",
                                                               f"train.grad_accum={grad_accum}", "eval.points=[1.0]",
                                                               "budget.flops=1e9", *FAST)])
    seen: list[int] = []
    original = objective.flow_loss

    def recording(model, x0, *args, **kwargs):
        seen.append(len(x0) if x0.shape[-1] < cfg.data.image_size else 0)
        return original(model, x0, *args, **kwargs)

    monkeypatch.setattr(objective, "flow_loss", recording)
    run = new_trainer(cfg).fit()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    planned = [sum(downscaled_count(cfg, grad_accum, step["step"])) for step in steps]
    assert 0 < sum(planned) < cfg.train.batch_size * len(steps)   # some, not all, samples downscaled
    assert sum(seen) == sum(planned)
    schedule = make_schedule(cfg, resolve_dataset(cfg.data, cfg.paths.data, create=False), n_streams=grad_accum)
    assert steps[-1]["flops"] == schedule.total_flops and len(set(schedule.phases[0].flops_per_step)) > 1


def test_downscale_window_is_validated() -> None:
    with pytest.raises(ConfigError, match="downscale_window"):
        load_config(["train.downscale_window=[0.8,0.2]"])
    with pytest.raises(ConfigError, match="token dropping"):
        load_config(["arm=mask75", "train.downscale_window=[0.5,1.0]"])
    with pytest.raises(ConfigError, match="downscale_factor"):
        load_config(["arm=downscale_window", "train.downscale_factor=3"])


# -------------------------------------------------------------------------------- shipped arms, diagnostics
@pytest.mark.parametrize("arm", ["lsc_mask75_then0", "maskdit50"])
def test_arm_trains_and_logs_block_norms_per_step_and_per_point(tmp_path, synth_root, arm: str) -> None:
    cfg = load_config([f"arm={arm}", *tiny_overrides(tmp_path, synth_root, "budget.flops=1.5e9", *FAST)])
    run = train(cfg)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    points = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    model = _model(**{k: getattr(cfg.model, k) for k in ("depth", "decoder_depth", "long_skip")})
    names = [name for name, _ in named_blocks(model)]
    assert all(sorted(step["block_norm"]) == sorted(names) for step in steps)
    assert all(sorted(step["block_osc"]) == sorted(names) for step in steps[1:])
    assert [p["point"] for p in points] == [0.5, 1.0] and all(p["diagnostics"]["steps"] > 0 for p in points)
    if cfg.model.long_skip != "none":
        assert sorted(steps[-1]["skip_norm"]) == ["skip.1.bias", "skip.1.weight"]
        assert points[-1]["diagnostics"]["skip_norm"]["skip.1.weight"] > 0


def test_block_norms_record_training_forwards_only() -> None:
    model = _model(depth=2, long_skip="concat")
    norms = BlockNorms(model)
    outputs = []
    model.blocks[1].register_forward_hook(lambda module, args, out: outputs.append(out.detach()))
    x0, noise, t, ids, mask = _inputs(model)
    for _ in range(2):
        model(interpolate(x0, noise, t), t, ids, mask)
    first = norms.step()
    assert first["block_norm"]["block.1"] == pytest.approx(torch.stack([o.norm(dim=-1).mean() for o in outputs]).mean().item())
    assert first["block_osc"] == {} and set(first["skip_norm"]) == {"skip.1.weight", "skip.1.bias"}
    with torch.no_grad():
        model(interpolate(x0, noise, t), t, ids, mask)         # sampling-like forward: not recorded
    model(interpolate(x0, 2 * noise, t), t, ids, mask)
    second = norms.step()
    expected = abs(second["block_norm"]["block.1"] - first["block_norm"]["block.1"]) / first["block_norm"]["block.1"]
    assert second["block_osc"]["block.1"] == pytest.approx(expected) and expected > 0
    summary = norms.summary()
    assert summary["steps"] == 2 and summary["block_osc"]["block.1"] == pytest.approx(expected)


def test_arms_lists_the_options_each_arm_sets(capsys) -> None:
    assert main(["arms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    lsc = next(i for i, line in enumerate(lines) if line.startswith("lsc_scalelong "))
    assert lines[lsc + 1].split() == ["sets", "model.long_skip=concat", "model.skip_scale=kappa",
                                      "model.skip_kappa=0.5", "model.skip_init=uvit"]


def test_a_user_arm_file_may_set_model_options_and_the_command_line_still_wins(tmp_path) -> None:
    arm_file = tmp_path / "skips_half.yaml"
    arm_file.write_text("arm:\n  phases: [{mask_ratio: 0.5, fraction: 1.0}]\nmodel:\n  long_skip: concat\n")
    cfg = load_config([f"arm={arm_file}"])
    assert (cfg.arm.name, cfg.arm.phases[0].mask_ratio, cfg.model.long_skip) == ("skips_half", 0.5, "concat")
    assert load_config([f"arm={arm_file}", "model.long_skip=concat_ln"]).model.long_skip == "concat_ln"
    arm_file.write_text("arm:\n  phases: [{mask_ratio: 0.5, fraction: 1.0}]\nmodel:\n  skips: 3\n")
    with pytest.raises(ConfigError, match="skips"):
        load_config([f"arm={arm_file}"])


# A value other than the default for each option hashed only when set, and the options that value needs.
_SET_TO = {
    "model.long_skip": ("concat", []),
    "model.skip_scale": ("constant", ["model.long_skip=concat"]),
    "model.skip_kappa": ("0.25", ["model.long_skip=concat", "model.skip_scale=kappa"]),
    "model.decoder_depth": ("1", []),
    "model.resplit": ("true", []),
    "train.mae_weight": ("0.1", ["model.decoder_depth=1"]),
    "train.downscale_window": ("[0.6,1.0]", []),
    "train.downscale_factor": ("4", ["train.downscale_window=[0.6,1.0]"]),
    "train.demote_routes": ("[{ratio: 0.75, t: [0.6, 1.0]}]", []),
    "train.demote_gate": ("batch", ["train.demote_routes=[{ratio: 0.75, t: [0.6, 1.0]}]"]),
    "model.skip_init": ("identity", ["model.long_skip=concat"]),
    "model.sparse_fusion": ("true", ["model.mixer_depth=1", "model.decoder_depth=1"]),
    "model.path_drop": ("0.1", ["model.mixer_depth=1", "model.decoder_depth=1", "model.sparse_fusion=true"]),
    "train.skip_step_grad_norm": ("0.02", []),
    "train.skip_step_grad_ratio": ("4", []),
    "train.skip_step_window": ("10", ["train.skip_step_grad_ratio=4"]),
    "train.data_streams": ("2", []),
    "model.route_ratio": ("0.5", []),
    "model.route_start": ("0", ["model.route_ratio=0.5"]),
    "model.route_end": ("1", ["model.route_ratio=0.5"]),
    "eval.final_n_samples": ("512", []),
    "eval.bootstrap_resamples": ("50", []),
    "train.repa_weight": ("0.5", []),
    "train.repa_depth": ("1", ["train.repa_weight=0.5"]),
    "train.repa_encoder": ("synth", ["train.repa_weight=0.5"]),
}
# init_from / init_weights need a trained source run: tests/test_convert.py checks they name a new run.
_NEED_A_SOURCE = {"init_from", "init_weights"}


@functools.cache
def _mask0_name(*overrides: str) -> str:
    return run_id(load_config(["arm=mask0", "model=tiny", *overrides]))


def test_new_options_left_at_their_defaults_keep_existing_run_names() -> None:
    """Runs trained before these options existed resume under the same directory name; setting one names a new run."""
    # Pinned on purpose: only a name from before a change sees the change (a new field that enters the hash,
    # or a changed hash recipe). It last changed with the draw scheme (config.DRAW_SCHEME crn-v3: every draw on a
    # CPU generator): runs trained before it drew on the GPU's generators there, so they must not resume under
    # the new code (the committed CSVs keep their old run ids).
    assert _mask0_name() == "mask0-synth-tiny-s0-ac4d3466"
    assert set(_SET_TO) | _NEED_A_SOURCE == HASHED_WHEN_SET
    for option, (value, needs) in _SET_TO.items():
        assert _mask0_name(*needs, f"{option}={value}") != _mask0_name(*needs), option
