"""Token drop/restore: the torch reference against its definition and gradcheck, the Triton kernels
against the reference, forward and backward, under the Triton interpreter (CPU, numpy).

The kernels are decorated on first use with the mode TRITON_INTERPRET has then, once per mode, so
setting the variable per test (monkeypatch) works in a pytest process shared with other suites and
leaves CUDA runs of those suites compiled.
"""

from __future__ import annotations

import importlib.util
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from maskbench.config.presets import ModelConfig
from maskbench.models import kernels
from maskbench.models.dit import DiT
from maskbench.models.inputs import StepInputs
from maskbench.models.kernels import gather_tokens, scatter_tokens

needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def random_keep(B: int, L: int, K: int, seed: int = 0) -> torch.Tensor:
    """B×K unique positions per row, unsorted, as the masking code draws them."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(L, generator=g)[:K] for _ in range(B)])                # B×K


def test_reference_matches_definition() -> None:
    B, L, D, K = 2, 6, 3, 4
    x, pos, fill = torch.randn(B, L, D), torch.randn(L, D), torch.randn(D)
    keep = random_keep(B, L, K)
    kept = gather_tokens(x, keep, pos, impl="torch")
    restored = scatter_tokens(kept, keep, L, fill, pos, impl="torch")
    for b in range(B):
        for k in range(K):
            assert torch.equal(kept[b, k], x[b, keep[b, k]] + pos[keep[b, k]])
        for row in range(L):
            expected = kept[b, (keep[b] == row).nonzero()[0, 0]] if row in keep[b] else fill + pos[row]
            assert torch.equal(restored[b, row], expected)


def test_reference_gradcheck() -> None:
    B, L, D, K = 2, 5, 3, 3
    f64 = dict(dtype=torch.float64, requires_grad=True)
    x, x_kept, pos, fill = torch.randn(B, L, D, **f64), torch.randn(B, K, D, **f64), \
        torch.randn(L, D, **f64), torch.randn(D, **f64)
    keep = random_keep(B, L, K)
    assert torch.autograd.gradcheck(lambda x, p: gather_tokens(x, keep, p, impl="torch"), (x, pos))
    assert torch.autograd.gradcheck(lambda x, f, p: scatter_tokens(x, keep, L, f, p, impl="torch"),
                                    (x_kept, fill, pos))


def run_both(B: int, L: int, D: int, K: int, with_pos: bool, impl: str,
             x: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Drop then restore (with a weighted loss so every gradient row differs); outputs and gradients."""
    torch.manual_seed(0)
    x = torch.randn(B, L, D) if x is None else x
    x.requires_grad_(True)
    pos = torch.randn(L, D, requires_grad=True) if with_pos else None
    fill = torch.randn(D, requires_grad=True)
    keep = random_keep(B, L, K)
    kept = gather_tokens(x, keep, pos, impl=impl)                                            # B×K×D
    restored = scatter_tokens(kept * 2, keep, L, fill, pos, impl=impl)                       # B×L×D
    loss = (kept * torch.randn(B, K, D)).sum() + (restored * torch.randn(B, L, D)).sum()
    leaves = [x, fill] + ([pos] if with_pos else [])
    grads = torch.autograd.grad(loss, leaves)
    return [kept.detach(), restored.detach(), *grads]


@needs_triton
@pytest.mark.parametrize("B, L, D, K, with_pos", [
    (2, 6, 5, 3, True),      # D neither a power of two nor a multiple of 8
    (3, 8, 16, 8, True),     # K = L: no mask, every row kept
    (2, 7, 33, 2, False),    # pos None, D just over a power of two
    (1, 4, 4, 1, True),      # a single kept row
    (17, 4, 3, 2, True),     # the batch sums run in two chunks of samples, the second partial
])
def test_triton_matches_reference(interpret: None, B: int, L: int, D: int, K: int, with_pos: bool) -> None:
    ref = run_both(B, L, D, K, with_pos, "torch")
    tri = run_both(B, L, D, K, with_pos, "triton")
    names = ["drop", "restore", "grad_x", "grad_fill", "grad_pos"]
    for name, r, t in zip(names[:3], ref[:3], tri[:3]):        # row copies: bit-exact
        assert t.dtype == r.dtype and torch.equal(t, r), name
    for name, r, t in zip(names[3:], ref[3:], tri[3:]):        # sums in another order
        torch.testing.assert_close(t, r, rtol=1e-6, atol=1e-5, msg=name)


