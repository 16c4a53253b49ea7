"""Token drop (gather) and restore (scatter) for masked training, in torch and as fused Triton kernels.

Token dropping moves B×L×D activations twice per step: drop the masked rows (and add positions),
then restore them (kept rows back in place, a mask token + position everywhere else). Peers do this
with `torch.gather` on a `.repeat`-ed B×K×D int64 index, which moves an index 4× the bf16 data.
The torch path here uses an `expand`-ed index (a view, no copy) and is the reference and CPU default.
The Triton path does each direction in one pass over the rows, with backward kernels of its own:

- `_gather_rows_kernel`:  out[b, k] = x[b, idx[b, k]] (+ pos[idx[b, k]]); also restore's grad_x.
- `_restore_rows_kernel`: out[b, l] = x[b, inv[b, l]] if inv[b, l] >= 0 else fill (+ pos[l]), where
  inv is the inverse map l -> k (B×L int32, -1 on dropped rows); also drop's grad_x (fill 0).
- `_batch_sum_kernel`:    grad_pos (and grad_fill) as sums over the batch, per position and chunk of
  samples. It reads the inverse map instead of scattering with atomics, so the gradient is
  deterministic (a fixed summation order: `maskbench repro` compares runs).

Each launcher is a custom op (`maskbench::gather_rows`, `restore_rows`, `batch_sum`) with a fake
(shape-only) implementation, and the first two carry their backward (`register_autograd`): torch.compile
sees one opaque call per kernel, never Triton's own Python, so the masked forward and backward trace as
one graph. Not `torch.library.triton_op`: under TRITON_INTERPRET=1 `wrap_triton` hands back the
interpreted kernel itself (torch/_library/triton.py), and torch.compile of such an op fails on a CPU
("RuntimeError when making fake tensor call", torch 2.14), so it could not be tested here; the opaque
op runs the same way on both devices (Inductor cannot fuse into it; the kernels are single passes).

Rows keep the dtype rules of the eager expressions (`x + pos` promotes); keep_idx rows must hold
unique positions (a random permutation prefix), which every masking scheme here produces.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the torch path needs none of it
    triton = tl = None

IMPLS = ("auto", "triton", "torch")

_unusable = ("triton does not import" if triton is None else
             f"triton {triton.__version__} has no triton.knobs" if not hasattr(triton, "knobs") else None)
if _unusable:
    triton = tl = None  # a Triton without triton.knobs (which reads TRITON_INTERPRET here) is as good as none
    if torch.cuda.is_available():  # once per process, where "auto" would have picked the kernels
        logging.getLogger(__name__).warning(f"maskbench: {_unusable}; token drop/restore use the torch path")


def gather_tokens(x: torch.Tensor, keep_idx: torch.Tensor, pos: torch.Tensor | None = None,
                  impl: str = "auto") -> torch.Tensor:
    """Kept rows of x (B×L×D) at keep_idx (B×K), plus pos[keep_idx] (pos: L×D) if given -> B×K×D."""
    _check(x, keep_idx, x.shape[1], pos)
    if _use_triton(x, impl):
        return _gather_rows(x, keep_idx, pos, _result_dtype(x, pos))                         # B×K×D
    index = keep_idx.unsqueeze(-1).expand(-1, -1, x.shape[-1])      # B×K×D view, no copy
    out = torch.gather(x, 1, index)                                 # B×K×D
    if pos is not None:
        out = out + pos[keep_idx]                                    # B×K×D
    return out


def scatter_tokens(x_kept: torch.Tensor, keep_idx: torch.Tensor, seq_len: int, fill: torch.Tensor,
                   pos: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """B×L×D tensor: x_kept rows at keep_idx, every other row = fill (D,), plus pos (L×D) on filled rows."""
    _check(x_kept, keep_idx, seq_len, pos)
    B, K, D = x_kept.shape
    if keep_idx.shape[1] != K:
        raise ValueError(f"keep_idx has {keep_idx.shape[1]} rows per sample but x_kept has K={K}")
    if fill.numel() != D:
        raise ValueError(f"fill must hold D={D} values (the mask token), got shape {tuple(fill.shape)}")
    if _use_triton(x_kept, impl):
        return _restore_rows(x_kept, keep_idx, _inverse_index(keep_idx, seq_len), fill.reshape(D), pos,
                             _result_dtype(x_kept, fill, pos))                                # B×L×D
    dtype = _result_dtype(x_kept, fill, pos)
    out = fill.to(dtype).expand(B, seq_len, D)                       # B×L×D view
    if pos is not None:
        out = out + pos                                              # B×L×D
    index = keep_idx.unsqueeze(-1).expand(-1, -1, D)                 # B×K×D view
    return out.scatter(1, index, x_kept.to(dtype))                   # B×L×D


def triton_available() -> bool:
    """Whether the Triton path can run at all (the package imports and has triton.knobs)."""
    return triton is not None


def _check(x: torch.Tensor, keep_idx: torch.Tensor, seq_len: int, pos: torch.Tensor | None) -> None:
    """One clear line for the shape mistakes that would otherwise surface deep inside a kernel."""
    if x.dim() != 3:
        raise ValueError(f"tokens must be B×N×D, got shape {tuple(x.shape)}")
    if keep_idx.dtype != torch.int64 or keep_idx.dim() != 2 or keep_idx.shape[0] != x.shape[0]:
        raise ValueError(f"keep_idx must be int64 B×K with B={x.shape[0]}, got {keep_idx.dtype} "
                         f"{tuple(keep_idx.shape)}")
    if pos is not None and tuple(pos.shape) != (seq_len, x.shape[-1]):
        raise ValueError(f"pos must be L×D = {(seq_len, x.shape[-1])}, got {tuple(pos.shape)}")


def _use_triton(x: torch.Tensor, impl: str) -> bool:
    """auto: Triton on CUDA when it imports; "triton" on CPU only under the interpreter (`_kernels` checks,
    when the op runs: torch.compile traces this function, and reading triton.knobs would break its graph)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":
        return x.is_cuda and triton_available()
    if not triton_available():
        raise ValueError("impl='triton' needs the triton package; use impl='torch' or 'auto'")
    return True


