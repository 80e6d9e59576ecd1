"""Fused SwiGLU activation for expert hidden states: ``h = silu(a) * b`` (a = x W1^T gate, b = x
W3^T up), optionally times a per-row scale: ``h[r] = scale[r] * silu(a[r]) * b[r]``.

Shapes: a, b [N, H] (any matching shapes; the last dim is H) -> h [N, H] in a's dtype, computed in
float32; scale [N] float32 (the MoE routing weight of each expert-sorted row: folding it here makes
the combine an unweighted sum whose backward never reads the expert outputs,
layers.moe.experts.run_plan). Backward: with g = dh * scale and s = sigmoid(a): ``da = g * b * s *
(1 + a * (1 - s))``, ``db = g * a * s``, ``dscale[r] = sum_h dh * silu(a) * b``.

Why a kernel: eager ``F.silu(a) * b`` makes 2 passes forward and ~4 backward over [N, H] tensors
that are the largest activations of an MoE layer (Mixtral shape: 32768 x 14336 bf16 = 0.94 GB each);
fused it is one pass each way (3 and 5 tensor touches instead of 5 and 9), and only a, b are saved.

Layers: ``@triton.jit`` kernels over rows (one program per row and column block; the backward with a
scale walks a whole row to reduce dscale) + launchers -> custom op ``moezoo::swiglu`` (autograd) and
``moezoo::swiglu_backward`` (each with ``register_fake``); ``swiglu_reference`` and
``swiglu_backward_reference`` are the oracles.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .launch import jit, tl, triton, use_triton

MAX_BLOCK = 2048  # columns per program: 4 KB of bf16 per operand, enough bytes in flight per SM


def swiglu_reference(
    a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None
) -> torch.Tensor:
    h = F.silu(a) * b
    return h if scale is None else (h.float() * scale.float().unsqueeze(-1)).to(h.dtype)


def swiglu_backward_reference(
    dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None
):
    """Closed-form (da, db, dscale) in float32; da, db cast to a's and b's dtypes, dscale [N]
    float32 as the kernel's (empty without a scale). Not autograd: custom-op bodies run below the
    autograd dispatch key, where no graph is recorded."""
    dh, af, bf = dh.float(), a.float(), b.float()
    s = torch.sigmoid(af)
    g = dh if scale is None else dh * scale.float().unsqueeze(-1)
    da, db = (g * bf * s * (1.0 + af * (1.0 - s))).to(a.dtype), (g * af * s).to(b.dtype)
    if scale is None:
        return da, db, dh.new_empty(0, dtype=torch.float32)
    return da, db, (dh * af * s * bf).sum(-1)


def _swiglu_fwd_kernel(a_ptr, b_ptr, s_ptr, h_ptr, H, HAS_S: tl.constexpr, BLOCK: tl.constexpr):
    # grid (N, cdiv(H, BLOCK)): a, b, h contiguous [N, H]; rows, so the scale is one load per
    # program.
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    a = tl.load(a_ptr + r * H + cols, mask=m).to(tl.float32)
    b = tl.load(b_ptr + r * H + cols, mask=m).to(tl.float32)
    h = a / (1.0 + tl.exp(-a)) * b  # silu(a) * b; builtins only (see kernels/moe_combine.py)
    if HAS_S:
        h = h * tl.load(s_ptr + r).to(tl.float32)
    tl.store(h_ptr + r * H + cols, h.to(h_ptr.dtype.element_ty), mask=m)


def _swiglu_bwd_kernel(
    dh_ptr,
    a_ptr,
    b_ptr,
    s_ptr,
    da_ptr,
    db_ptr,
    ds_ptr,
    H,
    HAS_S: tl.constexpr,
    BLOCK: tl.constexpr,
    N_BLOCKS: tl.constexpr,
):
    # dh, a, b, da, db contiguous [N, H]. Without a scale: grid (N, cdiv(H, BLOCK)), one block per
    # program. With one: grid (N,), the program walks the whole row, because dscale[r] reduces over
    # all of H (no atomics: deterministic, one writer per row). N_BLOCKS (blocks a program walks) is
    # a constexpr: Triton 3.6's interpreter fails on range() over a runtime value with numpy >= 2.4.
    r = tl.program_id(0).to(tl.int64)
    if HAS_S:
        lo = 0
        sc = tl.load(s_ptr + r).to(tl.float32)
    else:
        lo = tl.program_id(1) * BLOCK
        sc = 1.0
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for i in range(N_BLOCKS):
        cols = lo + i * BLOCK + tl.arange(0, BLOCK)
        m = cols < H
        dh = tl.load(dh_ptr + r * H + cols, mask=m, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + r * H + cols, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + r * H + cols, mask=m, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        g = dh * sc
        tl.store(
            da_ptr + r * H + cols,
            (g * b * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty),
            mask=m,
        )
        tl.store(db_ptr + r * H + cols, (g * a * s).to(db_ptr.dtype.element_ty), mask=m)
        if HAS_S:
            acc += dh * a * s * b
    if HAS_S:
        tl.store(
            ds_ptr + r, tl.reduce(acc, 0, tl.standard._sum_combine).to(ds_ptr.dtype.element_ty)
        )


def _block(H: int):
    block = min(triton.next_power_of_2(H), MAX_BLOCK)
    return block, (8 if block >= MAX_BLOCK else 4)


def _fwd(a, b, scale, h, N, H):
    if N and H:
        block, warps = _block(H)
        s = scale.contiguous() if scale is not None else h  # dummy pointer when HAS_S is False
        jit(_swiglu_fwd_kernel)[(N, triton.cdiv(H, block))](
            a, b, s, h, H, HAS_S=scale is not None, BLOCK=block, num_warps=warps
        )
    return h


def _bwd(dh, a, b, scale, da, db, N, H):
    """-> dscale [N] float32 (empty without a scale)."""
    ds = torch.empty(N if scale is not None else 0, dtype=torch.float32, device=dh.device)
    if N and H:
        block, warps = _block(H)
        grid = (N,) if scale is not None else (N, triton.cdiv(H, block))
        # Dummy pointers (never dereferenced) when HAS_S is False: real tensors, not the empty ds.
        s, ds_arg = (scale.contiguous(), ds) if scale is not None else (dh, dh)
        jit(_swiglu_bwd_kernel)[grid](
            dh,
            a,
            b,
            s,
            da,
            db,
            ds_arg,
            H,
            HAS_S=scale is not None,
            BLOCK=block,
            N_BLOCKS=triton.cdiv(H, block) if scale is not None else 1,
            num_warps=warps,
        )
    return ds


def _rows(t: torch.Tensor, H: int) -> int:
    return t.numel() // max(H, 1)


def swiglu_rows_fwd(
    a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None
) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    H = a.shape[-1] if a.dim() else 1
    return _fwd(a, b, scale, torch.empty_like(a), _rows(a, H), H)


def swiglu_rows_bwd(
    dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None
):
    """-> (da, db, dscale) (dscale empty without a scale)."""
    dh, a, b = dh.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    H = a.shape[-1] if a.dim() else 1
    ds = _bwd(dh, a, b, scale, da, db, _rows(a, H), H)
    return da, db, ds


@torch.library.custom_op("moezoo::swiglu", mutates_args=())
def swiglu(a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scale * silu(a) * b`` (Triton on CUDA / under TRITON_INTERPRET, else the reference)."""
    if use_triton(a):
        return swiglu_rows_fwd(a, b, scale)
    return swiglu_reference(a, b, scale)


@swiglu.register_fake
def _(a, b, scale=None):
    return torch.empty_like(a)


@torch.library.custom_op("moezoo::swiglu_backward", mutates_args=())
def swiglu_backward(
    dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (da, db, dscale); dscale is empty without a scale."""
    if use_triton(a):
        return swiglu_rows_bwd(dh, a, b, scale)
    return swiglu_backward_reference(dh, a, b, scale)


@swiglu_backward.register_fake
def _(dh, a, b, scale):
    return (
        torch.empty_like(a),
        torch.empty_like(b),
        dh.new_empty(0 if scale is None else scale.shape[0], dtype=torch.float32),
    )


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dh):
    a, b, scale = ctx.saved_tensors
    da, db, ds = swiglu_backward(dh, a, b, scale)
    return da, db, (ds if scale is not None else None)


swiglu.register_autograd(_backward, setup_context=_setup)
