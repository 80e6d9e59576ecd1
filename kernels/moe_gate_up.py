"""SwiGLU gate and up projections of GroupedExperts with the token permute fused into their
backward.

``gate_up(x, w1, w3, offs, inv=None, num_rows=0, zero_fill=False, fp8=False) -> (a [N, H], b [N,
H])``: ``xs = moe_permute(x[T, D], inv[T, K], num_rows, zero_fill)`` (``inv=None``: x is already the
sorted rows xs [N, D]), then ``a = xs w1[e]^T`` and ``b = xs w3[e]^T`` on each expert's rows (w1, w3
[E, H, D]; ``offs`` [E] int32 group ends, as torch._grouped_mm takes them).

Why: autograd over a separate permute and two GEMMs computes dxs as ``xs``'s two gradients added in
an [N, D] elementwise pass, which the permute's backward (an unweighted combine) then reads again.
Here the backward hands both GEMM outputs g1 = da w1, g3 = db w3 to ``moe_unpermute(g1, inv,
zero_fill, g3)``, which sums the 2K rows of each token in one float32 pass (one bf16 rounding
instead of two). At the fine-grained shape (N = 131072, D = 4096) the fwd+bwd step gains ~0.3 ms
(bench/moe.py's ``ours_unfused_permute`` vs ``ours``; BENCHMARKS.md, MoE layer).

Weight gradients are grouped GEMMs over the transposed view ``da^T xs`` (no copy), in the
parameters' [E, H, D] layout (kernels.grouped_wgrad: split along the rows for small experts). Rows
past the last group are unspecified in a and b, as in torch._grouped_mm; no assignment maps to them,
so nothing reads their gradients.

``fp8=True`` (``model.moe.precision: fp8``): the six GEMMs are kernels.moe_fp8's rowwise-scaled e4m3
ones; xs is quantized by rows for both forward GEMMs and per expert column for both weight gradients
in one ``fp8_quantize_dual`` (that copy, 1 byte per element, is what the forward saves instead of
xs), each weight for its forward and its dgrad GEMM in one ``fp8_quantize_weight_dual`` (the dgrad
operand kept for the backward), and da / db each for their dgrad and wgrad GEMMs in one dual pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from .grouped_wgrad import grouped_wgrad
from .moe_fp8 import fp8_dgrad, fp8_forward, fp8_operands, fp8_weight, fp8_wgrad
from .moe_permute import moe_permute, moe_unpermute


class _PermuteGateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, offs, inv, num_rows, zero_fill, fp8):
        xs = x if inv is None else moe_permute(x, inv, num_rows, zero_fill)
        ctx.zero_fill, ctx.fp8 = zero_fill, fp8
        if not fp8:
            ctx.save_for_backward(offs, inv, xs, w1, w3)
            return (
                torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs),
                torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs),
            )
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        xq, xd, xt = fp8_operands(xs, offs, rows=True, cols=need_w)
        w1q, w1d, w1tq, w1td = fp8_weight(w1, dgrad=need_x)
        w3q, w3d, w3tq, w3td = fp8_weight(w3, dgrad=need_x)
        ctx.save_for_backward(offs, inv, *xt, w1tq, w1td, w3tq, w3td)
        ctx.wdtypes = (w1.dtype, w3.dtype)
        return fp8_forward(xq, xd, w1q, w1d, offs), fp8_forward(xq, xd, w3q, w3d, offs)

    @staticmethod
    def backward(ctx, da, db):
        offs, inv, *saved = ctx.saved_tensors
        need_x, need1, need3 = ctx.needs_input_grad[:3]
        if ctx.fp8:
            xt, wt1, wt3 = tuple(saved[:3]), saved[3:5], saved[5:]
            daq, dad, dat = fp8_operands(da, offs, rows=need_x, cols=need1, pends=xt[2])
            dbq, dbd, dbt = fp8_operands(db, offs, rows=need_x, cols=need3, pends=xt[2])
            g1 = fp8_dgrad(daq, dad, *wt1, offs) if need_x else None  # [N, D]
            g3 = fp8_dgrad(dbq, dbd, *wt3, offs) if need_x else None
            dw1 = fp8_wgrad(dat, xt, ctx.wdtypes[0]) if need1 else None
            dw3 = fp8_wgrad(dbt, xt, ctx.wdtypes[1]) if need3 else None
        else:
            xs, w1, w3 = saved
            g1 = torch._grouped_mm(da, w1, offs=offs) if need_x else None
            g3 = torch._grouped_mm(db, w3, offs=offs) if need_x else None
            dw1 = grouped_wgrad(da.t(), xs, offs) if need1 else None  # [E, H, D]
            dw3 = grouped_wgrad(db.t(), xs, offs) if need3 else None
        dx = None
        if need_x:
            dx = g1 + g3 if inv is None else moe_unpermute(g1, inv, ctx.zero_fill, g3)
        return dx, dw1, dw3, None, None, None, None, None


def gate_up(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    offs: torch.Tensor,
    inv: Optional[torch.Tensor] = None,
    num_rows: int = 0,
    zero_fill: bool = False,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) [N, H] of the (permuted) rows; differentiable in x, w1, w3. See the module
    docstring."""
    return _PermuteGateUp.apply(x, w1, w3, offs, inv, num_rows, zero_fill, fp8)
