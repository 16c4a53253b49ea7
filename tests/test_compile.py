"""The GPU path under torch.compile, checked on CPU: the Triton kernels trace as ops (forward and backward in
one graph each, the kernels run by Triton's interpreter), demotion's changing sub-batch sizes compile a
bounded set of graphs, and a step's loss and diagnostics leave the device only where they must."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounter
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from maskbench.config import DemoteWindow
from maskbench.config.presets import ModelConfig
from maskbench.models import kernels
from maskbench.models.dit import DiT
from maskbench.models.inputs import Demotion, StepInputs
from maskbench.models.masking import random_keep_idx
from maskbench.models.objective import window_choice, windowed_flow_loss
from maskbench.train.diagnostics import BlockNorms
from tests.conftest import fresh_dynamo, new_trainer, randomized
from tests.test_arms import _model
from tests.test_kernels import interpret, needs_triton, random_keep  # noqa: F401 (interpret is a fixture)
from tests.test_rule_arm import _cfg as _rule_cfg


@pytest.fixture(autouse=True)
def own_graphs():
    """Every test counts its own graphs: nothing compiled by an earlier test is reused."""
    with fresh_dynamo():
        yield


class Graphs:
    """A torch.compile backend that keeps every graph it is given (forward and, through AOTAutograd, backward)
    and runs it as traced."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []
        self.dynamo: list[torch.fx.GraphModule] = []

    def eager(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.dynamo.append(gm)
        return gm.forward

    def aot(self) -> object:
        def keep(into: list) -> object:
            return lambda gm, example_inputs: into.append(gm) or make_boxed_func(gm.forward)
        return aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))


def ops(gm: torch.fx.GraphModule) -> set[str]:
    """The maskbench ops a graph calls."""
    return {str(node.target).split(".")[1] for node in gm.graph.nodes if str(node.target).startswith("maskbench.")}


