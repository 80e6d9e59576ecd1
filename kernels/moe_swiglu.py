"""Fused SwiGLU activation for expert hidden states: ``h = silu(a) * b`` (a = x W1^T gate, b = x W3^T up).

Shapes: a, b [N, H] (any matching shapes; the last dim is H) -> h [N, H] in a's dtype, computed in
float32. Packed form (fused gate|up GEMM, layers.moe_gate_up): ``ab [N, 2H]`` holding a in columns
``:H`` and b in ``H:`` -> h [N, H]; its backward writes ``da | db`` into one [N, 2H] buffer, so the
halves are read and written in place, never split into copies.
Backward: ``da = dh * b * s * (1 + a * (1 - s))``, ``db = dh * a * s`` with s = sigmoid(a).

Why a kernel: eager ``F.silu(a) * b`` makes 2 passes forward and ~4 backward over [N, H] tensors that
are the largest activations of an MoE layer (Mixtral shape: 32768 x 14336 bf16 = 0.94 GB each); fused it
is one pass each way (3 and 5 tensor touches instead of 5 and 9), and only a, b are saved.

Layers: ``@triton.jit`` kernels (one pair for both layouts: rows of a and b ``stride`` elements apart,
b at offset ``b_off``) + launchers -> custom ops ``moezoo::swiglu`` / ``moezoo::swiglu_packed``
(autograd) and their ``*_backward`` ops (each with ``register_fake``); ``swiglu_reference`` and
``swiglu_packed_reference`` are the oracles.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .moe_launch import jit, use_triton

MAX_BLOCK = 2048   # columns per program: 4 KB of bf16 per operand, enough bytes in flight per SM


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def swiglu_backward_reference(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form (da, db) in float32, cast to a's / b's dtype. Not autograd: custom-op bodies run
    below the autograd dispatch key, where no graph would be recorded."""
    dh, af, bf = dh.float(), a.float(), b.float()
    s = torch.sigmoid(af)
    return (dh * bf * s * (1.0 + af * (1.0 - s))).to(a.dtype), (dh * af * s).to(b.dtype)


def swiglu_packed_reference(ab: torch.Tensor) -> torch.Tensor:
    """ab [..., 2H] -> ``silu(ab[..., :H]) * ab[..., H:]``."""
    a, b = ab.chunk(2, dim=-1)
    return swiglu_reference(a, b)


def _swiglu_fwd_kernel(a_ptr, b_ptr, h_ptr, H, stride, b_off, BLOCK: tl.constexpr):
    # grid (N, cdiv(H, BLOCK)): row r of a at a_ptr + r*stride, of b at b_ptr + b_off + r*stride
    # (stride H for two [N, H] tensors, 2H for the halves of one [N, 2H] gate|up buffer).
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    a = tl.load(a_ptr + r * stride + cols, mask=m).to(tl.float32)
    b = tl.load(b_ptr + b_off + r * stride + cols, mask=m).to(tl.float32)
    h = a / (1.0 + tl.exp(-a)) * b      # silu(a) * b; builtins only (see kernels/moe_combine.py)
    tl.store(h_ptr + r * H + cols, h.to(h_ptr.dtype.element_ty), mask=m)


def _swiglu_bwd_kernel(dh_ptr, a_ptr, b_ptr, da_ptr, db_ptr, H, stride, b_off, BLOCK: tl.constexpr):
    # Same layout as the forward; da / db rows are laid out like a / b.
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    dh = tl.load(dh_ptr + r * H + cols, mask=m).to(tl.float32)
    a = tl.load(a_ptr + r * stride + cols, mask=m).to(tl.float32)
    b = tl.load(b_ptr + b_off + r * stride + cols, mask=m).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    tl.store(da_ptr + r * stride + cols, (dh * b * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty), mask=m)
    tl.store(db_ptr + b_off + r * stride + cols, (dh * a * s).to(db_ptr.dtype.element_ty), mask=m)


def _grid(N: int, H: int):
    block = min(triton.next_power_of_2(H), MAX_BLOCK)
    return (N, triton.cdiv(H, block)), block, (8 if block >= MAX_BLOCK else 4)


