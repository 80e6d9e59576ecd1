"""SwiGLU gate and up projections of GroupedExperts with the token permute fused into their backward.

``gate_up(x, w1, w3, offs, inv=None, num_rows=0, zero_fill=False) -> (a [N, H], b [N, H])``:
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
"""
from __future__ import annotations

from typing import Optional

import torch

from .moe_permute import moe_permute, moe_unpermute


class _PermuteGateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, offs, inv, num_rows, zero_fill):
        xs = x if inv is None else moe_permute(x, inv, num_rows, zero_fill)
        a = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
        b = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
        ctx.save_for_backward(xs, w1, w3, offs, inv)
        ctx.zero_fill = zero_fill
        return a, b

    @staticmethod
    def backward(ctx, da, db):
        xs, w1, w3, offs, inv = ctx.saved_tensors
        dx = dw1 = dw3 = None
        if ctx.needs_input_grad[0]:
            g1 = torch._grouped_mm(da, w1, offs=offs)                  # [N, D]
            g3 = torch._grouped_mm(db, w3, offs=offs)
            dx = g1 + g3 if inv is None else moe_unpermute(g1, inv, ctx.zero_fill, g3)
        if ctx.needs_input_grad[1]:
            dw1 = torch._grouped_mm(da.t(), xs, offs=offs)             # [E, H, D]
        if ctx.needs_input_grad[2]:
            dw3 = torch._grouped_mm(db.t(), xs, offs=offs)
        return dx, dw1, dw3, None, None, None, None


def gate_up(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, offs: torch.Tensor,
            inv: Optional[torch.Tensor] = None, num_rows: int = 0,
            zero_fill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) [N, H] of the (permuted) rows; differentiable in x, w1, w3. See the module docstring."""
    return _PermuteGateUp.apply(x, w1, w3, offs, inv, num_rows, zero_fill)
