"""SwiGLU gate and up projections of GroupedExperts with the token permute fused into their backward.

``gate_up(x, w1, w3, offs, inv=None, num_rows=0, zero_fill=False, fp8=False) -> (a [N, H], b [N, H])``:
``xs = moe_permute(x[T, D], inv[T, K], num_rows, zero_fill)`` (``inv=None``: x is already the sorted
rows xs [N, D]), then ``a = xs w1[e]^T`` and ``b = xs w3[e]^T`` on each expert's rows (w1, w3 [E, H, D];
``offs`` [E] int32 group ends, as torch._grouped_mm takes them).

Why: autograd over a separate permute and two GEMMs computes dxs as ``xs``'s two gradients added in an
[N, D] elementwise pass, which the permute's backward (an unweighted combine) then reads again. Here the
backward hands both GEMM outputs g1 = da w1, g3 = db w3 to ``moe_unpermute(g1, inv, zero_fill, g3)``,
which sums the 2K rows of each token in one float32 pass (one bf16 rounding instead of two). H200,
fine-grained shape (N = 131072, D = 4096): the add's 0.73 ms goes, the combine costs 0.25 ms more; the
fwd+bwd step 19.49 -> 19.16 ms in one bench/moe.py run (``ours_unfused_permute`` vs ``ours``). Weight gradients are grouped GEMMs over the transposed view ``da^T xs`` (no copy), in
the parameters' [E, H, D] layout. Rows past the last group are unspecified in a and b, as in
torch._grouped_mm; no assignment maps to them, so nothing reads their gradients.

``fp8=True`` (``model.moe.precision: fp8``): the four GEMMs are kernels.moe_fp8's rowwise-scaled e4m3
ones; xs is quantized once by rows for both forward GEMMs and once per expert column for both weight
gradients (that copy, 1 byte per element, is what the forward saves instead of xs).
"""
from __future__ import annotations

from typing import Optional

import torch

from .moe_fp8 import fp8_columns, fp8_dgrad, fp8_forward, fp8_quantize_rows, fp8_wgrad
from .moe_permute import moe_permute, moe_unpermute


class _PermuteGateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, offs, inv, num_rows, zero_fill, fp8):
        xs = x if inv is None else moe_permute(x, inv, num_rows, zero_fill)
        if fp8:
            xq = fp8_quantize_rows(xs)
            a, b = fp8_forward(*xq, w1, offs), fp8_forward(*xq, w3, offs)
            x_saved = fp8_columns(xs, offs) if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else (None,) * 3
        else:
            a = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
            b = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
            x_saved = (xs,)
        ctx.save_for_backward(w1, w3, offs, inv, *x_saved)
        ctx.zero_fill, ctx.fp8 = zero_fill, fp8
        return a, b

    @staticmethod
    def backward(ctx, da, db):
        w1, w3, offs, inv, *x_saved = ctx.saved_tensors
        dx = None
        if ctx.fp8:
            da, db = da.contiguous(), db.contiguous()
        if ctx.needs_input_grad[0]:
            if ctx.fp8:
                g1, g3 = fp8_dgrad(da, w1, offs), fp8_dgrad(db, w3, offs)      # [N, D]
            else:
                g1 = torch._grouped_mm(da, w1, offs=offs)
                g3 = torch._grouped_mm(db, w3, offs=offs)
            dx = g1 + g3 if inv is None else moe_unpermute(g1, inv, ctx.zero_fill, g3)
        need1, need3 = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if ctx.fp8:
            dw1 = fp8_wgrad(da, offs, x_saved, w1.dtype) if need1 else None
            dw3 = fp8_wgrad(db, offs, x_saved, w3.dtype) if need3 else None
        else:
            dw1 = torch._grouped_mm(da.t(), x_saved[0], offs=offs) if need1 else None   # [E, H, D]
            dw3 = torch._grouped_mm(db.t(), x_saved[0], offs=offs) if need3 else None
        return dx, dw1, dw3, None, None, None, None, None


def gate_up(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, offs: torch.Tensor,
            inv: Optional[torch.Tensor] = None, num_rows: int = 0,
            zero_fill: bool = False, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) [N, H] of the (permuted) rows; differentiable in x, w1, w3. See the module docstring."""
    return _PermuteGateUp.apply(x, w1, w3, offs, inv, num_rows, zero_fill, fp8)
