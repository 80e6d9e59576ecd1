"""MoE permute (dispatch): copy each token's row to its K slots in expert-sorted order.

Shapes: x [T, D], inv [T, K] int32 (sorted row of token t's j-th assignment, -1 when dropped) -> xs
[num_rows, D] with ``xs[inv[t, j]] = x[t]``. Rows that no valid assignment maps to (capacity drops,
alignment padding) are zero when ``zero_fill`` is set and unspecified otherwise; with a dropless,
unpadded plan every row is written, so the memset is skipped.

Backward: ``dx[t] = sum_j dxs[inv[t, j]]``: ``moe_unpermute``, the unweighted sum of a token's rows
(the combine kernel of kernels.moe_combine without weights). ``moe_unpermute``'s own backward is
this permute, so an unweighted combine never reads the rows it summed again (unlike moe_combine,
whose weight gradient needs them). ``moe_unpermute(ys, inv, zero_fill, ys2)`` also sums a second [N,
D] source row by row: the permute backward when the permuted rows fed two GEMMs
(kernels.moe_gate_up).

Layers: ``@triton.jit`` kernel + launcher -> ``torch.library.custom_op`` ``moezoo::moe_permute`` and
``moezoo::moe_unpermute`` (``register_fake`` + autograd); ``moe_permute_reference`` is the
pure-torch oracle (and ``moe_combine_reference(ys, inv, None)`` the unpermute's).
"""

from __future__ import annotations

from typing import Optional

import torch

from .launch import jit, tl, triton, use_triton
from .moe_combine import _block_d, combine_rows, moe_combine_reference


def moe_permute_reference(x: torch.Tensor, inv: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Pure torch, differentiable: ``xs[inv[t, j]] = x[t]`` for valid (>= 0) ``inv``; other rows
    zero.

    No host sync and no data-dependent shape (no boolean-mask indexing): dropped assignments (-1)
    all land in one extra row that is cut off (a CUDA reference backend would otherwise sync twice a
    call).
    """
    T, K = inv.shape
    flat = inv.reshape(-1).long()
    dest = torch.where(flat >= 0, flat, torch.full_like(flat, num_rows))
    tok = torch.arange(T, device=x.device).repeat_interleave(K)
    xs = x.new_zeros(num_rows + 1, x.shape[1])
    return xs.index_put((dest,), x[tok])[:num_rows]


def _permute_kernel(x_ptr, inv_ptr, xs_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid (T, cdiv(D, BLOCK_D)): the source row slice is loaded once and stored K times, so x is
    # read once in total (a gather formulation would read it K times).
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    row = tl.load(x_ptr + t * D + offs, mask=m)
    for j in tl.static_range(K):
        dst = tl.load(inv_ptr + t * K + j).to(tl.int64)
        # (offs * 0 + dst) broadcasts the scalar test to a vector mask (the interpreter rejects
        # scalar & vector).
        tl.store(xs_ptr + tl.maximum(dst, 0) * D + offs, row, mask=m & ((offs * 0 + dst) >= 0))


def permute_rows(
    x: torch.Tensor, inv: torch.Tensor, num_rows: int, zero_fill: bool
) -> torch.Tensor:
    """Launcher (no autograd)."""
    x, inv = x.contiguous(), inv.contiguous()
    T, K = inv.shape
    D = x.shape[1]
    xs = (torch.zeros if zero_fill else torch.empty)(num_rows, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return xs
    BLOCK_D = _block_d(D)
    jit(_permute_kernel)[(T, triton.cdiv(D, BLOCK_D))](
        x, inv, xs, D, K=K, BLOCK_D=BLOCK_D, num_warps=4
    )
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


@torch.library.custom_op("moezoo::moe_unpermute", mutates_args=())
def moe_unpermute(
    ys: torch.Tensor, inv: torch.Tensor, zero_fill: bool, ys2: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """ys [N, D] -> out [T, D], ``out[t] = sum_j ys[inv[t, j]]`` over valid assignments; with ys2
    [N, D] ``sum_j ys[inv[t, j]] + ys2[inv[t, j]]`` (one float32 sum, no [N, D] intermediate).

    ``zero_fill``: some rows of ys are no assignment's (drops, padding); their gradient must be
    zero.
    """
    if use_triton(ys):
        return combine_rows(ys, inv, None, ys2)
    return moe_combine_reference(ys, inv, None, ys2)


@moe_unpermute.register_fake
def _(ys, inv, zero_fill, ys2=None):
    return ys.new_empty(inv.shape[0], ys.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward(ctx, dxs):
    (inv,) = ctx.saved_tensors
    return moe_unpermute(dxs, inv, False), None, None, None


def _setup_unpermute(ctx, inputs, output):
    ys, inv, zero_fill, ys2 = inputs
    ctx.save_for_backward(inv)
    ctx.num_rows, ctx.zero_fill, ctx.two = ys.shape[0], zero_fill, ys2 is not None


def _backward_unpermute(ctx, dout):
    (inv,) = ctx.saved_tensors
    dys = moe_permute(dout, inv, ctx.num_rows, ctx.zero_fill)
    return dys, None, None, (dys if ctx.two else None)  # both sources get the same rows


moe_permute.register_autograd(_backward, setup_context=_setup)
moe_unpermute.register_autograd(_backward_unpermute, setup_context=_setup_unpermute)