@needs_triton
def test_triton_non_contiguous_inputs(interpret: None) -> None:
    B, L, D, K = 2, 6, 5, 3
    channels_first = torch.randn(B, D, L).transpose(1, 2)                                    # D stride L
    for x in (channels_first, torch.randn(B, L + 1, D)[:, 1:]):                              # + a row view
        ref = run_both(B, L, D, K, True, "torch", x.detach().clone())
        tri = run_both(B, L, D, K, True, "triton", x.detach().clone())
        for r, t in zip(ref, tri):
            torch.testing.assert_close(t, r, rtol=1e-6, atol=1e-5)
    # .sum() backpropagates an expanded (all-stride-0) gradient into both kernels
    keep = random_keep(B, L, K)
    x = torch.randn(B, L, D, requires_grad=True)
    grads = [torch.autograd.grad(scatter_tokens(gather_tokens(x, keep, impl=impl), keep, L,
                                                torch.zeros(D), impl=impl).sum(), x)[0]
             for impl in ("torch", "triton")]
    assert torch.equal(grads[0], grads[1])


@needs_triton
def test_triton_promotes_like_eager(interpret: None) -> None:
    B, L, D, K = 2, 5, 6, 3
    x = torch.randn(B, L, D, dtype=torch.float16, requires_grad=True)
    pos = torch.randn(L, D, requires_grad=True)                                               # fp32
    keep = random_keep(B, L, K)
    outs = [gather_tokens(x, keep, pos, impl=impl) for impl in ("torch", "triton")]
    assert outs[1].dtype == torch.float32 and torch.equal(outs[0], outs[1])
    grad_x, grad_pos = torch.autograd.grad(outs[1].sum(), (x, pos))
    assert grad_x.dtype == torch.float16 and grad_pos.dtype == torch.float32


class TwoLayer(nn.Module):
    """Embed -> drop (+ learned pos) -> block on kept rows -> restore with a mask token -> head."""

    def __init__(self, L: int, D: int, impl: str) -> None:
        super().__init__()
        self.impl = impl
        self.embed, self.block, self.head = nn.Linear(3, D), nn.Linear(D, D), nn.Linear(D, 3)
        self.pos = nn.Parameter(torch.randn(L, D) * 0.1)
        self.mask_token = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = gather_tokens(self.embed(x), keep, self.pos, impl=self.impl)                     # B×K×D
        h = torch.nn.functional.gelu(self.block(h))                                          # B×K×D
        h = scatter_tokens(h, keep, x.shape[1], self.mask_token, self.pos, impl=self.impl)   # B×L×D
        return self.head(h)                                                                  # B×L×3