def _fwd(a, b, h, N, H, stride, b_off):
    if N and H:
        grid, block, warps = _grid(N, H)
        jit(_swiglu_fwd_kernel)[grid](a, b, h, H, stride, b_off, BLOCK=block, num_warps=warps)
    return h


def _bwd(dh, a, b, da, db, N, H, stride, b_off):
    if N and H:
        grid, block, warps = _grid(N, H)
        jit(_swiglu_bwd_kernel)[grid](dh, a, b, da, db, H, stride, b_off, BLOCK=block, num_warps=warps)


def swiglu_rows_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    H = a.shape[-1] if a.dim() else 1
    return _fwd(a, b, torch.empty_like(a), a.numel() // max(H, 1), H, H, 0)


def swiglu_rows_bwd(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dh, a, b = dh.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    H = a.shape[-1] if a.dim() else 1
    _bwd(dh, a, b, da, db, a.numel() // max(H, 1), H, H, 0)
    return da, db


def swiglu_packed_fwd(ab: torch.Tensor) -> torch.Tensor:
    """ab [..., 2H] -> h [..., H] (launcher, no autograd)."""
    ab = ab.contiguous()
    H = ab.shape[-1] // 2
    h = ab.new_empty(*ab.shape[:-1], H)
    return _fwd(ab, ab, h, h.numel() // max(H, 1), H, 2 * H, H)


def swiglu_packed_bwd(dh: torch.Tensor, ab: torch.Tensor) -> torch.Tensor:
    """-> dab [..., 2H] = da | db (launcher, no autograd)."""
    dh, ab = dh.contiguous(), ab.contiguous()
    H = ab.shape[-1] // 2
    dab = torch.empty_like(ab)
    _bwd(dh, ab, ab, dab, dab, dh.numel() // max(H, 1), H, 2 * H, H)
    return dab


@torch.library.custom_op("moezoo::swiglu", mutates_args=())
def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` (Triton on CUDA / under TRITON_INTERPRET, else the reference)."""
    if use_triton(a):
        return swiglu_rows_fwd(a, b)
    return swiglu_reference(a, b)


@swiglu.register_fake
def _(a, b):
    return torch.empty_like(a)


@torch.library.custom_op("moezoo::swiglu_backward", mutates_args=())
def swiglu_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(a):
        return swiglu_rows_bwd(dh, a, b)
    return swiglu_backward_reference(dh, a, b)


@swiglu_backward.register_fake
def _(dh, a, b):
    return torch.empty_like(a), torch.empty_like(b)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dh):
    a, b = ctx.saved_tensors
    return swiglu_backward(dh, a, b)


swiglu.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("moezoo::swiglu_packed", mutates_args=())
def swiglu_packed(ab: torch.Tensor) -> torch.Tensor:
    """``silu(ab[..., :H]) * ab[..., H:]`` (Triton on CUDA / under TRITON_INTERPRET, else the reference)."""
    if use_triton(ab):
        return swiglu_packed_fwd(ab)
    return swiglu_packed_reference(ab)


@swiglu_packed.register_fake
def _(ab):
    return ab.new_empty(*ab.shape[:-1], ab.shape[-1] // 2)


@torch.library.custom_op("moezoo::swiglu_packed_backward", mutates_args=())
def swiglu_packed_backward(dh: torch.Tensor, ab: torch.Tensor) -> torch.Tensor:
    """Gradient of swiglu_packed: dab [..., 2H] = da | db."""
    if use_triton(ab):
        return swiglu_packed_bwd(dh, ab)
    return torch.cat(swiglu_backward_reference(dh, *ab.chunk(2, dim=-1)), dim=-1)


@swiglu_packed_backward.register_fake
def _(dh, ab):
    return torch.empty_like(ab)


def _setup_packed(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward_packed(ctx, dh):
    (ab,) = ctx.saved_tensors
    return swiglu_packed_backward(dh, ab)


swiglu_packed.register_autograd(_backward_packed, setup_context=_setup_packed)
