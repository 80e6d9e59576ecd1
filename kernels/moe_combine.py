"""MoE combine (unpermute + weighted sum): ``out[t] = sum_j w[t, j] * ys[inv[t, j]]``.

Shapes: ys [N, D] expert outputs in expert-sorted order, inv [T, K] int32 (sorted row of token t's
j-th assignment, -1 when the assignment was dropped by capacity), w [T, K] routing weights (float32)
-> out [T, D] in ys's dtype, accumulated in float32. An optional second source ys2 [N, D] (unit
weights only: ``moe_unpermute``) adds its rows too, ``out[t] = sum_j ys[inv[t, j]] + ys2[inv[t,
j]]``: the backward of a permute whose rows fed two GEMMs (SwiGLU gate and up, kernels.moe_gate_up)
sums both input gradients in this one pass instead of adding them as [N, D] tensors first.

Backward: ``dys[inv[t, j]] = w[t, j] * dout[t]`` (rows no assignment maps to are zero) and ``dw[t,
j] = <dout[t], ys[inv[t, j]]>``; both come from one kernel that reads each ``dout`` row once per
assignment. ``inv`` is a permutation onto its valid rows, so every store has one writer: no atomics.

Layers: ``@triton.jit`` kernels + launchers -> ``torch.library.custom_op`` ``moezoo::moe_combine``
and ``moezoo::moe_combine_backward`` (each with ``register_fake``; autograd on the first);
``moe_combine_reference`` is the pure-torch oracle.
"""

from __future__ import annotations

from typing import Optional

import torch

from .launch import jit, tl, triton, use_triton

# Kernels here use only triton.language builtins (tl.full, tl.reduce, tl.exp), not its @jit standard
# library (tl.zeros, tl.sum, tl.sigmoid): those are jitted when triton is first imported, so under a
# TRITON_INTERPRET=1 set later (a test) they would be compiled functions inside an interpreted
# kernel.