def train_steps(impl: str, make_model: Callable[[str], nn.Module],
                loss_fn: Callable[[nn.Module], torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Parameters (by name) before and after three SGD steps from seed 0, with the given kernels."""
    torch.manual_seed(0)
    model = make_model(impl)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model).backward()
        opt.step()
    return {name: (before[name], p.detach()) for name, p in model.named_parameters()}


def assert_same_training(make_model: Callable[[str], nn.Module], loss_fn: Callable[[nn.Module], torch.Tensor],
                         through_kernels: list[str]) -> None:
    """Triton and torch train to the same parameters, and the parameters upstream of the kernels moved."""
    ref = train_steps("torch", make_model, loss_fn)
    tri = train_steps("triton", make_model, loss_fn)
    for name in through_kernels:
        assert not torch.equal(*ref[name]), f"{name} got no gradient through the kernels"
    for name, (_, after) in ref.items():
        torch.testing.assert_close(tri[name][1], after, rtol=1e-5, atol=1e-6, msg=name)


@needs_triton
def test_training_steps_two_layer(interpret: None) -> None:
    B, L, K = 2, 8, 3
    x, target, keep = torch.randn(B, L, 3), torch.randn(B, L, 3), random_keep(B, L, K)
    assert_same_training(lambda impl: TwoLayer(L, 12, impl),
                         lambda model: nn.functional.mse_loss(model(x, keep), target),
                         through_kernels=["embed.weight", "pos", "mask_token"])


@needs_triton
def test_training_steps_dit(interpret: None) -> None:
    """The real model (drop with its fixed sin-cos positions), 8×8 images in 2×2 patches: 16 tokens."""
    B, T = 2, 3
    x, target = torch.randn(B, 3, 8, 8), torch.randn(B, 3, 8, 8)
    context, context_mask = torch.randn(B, T, 8), torch.ones(B, T, dtype=torch.bool)
    keep, t = random_keep(B, 16, 4).sort(dim=1).values, torch.rand(B)

    def make_model(impl: str) -> DiT:
        return DiT(ModelConfig(width=16, depth=1, heads=2, patch_size=2, kernels=impl), 8, 3, context_dim=8)

    def loss_fn(model: DiT) -> torch.Tensor:
        pred = model(x, t, context, context_mask, inputs=StepInputs(keep))                                # B×K×12
        return nn.functional.mse_loss(pred, gather_tokens(model.patchify(target), keep, impl="torch"))

    assert_same_training(make_model, loss_fn, through_kernels=["x_embedder.proj.weight"])


def test_auto_uses_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_triton(*args: object) -> None:
        raise AssertionError("the Triton path ran on CPU under impl='auto'")
    monkeypatch.setattr(kernels, "_gather_rows", no_triton)
    x, keep = torch.randn(1, 4, 2), random_keep(1, 4, 2)
    assert torch.equal(gather_tokens(x, keep), gather_tokens(x, keep, impl="torch"))


@pytest.mark.parametrize("call, message", [
    (lambda: gather_tokens(torch.randn(1, 4, 2), random_keep(1, 4, 2), impl="cuda"), "impl must be one of"),
    (lambda: gather_tokens(torch.randn(4, 2), random_keep(1, 4, 2)), "B×N×D"),
    (lambda: gather_tokens(torch.randn(1, 4, 2), random_keep(1, 4, 2).int()), "int64"),
    (lambda: gather_tokens(torch.randn(1, 4, 2), random_keep(1, 4, 2), torch.randn(3, 2)), "pos must be"),
    (lambda: scatter_tokens(torch.randn(1, 2, 2), random_keep(1, 4, 2), 4, torch.zeros(3)), "fill must"),
    (lambda: scatter_tokens(torch.randn(1, 3, 2), random_keep(1, 4, 2), 4, torch.zeros(2)), "keep_idx has"),
])
def test_bad_input_is_one_clear_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@needs_triton
def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gather_tokens(torch.randn(1, 4, 2), random_keep(1, 4, 2), impl="triton")


POINTER_TYPES = {"idx_ptr": "*i64", "inv_ptr": "*i32"}


@needs_triton
@pytest.mark.parametrize("name, constexprs", [
    ("_gather_rows_kernel", {"HAS_POS": True, "BLOCK_D": 2048}),
    ("_restore_rows_kernel", {"HAS_FILL": True, "HAS_POS": True, "BLOCK_D": 2048}),
    ("_batch_sum_kernel", {"KEPT": False, "BLOCK_B": 16, "BLOCK_D": 256}),
])
def test_kernels_compile_for_hopper_with_wide_loads(monkeypatch: pytest.MonkeyPatch, name: str,
                                                    constexprs: dict) -> None:
    """The interpreter accepts code the compiler rejects: compile for sm_90 (no GPU needed) with bf16
    rows and the divisibility-by-16 facts the JIT sees at D=1152, and check for 16-byte accesses."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernels.triton.jit(getattr(kernels, name))
    names = fn.arg_names
    signature = {a: "constexpr" if a in constexprs else POINTER_TYPES.get(a, "*bf16") if a.endswith("_ptr")
                 else "i32" for a in names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(a),): v for a, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                              if a not in constexprs and a != "B"})
    ptx = kernels.triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 1 if name == "_batch_sum_kernel" else 8}).asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs for real: gpu_check.sh")
