"""Fused SwiGLU activation for expert hidden states: ``h = silu(a) * b`` (a = x W1^T gate, b = x W3^T up),
optionally times a per-row scale: ``h[r] = scale[r] * silu(a[r]) * b[r]``.

Shapes: a, b [N, H] (any matching shapes; the last dim is H) -> h [N, H] in a's dtype, computed in
float32; scale [N] float32 (the MoE routing weight of each expert-sorted row: folding it here makes the
combine an unweighted sum whose backward never reads the expert outputs, layers.moe_experts.run_plan).
Packed form (fused gate|up GEMM, layers.moe_gate_up): ``ab [N, 2H]`` holding a in columns ``:H`` and b
in ``H:`` -> h [N, H]; its backward writes ``da | db`` into one [N, 2H] buffer, so the halves are read
and written in place, never split into copies.
Backward: with g = dh * scale and s = sigmoid(a): ``da = g * b * s * (1 + a * (1 - s))``,
``db = g * a * s``, ``dscale[r] = sum_h dh * silu(a) * b``.

Why a kernel: eager ``F.silu(a) * b`` makes 2 passes forward and ~4 backward over [N, H] tensors that
are the largest activations of an MoE layer (Mixtral shape: 32768 x 14336 bf16 = 0.94 GB each); fused it
is one pass each way (3 and 5 tensor touches instead of 5 and 9), and only a, b are saved.

Layers: ``@triton.jit`` kernels (one pair for both layouts: rows of a and b ``stride`` elements apart,
b at offset ``b_off``) + launchers -> custom ops ``moezoo::swiglu`` / ``moezoo::swiglu_packed``
(autograd) and their ``*_backward`` ops (each with ``register_fake``); ``swiglu_reference``,
``swiglu_packed_reference`` and ``swiglu_backward_reference`` are the oracles.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .moe_launch import jit, use_triton

MAX_BLOCK = 2048   # columns per program: 4 KB of bf16 per operand, enough bytes in flight per SM


def swiglu_reference(a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    h = F.silu(a) * b
    return h if scale is None else (h.float() * scale.float().unsqueeze(-1)).to(h.dtype)


def swiglu_packed_reference(ab: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ab [..., 2H] -> ``scale * silu(ab[..., :H]) * ab[..., H:]``."""
    a, b = ab.chunk(2, dim=-1)
    return swiglu_reference(a, b, scale)


def swiglu_backward_reference(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              scale: Optional[torch.Tensor] = None):
    """Closed-form (da, db, dscale) in float32, cast to the inputs' dtypes (dscale: empty without a
    scale). Not autograd: custom-op bodies run below the autograd dispatch key, where no graph is recorded."""
    dh, af, bf = dh.float(), a.float(), b.float()
    s = torch.sigmoid(af)
    g = dh if scale is None else dh * scale.float().unsqueeze(-1)
    da, db = (g * bf * s * (1.0 + af * (1.0 - s))).to(a.dtype), (g * af * s).to(b.dtype)
    if scale is None:
        return da, db, dh.new_empty(0, dtype=torch.float32)
    return da, db, (dh * af * s * bf).sum(-1).to(scale.dtype)


def _swiglu_fwd_kernel(a_ptr, b_ptr, s_ptr, h_ptr, H, stride, b_off, HAS_S: tl.constexpr, BLOCK: tl.constexpr):
    # grid (N, cdiv(H, BLOCK)): row r of a at a_ptr + r*stride, of b at b_ptr + b_off + r*stride
    # (stride H for two [N, H] tensors, 2H for the halves of one [N, 2H] gate|up buffer).
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    a = tl.load(a_ptr + r * stride + cols, mask=m).to(tl.float32)
    b = tl.load(b_ptr + b_off + r * stride + cols, mask=m).to(tl.float32)
    h = a / (1.0 + tl.exp(-a)) * b      # silu(a) * b; builtins only (see kernels/moe_combine.py)
    if HAS_S:
        h = h * tl.load(s_ptr + r).to(tl.float32)
    tl.store(h_ptr + r * H + cols, h.to(h_ptr.dtype.element_ty), mask=m)


