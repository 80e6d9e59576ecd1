"""2:4 semi-structured sparse linear (cuSPARSELt / CUTLASS through ``to_sparse_semi_structured``),
CUDA only.

``SemiSparseLinear.apply(x[..., in], weight[out, in], dtype, transposable) -> [..., out]`` computes
``F.linear(x, weight)`` for a weight whose zeros already form a 2:4 pattern along ``in``:
- forward ``y = x W^T``: W packed every call (the weight changes every optimizer step);
- backward ``gx = g W``: sparse too when the mask is transposable (W^T is then 2:4 along ``out``);
  ``gW = g^T x``: dense (RigL grows by |dL/dW| at masked positions).
The pure-torch reference is ``F.linear`` on the masked weight. Used by layers.dst.semi_structured.
"""

from __future__ import annotations

import torch


def pack_semi_structured(w: torch.Tensor):
    from torch.sparse import to_sparse_semi_structured

    return to_sparse_semi_structured(w)


class SemiSparseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, dtype, transposable):
        with torch.autocast("cuda", enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            w = weight.to(dtype)
            y = torch.mm(x2, pack_semi_structured(w).t())
        ctx.save_for_backward(x2, w)
        ctx.transposable, ctx.wdtype, ctx.xdtype = transposable, weight.dtype, x.dtype
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, w = ctx.saved_tensors
        with torch.autocast("cuda", enabled=False):
            g2 = gy.reshape(-1, gy.shape[-1]).to(w.dtype)
            gx = (
                torch.mm(g2, pack_semi_structured(w.t().contiguous()).t())
                if ctx.transposable
                else torch.mm(g2, w)
            )
            gw = torch.mm(g2.t(), x2)
        return gx.view(*gy.shape[:-1], w.shape[1]).to(ctx.xdtype), gw.to(ctx.wdtype), None, None
