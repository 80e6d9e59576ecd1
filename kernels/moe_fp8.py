"""FP8 grouped GEMMs for the expert projections (``model.moe.precision: fp8``), forward and backward.

Legend: R rows of the expert-sorted buffer, I / O a projection's in / out features, E experts (= groups),
P rows of the padded wgrad layout. ``offs [E]`` int32 are cumulative group ends, as torch._grouped_mm
takes them; rows past ``offs[-1]`` are not computed (their output is unspecified, as in torch._grouped_mm).

``fp8_grouped_linear(x[R, I], w[E, O, I], offs) -> y[R, O]`` bf16, ``y[r] = x[r] w[e]^T`` for the rows
of expert e; differentiable in x and w (w of any float dtype: bf16 or float32 master weights are read as
they are and get a gradient of their own dtype). ``kernels.moe_gate_up`` runs the gate/up pair with the
same pieces (one quantization of x shared by both GEMMs).

Recipe (torchao.prototype.moe_training's FP8 rowwise, which torchtitan trains MoE with): every operand is
cast on the fly, each step, to float8_e4m3fn with a float32 scale per row or column of the contraction,
computed from its amax ("dynamic" scaling, no history), and every GEMM is one ``torch._scaled_grouped_mm``
(CUTLASS, sm90 / sm100) with bf16 output and FP8 fast accumulation:

| GEMM | mat_a (row-major) | mat_b (column-major) |
| --- | --- | --- |
| forward ``y = x w^T`` | x, a scale per row (amax over I) | w^T, a scale per output channel (over I) |
| dgrad ``dx = dy w`` | dy, a scale per row (over O) | w, a scale per input channel (over O), stored transposed |
| wgrad ``dw = dy^T x`` | dy^T, a scale per expert and column | x, a scale per expert and column |

The wgrad operands are 2-D with the experts along the contraction: CUTLASS needs each group's start 16-byte
aligned there, so ``quantize_groups_t`` writes them column-major with every group padded to a multiple of
16 rows, zero pad rows (at least 16: an empty expert is a block of zeros, as CUTLASS's Blackwell grouped
kernels reject empty contraction groups). Forward and dgrad group along the rows of a row-major operand
and take any group sizes. So the dispatch needs no ``group_align``, and expert parallelism's uneven counts
run as they are.

Scales are powers of two, ``s = 2^floor(log2(448 / amax))`` (the exponent bits of the correctly rounded
quotient): scaling is exact, amax lands in (224, 448], and the dequantization scale ``1 / s`` handed to the
GEMM is exact too. e4m3 everywhere, gradients included (torchao's choice for this recipe; e5m2 gradients
are the per-tensor recipes' answer to their coarser scales).

Layers: ``@triton.jit`` quantizers (one row per program; or one column block of one group per program,
transposed out) + launchers -> custom ops ``moezoo::fp8_quantize_rows`` / ``fp8_quantize_groups_t`` /
``fp8_quantize_weight_t`` (``register_fake``, so torch.compile traces through) -> the autograd.Function.
``*_reference`` are the pure-torch oracles (and the path without triton); ``scaled_grouped_mm_reference``
emulates torch._scaled_grouped_mm in float32 (CPU tests; the op itself is CUDA-only).
"""
from __future__ import annotations

from typing import Optional

import torch

from .launch import jit, tl, triton, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0           # largest finite float8_e4m3fn
AMAX_EPS = 1e-12          # an all-zero row or column gets a finite scale (2^48) and quantizes to zeros
WGRAD_ALIGN = 16          # rows per wgrad group: 16 bytes of fp8 (TMA alignment of group starts)
FAST_ACCUM = True         # FP8 tensor-core accumulation without periodic float32 promotion (torchao: all three)
ROWS_BLOCK = 4096         # columns per step of the row quantizer: 8 KB of bf16 in flight per program
COLS_BLOCK_R, COLS_BLOCK_C = 128, 64   # column quantizer tile: 128 B contiguous per column on the transposed store


