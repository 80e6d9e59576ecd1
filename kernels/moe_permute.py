"""MoE permute (dispatch): copy each token's row to its K slots in expert-sorted order.

Shapes: x [T, D], inv [T, K] int32 (sorted row of token t's j-th assignment, -1 when dropped) ->
xs [num_rows, D] with ``xs[inv[t, j]] = x[t]``. Rows that no valid assignment maps to (capacity drops,
alignment padding) are zero when ``zero_fill`` is set and unspecified otherwise; with a dropless,
unpadded plan every row is written, so the memset is skipped.

Backward: ``dx[t] = sum_j dxs[inv[t, j]]``, i.e. moe_combine with unit weights (kernels.moe_combine).

Layers: ``@triton.jit`` kernel + launcher -> ``torch.library.custom_op`` ``moezoo::moe_permute``
(``register_fake`` + autograd); ``moe_permute_reference`` is the pure-torch oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_combine import _block_d, moe_combine
from .moe_launch import jit, use_triton


def moe_permute_reference(x: torch.Tensor, inv: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Pure torch, differentiable: ``xs[inv[t, j]] = x[t]`` for valid (>= 0) ``inv``; other rows zero."""
    T, K = inv.shape
    flat = inv.reshape(-1).long()
    valid = flat >= 0
    tok = torch.arange(T, device=x.device).repeat_interleave(K)
    xs = x.new_zeros(num_rows, x.shape[1])
    return xs.index_put((flat[valid],), x[tok[valid]])


def _permute_kernel(x_ptr, inv_ptr, xs_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (T, cdiv(D, BLOCK_D)): the source row slice is loaded once and stored K times, so x is read
    # once in total (a gather formulation would read it K times).
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    row = tl.load(x_ptr + t * D + offs, mask=m)
    for j in tl.static_range(K):
        dst = tl.load(inv_ptr + t * K + j).to(tl.int64)
        # (offs * 0 + dst) broadcasts the scalar test to a vector mask (the interpreter rejects scalar & vector).
        tl.store(xs_ptr + tl.maximum(dst, 0) * D + offs, row, mask=m & ((offs * 0 + dst) >= 0))


def permute_rows(x: torch.Tensor, inv: torch.Tensor, num_rows: int, zero_fill: bool) -> torch.Tensor:
    """Launcher (no autograd)."""
    x, inv = x.contiguous(), inv.contiguous()
    T, K = inv.shape
    D = x.shape[1]
    xs = (torch.zeros if zero_fill else torch.empty)(num_rows, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return xs
    BLOCK_D = _block_d(D)
    jit(_permute_kernel)[(T, triton.cdiv(D, BLOCK_D))](x, inv, xs, D, K=K, BLOCK_D=BLOCK_D, num_warps=4)
    return xs


@torch.library.custom_op("moezoo::moe_permute", mutates_args=())
def moe_permute(x: torch.Tensor, inv: torch.Tensor, num_rows: int, zero_fill: bool) -> torch.Tensor:
    """``xs[inv[t, j]] = x[t]`` (Triton on CUDA / under TRITON_INTERPRET, else the reference)."""
    if use_triton(x):
        return permute_rows(x, inv, num_rows, zero_fill)
    return moe_permute_reference(x, inv, num_rows)


@moe_permute.register_fake
def _(x, inv, num_rows, zero_fill):
    return x.new_empty(num_rows, x.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward(ctx, dxs):
    (inv,) = ctx.saved_tensors
    # dx[t] = sum_j dxs[inv[t, j]]: the combine op with unit weights (an op, so fake tracing sees it).
    ones = torch.ones(inv.shape, dtype=torch.float32, device=dxs.device)
    return moe_combine(dxs, inv, ones, False), None, None, None


moe_permute.register_autograd(_backward, setup_context=_setup)