# ------------------------------------------------------------------------------------- kernels as ops (item 5)
@needs_triton
def test_masked_dit_forward_and_backward_compile_to_one_graph_each_through_the_kernel_ops(interpret: None) -> None:
    """fullgraph=True: a graph break anywhere in the masked forward (drop and restore) fails the compile; the
    compiled Triton path trains like the eager torch path."""
    B = 2
    x, t = torch.randn(B, 3, 8, 8), torch.rand(B)
    context, context_mask = torch.randn(B, 3, 8), torch.ones(B, 3, dtype=torch.bool)
    keep = random_keep_idx(B, 16, 0.5, torch.Generator().manual_seed(0))

    def loss_and_grads(impl: str, compile_with: Graphs | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = randomized(DiT(ModelConfig(width=16, depth=1, heads=2, patch_size=2, decoder_depth=1, kernels=impl),
                               8, 3, context_dim=8), std=0.1)
        run = model if compile_with is None else torch.compile(model, fullgraph=True, backend=compile_with.aot())
        loss = run(x, t, context, context_mask, inputs=StepInputs(keep)).square().mean()                        # B×L×12 -> ()
        loss.backward()
        return [loss.detach(), model.x_embedder.proj.weight.grad, model.mask_token.grad]

    graphs = Graphs()
    compiled, eager = loss_and_grads("triton", graphs), loss_and_grads("torch", None)
    assert len(graphs.forward) == 1 and len(graphs.backward) == 1
    assert ops(graphs.forward[0]) == {"gather_rows", "restore_rows"}
    assert ops(graphs.backward[0]) == {"gather_rows", "restore_rows", "batch_sum"}
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kernel_ops_trace_forward_and_backward_on_fake_tensors() -> None:
    """The ops' shapes and gradients are registered whether or not Triton imports: tracing runs no kernel."""
    B, L, K, D = 2, 6, 3, 4
    x, pos, fill = torch.randn(B, L, D), torch.randn(L, D), torch.randn(D)
    keep = random_keep(B, L, K)

    def drop_restore_grads(x: torch.Tensor, pos: torch.Tensor, fill: torch.Tensor,
                           keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = [v.requires_grad_() for v in (x, pos, fill)]
        kept = kernels._gather_rows(x, keep, pos, x.dtype)                                   # B×K×D
        full = kernels._restore_rows(kept, keep, kernels._inverse_index(keep, L), fill, pos, x.dtype)  # B×L×D
        return (full, *torch.autograd.grad(full.sum(), leaves))

    gm = make_fx(drop_restore_grads, tracing_mode="fake")(x, pos, fill, keep)
    assert ops(gm) == {"gather_rows", "restore_rows", "batch_sum"}
    outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    assert [tuple(node.meta["val"].shape) for node in outputs] == [(B, L, D), (B, L, D), (L, D), (D,)]


# ------------------------------------------------------------------------------- demotion's shapes (item 6)
def test_demotion_compiles_a_bounded_set_of_graphs_however_many_steps() -> None:
    """The trainer's static compile (dynamic=False) over 20 demotion steps with random t: sub-batches of many sizes
    at two resolutions (16 and 8 px) compile at most two graphs per resolution (one sample, and any other count)."""
    B, steps = 6, 20
    torch.manual_seed(0)
    model = _model(depth=1)
    graphs = Graphs()
    forward = torch.compile(model, dynamic=False, backend=graphs.eager)
    routes = [DemoteWindow(0.5, [0.5, 1.0])]
    ids, mask = model.text_encoder.tokenize(["a red circle"] * B)
    gen = torch.Generator().manual_seed(0)
    parts = set()
    with torch._dynamo.config.patch(recompile_limit=64):  # let static shapes show how many graphs they need
        for _ in range(steps):
            x0, noise = torch.randn(B, 3, 16, 16, generator=gen), torch.randn(B, 3, 16, 16, generator=gen)
            t = torch.rand(B, generator=gen)
            choice = window_choice(t, routes, "sample")                                      # B
            parts |= {(route, int((choice == route).sum())) for route in (-1, 0)} - {(-1, 0), (0, 0)}
            windowed_flow_loss(model, x0, noise, t, ids, mask, torch.zeros(B, dtype=torch.bool),
                               StepInputs(demotion=Demotion(routes, generator=gen)), forward=forward).backward()
    assert len(parts) > 2 * 2  # the steps did need more than the bound: one static graph per (resolution, size)
    assert len(graphs.dynamo) <= 2 * 2


# ------------------------------------------------------------------------------------- host syncs (item 7)
def test_a_masked_step_loss_traces_to_one_graph_of_shapes_known_from_its_inputs() -> None:
    """No routes, mask 0.5, MAE on: no Python branch on a tensor (a host sync, a graph break under fullgraph) and
    no data-dependent shape (a boolean index: a sync on a GPU) in the loss around the model."""
    B = 3
    torch.manual_seed(0)
    model = randomized(_model(depth=2, decoder_depth=1), std=0.1)
    ids, mask = model.text_encoder.tokenize(["a red circle"] * B)
    x0, noise, t = torch.randn(B, 3, 16, 16), torch.randn(B, 3, 16, 16), torch.rand(B)
    keep = random_keep_idx(B, model.seq_len, 0.5, torch.Generator().manual_seed(1))
    drop = torch.zeros(B, dtype=torch.bool)
    graphs = Graphs()
    loss = torch.compile(lambda: windowed_flow_loss(model, x0, noise, t, ids, mask, drop, StepInputs(keep), mae_weight=0.5),
                         fullgraph=True, backend=graphs.eager)()
    assert len(graphs.dynamo) == 1
    unbacked = [node for node in graphs.dynamo[0].graph.nodes
                if free_unbacked_symbols(node.meta.get("example_value"))]
    assert unbacked == []
    torch.testing.assert_close(loss, windowed_flow_loss(model, x0, noise, t, ids, mask, drop, StepInputs(keep), mae_weight=0.5))


def test_block_norms_reach_the_host_in_one_transfer_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model = randomized(_model(depth=4, long_skip="concat"), std=0.1)
    norms = BlockNorms(model)
    B = 3
    ids, mask = model.text_encoder.tokenize(["a red circle"] * B)
    model(torch.randn(B, 3, 16, 16), torch.rand(B), ids, mask)
    transfers = []
    for method in ("item", "tolist"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, _f=original: transfers.append(self.numel()) or _f(self))
    step = norms.step()
    assert len(step["block_norm"]) == 4 and len(step["skip_norm"]) == 4
    assert transfers == [4 + 4 + 4]  # the block means, the skip norms and the forwards counted, together


def test_a_compiled_run_with_accumulation_and_a_probe_compiles_one_graph_per_phase(tmp_path, synth_root, monkeypatch):
    """grad_accum=2 and a cosine rule's probe every 2 steps, compiled (Dynamo's `eager` backend, counted): one
    graph per phase, however many micro-batches and probes run. Diagnostics that guard on Python state (a list
    the block hooks append to) recompile for every micro-batch and after every probe, and past Dynamo's
    recompile limit training silently runs eager."""
    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    cfg = _rule_cfg(tmp_path, synth_root, -1.0, "train.compile=true", "train.grad_accum=2", "budget.flops=2e9", every=2)
    trainer = new_trainer(cfg)
    trainer.fit()
    steps = [json.loads(line) for line in trainer.run.metrics.read_text().splitlines()]
    assert {s["mask_ratio"] for s in steps} == {0.75, 0.0} and sum("until" in s for s in steps) >= 2
    assert all(s["block_norm"] for s in steps)  # the hooks recorded inside the compiled graphs
    assert counter.frame_count == 2  # one graph for the masked phase, one for the unmasked