def _swiglu_bwd_kernel(dh_ptr, a_ptr, b_ptr, s_ptr, da_ptr, db_ptr, ds_ptr, H, stride, b_off,
                       HAS_S: tl.constexpr, BLOCK: tl.constexpr):
    # Same layout as the forward; da / db rows are laid out like a / b. Without a scale: grid
    # (N, cdiv(H, BLOCK)), one block per program. With one: grid (N,), the program walks the whole row,
    # because dscale[r] reduces over all of H (no atomics: deterministic, one writer per row).
    r = tl.program_id(0).to(tl.int64)
    if HAS_S:
        lo = 0
        n_blocks = (H + BLOCK - 1) // BLOCK
        sc = tl.load(s_ptr + r).to(tl.float32)
    else:
        lo = tl.program_id(1) * BLOCK
        n_blocks = 1
        sc = 1.0
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for i in range(n_blocks):
        cols = lo + i * BLOCK + tl.arange(0, BLOCK)
        m = cols < H
        dh = tl.load(dh_ptr + r * H + cols, mask=m, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + r * stride + cols, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + b_off + r * stride + cols, mask=m, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        g = dh * sc
        tl.store(da_ptr + r * stride + cols, (g * b * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty), mask=m)
        tl.store(db_ptr + b_off + r * stride + cols, (g * a * s).to(db_ptr.dtype.element_ty), mask=m)
        if HAS_S:
            acc += dh * a * s * b
    if HAS_S:
        tl.store(ds_ptr + r, tl.reduce(acc, 0, tl.standard._sum_combine).to(ds_ptr.dtype.element_ty))


def _block(H: int):
    block = min(triton.next_power_of_2(H), MAX_BLOCK)
    return block, (8 if block >= MAX_BLOCK else 4)


def _fwd(a, b, scale, h, N, H, stride, b_off):
    if N and H:
        block, warps = _block(H)
        s = scale.contiguous() if scale is not None else h    # dummy pointer when HAS_S is False
        jit(_swiglu_fwd_kernel)[(N, triton.cdiv(H, block))](a, b, s, h, H, stride, b_off, HAS_S=scale is not None,
                                                             BLOCK=block, num_warps=warps)
    return h


def _bwd(dh, a, b, scale, da, db, N, H, stride, b_off):
    """-> dscale [N] float32 (empty without a scale)."""
    ds = torch.empty(N if scale is not None else 0, dtype=torch.float32, device=dh.device)
    if N and H:
        block, warps = _block(H)
        grid = (N,) if scale is not None else (N, triton.cdiv(H, block))
        # Dummy pointers (never dereferenced) when HAS_S is False: real tensors, not the empty ds.
        s, ds_arg = (scale.contiguous(), ds) if scale is not None else (dh, dh)
        jit(_swiglu_bwd_kernel)[grid](dh, a, b, s, da, db, ds_arg, H, stride, b_off, HAS_S=scale is not None,
                                      BLOCK=block, num_warps=warps)
    return ds


def _rows(t: torch.Tensor, H: int) -> int:
    return t.numel() // max(H, 1)


def swiglu_rows_fwd(a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    H = a.shape[-1] if a.dim() else 1
    return _fwd(a, b, scale, torch.empty_like(a), _rows(a, H), H, H, 0)


def swiglu_rows_bwd(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None):
    """-> (da, db, dscale) (dscale empty without a scale)."""
    dh, a, b = dh.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    H = a.shape[-1] if a.dim() else 1
    ds = _bwd(dh, a, b, scale, da, db, _rows(a, H), H, H, 0)
    return da, db, ds


def swiglu_packed_fwd(ab: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ab [..., 2H] -> h [..., H] (launcher, no autograd)."""
    ab = ab.contiguous()
    H = ab.shape[-1] // 2
    h = ab.new_empty(*ab.shape[:-1], H)
    return _fwd(ab, ab, scale, h, _rows(h, H), H, 2 * H, H)


def swiglu_packed_bwd(dh: torch.Tensor, ab: torch.Tensor, scale: Optional[torch.Tensor] = None):
    """-> (dab [..., 2H] = da | db, dscale) (launcher, no autograd)."""
    dh, ab = dh.contiguous(), ab.contiguous()
    H = ab.shape[-1] // 2
    dab = torch.empty_like(ab)
    ds = _bwd(dh, ab, ab, scale, dab, dab, _rows(dh, H), H, 2 * H, H)
    return dab, ds


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
def swiglu_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (da, db, dscale); dscale is empty without a scale."""
    if use_triton(a):
        return swiglu_rows_bwd(dh, a, b, scale)
    return swiglu_backward_reference(dh, a, b, scale)


@swiglu_backward.register_fake
def _(dh, a, b, scale):
    return torch.empty_like(a), torch.empty_like(b), dh.new_empty(0 if scale is None else scale.shape[0],
                                                                  dtype=torch.float32)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dh):
    a, b, scale = ctx.saved_tensors
    da, db, ds = swiglu_backward(dh, a, b, scale)
    return da, db, (ds if scale is not None else None)


swiglu.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("moezoo::swiglu_packed", mutates_args=())
def swiglu_packed(ab: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scale * silu(ab[..., :H]) * ab[..., H:]`` (Triton on CUDA / under TRITON_INTERPRET, else the reference)."""
    if use_triton(ab):
        return swiglu_packed_fwd(ab, scale)
    return swiglu_packed_reference(ab, scale)


@swiglu_packed.register_fake
def _(ab, scale=None):
    return ab.new_empty(*ab.shape[:-1], ab.shape[-1] // 2)


@torch.library.custom_op("moezoo::swiglu_packed_backward", mutates_args=())
def swiglu_packed_backward(dh: torch.Tensor, ab: torch.Tensor,
                           scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of swiglu_packed: (dab [..., 2H] = da | db, dscale (empty without a scale))."""
    if use_triton(ab):
        return swiglu_packed_bwd(dh, ab, scale)
    da, db, ds = swiglu_backward_reference(dh, *ab.chunk(2, dim=-1), scale)
    return torch.cat([da, db], dim=-1), ds


@swiglu_packed_backward.register_fake
def _(dh, ab, scale):
    return torch.empty_like(ab), dh.new_empty(0 if scale is None else scale.shape[0], dtype=torch.float32)


def _setup_packed(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_packed(ctx, dh):
    ab, scale = ctx.saved_tensors
    dab, ds = swiglu_packed_backward(dh, ab, scale)
    return dab, (ds if scale is not None else None)


swiglu_packed.register_autograd(_backward_packed, setup_context=_setup_packed)
