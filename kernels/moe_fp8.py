"""FP8 grouped GEMMs for the expert projections (``model.moe.precision: fp8``), forward and
backward.

Legend: R rows of the expert-sorted buffer, I / O a projection's in / out features, E experts (=
groups), P rows of the padded wgrad layout. ``offs [E]`` int32 are cumulative group ends, as
torch._grouped_mm takes them; rows past ``offs[-1]`` are not computed (their output is unspecified,
as in torch._grouped_mm).

``fp8_grouped_linear(x[R, I], w[E, O, I], offs) -> y[R, O]`` bf16, ``y[r] = x[r] w[e]^T`` for the
rows of expert e; differentiable in x and w (w of any float dtype: bf16 or float32 master weights
are read as they are and get a gradient of their own dtype). ``kernels.moe_gate_up`` runs the
gate/up pair with the same pieces (one quantization of x shared by both GEMMs).

Recipe (torchao.prototype.moe_training's FP8 rowwise, which torchtitan trains MoE with): every
operand is cast on the fly, each step, to float8_e4m3fn with a float32 scale per row or column of
the contraction, computed from its amax ("dynamic" scaling, no history), and every GEMM is one
``torch._scaled_grouped_mm`` (CUTLASS, sm90 / sm100) with bf16 output and FP8 fast accumulation:

- forward ``y = x w^T``: mat_a (row-major) x, a scale per row (amax over I); mat_b
  (column-major) w^T, a scale per output channel (over I).
- dgrad ``dx = dy w``: mat_a dy, a scale per row (over O); mat_b w, a scale per input channel
  (over O), stored transposed.
- wgrad ``dw = dy^T x``: mat_a dy^T, a scale per expert and column; mat_b x, a scale per expert
  and column.

The wgrad operands are 2-D with the experts along the contraction: CUTLASS needs each group's start
16-byte aligned there, so ``quantize_groups_t`` writes them column-major with every group padded to
a multiple of 16 rows, zero pad rows (at least 16: an empty expert is a block of zeros, as CUTLASS's
Blackwell grouped kernels reject empty contraction groups). Forward and dgrad group along the rows
of a row-major operand and take any group sizes. So the dispatch needs no ``group_align``, and
expert parallelism's uneven counts run as they are.

Scales are powers of two, ``s = 2^floor(log2(448 / amax))`` (the exponent bits of the correctly
rounded quotient): scaling is exact, amax lands in (224, 448], and the dequantization scale ``1 /
s`` handed to the GEMM is exact too. e4m3 everywhere, gradients included (torchao's choice for this
recipe; e5m2 gradients are the per-tensor recipes' answer to their coarser scales).

Every operand that needs two layouts gets both from one "dual" pass: an activation (x in the
forward, dy in the backward) by rows for its forward / dgrad GEMM and per expert column for its
wgrad GEMM, a weight by output channel for the forward and by input channel for the dgrad (the
forward keeps that copy for the backward). A column scale needs its whole group's column read first,
so a dual pass reads its input twice: an amax kernel takes every row's and every group column's amax
over tiles (atomic max), a cast kernel writes both layouts (and makes the scales from the amax and
writes the dequantization scales itself, so a dual pass is a memset and two launches, with no small
torch ops between them). The cast kernel's tiles walk the rows of the transposed output (the padded
wgrad rows, or one weight's rows), so that store is 16-byte vectors along contiguous, aligned
columns of qt, and the pads are written as zeros in the same pass; the source rows are gathered
(row-major, contiguous along the features either way). Tiling the source rows instead makes the
transposed store one byte per lane, needs a separate kernel to zero the pads and 90 registers a
thread (one block per SM), ~3x the bytes' time (BENCHMARKS.md, Tried and rejected); separate row and
column quantizers read the input three times.

Layers: ``@triton.jit`` kernels (a row quantizer, one row per program; the amax and cast passes) +
launchers -> custom ops ``moezoo::fp8_quantize_rows`` / ``fp8_quantize_groups_t`` /
``fp8_quantize_dual`` / ``fp8_quantize_weight_dual`` (``register_fake``, so torch.compile traces
through) -> the autograd.Function. AMAX_TILE / CAST_TILE: the passes' tiles (``bench/fp8_quant.py``
times others). ``*_reference`` are the pure-torch oracles (and the path without triton);
``scaled_grouped_mm_reference`` emulates torch._scaled_grouped_mm in float32 (CPU tests; the op
itself is CUDA-only).
"""