def _result_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype the eager expression gives (`x + pos` promotes bf16 + fp32 to fp32)."""
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors if t is not None])


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along D (row strides may stay arbitrary: the kernels take them)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _inverse_index(keep_idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """B×L int32 map l -> k with -1 on dropped rows: lets every output row find its source in one load."""
    B, K = keep_idx.shape
    inv = torch.full((B, seq_len), -1, dtype=torch.int32, device=keep_idx.device)            # B×L
    ks = torch.arange(K, dtype=torch.int32, device=keep_idx.device).expand(B, K)              # B×K
    return inv.scatter_(1, keep_idx, ks)                                                      # B×L


# The kernels are plain functions decorated on first use (`_kernels`), not at import: Triton decides
# between compiling and interpreting when a kernel is decorated, from TRITON_INTERPRET at that moment,
# and a test sets that variable only around its own calls. The kernels call only builtins (tl.full,
# not tl.zeros): triton.language's own @triton.jit helpers took their mode at `import triton`.

def _gather_rows_kernel(x_ptr, idx_ptr, pos_ptr, out_ptr, K, D, stride_xb, stride_xl,
                        HAS_POS: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[b, k] = x[b, idx[b, k]] (+ pos[idx[b, k]]); one program per output row, int64 offsets."""
    row = tl.program_id(0).to(tl.int64)                              # b*K + k
    src = tl.load(idx_ptr + row)                                     # l, int64
    x_row = x_ptr + (row // K) * stride_xb + src * stride_xl
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)                            # BLOCK_D
        in_d = cols < D
        val = tl.load(x_row + cols, mask=in_d)
        if HAS_POS:
            val += tl.load(pos_ptr + src * D + cols, mask=in_d)
        tl.store(out_ptr + row * D + cols, val, mask=in_d)


