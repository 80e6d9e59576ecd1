"""Fused gate|up projection of GroupedExperts (SwiGLU): one grouped GEMM over ``W13 = [w1 | w3]``.

Legend: N rows of the expert-sorted buffer, E experts, H expert hidden dim, D model dim.
``gate_up_swiglu(xs[N, D], w1[E, H, D], w3[E, H, D], offs[E], scale[N] | None) -> h[N, H]
= scale * silu(xs w1_e^T) * xs w3_e^T`` row-wise per expert group (``offs``: int32 group ends, as
torch._grouped_mm takes them; ``scale``: optional per-row factor, kernels.moe_swiglu).

Forward: W13 [E, 2H, D] is built once (w1 rows then w3 rows per expert), ``ab = xs @ W13_e^T`` [N, 2H]
in one grouped GEMM and ``h = swiglu_packed(ab)`` reads the two halves in place.
Backward (the point of the fusion): ``dab = da | db`` [N, 2H] from one SwiGLU-backward pass,
``dxs = dab @ W13_e`` [N, D] in ONE grouped GEMM (its K = 2H sums both contributions, so there is no
[N, D] add of a dX from w1 and one from w3), and ``dW13 = dab^T @ xs`` [E, 2H, D] in ONE grouped GEMM
(one transposed read of xs instead of one per projection), returned to w1 / w3 as its two halves.

Bytes (elements; ``fuse_gate_up_pays``): costs ~2 * E*2H*D to build W13 (read w1, w3; write W13) and
~2 * E*2H*D when autograd copies the strided gradient halves into w1 / w3's layout; saves ~3 * N*D
(the dX add: two reads, one write) + ~2 * N*D (one transposed copy of xs). So it pays when the rows
outnumber the weights: fine-grained experts (E=64, H=1024, N=T*8) yes, Mixtral (E=8, H=14336, N=T*2) no.
W13 is kept for the backward (E*2H*D extra elements of activation memory).
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.moe_swiglu import swiglu_packed, swiglu_packed_backward


def fuse_gate_up_pays(num_rows: int, dim: int, hidden: int, num_experts: int) -> bool:
    """True when the fused gate|up path moves fewer bytes than two separate grouped GEMMs."""
    cost = 4 * num_experts * 2 * hidden * dim
    saved = 5 * num_rows * dim
    return saved > cost


class _GateUpSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, w1, w3, offs, scale):
        E, H, D = w1.shape
        # Two copies into one buffer (cast included) rather than cat of casts: W13 written once.
        w13 = torch.empty(E, 2 * H, D, dtype=xs.dtype, device=xs.device)
        w13[:, :H].copy_(w1)
        w13[:, H:].copy_(w3)
        ab = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
        ctx.save_for_backward(xs, w13, ab, offs, scale)
        ctx.w_dtypes = (w1.dtype, w3.dtype)
        return swiglu_packed(ab, scale)

    @staticmethod
    def backward(ctx, dh):
        xs, w13, ab, offs, scale = ctx.saved_tensors
        dab, dscale = swiglu_packed_backward(dh, ab, scale)
        dxs = dw1 = dw3 = None
        if ctx.needs_input_grad[0]:
            dxs = torch._grouped_mm(dab, w13, offs=offs)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dw13 = torch._grouped_mm(dab.t(), xs, offs=offs)          # [E, 2H, D]
            H = w13.shape[1] // 2
            dw1, dw3 = dw13[:, :H].to(ctx.w_dtypes[0]), dw13[:, H:].to(ctx.w_dtypes[1])
        return dxs, dw1, dw3, None, (dscale if scale is not None else None)


def gate_up_swiglu(xs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, offs: torch.Tensor,
                   scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """xs [N, D], w1 / w3 [E, H, D], offs [E] int32 group ends, scale [N] float32 or None -> h [N, H]
    (see the module docstring)."""
    return _GateUpSwiGLU.apply(xs, w1, w3, offs, scale)
