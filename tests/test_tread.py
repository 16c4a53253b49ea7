"""TREAD's token routing (arms tread50, tread50_mask75): which tokens pass which blocks, the rejoin in order against a
hand-written per-sample loop, the loss on every token, no routing at sampling, the route's draw, and its FLOPs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from maskbench.config import load_config
from maskbench.config.presets import PRESETS, ModelConfig, check_model, route_span
from maskbench.eval.sample import euler_sample
from maskbench.models import dit as dit_module
from maskbench.models.dit import DiT
from maskbench.models.inputs import StepInputs
from maskbench.models.masking import keep_count, random_keep_idx
from maskbench.models.objective import flow_loss, interpolate
from maskbench.models.routing import draw_token_route, run_routed
from maskbench.models.text import VOCAB_SIZE, SynthTextEncoder
from maskbench.runs.launch import train
from maskbench.train.flops import train_step_flops
from tests.conftest import randomized, tiny_overrides
from tests.test_flops import _setting

B, IMAGE = 3, 16  # a 4×4 token grid at patch 4


def _model(**fields) -> DiT:
    cfg = ModelConfig(width=32, heads=2, text_width=32, text_depth=1, text_len=8, **fields)
    torch.manual_seed(0)
    return DiT(cfg, IMAGE, 3, cfg.text_width, SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len))


def _inputs(model: DiT) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(B, 3, IMAGE, IMAGE, generator=gen), torch.randn(B, 3, IMAGE, IMAGE, generator=gen)
    t = torch.rand(B, generator=gen)
    ids, mask = model.text_encoder.tokenize(["a red circle", "two blue squares", "a green triangle"])
    return x0, noise, t, ids, mask


# ------------------------------------------------------------------------------------------------- the span
def test_span_is_the_authors_at_depth_12_and_scales_with_depth() -> None:
    assert route_span(PRESETS["dit_b2"]()) == (2, 8)        # CompVis/tread configs/model/tread.yaml 12-13
    assert route_span(PRESETS["micro_s"]()) == (1, 2)       # the default model's 4 backbone blocks
    assert route_span(PRESETS["dit_xl2"]()) == (5, 20)
    assert route_span(ModelConfig(depth=12, route_ratio=0.5, route_start=3, route_end=5)) == (3, 5)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(route_ratio=1.0), "route_ratio must be in"),
    (dict(route_ratio=0.5, route_start=2, route_end=1), "must lie within"),
    (dict(route_ratio=0.5, route_end=4), "must lie within"),
    (dict(route_start=1), "set model.route_ratio"),
    (dict(route_ratio=0.5, long_skip="concat"), "is not built"),
])
def test_a_route_the_model_cannot_run_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_model(ModelConfig(**fields))


# ---------------------------------------------------------------------------------------------- the routing
class Tally(nn.Module):
    """A block that adds 1 to channel 0 of every token it sees and records their ids (channel 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x[..., 1].long().tolist()
        return x + torch.tensor([1.0, 0.0])


@pytest.mark.parametrize("span", [(None, None), (0, 1), (2, 3)])
def test_each_token_passes_the_blocks_its_route_says_and_rejoins_in_place(span: tuple) -> None:
    cfg = ModelConfig(depth=4, route_ratio=0.5, route_start=span[0], route_end=span[1])
    start, end = route_span(cfg)
    K = 16
    span_idx = random_keep_idx(B, K, cfg.route_ratio, generator=torch.Generator().manual_seed(0))   # B×8
    tokens = torch.stack([torch.zeros(B, K), torch.arange(K).float().expand(B, K)], dim=-1)        # B×K×2
    blocks = [Tally() for _ in range(cfg.depth)]
    out = run_routed(blocks, tokens, span_idx, cfg, lambda block, x: block(x))
    for i, block in enumerate(blocks):
        assert block.seen == (span_idx.tolist() if start <= i <= end else [list(range(K))] * B), i
    in_span = torch.zeros(B, K).scatter(1, span_idx, 1.0)                                            # B×K
    assert torch.equal(out[..., 1], tokens[..., 1])                          # every token back at its position
    assert torch.equal(out[..., 0], cfg.depth - (end - start + 1) * (1 - in_span))  # bypassers skip the span


def _reference_backbone(blocks: nn.ModuleList, tokens: torch.Tensor, c: torch.Tensor, ctx: torch.Tensor,
                        ctx_mask: torch.Tensor, span_idx: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """One sample at a time, each span block on that sample's routed rows, written back after every block."""
    start, end = span
    out = []
    for b in range(tokens.shape[0]):
        x, args = tokens[b:b + 1], (c[b:b + 1], ctx[b:b + 1], ctx_mask[b:b + 1])
        for i, block in enumerate(blocks):
            if start <= i <= end:
                x = x.clone()
                x[0, span_idx[b]] = block(x[:, span_idx[b]], *args)[0]
            else:
                x = block(x, *args)
        out.append(x)
    return torch.cat(out)


@pytest.mark.parametrize("mask_ratio", [0.0, 0.5])
def test_routed_forward_matches_a_per_sample_reference_loop(mask_ratio: float) -> None:
    model = randomized(_model(depth=4, route_ratio=0.5), std=0.1)
    x0, noise, t, ids, mask = _inputs(model)
    x_t = interpolate(x0, noise, t)
    keep_idx = random_keep_idx(B, model.seq_len, mask_ratio, generator=torch.Generator().manual_seed(1))
    span_idx = draw_token_route(model.cfg, B, model.seq_len, keep_idx, torch.Generator().manual_seed(2))
    seen = {}
    hook = model.blocks[0].register_forward_pre_hook(lambda module, args: seen.update(args=args))  # backbone input
    with torch.no_grad():
        out = model(x_t, t, ids, mask, inputs=StepInputs(keep_idx, span_idx))                            # B×K×P
        hook.remove()
        tokens, c, ctx, ctx_mask = seen["args"]
        expected = model.final_layer(_reference_backbone(model.blocks, tokens, c, ctx, ctx_mask, span_idx,
                                                         route_span(model.cfg)), c)
        plain = model(x_t, t, ids, mask, inputs=StepInputs(keep_idx))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, plain, atol=1e-3)  # the route changed what the span saw


def test_the_loss_reads_every_token_of_a_routed_step() -> None:
    model = randomized(_model(depth=4, route_ratio=0.5), std=0.1)
    x0, noise, t, ids, mask = _inputs(model)
    span_idx = draw_token_route(model.cfg, B, model.seq_len, None, torch.Generator().manual_seed(2))
    pred = model(interpolate(x0, noise, t), t, ids, mask, inputs=StepInputs(span_idx=span_idx))            # B×L×P
    assert pred.shape[1] == model.seq_len
    hand = ((pred - model.patchify(noise - x0)) ** 2).mean()
    torch.testing.assert_close(flow_loss(model, x0, noise, t, ids, mask, inputs=StepInputs(span_idx=span_idx)), hand)


def test_sampling_runs_every_block_on_every_token() -> None:
    """The sampler passes no route: a routed model samples exactly what the same weights unrouted do."""
    routed = randomized(_model(depth=4, route_ratio=0.5), std=0.1).eval()
    plain = _model(depth=4)
    plain.load_state_dict(routed.state_dict())
    _, noise, _, ids, mask = _inputs(routed)
    with torch.no_grad():
        samples = [euler_sample(m, noise, ids, mask, steps=3, cfg_scale=2.0) for m in (routed, plain)]
    assert torch.equal(*samples)


# ------------------------------------------------------------------------------------------------ the draw
def test_the_route_is_drawn_over_the_tokens_the_mask_kept() -> None:
    cfg = ModelConfig(route_ratio=0.5)
    gen = torch.Generator().manual_seed(0)
    keep_idx = random_keep_idx(B, 64, 0.75, generator=gen)                                          # B×16
    span_idx = draw_token_route(cfg, B, 64, keep_idx, gen)                                                # B×8
    assert span_idx.shape == (B, 8) and span_idx.max() < 16
    assert torch.equal(span_idx, span_idx.sort(dim=1).values)
    assert all(len(set(row)) == 8 for row in span_idx.tolist())


def test_an_arm_without_a_route_leaves_the_mask_stream_where_it_was() -> None:
    """So every existing arm's masks are drawn exactly as before routing existed."""
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert draw_token_route(ModelConfig(), B, 64, None, gen) is None
    assert torch.equal(gen.get_state(), state)


# ------------------------------------------------------------------------------------------------- FLOPs
def _routed_flops(cfg: ModelConfig, mask_ratio: float) -> int:
    """FlopCounterMode's count of one routed training forward + backward (meta tensors: shapes only)."""
    s, batch = _setting(cfg), 2
    with torch.device("meta"):
        text = SynthTextEncoder(cfg.text_width, cfg.text_depth, cfg.text_len) if s["text_encoder"] else None
        model = DiT(cfg, s["image_size"], s["in_channels"], s["context_dim"], text)
        context = (torch.randint(0, VOCAB_SIZE, (batch, s["context_len"])) if s["text_encoder"]
                   else torch.randn(batch, s["context_len"], s["context_dim"]))
        x = torch.randn(batch, s["in_channels"], s["image_size"], s["image_size"])
        keep_idx = random_keep_idx(batch, model.seq_len, mask_ratio)
        span_idx = draw_token_route(cfg, batch, model.seq_len, keep_idx)
        with FlopCounterMode(display=False) as counter:
            model(x, torch.rand(batch), context, torch.ones(batch, s["context_len"], dtype=torch.bool),
                  torch.tensor([True, False]), StepInputs(keep_idx, span_idx)).square().mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(("arm", "model"), [("tread50", "micro_s"), ("tread50_mask75", "micro_s"),
                                            ("tread50", "dit_b2")])   # dit_b2: the authors' DiT-B/2 span
def test_routed_step_flops_match_flop_counter_within_one_percent(arm: str, model: str) -> None:
    cfg = load_config([f"arm={arm}", f"model={model}"])
    (phase,) = cfg.arm.phases
    analytic = train_step_flops(cfg.model, batch=2, mask_ratio=phase.mask_ratio, **_setting(cfg.model))
    assert analytic == pytest.approx(_routed_flops(cfg.model, phase.mask_ratio), rel=0.01)
    unrouted = dataclasses.replace(cfg.model, route_ratio=0.0)
    assert analytic < train_step_flops(unrouted, batch=2, mask_ratio=phase.mask_ratio, **_setting(unrouted))


# ---------------------------------------------------------------------------------------------- training
def test_tread50_trains_and_routes_every_training_step_and_nothing_else(tmp_path, synth_root, monkeypatch) -> None:
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[2].shape)                                                  # span_idx
        return run_routed(*args, **kwargs)

    monkeypatch.setattr(dit_module, "run_routed", spy)
    run = train(load_config(["arm=tread50", *tiny_overrides(tmp_path, synth_root)]))
    logs = [run / "metrics.jsonl", *(run / "branches").glob("*.jsonl")]  # the trunk's steps, the cooled branches'
    steps = [line for log in logs for line in log.read_text().splitlines()]
    assert len(steps) > 0 and len(calls) == len(steps)  # eval's samples and validation loss route nothing
    assert all(shape == (8, keep_count(64, 0.5)) for shape in calls)