def _restore_rows_kernel(x_ptr, inv_ptr, fill_ptr, pos_ptr, out_ptr, L, D, stride_xb, stride_xk,
                         HAS_FILL: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[b, l] = x[b, inv[b, l]] if kept, else fill (+ pos[l]), or 0 without fill; one program per row."""
    row = tl.program_id(0).to(tl.int64)                              # b*L + l
    src = tl.load(inv_ptr + row).to(tl.int64)                        # k, or -1 if dropped
    kept = src >= 0
    x_row = x_ptr + (row // L) * stride_xb + src * stride_xk
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)                            # BLOCK_D
        in_d = cols < D
        val = tl.load(x_row + cols, mask=in_d & kept, other=0.0)
        if HAS_FILL:
            filled = tl.load(fill_ptr + cols, mask=in_d & ~kept, other=0.0)
            if HAS_POS:
                filled += tl.load(pos_ptr + (row % L) * D + cols, mask=in_d & ~kept, other=0.0)
            val = tl.where(kept, val, filled)
        tl.store(out_ptr + row * D + cols, val, mask=in_d)


def _batch_sum_kernel(src_ptr, inv_ptr, out_ptr, B, L, D, stride_sb, stride_sr,
                      KEPT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[c, l] = Σ over samples b of chunk c of the row position l received (KEPT: src[b, inv[b, l]]
    where kept) or was filled with (not KEPT: src[b, l] where dropped); fp32, in a fixed order."""
    pos_l = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)        # BLOCK_D
    chunk = tl.program_id(2).to(tl.int64)
    in_d = cols < D
    acc = tl.full([BLOCK_D], 0.0, tl.float32)                        # BLOCK_D
    src_b = src_ptr + chunk * BLOCK_B * stride_sb
    inv_b = inv_ptr + chunk * BLOCK_B * L + pos_l
    for i in range(0, BLOCK_B):
        in_b = chunk * BLOCK_B + i < B
        k = tl.load(inv_b, mask=in_b, other=0).to(tl.int64)
        if KEPT:
            row, take = k, in_b & (k >= 0)
        else:
            row, take = pos_l, in_b & (k < 0)
        acc += tl.load(src_b + row * stride_sr + cols, mask=in_d & take, other=0.0).to(tl.float32)
        src_b += stride_sb                                           # pointer steps: no int32 overflow
        inv_b += L
    tl.store(out_ptr + (chunk * L + pos_l) * D + cols, acc, mask=in_d)


def _kernels(x: torch.Tensor) -> SimpleNamespace:
    """The jitted kernels for the current mode (TRITON_INTERPRET, read now), decorated once per mode."""
    interpret = bool(triton.knobs.runtime.interpret)
    if not x.is_cuda and not interpret:
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1; use impl='torch' or 'auto'")
    return _jit(interpret)


@functools.cache
def _jit(interpret: bool) -> SimpleNamespace:
    """Decorating reads TRITON_INTERPRET again, which equals `interpret`: the argument keys the cache."""
    return SimpleNamespace(gather=triton.jit(_gather_rows_kernel), restore=triton.jit(_restore_rows_kernel),
                           batch_sum=triton.jit(_batch_sum_kernel))


