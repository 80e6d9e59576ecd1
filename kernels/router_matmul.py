"""Router logits ``x[T, D] @ w[E, D]^T`` in float32 from bf16/fp16 CUDA inputs, without an fp32 copy
of x.

``router_matmul(x, w, low_precision=True) -> [T, E] float32``. The low-precision path is an autograd
Function over ``torch.mm(..., out_dtype=torch.float32)``; its reference (CPU, float32 inputs, or
``low_precision=False``) is ``F.linear`` of the float32 upcasts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _LowPrecisionRouterMM(torch.autograd.Function):
    """``x[T, D] @ w[E, D]^T`` for bf16/fp16 CUDA inputs with float32 output and accumulation.

    Products of bf16 values are exact in fp32, so the logits equal the fp32 GEMM of the same values
    up to summation order, without the fp32 copy of x and the fp32 GEMMs (BENCHMARKS.md, Tried and
    rejected: router reading the float32 residual). Gradients are computed from the bf16-rounded
    dlogits, like every other bf16 grad.
    """

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.to(x.dtype)
        # none for a detached input (NeuronRoutedFFN)
        dx = g @ w if ctx.needs_input_grad[0] else None
        dw = (
            torch.mm(g.t(), x, out_dtype=torch.float32).to(w.dtype)
            if ctx.needs_input_grad[1]
            else None
        )
        return dx, dw


def router_matmul(x: torch.Tensor, w: torch.Tensor, low_precision: bool = True) -> torch.Tensor:
    """Float32 logits ``x[T, D] @ w[E, D]^T``; bf16/fp16 CUDA inputs skip the fp32 upcast of x."""
    if low_precision and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return _LowPrecisionRouterMM.apply(x, w.to(x.dtype))
    return F.linear(x.float(), w.float())