def moe_combine_reference(
    ys: torch.Tensor,
    inv: torch.Tensor,
    w: Optional[torch.Tensor],
    ys2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pure torch, differentiable: ``out[t] = sum_j w[t, j] * (ys + ys2)[inv[t, j]]`` over valid (>=
    0) ``inv`` (``ys2=None``: ys alone), the sum in float32."""
    valid = inv >= 0
    idx = inv.clamp(min=0).long()
    rows = ys[idx].float()  # [T, K, D]
    if ys2 is not None:
        rows = rows + ys2[idx].float()
    scale = valid.to(torch.float32) if w is None else w.float() * valid
    return (rows * scale.unsqueeze(-1)).sum(1).to(ys.dtype)


def _combine_kernel(
    ys_ptr,
    ys2_ptr,
    inv_ptr,
    w_ptr,
    out_ptr,
    D,
    K: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_Y2: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid (T, cdiv(D, BLOCK_D)): each program owns one token's slice of D, so the K rows it sums
    # are read once and the output row is written once (memory-bound: 2*K*D + 2*D bytes per token
    # slice).
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for j in tl.static_range(K):
        src = tl.load(inv_ptr + t * K + j).to(tl.int64)
        # Dropped assignments (-1) are masked loads (no traffic) rather than branches; (offs * 0 +
        # src) broadcasts the scalar test to a vector mask (the interpreter rejects scalar &
        # vector).
        valid = (offs * 0 + src) >= 0
        y = tl.load(ys_ptr + tl.maximum(src, 0) * D + offs, mask=m & valid, other=0.0).to(
            tl.float32
        )
        if HAS_Y2:
            y += tl.load(ys2_ptr + tl.maximum(src, 0) * D + offs, mask=m & valid, other=0.0).to(
                tl.float32
            )
        if HAS_W:
            y = y * tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += y
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def _combine_bwd_kernel(
    dout_ptr,
    ys_ptr,
    inv_ptr,
    w_ptr,
    dys_ptr,
    dw_ptr,
    D: tl.constexpr,
    K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid (T,): dw[t, j] is a reduction over all of D, so one program walks the whole row instead
    # of splitting D across programs and needing atomics; dout[t] re-reads for j > 0 hit L1/L2. D is
    # constexpr (one compile per model width): the loop then has a static trip count, which also
    # keeps Triton 3.6's interpreter working (its range() over a runtime int fails with numpy >=
    # 2.4).
    t = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(K):
        dst = tl.load(inv_ptr + t * K + j).to(tl.int64)
        row = tl.maximum(dst, 0) * D
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc = tl.full([BLOCK_D], 0.0, tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            m = (offs < D) & ((offs * 0 + dst) >= 0)
            g = tl.load(dout_ptr + t * D + offs, mask=m, other=0.0).to(tl.float32)
            y = tl.load(ys_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
            acc += g * y
            tl.store(dys_ptr + row + offs, (g * wj).to(dys_ptr.dtype.element_ty), mask=m)
        tl.store(
            dw_ptr + t * K + j,
            tl.reduce(acc, 0, tl.standard._sum_combine).to(dw_ptr.dtype.element_ty),
        )


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(D), 1024)


def combine_rows(
    ys: torch.Tensor,
    inv: torch.Tensor,
    w: Optional[torch.Tensor],
    ys2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launcher for the forward kernel (no autograd). ``w=None`` means unit weights; ``ys2`` [N, D]:
    a second source summed with ys row by row."""
    ys, inv = ys.contiguous(), inv.contiguous()
    has_y2 = ys2 is not None
    ys2 = ys2.contiguous() if has_y2 else ys  # dummy pointer when HAS_Y2 is False
    T, K = inv.shape
    D = ys.shape[1]
    out = torch.empty(T, D, dtype=ys.dtype, device=ys.device)
    if T == 0:
        return out
    BLOCK_D = _block_d(D)
    wt = w.contiguous() if w is not None else inv  # dummy pointer when HAS_W is False
    jit(_combine_kernel)[(T, triton.cdiv(D, BLOCK_D))](
        ys,
        ys2,
        inv,
        wt,
        out,
        D,
        K=K,
        HAS_W=w is not None,
        HAS_Y2=has_y2,
        BLOCK_D=BLOCK_D,
        num_warps=4,
    )
    return out


def combine_rows_backward(
    dout: torch.Tensor, ys: torch.Tensor, inv: torch.Tensor, w: torch.Tensor, zero_fill: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher for the backward kernel -> (dys [N, D], dw [T, K] float32).

    ``zero_fill`` must be True when some rows of ys are not the image of any valid assignment
    (capacity dropping or alignment padding); dropless plans write every row.
    """
    dout, ys, inv, w = dout.contiguous(), ys.contiguous(), inv.contiguous(), w.contiguous()
    T, K = inv.shape
    N, D = ys.shape
    dys = (torch.zeros if zero_fill else torch.empty)(N, D, dtype=ys.dtype, device=ys.device)
    dw = torch.empty(T, K, dtype=torch.float32, device=ys.device)
    if T == 0:
        return dys, dw
    BLOCK_D = _block_d(D)
    jit(_combine_bwd_kernel)[(T,)](
        dout, ys, inv, w, dys, dw, D=D, K=K, BLOCK_D=BLOCK_D, num_warps=4
    )
    return dys, dw


@torch.library.custom_op("moezoo::moe_combine", mutates_args=())
def moe_combine(
    ys: torch.Tensor, inv: torch.Tensor, w: torch.Tensor, zero_fill: bool
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * ys[inv[t, j]]`` (Triton on CUDA / under TRITON_INTERPRET, else
    reference).

    ``zero_fill``: see ``combine_rows_backward``; it only affects the backward pass.
    """
    if use_triton(ys):
        return combine_rows(ys, inv, w)
    return moe_combine_reference(ys, inv, w)


@moe_combine.register_fake
def _(ys, inv, w, zero_fill):
    return ys.new_empty(inv.shape[0], ys.shape[1])


@torch.library.custom_op("moezoo::moe_combine_backward", mutates_args=())
def moe_combine_backward(
    dout: torch.Tensor, ys: torch.Tensor, inv: torch.Tensor, w: torch.Tensor, zero_fill: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of moe_combine -> (dys [N, D] in ys's dtype, dw [T, K] in w's dtype)."""
    if use_triton(ys):
        dys, dw = combine_rows_backward(dout, ys, inv, w, zero_fill)
        return dys, dw.to(w.dtype)
    # Closed form, not autograd: custom-op bodies run below the autograd key (no graph is recorded).
    # No boolean-mask indexing (a host sync on CUDA): dropped assignments write their (zero) rows to
    # one extra row that is cut off.
    N = ys.shape[0]
    valid = inv >= 0
    rows = inv.clamp(min=0).long()
    dest = torch.where(valid, rows, torch.full_like(rows, N))
    g = dout.float().unsqueeze(1) * valid.unsqueeze(-1)  # [T, K, D]
    dys = ys.new_zeros(N + 1, ys.shape[1]).index_put(
        (dest,), (g * w.float().unsqueeze(-1)).to(ys.dtype)
    )[:N]
    dw = (g * ys[rows].float()).sum(-1).to(w.dtype)
    return dys, dw


@moe_combine_backward.register_fake
def _(dout, ys, inv, w, zero_fill):
    return ys.new_empty(ys.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    ys, inv, w, zero_fill = inputs
    ctx.save_for_backward(ys, inv, w)
    ctx.zero_fill = zero_fill


def _backward(ctx, dout):
    ys, inv, w = ctx.saved_tensors
    dys, dw = moe_combine_backward(dout, ys, inv, w, ctx.zero_fill)
    return dys, None, dw, None


moe_combine.register_autograd(_backward, setup_context=_setup)