def _launch_params(D: int) -> dict[str, int]:
    """One row of D per program: up to 4096 columns in one block, 8 elements (16 bytes bf16) per thread."""
    block = min(triton.next_power_of_2(D), 4096)
    return {"BLOCK_D": block, "num_warps": max(1, min(8, block // 256))}


@torch.library.custom_op("maskbench::gather_rows", mutates_args=())
def _gather_rows(x: torch.Tensor, keep_idx: torch.Tensor, pos: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """B×K×D rows of x (B×L×D) at keep_idx, plus pos rows; the drop forward and restore's grad_x."""
    B, K = keep_idx.shape
    D = x.shape[-1]
    x = _rows(x)
    out = torch.empty(B, K, D, dtype=dtype, device=x.device)                                 # B×K×D
    _kernels(x).gather[(B * K,)](
        x, keep_idx.contiguous(), pos.contiguous() if pos is not None else x, out, K, D,
        x.stride(0), x.stride(1), HAS_POS=pos is not None, **_launch_params(D))
    return out


@torch.library.custom_op("maskbench::restore_rows", mutates_args=())
def _restore_rows(x: torch.Tensor, keep_idx: torch.Tensor, inv: torch.Tensor, fill: torch.Tensor | None,
                  pos: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """B×L×D: rows of x (B×K×D) where inv >= 0, fill (+ pos) or zero elsewhere; restore fwd, drop's grad_x.

    keep_idx (B×K) is the map inv inverts (`_inverse_index`): the kernel reads inv, the backward keep_idx."""
    B, L = inv.shape
    D = x.shape[-1]
    x = _rows(x)
    out = torch.empty(B, L, D, dtype=dtype, device=x.device)                                 # B×L×D
    _kernels(x).restore[(B * L,)](
        x, inv, fill.contiguous() if fill is not None else x, pos.contiguous() if pos is not None else x,
        out, L, D, x.stride(0), x.stride(1), HAS_FILL=fill is not None, HAS_POS=pos is not None,
        **_launch_params(D))
    return out


@torch.library.custom_op("maskbench::batch_sum", mutates_args=())
def _batch_sum(src: torch.Tensor, inv: torch.Tensor, kept: bool) -> torch.Tensor:
    """L×D fp32 sums over the batch of the rows each position received (kept) or was filled with (not kept).

    Programs sum chunks of (up to) 16 samples and torch adds the chunks: enough programs to hide the latency
    of the row loads, and still a fixed summation order (no atomics).
    """
    B, L = inv.shape
    D = src.shape[-1]
    src = _rows(src)
    block_b, block_d = min(B, 16), min(triton.next_power_of_2(D), 256)
    chunks = triton.cdiv(B, block_b)
    partial = torch.empty(chunks, L, D, dtype=torch.float32, device=src.device)             # C×L×D
    _kernels(src).batch_sum[(L, triton.cdiv(D, block_d), chunks)](
        src, inv, partial, B, L, D, src.stride(0), src.stride(1), KEPT=kept, BLOCK_B=block_b,
        BLOCK_D=block_d, num_warps=max(1, block_d // 256))
    return partial.sum(0)                                                                     # L×D


# Shapes only, for tracing (torch.compile runs these on fake tensors instead of launching a kernel).

@_gather_rows.register_fake
def _gather_rows_shape(x: torch.Tensor, keep_idx: torch.Tensor, pos: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((*keep_idx.shape, x.shape[-1]), dtype=dtype)                           # B×K×D


@_restore_rows.register_fake
def _restore_rows_shape(x: torch.Tensor, keep_idx: torch.Tensor, inv: torch.Tensor, fill: torch.Tensor | None,
                        pos: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((*inv.shape, x.shape[-1]), dtype=dtype)                                # B×L×D


@_batch_sum.register_fake
def _batch_sum_shape(src: torch.Tensor, inv: torch.Tensor, kept: bool) -> torch.Tensor:
    return src.new_empty((inv.shape[1], src.shape[-1]), dtype=torch.float32)                 # L×D


# Backward: each direction's gradient is the other direction's kernel (and the batch sums), no atomics.

def _save_gather(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, keep_idx, pos, _ = inputs
    ctx.save_for_backward(keep_idx)
    ctx.seq_len, ctx.x_dtype = x.shape[1], x.dtype
    ctx.pos_dtype = pos.dtype if pos is not None else None


def _gather_rows_backward(ctx, grad_out: torch.Tensor) -> tuple:
    """gather_tokens' backward: the restore kernel scatters grad_out back (fill 0), grad_pos sums it."""
    keep_idx, = ctx.saved_tensors
    inv = _inverse_index(keep_idx, ctx.seq_len)                                               # B×L
    grad_x = grad_pos = None
    if ctx.needs_input_grad[0]:
        grad_x = _restore_rows(grad_out, keep_idx, inv, None, None, ctx.x_dtype)              # B×L×D
    if ctx.needs_input_grad[2]:
        grad_pos = _batch_sum(grad_out, inv, True).to(ctx.pos_dtype)                          # L×D
    return grad_x, None, grad_pos, None


def _save_restore(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, keep_idx, inv, fill, pos, _ = inputs
    ctx.save_for_backward(keep_idx, inv)
    ctx.dtypes = (x.dtype, fill.dtype if fill is not None else None, pos.dtype if pos is not None else None)


def _restore_rows_backward(ctx, grad_out: torch.Tensor) -> tuple:
    """scatter_tokens' backward: the gather kernel takes the kept rows, the batch sums the filled ones."""
    keep_idx, inv = ctx.saved_tensors
    x_dtype, fill_dtype, pos_dtype = ctx.dtypes
    grad_x = grad_fill = grad_pos = None
    if ctx.needs_input_grad[0]:
        grad_x = _gather_rows(grad_out, keep_idx, None, x_dtype)                              # B×K×D
    if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
        filled = _batch_sum(grad_out, inv, False)                                             # L×D fp32
        grad_fill = filled.sum(0).to(fill_dtype) if ctx.needs_input_grad[3] else None         # D
        grad_pos = filled.to(pos_dtype) if ctx.needs_input_grad[4] else None                  # L×D
    return grad_x, None, None, grad_fill, grad_pos, None


_gather_rows.register_autograd(_gather_rows_backward, setup_context=_save_gather)
_restore_rows.register_autograd(_restore_rows_backward, setup_context=_save_restore)