from __future__ import annotations

from typing import Optional

import torch

from .launch import jit, tl, triton, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_EPS = 1e-12  # an all-zero row or column gets a finite scale (2^48) and quantizes to zeros
WGRAD_ALIGN = 16  # rows per wgrad group: 16 bytes of fp8 (TMA alignment of group starts)
# FP8 tensor-core accumulation without periodic float32 promotion (torchao: all three)
FAST_ACCUM = True
ROWS_BLOCK = 4096  # columns per step of the row quantizer: 8 KB of bf16 in flight per program
# The passes' tiles, (rows, columns, warps): the fastest of bench/fp8_quant.py's 20 pairs over the
# Mixtral layer's five operand kinds (BENCHMARKS.md, FP8 experts); an amax pass on 16 warps is slow.
# Every global store of the cast pass is a 16-byte vector (ptxas for sm_90, as
# tests/kernels/test_compile_sm90.py compiles on the CPU machine).
AMAX_TILE = (128, 64, 8)
CAST_TILE = (32, 128, 4)


# -- pure torch: the math, once --------------------------------------------------------------------
def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 ``2^floor(log2(448 / amax))``: the exponent bits of the correctly rounded
    quotient."""
    s = FP8_MAX / amax.float().clamp(min=AMAX_EPS)
    return (s.view(torch.int32) & 0x7F800000).view(torch.float32)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (q [..., C] float8_e4m3fn contiguous, d [...] float32) with ``x ~= q * d[...,
    None]``: ``q = clamp(x * s, +-448)`` rounded to nearest even, ``d = 1 / s``, one power-of-two s
    per row."""
    xf = x.float()
    amax = xf.abs().amax(-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1])
    s = pow2_scale(amax)
    q = (xf * s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    return q, 1.0 / s


def padded_group_ends(offs: torch.Tensor) -> torch.Tensor:
    """offs [E] int32 group ends -> the ends [E] int32 of the wgrad layout, every group rounded up
    to a multiple of 16 rows and at least 16 (device ops, no host sync)."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = ((sizes + WGRAD_ALIGN - 1) // WGRAD_ALIGN * WGRAD_ALIGN).clamp(min=WGRAD_ALIGN)
    return torch.cumsum(padded, 0, dtype=torch.int32)


def padded_rows(num_rows: int, num_groups: int) -> int:
    """P, static: room for every padded layout of ``num_rows`` rows in ``num_groups`` groups, a
    multiple of 16 (torch._scaled_grouped_mm's contraction dim)."""
    return -(-num_rows // WGRAD_ALIGN) * WGRAD_ALIGN + WGRAD_ALIGN * num_groups


def quantize_groups_t_reference(
    x: torch.Tensor, offs: torch.Tensor, pends: torch.Tensor, num_padded: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C], offs / pends [E] int32 -> (qt [C, P] float8_e4m3fn, d [E, C] float32): expert e's
    rows ``offs[e-1] .. offs[e]`` quantized per column (``quantize_rows_reference`` of their
    transpose) and stored at columns ``pends[e-1] ..`` of qt, the rest of its padded block zero.
    Columns past ``pends[-1]`` are zero here and unspecified in the kernel."""
    C = x.shape[1]
    qt = torch.zeros(C, num_padded, dtype=FP8, device=x.device)
    d = torch.empty(offs.numel(), C, dtype=torch.float32, device=x.device)
    start = pstart = 0
    for e, (end, pend) in enumerate(zip(offs.tolist(), pends.tolist())):
        q, d[e] = quantize_rows_reference(x[start:end].t())
        qt[:, pstart : pstart + end - start] = q
        start, pstart = end, pend
    return qt, d


def quantize_weight_t_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, O, I] -> (qt [E, I, O] float8_e4m3fn contiguous, d [E, I] float32): a scale per input
    channel (amax over O), stored transposed (the dgrad operand)."""
    return quantize_rows_reference(w.transpose(-2, -1))


def quantize_dual_reference(
    x: torch.Tensor, offs: torch.Tensor, pends: torch.Tensor, num_padded: int
):
    """x [R, C] -> (q [R, C], d [R], qt [C, P], dt [E, C]): ``quantize_rows_reference`` and
    ``quantize_groups_t_reference`` of the same x (the forward / dgrad operand and the wgrad
    operand)."""
    return (*quantize_rows_reference(x), *quantize_groups_t_reference(x, offs, pends, num_padded))


def quantize_weight_dual_reference(w: torch.Tensor):
    """w [E, O, I] -> (q [E, O, I], d [E, O], qt [E, I, O], dt [E, I]): the forward operand (a scale
    per output channel) and the dgrad operand (``quantize_weight_t_reference``)."""
    return (*quantize_rows_reference(w), *quantize_weight_t_reference(w))


def scaled_grouped_mm_reference(
    a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """torch._scaled_grouped_mm's rowwise math in float32, bf16 out; the two layouts moezoo uses:

    - a [R, K], b [E, K, N], da [R], db [E, N]: ``out[r] = (a[r] da[r]) (b[e] db[e])`` for the rows
      of group e (rows past ``offs[-1]`` zero);
    - a [M, P], b [P, N], da [E * M], db [E * N]: ``out[e] = (a[:, g_e] da[e]) (b[g_e] db[e])`` over
      the contraction slice g_e of group e -> [E, M, N].
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


# -- Triton quantizers -----------------------------------------------------------------------------
# Builtins only (tl.full, tl.reduce, tl.div_rn), as in kernels/moe_combine.py. Scales use tl.div_rn
# (the default fp32 division is approximate: a quotient that is exactly a power of two could lose
# its exponent) and the exponent mask, so they equal the torch reference bit for bit; the e4m3 cast
# rounds to nearest even after the clamp, as torch's does. Under TRITON_INTERPRET the tests read
# float32 outputs (the interpreter's own fp8 cast is not IEEE) and cast them with torch.


def _quantize_rows_kernel(
    x_ptr, q_ptr, d_ptr, C, MAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr
):
    # grid (R,): a row per program, two passes over it (amax, then scale and cast; the second reads
    # hit L2).
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


def _amax_kernel(
    x_ptr,
    ends_ptr,
    ramax_ptr,
    camax_ptr,
    R,
    C,
    E,
    L,
    ROWS: tl.constexpr,
    PADDED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # Pass 1. grid (cdiv(R, BLOCK_R), cdiv(C, BLOCK_C)) over x [R, C] row-major. Groups: rows
    # ends[e-1] .. ends[e] (PADDED; rows past the last end belong to none) or blocks of L rows. The
    # tile's partial row amax (ROWS) and, per group present in the tile, its columns' partial amax
    # go to float32 buffers (zero-initialised) by atomic max on their int32 bits (amax >= 0 orders
    # like its bits); relaxed: only the next launch reads them (the kernel boundary orders them).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rm, cm = rows < R, cols < C
    a = tl.abs(
        tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :],
            mask=rm[:, None] & cm[None, :],
            other=0.0,
        ).to(tl.float32)
    )
    if ROWS:
        tl.atomic_max(
            ramax_ptr + rows,
            tl.reduce(a, 1, tl.standard._elementwise_max).to(tl.int32, bitcast=True),
            mask=rm,
            sem="relaxed",
        )
    if PADDED:
        es = tl.arange(0, BLOCK_E)
        ends = tl.load(ends_ptr + es, mask=es < E, other=2147483647)
        g = tl.reduce((ends[None, :] <= rows[:, None]).to(tl.int32), 1, tl.standard._sum_combine)
    else:
        g = rows // L
    g = tl.where(rm, g, E)
    g_lo = tl.reduce(g, 0, tl.standard._elementwise_min)
    g_hi = tl.minimum(tl.reduce(tl.where(g < E, g, -1), 0, tl.standard._elementwise_max), E - 1)
    for gg in range(g_lo, g_hi + 1):  # a tile usually lies in one group
        m = tl.reduce(tl.where((g == gg)[:, None], a, 0.0), 0, tl.standard._elementwise_max)
        tl.atomic_max(
            camax_ptr + gg * C + cols, m.to(tl.int32, bitcast=True), mask=cm, sem="relaxed"
        )


def _cast_kernel(
    x_ptr,
    ends_ptr,
    pends_ptr,
    ramax_ptr,
    camax_ptr,
    d_ptr,
    dt_ptr,
    q_ptr,
    qt_ptr,
    R,
    C,
    E,
    L,
    P,
    ROWS: tl.constexpr,
    PADDED: tl.constexpr,
    MAX: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # Pass 2, from pass 1's amax: ramax [R], camax [E, C]. The scales s = 2^floor(log2(MAX / amax))
    # are made here (the exponent bits of tl.div_rn's quotient, as pow2_scale), and the tiles that
    # hold a group's first row (a source row, in the first column tile) write its dequantization
    # scales dt[g, cols] (d[r]) = 1 / s, so a dual pass is two launches after its memset, not a
    # dozen small torch ops. Tiles walk the rows of the transposed output, so its store is BLOCK_R
    # contiguous bytes per column, aligned (16-byte vectors), whatever the group sizes; the source
    # rows are gathered (row-major: contiguous along the columns either way). PADDED: grid (cdiv(P,
    # BLOCK_R), cdiv(C, BLOCK_C)); tile rows p are columns of qt [C, P]. Padded row p
    #   of group g = #{pends <= p} is source row ends[g-1] + p - pends[g-1] if that is < ends[g],
    #   else a pad (written as zero). Past pends[-1], "group E" continues to row R, so the
    #   row-scaled q [R, C] gets every row (its qt columns there are zero: unspecified for the
    #   GEMM).
    # else: grid (E * cdiv(L, BLOCK_R), cdiv(C, BLOCK_C)); tile rows are rows of one group g of L
    # rows, at
    #   qt[g, :, row - g L] (qt [E, C, L]).
    # ROWS: also q[r, c] = x * rs[r].
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    j = tl.arange(0, BLOCK_R)
    if PADDED:
        p = tl.program_id(0) * BLOCK_R + j
        es = tl.arange(0, BLOCK_E)
        pend = tl.load(pends_ptr + es, mask=es < E, other=2147483647)
        g = tl.reduce((pend[None, :] <= p[:, None]).to(tl.int32), 1, tl.standard._sum_combine)
        g_lo = tl.reduce(g, 0, tl.standard._elementwise_min)
        g_hi = tl.reduce(g, 0, tl.standard._elementwise_max)
        pstart = tl.load(pends_ptr + g - 1, mask=g > 0, other=0)
        start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
        src = start + p - pstart
        real = src < tl.load(ends_ptr + g, mask=g < E, other=R)  # a source row (group E: up to R)
        grouped = real & (g < E)  # one of a group's rows
        qt_base = qt_ptr
        dst = cols.to(tl.int64)[None, :] * P + p[:, None]
        dst_m = cm[None, :] & (p < P)[:, None]
        first = (p == pstart) & (g < E)  # the rows that start a group
    else:
        nblk = (L + BLOCK_R - 1) // BLOCK_R
        g_lo = tl.program_id(0) // nblk
        g_hi = g_lo
        g = tl.full([BLOCK_R], 0, tl.int32) + g_lo
        local = (tl.program_id(0) % nblk) * BLOCK_R + j
        real = local < L
        grouped = real
        src = g_lo * L + local
        qt_base = qt_ptr + g_lo.to(tl.int64) * C * L
        dst = cols.to(tl.int64)[None, :] * L + local[:, None]
        dst_m = cm[None, :] & real[:, None]
        first = local == 0
    x = tl.load(
        x_ptr + src.to(tl.int64)[:, None] * C + cols[None, :],
        mask=real[:, None] & cm[None, :],
        other=0.0,
    ).to(tl.float32)
    if ROWS:
        row_a = tl.maximum(tl.load(ramax_ptr + src, mask=real, other=1.0), EPS)
        row_s = (tl.div_rn(MAX, row_a).to(tl.int32, bitcast=True) & 0x7F800000).to(
            tl.float32, bitcast=True
        )
        tl.store(
            q_ptr + src.to(tl.int64)[:, None] * C + cols[None, :],
            tl.clamp(x * row_s[:, None], -MAX, MAX).to(q_ptr.dtype.element_ty),
            mask=real[:, None] & cm[None, :],
        )
        tl.store(d_ptr + src, tl.div_rn(1.0, row_s), mask=real & (j * 0 + tl.program_id(1) == 0))
    if g_lo == g_hi:
        # one group (all but the tiles on a group boundary): one row of scales for the tile; none
        # past the last group (g_lo == E; the bound as a vector: the interpreter refuses a scalar
        # term in a mask)
        in_g = cm & (cols * 0 + g_lo < E)
        col_a = tl.maximum(tl.load(camax_ptr + g_lo * C + cols, mask=in_g, other=1.0), EPS)
        col_s = (tl.div_rn(MAX, col_a).to(tl.int32, bitcast=True) & 0x7F800000).to(
            tl.float32, bitcast=True
        )
        qv = x * tl.where(in_g, col_s, 0.0)[None, :]
    else:
        # (names of their own: Triton wants a name to have one type in both branches)
        tile_m = grouped[:, None] & cm[None, :]
        tile_a = tl.maximum(
            tl.load(
                camax_ptr + g.to(tl.int64)[:, None] * C + cols[None, :], mask=tile_m, other=1.0
            ),
            EPS,
        )
        tile_s = (tl.div_rn(MAX, tile_a).to(tl.int32, bitcast=True) & 0x7F800000).to(
            tl.float32, bitcast=True
        )
        qv = x * tl.where(tile_m, tile_s, 0.0)
    tl.store(qt_base + dst, tl.clamp(qv, -MAX, MAX).to(qt_ptr.dtype.element_ty), mask=dst_m)
    # dt[g, cols] from the tile rows that start a group (every group has one: at least 16 padded
    # rows); only the few tiles holding such a row do the tile's divisions
    if tl.reduce(first.to(tl.int32), 0, tl.standard._elementwise_max) > 0:
        dt_a = tl.maximum(
            tl.load(
                camax_ptr + g.to(tl.int64)[:, None] * C + cols[None, :],
                mask=first[:, None] & cm[None, :],
                other=1.0,
            ),
            EPS,
        )
        dt_s = (tl.div_rn(MAX, dt_a).to(tl.int32, bitcast=True) & 0x7F800000).to(
            tl.float32, bitcast=True
        )
        tl.store(
            dt_ptr + g.to(tl.int64)[:, None] * C + cols[None, :],
            tl.div_rn(1.0, dt_s),
            mask=first[:, None] & cm[None, :],
        )


def quantize_rows_triton(
    x: torch.Tensor, out_dtype: torch.dtype = FP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher (no autograd): x [R, C] -> (q [R, C], d [R]); ``out_dtype`` float32 for interpreter
    tests."""
    x = x.contiguous()
    R, C = x.shape
    q = torch.empty(R, C, dtype=out_dtype, device=x.device)
    d = torch.empty(R, dtype=torch.float32, device=x.device)
    if R and C:
        block = min(triton.next_power_of_2(C), ROWS_BLOCK)
        jit(_quantize_rows_kernel)[(R,)](
            x,
            q,
            d,
            C,
            MAX=FP8_MAX,
            EPS=AMAX_EPS,
            BLOCK=block,
            num_warps=8 if block >= ROWS_BLOCK else 4,
        )
    return q, d


def _quantize_tiles(
    x: torch.Tensor,
    ends: Optional[torch.Tensor],
    pends: Optional[torch.Tensor],
    L: int,
    num_padded: int,
    rows: bool,
    out_dtype: torch.dtype,
    tiles: Optional[tuple] = None,
):
    """x [R, C] -> (q [R, C] | None, d [R] | None, qt, dt [E, C]): the two passes over x (amax, then
    cast) for the row and the per-group column quantization at once. Groups: ``ends`` [E] (PADDED,
    qt [C, P] with zero pads) or, with ``ends`` None, consecutive blocks of L rows (qt [E, C, L]).
    ``tiles``: ((rows, cols, warps) of the amax pass, (rows, cols, warps) of the cast pass),
    AMAX_TILE / CAST_TILE by default (bench/)."""
    (ar, ac, aw), (cr, cc, cw) = tiles or (AMAX_TILE, CAST_TILE)
    R, C = x.shape
    padded = ends is not None
    E = ends.numel() if padded else (R // L if L else 0)
    dev = x.device
    nr = R if rows else 0
    # the column part starts 16-byte aligned (as the kernels' pointers specialise)
    na = -(-nr // 4) * 4
    # one memset for both amax buffers (views of one)
    amax = torch.zeros(max(na + E * C, 1), dtype=torch.float32, device=dev)
    ramax, camax = amax[:nr], amax[na : na + E * C]
    # the scale outputs apart: a custom op's outputs may not alias one another (views of one buffer
    # failed torch's aliasing check on the GPU; the opcheck test of the Triton path checks it on the
    # CPU)
    d, dt = (
        torch.empty(nr, dtype=torch.float32, device=dev),
        torch.empty(E, C, dtype=torch.float32, device=dev),
    )
    q = torch.empty(R, C, dtype=out_dtype, device=dev) if rows else None
    qt = (
        torch.empty(C, num_padded, dtype=out_dtype, device=dev)
        if padded
        else torch.empty(E, C, L, dtype=out_dtype, device=dev)
    )
    ends = ends if padded else amax  # unused pointers when not padded
    pends = pends if padded else amax
    block_e = triton.next_power_of_2(E) if padded else 1
    if R and C and E:
        jit(_amax_kernel)[(triton.cdiv(R, ar), triton.cdiv(C, ac))](
            x,
            ends,
            amax.view(torch.int32),
            camax.view(torch.int32),
            R,
            C,
            E,
            L,
            ROWS=rows,
            PADDED=padded,
            BLOCK_R=ar,
            BLOCK_C=ac,
            BLOCK_E=block_e,
            num_warps=aw,
        )
    if C and E:  # no rows: the pads (every group empty) still zeroed, the scales still written
        grid = (
            triton.cdiv(num_padded, cr) if padded else E * triton.cdiv(L, cr),
            triton.cdiv(C, cc),
        )
        # (d and q are dummy pointers, never written, without ROWS)
        jit(_cast_kernel)[grid](
            x,
            ends,
            pends,
            amax,
            camax,
            d if nr else dt,
            dt,
            q if rows else qt,
            qt,
            R,
            C,
            E,
            L,
            num_padded,
            ROWS=rows,
            PADDED=padded,
            MAX=FP8_MAX,
            EPS=AMAX_EPS,
            BLOCK_R=cr,
            BLOCK_C=cc,
            BLOCK_E=block_e,
            num_warps=cw,
        )
    elif nr:  # no columns: every row is empty, its scale that of a zero amax (nothing to cast)
        d.copy_(1.0 / pow2_scale(ramax))
    return q, (d if rows else None), qt, dt


def quantize_groups_t_triton(
    x: torch.Tensor,
    offs: torch.Tensor,
    pends: torch.Tensor,
    num_padded: int,
    out_dtype: torch.dtype = FP8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: as ``quantize_groups_t_reference`` (columns past ``pends[-1]`` left unwritten)."""
    _, _, qt, dt = _quantize_tiles(
        x.contiguous(), offs.contiguous(), pends.contiguous(), 0, num_padded, False, out_dtype
    )
    return qt, dt


def quantize_dual_triton(
    x: torch.Tensor,
    offs: torch.Tensor,
    pends: torch.Tensor,
    num_padded: int,
    out_dtype: torch.dtype = FP8,
):
    """Launcher: as ``quantize_dual_reference``, x read twice in all (not three times, as the two
    apart)."""
    return _quantize_tiles(
        x.contiguous(), offs.contiguous(), pends.contiguous(), 0, num_padded, True, out_dtype
    )


def quantize_weight_dual_triton(w: torch.Tensor, out_dtype: torch.dtype = FP8):
    """Launcher: as ``quantize_weight_dual_reference``."""
    E, O, I = w.shape
    q, d, qt, dt = _quantize_tiles(w.contiguous().view(E * O, I), None, None, O, 0, True, out_dtype)
    return q.view(E, O, I), d.view(E, O), qt.view(E, I, O), dt


# -- custom ops (Triton on CUDA / under TRITON_INTERPRET, else the references) ---------------------
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
def fp8_quantize_groups_t(
    x: torch.Tensor, offs: torch.Tensor, pends: torch.Tensor, num_padded: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (qt [C, P] e4m3, d [E, C] float32): per expert and column, transposed, groups
    padded."""
    if use_triton(x):
        return quantize_groups_t_triton(x, offs, pends, num_padded)
    return quantize_groups_t_reference(x, offs, pends, num_padded)


@fp8_quantize_groups_t.register_fake
def _(x, offs, pends, num_padded):
    return (
        x.new_empty(x.shape[1], num_padded, dtype=FP8),
        x.new_empty(offs.shape[0], x.shape[1], dtype=torch.float32),
    )


@torch.library.custom_op("moezoo::fp8_quantize_dual", mutates_args=())
def fp8_quantize_dual(
    x: torch.Tensor, offs: torch.Tensor, pends: torch.Tensor, num_padded: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, C] -> ``fp8_quantize_rows(x)`` and ``fp8_quantize_groups_t(x, ...)`` from two reads of
    x."""
    if use_triton(x):
        return quantize_dual_triton(x, offs, pends, num_padded)
    return quantize_dual_reference(x, offs, pends, num_padded)


@fp8_quantize_dual.register_fake
def _(x, offs, pends, num_padded):
    return (
        x.new_empty(x.shape, dtype=FP8),
        x.new_empty(x.shape[0], dtype=torch.float32),
        x.new_empty(x.shape[1], num_padded, dtype=FP8),
        x.new_empty(offs.shape[0], x.shape[1], dtype=torch.float32),
    )


@torch.library.custom_op("moezoo::fp8_quantize_weight_dual", mutates_args=())
def fp8_quantize_weight_dual(
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, O, I] -> (q [E, O, I], d [E, O], qt [E, I, O], dt [E, I]): forward and dgrad operands
    at once."""
    if use_triton(w):
        return quantize_weight_dual_triton(w)
    return quantize_weight_dual_reference(w)


@fp8_quantize_weight_dual.register_fake
def _(w):
    E, O, I = w.shape
    return (
        w.new_empty(E, O, I, dtype=FP8),
        w.new_empty(E, O, dtype=torch.float32),
        w.new_empty(E, I, O, dtype=FP8),
        w.new_empty(E, I, dtype=torch.float32),
    )


@torch.library.custom_op("moezoo::scaled_grouped_mm_emulated", mutates_args=())
def scaled_grouped_mm_emulated(
    a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``scaled_grouped_mm_reference`` as an op (its host loop over groups stays out of a traced
    graph)."""
    return scaled_grouped_mm_reference(a, b, da, db, offs)


@scaled_grouped_mm_emulated.register_fake
def _(a, b, da, db, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1], dtype=torch.bfloat16)
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1], dtype=torch.bfloat16)


# -- the three GEMMs -------------------------------------------------------------------------------
def scaled_grouped_mm(a, b, da, db, offs) -> torch.Tensor:
    """torch._scaled_grouped_mm (bf16 out) on CUDA (and meta / fake tensors); its float32 emulation
    on CPU."""
    if a.device.type == "cpu":
        return scaled_grouped_mm_emulated(a, b, da, db, offs)
    return torch._scaled_grouped_mm(
        a, b, da, db, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM
    )


def fp8_weight(w: torch.Tensor, dgrad: bool = True):
    """w [E, O, I] -> (wq, wd, wtq | None, wtd | None): the forward operand and, with ``dgrad``, the
    dgrad operand from the same two reads of w. The forward keeps the dgrad operand for the backward
    (1 byte a weight, less than the bf16 copy autocast keeps on the bf16 path) instead of reading w
    twice more there."""
    if dgrad:
        return fp8_quantize_weight_dual(w)
    E, O, I = w.shape
    wq, wd = fp8_quantize_rows(w.reshape(E * O, I))
    return wq.view(E, O, I), wd.view(E, O), None, None


def fp8_operands(
    x: torch.Tensor,
    offs: torch.Tensor,
    rows: bool,
    cols: bool,
    pends: Optional[torch.Tensor] = None,
) -> tuple:
    """x [R, C] -> (xq, xd, (qt, dt, pends)): the row-scaled operand (forward or dgrad) if ``rows``,
    the per-expert column-scaled wgrad operand if ``cols`` (each None when not asked for); both from
    one ``fp8_quantize_dual`` when both are. ``pends``: the padded group ends, when already computed
    for offs."""
    x = x.contiguous()
    if not cols:
        return (
            (*fp8_quantize_rows(x), (None, None, None))
            if rows
            else (None, None, (None, None, None))
        )
    pends = padded_group_ends(offs) if pends is None else pends
    P = padded_rows(x.shape[0], offs.numel())
    if rows:
        xq, xd, qt, dt = fp8_quantize_dual(x, offs, pends, P)
        return xq, xd, (qt, dt, pends)
    return None, None, (*fp8_quantize_groups_t(x, offs, pends, P), pends)


def fp8_forward(xq, xd, wq, wd, offs) -> torch.Tensor:
    """x quantized by rows, w by output channel (``fp8_weight``) -> y [R, O] = x w[e]^T."""
    return scaled_grouped_mm(xq, wq.transpose(-2, -1), xd, wd, offs)


def fp8_dgrad(dyq, dyd, wtq, wtd, offs) -> torch.Tensor:
    """dy quantized by rows, w's dgrad operand (``fp8_weight``) -> dx [R, I] = dy w[e]."""
    return scaled_grouped_mm(dyq, wtq.transpose(-2, -1), dyd, wtd, offs)


def fp8_wgrad(dyt: tuple, xt: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The column-scaled operands of dy [R, O] and x [R, I] (``fp8_operands(..., cols=True)``, same
    pends) -> dw [E, O, I] = dy_e^T x_e in ``dtype`` (an expert with no rows gets zeros)."""
    (dytq, dytd, pends), (xtq, xtd, _) = dyt, xt
    return scaled_grouped_mm(dytq, xtq.t(), dytd.reshape(-1), xtd.reshape(-1), pends).to(dtype)


class _FP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xq, xd, xt = fp8_operands(x, offs, rows=True, cols=need_w)
        wq, wd, wtq, wtd = fp8_weight(w, dgrad=need_x)
        ctx.save_for_backward(offs, wtq, wtd, *xt)
        ctx.wdtype = w.dtype
        return fp8_forward(xq, xd, wq, wd, offs)

    @staticmethod
    def backward(ctx, dy):
        offs, wtq, wtd, *xt = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dyq, dyd, dyt = fp8_operands(dy, offs, rows=need_x, cols=need_w, pends=xt[2])
        dx = fp8_dgrad(dyq, dyd, wtq, wtd, offs) if need_x else None
        dw = fp8_wgrad(dyt, xt, ctx.wdtype) if need_w else None
        return dx, dw, None


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y [R, O] bf16 = x [R, I] w[e]^T per expert group (w [E, O, I], offs [E] int32 ends);
    differentiable."""
    return _FP8GroupedLinear.apply(x, w, offs)


def fp8_grouped_linear_reference(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dy: Optional[torch.Tensor] = None
):
    """The op's intended math in torch (no autograd), from the reference quantizers and the emulated
    GEMM: y, and with ``dy`` also (dx, dw). The oracle of the CPU tests."""
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