# -- pure torch: the math, once -------------------------------------------------------------------------
def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 ``2^floor(log2(448 / amax))``: the exponent bits of the correctly rounded quotient."""
    s = FP8_MAX / amax.float().clamp(min=AMAX_EPS)
    return (s.view(torch.int32) & 0x7F800000).view(torch.float32)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (q [..., C] float8_e4m3fn contiguous, d [...] float32) with ``x ~= q * d[..., None]``:
    ``q = clamp(x * s, +-448)`` rounded to nearest even, ``d = 1 / s``, one power-of-two s per row."""
    xf = x.float()
    amax = xf.abs().amax(-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1])
    s = pow2_scale(amax)
    q = (xf * s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    return q, 1.0 / s


def padded_group_ends(offs: torch.Tensor) -> torch.Tensor:
    """offs [E] int32 group ends -> the ends [E] int32 of the wgrad layout, every group rounded up to a
    multiple of 16 rows and at least 16 (device ops, no host sync)."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = ((sizes + WGRAD_ALIGN - 1) // WGRAD_ALIGN * WGRAD_ALIGN).clamp(min=WGRAD_ALIGN)
    return torch.cumsum(padded, 0, dtype=torch.int32)


def padded_rows(num_rows: int, num_groups: int) -> int:
    """P, static: room for every padded layout of ``num_rows`` rows in ``num_groups`` groups, a multiple of 16
    (torch._scaled_grouped_mm's contraction dim)."""
    return -(-num_rows // WGRAD_ALIGN) * WGRAD_ALIGN + WGRAD_ALIGN * num_groups


def quantize_groups_t_reference(x: torch.Tensor, offs: torch.Tensor, pends: torch.Tensor,
                                num_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C], offs / pends [E] int32 -> (qt [C, P] float8_e4m3fn, d [E, C] float32): expert e's rows
    ``offs[e-1] .. offs[e]`` quantized per column (``quantize_rows_reference`` of their transpose) and stored
    at columns ``pends[e-1] ..`` of qt, the rest of its padded block zero. Columns past ``pends[-1]`` are zero
    here and unspecified in the kernel."""
    C = x.shape[1]
    qt = torch.zeros(C, num_padded, dtype=FP8, device=x.device)
    d = torch.empty(offs.numel(), C, dtype=torch.float32, device=x.device)
    start = pstart = 0
    for e, (end, pend) in enumerate(zip(offs.tolist(), pends.tolist())):
        q, d[e] = quantize_rows_reference(x[start:end].t())
        qt[:, pstart:pstart + end - start] = q
        start, pstart = end, pend
    return qt, d


def quantize_weight_t_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, O, I] -> (qt [E, I, O] float8_e4m3fn contiguous, d [E, I] float32): a scale per input channel
    (amax over O), stored transposed (the dgrad operand)."""
    return quantize_rows_reference(w.transpose(-2, -1))


def scaled_grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor,
                                offs: torch.Tensor) -> torch.Tensor:
    """torch._scaled_grouped_mm's rowwise math in float32, bf16 out; the two layouts moezoo uses:

    - a [R, K], b [E, K, N], da [R], db [E, N]: ``out[r] = (a[r] da[r]) (b[e] db[e])`` for the rows of
      group e (rows past ``offs[-1]`` zero);
    - a [M, P], b [P, N], da [E * M], db [E * N]: ``out[e] = (a[:, g_e] da[e]) (b[g_e] db[e])`` over the
      contraction slice g_e of group e -> [E, M, N].
    """
    af, bf = a.float(), b.float()
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = af.new_zeros(a.shape[0], b.shape[-1])
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[s:t] = (af[s:t] * da[s:t, None]) @ (bf[e] * db[e][None, :])
        return out.to(torch.bfloat16)
    E, M, N = len(ends), a.shape[0], b.shape[1]
    da, db = da.view(E, M), db.view(E, N)
    out = af.new_zeros(E, M, N)
    for e, (s, t) in enumerate(zip(starts, ends)):
        out[e] = (af[:, s:t] * da[e][:, None]) @ (bf[s:t] * db[e][None, :])
    return out.to(torch.bfloat16)


# -- Triton quantizers ----------------------------------------------------------------------------------
# Builtins only (tl.full, tl.reduce, tl.div_rn), as in kernels/moe_combine.py. Scales use tl.div_rn (the
# default fp32 division is approximate: a quotient that is exactly a power of two could lose its exponent)
# and the exponent mask, so they equal the torch reference bit for bit; the e4m3 cast rounds to nearest
# even after the clamp, as torch's does. Under TRITON_INTERPRET the tests read float32 outputs (the
# interpreter's own fp8 cast is not IEEE) and cast them with torch.

def _quantize_rows_kernel(x_ptr, q_ptr, d_ptr, C, MAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    # grid (R,): a row per program, two passes over it (amax, then scale and cast; the second reads hit L2).
    r = tl.program_id(0).to(tl.int64)
    amax = tl.full([BLOCK], 0.0, tl.float32)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * C + cols, mask=cols < C, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    m = tl.maximum(tl.reduce(amax, 0, tl.standard._elementwise_max), EPS)
    s = (tl.div_rn(MAX, m).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * C + cols, mask=cols < C, other=0.0).to(tl.float32)
        q = tl.clamp(x * s, -MAX, MAX)
        tl.store(q_ptr + r * C + cols, q.to(q_ptr.dtype.element_ty), mask=cols < C)
    tl.store(d_ptr + r, tl.div_rn(1.0, s))


def _quantize_cols_kernel(x_ptr, ends_ptr, pends_ptr, q_ptr, d_ptr, C, L, P, PADDED: tl.constexpr,
                          MAX: tl.constexpr, EPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # grid (cdiv(C, BLOCK_C), E): columns of one group per program; x [R, C] row-major. Each column's scale
    # comes from its amax over the group's rows; row i of the group goes to q[base + c * stride + i], the
    # group's block transposed (consecutive rows contiguous in q).
    # PADDED: groups are rows offs[e-1] .. offs[e] (ends_ptr); q is [C, P] and group e's block starts at
    # column pends[e-1], its padding up to pends[e] written as zeros. Else: groups of L rows, q [E, C, L].
    e = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    if PADDED:
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        n = tl.load(ends_ptr + e) - start
        pstart = tl.load(pends_ptr + e - 1, mask=e > 0, other=0)
        n_out = tl.load(pends_ptr + e) - pstart
        base = pstart.to(tl.int64)
        stride = P
    else:
        start = e * L
        n = L
        n_out = L
        base = e.to(tl.int64) * C * L
        stride = L
    rows = tl.arange(0, BLOCK_R)
    amax = tl.full([BLOCK_C], 0.0, tl.float32)
    for i in range(0, n, BLOCK_R):
        src = (start + i + rows).to(tl.int64)
        m = ((i + rows) < n)[:, None] & cm[None, :]
        x = tl.load(x_ptr + src[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.reduce(tl.abs(x), 0, tl.standard._elementwise_max))
    amax = tl.maximum(amax, EPS)
    s = (tl.div_rn(MAX, amax).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    tl.store(d_ptr + e * C + cols, tl.div_rn(1.0, s), mask=cm)
    for i in range(0, n_out, BLOCK_R):
        src = (start + i + rows).to(tl.int64)
        x = tl.load(x_ptr + src[:, None] * C + cols[None, :], mask=((i + rows) < n)[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        q = tl.clamp(x * s[None, :], -MAX, MAX)
        dst = base + cols.to(tl.int64)[None, :] * stride + (i + rows)[:, None]
        tl.store(q_ptr + dst, q.to(q_ptr.dtype.element_ty), mask=((i + rows) < n_out)[:, None] & cm[None, :])


def quantize_rows_triton(x: torch.Tensor, out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher (no autograd): x [R, C] -> (q [R, C], d [R]); ``out_dtype`` float32 for interpreter tests."""
    x = x.contiguous()
    R, C = x.shape
    q = torch.empty(R, C, dtype=out_dtype, device=x.device)
    d = torch.empty(R, dtype=torch.float32, device=x.device)
    if R and C:
        block = min(triton.next_power_of_2(C), ROWS_BLOCK)
        jit(_quantize_rows_kernel)[(R,)](x, q, d, C, MAX=FP8_MAX, EPS=AMAX_EPS, BLOCK=block,
                                         num_warps=8 if block >= ROWS_BLOCK else 4)
    return q, d


def _launch_cols(x, ends, pends, q, d, C, L, P, padded, groups):
    if groups and C:
        grid = (triton.cdiv(C, COLS_BLOCK_C), groups)
        jit(_quantize_cols_kernel)[grid](x, ends, pends, q, d, C, L, P, PADDED=padded, MAX=FP8_MAX, EPS=AMAX_EPS,
                                         BLOCK_R=COLS_BLOCK_R, BLOCK_C=COLS_BLOCK_C, num_warps=4)


def quantize_groups_t_triton(x: torch.Tensor, offs: torch.Tensor, pends: torch.Tensor, num_padded: int,
                             out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: as ``quantize_groups_t_reference`` (columns past ``pends[-1]`` left unwritten)."""
    x, offs, pends = x.contiguous(), offs.contiguous(), pends.contiguous()
    C, E = x.shape[1], offs.numel()
    q = torch.empty(C, num_padded, dtype=out_dtype, device=x.device)
    d = torch.empty(E, C, dtype=torch.float32, device=x.device)
    _launch_cols(x, offs, pends, q, d, C, 0, num_padded, True, E)
    return q, d


def quantize_weight_t_triton(w: torch.Tensor, out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: as ``quantize_weight_t_reference``."""
    w = w.contiguous()
    E, O, I = w.shape
    q = torch.empty(E, I, O, dtype=out_dtype, device=w.device)
    d = torch.empty(E, I, dtype=torch.float32, device=w.device)
    _launch_cols(w, d, d, q, d, I, O, 0, False, E if O else 0)   # ends / pends unused: dummy pointers
    return q, d


# -- custom ops (Triton on CUDA / under TRITON_INTERPRET, else the references) --------------------------
@torch.library.custom_op("moezoo::fp8_quantize_rows", mutates_args=())
def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q [R, C] e4m3, d [R] float32): a scale per row."""
    if use_triton(x):
        return quantize_rows_triton(x)
    return quantize_rows_reference(x)


@fp8_quantize_rows.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("moezoo::fp8_quantize_groups_t", mutates_args=())
def fp8_quantize_groups_t(x: torch.Tensor, offs: torch.Tensor, pends: torch.Tensor,
                          num_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (qt [C, P] e4m3, d [E, C] float32): per expert and column, transposed, groups padded."""
    if use_triton(x):
        return quantize_groups_t_triton(x, offs, pends, num_padded)
    return quantize_groups_t_reference(x, offs, pends, num_padded)


@fp8_quantize_groups_t.register_fake
def _(x, offs, pends, num_padded):
    return (x.new_empty(x.shape[1], num_padded, dtype=FP8),
            x.new_empty(offs.shape[0], x.shape[1], dtype=torch.float32))


@torch.library.custom_op("moezoo::fp8_quantize_weight_t", mutates_args=())
def fp8_quantize_weight_t(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, O, I] -> (qt [E, I, O] e4m3, d [E, I] float32): per input channel, transposed."""
    if use_triton(w):
        return quantize_weight_t_triton(w)
    return quantize_weight_t_reference(w)


@fp8_quantize_weight_t.register_fake
def _(w):
    E, O, I = w.shape
    return w.new_empty(E, I, O, dtype=FP8), w.new_empty(E, I, dtype=torch.float32)


@torch.library.custom_op("moezoo::scaled_grouped_mm_emulated", mutates_args=())
def scaled_grouped_mm_emulated(a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor,
                               offs: torch.Tensor) -> torch.Tensor:
    """``scaled_grouped_mm_reference`` as an op (its host loop over groups stays out of a traced graph)."""
    return scaled_grouped_mm_reference(a, b, da, db, offs)


@scaled_grouped_mm_emulated.register_fake
def _(a, b, da, db, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1], dtype=torch.bfloat16)
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1], dtype=torch.bfloat16)


# -- the three GEMMs ------------------------------------------------------------------------------------
def scaled_grouped_mm(a, b, da, db, offs) -> torch.Tensor:
    """torch._scaled_grouped_mm (bf16 out) on CUDA (and meta / fake tensors); its float32 emulation on CPU."""
    if a.device.type == "cpu":
        return scaled_grouped_mm_emulated(a, b, da, db, offs)
    return torch._scaled_grouped_mm(a, b, da, db, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)


def fp8_forward(xq: torch.Tensor, xd: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x quantized by rows (``fp8_quantize_rows``), w [E, O, I] -> y [R, O] = x w[e]^T."""
    E, O, I = w.shape
    wq, wd = fp8_quantize_rows(w.reshape(E * O, I))
    return scaled_grouped_mm(xq, wq.view(E, O, I).transpose(-2, -1), xd, wd.view(E, O), offs)


def fp8_dgrad(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dy [R, O], w [E, O, I] -> dx [R, I] = dy w[e]."""
    dyq, dyd = fp8_quantize_rows(dy)
    wtq, wtd = fp8_quantize_weight_t(w)
    return scaled_grouped_mm(dyq, wtq.transpose(-2, -1), dyd, wtd, offs)


def fp8_columns(x: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, C] -> the wgrad operand (qt [C, P], d [E, C], pends [E]); saved by the forward instead of x."""
    pends = padded_group_ends(offs)
    qt, d = fp8_quantize_groups_t(x, offs, pends, padded_rows(x.shape[0], offs.numel()))
    return qt, d, pends


def fp8_wgrad(dy: torch.Tensor, offs: torch.Tensor, xt: tuple, dtype: torch.dtype) -> torch.Tensor:
    """dy [R, O], ``xt = fp8_columns(x, offs)`` -> dw [E, O, I] = dy_e^T x_e in ``dtype`` (an expert with no
    rows gets zeros)."""
    xtq, xtd, pends = xt
    dytq, dytd = fp8_quantize_groups_t(dy, offs, pends, xtq.shape[1])
    return scaled_grouped_mm(dytq, xtq.t(), dytd.reshape(-1), xtd.reshape(-1), pends).to(dtype)


class _FP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs):
        x = x.contiguous()
        y = fp8_forward(*fp8_quantize_rows(x), w, offs)
        xt = fp8_columns(x, offs) if ctx.needs_input_grad[1] else (None, None, None)
        ctx.save_for_backward(w, offs, *xt)
        return y

    @staticmethod
    def backward(ctx, dy):
        w, offs, *xt = ctx.saved_tensors
        dy = dy.contiguous()
        dx = fp8_dgrad(dy, w, offs) if ctx.needs_input_grad[0] else None
        dw = fp8_wgrad(dy, offs, xt, w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y [R, O] bf16 = x [R, I] w[e]^T per expert group (w [E, O, I], offs [E] int32 ends); differentiable."""
    return _FP8GroupedLinear.apply(x, w, offs)


def fp8_grouped_linear_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                                 dy: Optional[torch.Tensor] = None):
    """The op's intended math in torch (no autograd), from the reference quantizers and the emulated GEMM:
    y, and with ``dy`` also (dx, dw). The oracle of the CPU tests."""
    xq, xd = quantize_rows_reference(x)
    E = w.shape[0]
    wq, wd = quantize_rows_reference(w)
    y = scaled_grouped_mm_reference(xq, wq.transpose(-2, -1), xd, wd, offs)
    if dy is None:
        return y
    dyq, dyd = quantize_rows_reference(dy)
    wtq, wtd = quantize_weight_t_reference(w)
    dx = scaled_grouped_mm_reference(dyq, wtq.transpose(-2, -1), dyd, wtd, offs)
    pends = padded_group_ends(offs)
    P = padded_rows(x.shape[0], E)
    xtq, xtd = quantize_groups_t_reference(x, offs, pends, P)
    dytq, dytd = quantize_groups_t_reference(dy, offs, pends, P)
    dw = scaled_grouped_mm_reference(dytq, xtq.t(), dytd.reshape(-1), xtd.reshape(-1), pends)
    return y, dx, dw.to(w.dtype)