def test_benchmark_skips_without_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    """The script run as a script (its `__main__` block, its directory on sys.path), in this process."""
    out = tmp_path / "kernels.csv"
    script = Path(__file__).parents[1] / "benchmarks" / "kernels.py"
    monkeypatch.syspath_prepend(str(script.parent))
    monkeypatch.setattr(sys, "argv", [str(script), "--out", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    assert "skipped" in capsys.readouterr().out and not out.exists()


def load_benchmark(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/kernels.py as a module (its directory on sys.path, as when the script runs)."""
    script = Path(__file__).parents[1] / "benchmarks" / "kernels.py"
    monkeypatch.syspath_prepend(str(script.parent))
    spec = importlib.util.spec_from_file_location("kernels_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_benchmark_refuses_an_implementation_whose_backward_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_benchmark(monkeypatch)

    def drop_doubled_grad(x: torch.Tensor, keep_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = gather_tokens(x, keep_idx, pos, impl="torch")                                   # B×K×D
        return out + (out - out.detach())                                                     # same values, 2× grad

    monkeypatch.setitem(bench.IMPLS, "doubled", (drop_doubled_grad, bench.IMPLS["torch-expand"][1]))
    case = bench.Case(16, 0.5, bench.SMOKE, torch.device("cpu"))
    bench.check_agrees(case, ["torch-expand", "torch-repeat"])
    with pytest.raises(SystemExit, match="doubled drop disagrees .*, backward"):
        bench.check_agrees(case, ["torch-expand", "doubled"])


FALLBACK_SCENARIOS = ("absent", "without knobs")


def test_unusable_triton_falls_back_to_torch_with_one_warning_line() -> None:
    """On a (pretend) CUDA machine: one line when the module loads, none per call, and the torch path runs; for
    a Triton that does not import and one without triton.knobs, each a fresh import of the module (one process,
    the scenarios' output split by a marker line)."""
    code = f"""
import sys, types, torch
torch.cuda.is_available = lambda: True
for triton_module in {FALLBACK_SCENARIOS!r}:
    for name in ("triton", "triton.language", "maskbench.models.kernels"):
        sys.modules.pop(name, None)
    if triton_module == "absent":
        sys.modules["triton"] = None
    else:
        old = types.ModuleType("triton"); old.__version__ = "3.3.0"; old.language = types.ModuleType("triton.language")
        sys.modules.update({{"triton": old, "triton.language": old.language}})
    from maskbench.models import kernels
    x, keep = torch.randn(2, 4, 3), torch.tensor([[0, 2], [1, 3]])
    for _ in range(3):
        assert torch.equal(kernels.gather_tokens(x, keep), kernels.gather_tokens(x, keep, impl="torch"))
    print(kernels.triton_available())
    print("-- scenario done", file=sys.stderr, flush=True)
    del sys.modules["maskbench.models"].kernels
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[1])
    scenarios = done.stderr.split("-- scenario done\n")
    assert len(scenarios) == len(FALLBACK_SCENARIOS) + 1, done.stderr
    for stderr in scenarios[:-1]:
        warnings = [line for line in stderr.splitlines() if "maskbench:" in line]
        assert len(warnings) == 1 and warnings[0].endswith("token drop/restore use the torch path"), done.stderr
    assert done.stdout.split() == ["False"] * len(FALLBACK_SCENARIOS)
