"""A Triton grouped GEMM over expert-sorted rows, with the token gather fused into the row loads and
a two-accumulator SwiGLU epilogue: the fused-kernel contender of bench/moe_gemm.py (issue 3's "fuse
the permute/gather into the GEMM inputs, pick grouped-GEMM tiles for small experts").

Not a product path: it runs at or below torch._grouped_mm's CUTLASS kernels (BENCHMARKS.md, Tried
and rejected), so layers.GroupedExperts keeps torch._grouped_mm. It stays here
so that the measurement can be repeated.

Rows of group e are ``ends[e-1] .. ends[e]`` (``ends`` [E] int32: torch._grouped_mm's ``offs``).
- ``grouped_mm(a[M, k], b, ends, src=None, b_kmajor=True) -> c[M, n]``: ``c[r] = a_r @ b[e]^T`` for
  b [E, n, k] (``b_kmajor``, the layout of w1/w3/w2 in the forward) or ``a_r @ b[e]`` for b [E, k,
  n] (the input gradients); ``a_r = a[src[r]]`` with ``src`` [M] int32 (gathered rows, no permuted
  copy of a), else ``a[r]``.
- ``grouped_swiglu(a, b1, b3, ends, src=None, scale=None) -> (g, u, h)`` [M, n]: both projections
  from one pass over the A tiles, ``h = silu(g) * u * scale[r]`` in the epilogue.
- ``grouped_mm_t(a[M, p], b[M, q], ends, src_b=None) -> w[E, p, q]``: ``w[e] = a[rows_e]^T
  b[rows_e]`` (weight gradients; ``src_b`` gathers b's rows). Rows past ``ends[-1]`` are not
  written. k must be a multiple of 64 (BK) on the row kernels.

Tiles: one program per (BM-row tile of a group, BN-column tile), the groups' row tiles laid end to
end; each program finds its group from the per-group tile counts it computes itself (no host sync,
no tile table), so the grid is the static bound ``cdiv(M, BM) + E`` row tiles. ``config`` (a dict of
the meta parameters) launches one configuration (tests, interpreter); without it ``triton.autotune``
picks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


# -- references ------------------------------------------------------------------------------------
def grouped_mm_reference(a, b, ends, src=None, b_kmajor=True):
    rows = a if src is None else a[src.long()]
    out = rows.new_zeros(rows.shape[0], b.shape[1] if b_kmajor else b.shape[2])
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = rows[start:end] @ (b[e].t() if b_kmajor else b[e])
        start = end
    return out


def grouped_swiglu_reference(a, b1, b3, ends, src=None, scale=None):
    g, u = grouped_mm_reference(a, b1, ends, src), grouped_mm_reference(a, b3, ends, src)
    h = F.silu(g.float()) * u.float()
    if scale is not None:
        h = h * scale.float().unsqueeze(-1)
    return g, u, h.to(g.dtype)


def grouped_mm_t_reference(a, b, ends, src_b=None):
    b = b if src_b is None else b[src_b.long()]
    out = a.new_zeros(ends.numel(), a.shape[1], b.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[e] = a[start:end].t() @ b[start:end]
        start = end
    return out


# -- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


# The kernels use only language builtins and helpers of this module, not triton.language.standard's
# jitted helpers (cumsum, sum, cdiv, zeros): under TRITON_INTERPRET=1 those are callable from an
# interpreted kernel only if Triton itself was first imported in interpreter mode, which a test run
# does not guarantee.
@triton.jit
def _tile(
    ends_ptr, E, n, BM: tl.constexpr, BN: tl.constexpr, E_PAD: tl.constexpr, GROUP_M: tl.constexpr
):
    """(valid, e, first row, group end, column tile) of this program."""
    pid = tl.program_id(0)
    ei = tl.arange(0, E_PAD)
    ends = tl.load(ends_ptr + ei, mask=ei < E, other=0).to(tl.int32)
    prev = tl.load(ends_ptr + ei - 1, mask=(ei > 0) & (ei < E), other=0).to(tl.int32)
    counts = tl.where(ei < E, ends - prev, 0)
    tiles = _cdiv(counts, BM)
    cum = tl.associative_scan(tiles, 0, _add)
    total_m = tl.reduce(tiles, 0, _add)
    num_n = _cdiv(n, BN)
    valid = pid < total_m * num_n
    # L2 swizzle: GROUP_M row tiles share each column tile of b[e] before moving on
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = tl.maximum(tl.minimum(total_m - first_m, GROUP_M), 1)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    e = tl.reduce((cum <= pid_m).to(tl.int32), 0, _add)  # first group whose tiles end past pid_m
    sel = ei == e
    tile0 = tl.reduce(tl.where(sel, cum - tiles, 0), 0, _add)
    start = tl.reduce(tl.where(sel, prev, 0), 0, _add)
    end = tl.reduce(tl.where(sel, ends, 0), 0, _add)
    return valid, e, start + (pid_m - tile0) * BM, end, pid_n


@triton.jit
def _span(start, size, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Indices start .. start + BLOCK of a dim of ``size``: clamped into range (the extra lanes are
    masked at the store), or, when ``EVEN`` (size % BLOCK == 0), left unclamped with the contiguity
    hint the compiler needs for vector loads (a clamp hides it: 30 TFLOP/s instead of 600 on the
    H200)."""
    idx = start + tl.arange(0, BLOCK)
    if EVEN:
        idx = tl.max_contiguous(tl.multiple_of(idx, BLOCK), BLOCK)
    else:
        idx = tl.minimum(idx, size - 1)
    return idx


@triton.jit
def _load_b(
    b_ptr,
    desc,
    e,
    ki,
    pid_n,
    n,
    k,
    B_KMAJOR: tl.constexpr,
    TMA: tl.constexpr,
    EVEN_N: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """The [BK, BN] tile (ki, pid_n) of b[e] (as the GEMM's right operand)."""
    if TMA:
        if B_KMAJOR:
            t = desc.load([e * n + pid_n * BN, ki * BK]).T
        else:
            t = desc.load([e * k + ki * BK, pid_n * BN])
    else:
        cols = _span(pid_n * BN, n, BN, EVEN_N)
        kk = ki * BK + tl.arange(0, BK)
        base = b_ptr + e.to(tl.int64) * n * k
        if B_KMAJOR:
            t = tl.load(base + cols[None, :].to(tl.int64) * k + kk[:, None])
        else:
            t = tl.load(base + kk[:, None].to(tl.int64) * n + cols[None, :])
    return t


@triton.jit
def _gmm_kernel(
    a_ptr,
    src_ptr,
    b_ptr,
    b2_ptr,
    c_ptr,
    c2_ptr,
    h_ptr,
    scale_ptr,
    ends_ptr,
    M,
    E,
    n,
    k,
    GATHER: tl.constexpr,
    DUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    EVEN_N: tl.constexpr,
    TMA: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    E_PAD: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    valid, e, row0, end, pid_n = _tile(ends_ptr, E, n, BM, BN, E_PAD, GROUP_M)
    if valid:
        rows = row0 + tl.arange(0, BM)
        rows_c = tl.minimum(rows, end - 1)  # clamped, not masked: unmasked loads pipeline better
        if GATHER:
            src = tl.load(src_ptr + rows_c).to(tl.int64)
        else:
            src = rows_c.to(tl.int64)
        a_ptrs = a_ptr + src[:, None] * k + tl.arange(0, BK)[None, :]
        # TMA descriptors for the dense operands (Hopper has no TMA gather: gathered rows use
        # pointers)
        b_desc = None
        b2_desc = None
        a_desc = None
        if TMA:
            if B_KMAJOR:
                b_desc = tl.make_tensor_descriptor(
                    b_ptr, shape=[E * n, k], strides=[k, 1], block_shape=[BN, BK]
                )
                if DUAL:
                    b2_desc = tl.make_tensor_descriptor(
                        b2_ptr, shape=[E * n, k], strides=[k, 1], block_shape=[BN, BK]
                    )
            else:
                b_desc = tl.make_tensor_descriptor(
                    b_ptr, shape=[E * k, n], strides=[n, 1], block_shape=[BK, BN]
                )
            if not GATHER:
                a_desc = tl.make_tensor_descriptor(
                    a_ptr, shape=[M, k], strides=[k, 1], block_shape=[BM, BK]
                )
        acc = tl.full((BM, BN), 0.0, tl.float32)
        if DUAL:
            acc2 = tl.full((BM, BN), 0.0, tl.float32)
        for ki in range(0, _cdiv(k, BK)):
            if TMA and not GATHER:
                x = a_desc.load([row0, ki * BK])
            else:
                x = tl.load(a_ptrs)
                a_ptrs += BK
            acc = tl.dot(
                x, _load_b(b_ptr, b_desc, e, ki, pid_n, n, k, B_KMAJOR, TMA, EVEN_N, BN, BK), acc
            )
            if DUAL:
                acc2 = tl.dot(
                    x,
                    _load_b(b2_ptr, b2_desc, e, ki, pid_n, n, k, B_KMAJOR, TMA, EVEN_N, BN, BK),
                    acc2,
                )
        cols = pid_n * BN + tl.arange(0, BN)
        m = (rows < end)[:, None] & (cols < n)[None, :]
        c_off = rows.to(tl.int64)[:, None] * n + cols[None, :]
        tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=m)
        if DUAL:
            tl.store(c2_ptr + c_off, acc2.to(c2_ptr.dtype.element_ty), mask=m)
            h = acc / (1.0 + tl.exp(-acc)) * acc2
            if HAS_SCALE:
                h = h * tl.load(scale_ptr + rows_c)[:, None]
            tl.store(h_ptr + c_off, h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gmm_t_kernel(
    a_ptr,
    b_ptr,
    src_ptr,
    w_ptr,
    ends_ptr,
    E,
    p,
    q,
    GATHER: tl.constexpr,
    EVEN_P: tl.constexpr,
    EVEN_Q: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grid (E * cdiv(p, BM) * cdiv(q, BN)): tile (pid_m, pid_n) of w[e], summed over the group's
    # rows
    pid = tl.program_id(0)
    num_m, num_n = _cdiv(p, BM), _cdiv(q, BN)
    per_e = num_m * num_n
    e = pid // per_e
    t = pid % per_e
    width = GROUP_M * num_n
    first_m = (t // width) * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % width) % gsz
    pid_n = (t % width) // gsz
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    ii = _span(pid_m * BM, p, BM, EVEN_P)
    jj = _span(pid_n * BN, q, BN, EVEN_Q)
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for r0 in range(start, end, BK):
        rr = r0 + tl.arange(0, BK)
        rm = rr < end
        at = tl.load(
            a_ptr + rr[:, None].to(tl.int64) * p + ii[None, :], mask=rm[:, None], other=0.0
        )
        if GATHER:
            srow = tl.load(src_ptr + rr, mask=rm, other=0).to(tl.int64)
        else:
            srow = rr.to(tl.int64)
        bt = tl.load(b_ptr + srow[:, None] * q + jj[None, :], mask=rm[:, None], other=0.0)
        acc = tl.dot(at.T, bt, acc)
    ii = pid_m * BM + tl.arange(0, BM)
    jj = pid_n * BN + tl.arange(0, BN)
    m = (ii < p)[:, None] & (jj < q)[None, :]
    tl.store(
        w_ptr + e.to(tl.int64) * p * q + ii[:, None].to(tl.int64) * q + jj[None, :],
        acc.to(w_ptr.dtype.element_ty),
        mask=m,
    )


# -- launchers -------------------------------------------------------------------------------------
def _row_configs(dual: bool):
    out = []
    for bm, bn, warps, stages in (
        (128, 128, 8, 4),
        (128, 128, 8, 3),
        (128, 256, 8, 3),
        (128, 128, 4, 4),
        (64, 256, 4, 4),
        (256, 128, 8, 3),
        (128, 64, 4, 4),
    ):
        if dual and bn > 128:  # two [BM, BN] fp32 accumulators must fit the registers
            continue
        for tma in (False, True):
            out.append(
                triton.Config(
                    {"BM": bm, "BN": bn, "BK": 64, "GROUP_M": 8, "TMA": tma},
                    num_warps=warps,
                    num_stages=stages,
                )
            )
    return out


def _t_configs():
    return [
        triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in (
            (128, 128, 64, 8, 3),
            (128, 256, 64, 8, 3),
            (128, 128, 64, 4, 4),
            (128, 128, 32, 4, 4),
            (256, 128, 64, 8, 3),
            (128, 256, 32, 8, 4),
        )
    ]


_tuned = {}


def _autotuned(name: str):
    if name not in _tuned:
        if name == "t":
            _tuned[name] = triton.autotune(_t_configs(), key=["p", "q", "E", "GATHER"])(
                _gmm_t_kernel
            )
        else:
            _tuned[name] = triton.autotune(
                _row_configs(name == "dual"), key=["n", "k", "E", "GATHER", "HAS_SCALE", "B_KMAJOR"]
            )(_gmm_kernel)
    return _tuned[name]


def _scratch(size: int, alignment: int, stream):
    """Global scratch for device-side TMA descriptors (triton.set_allocator)."""
    return torch.empty(
        size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu"
    )


def _rows(a, b, b2, ends, src, scale, b_kmajor, config):
    triton.set_allocator(_scratch)
    E = b.shape[0]
    n, k = (b.shape[1], b.shape[2]) if b_kmajor else (b.shape[2], b.shape[1])
    if (
        a.shape[1] != k
        or k % 64
        or not b.is_contiguous()
        or (b2 is not None and not b2.is_contiguous())
    ):
        raise ValueError(
            f"grouped_mm: a {tuple(a.shape)}, b {tuple(b.shape)}: need a contiguous b and "
            "k a multiple of 64"
        )
    num_rows = a.shape[0] if src is None else src.shape[0]
    dual = b2 is not None
    c = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    c2 = torch.empty_like(c) if dual else c
    h = torch.empty_like(c) if dual else c
    kw = dict(
        GATHER=src is not None,
        DUAL=dual,
        HAS_SCALE=scale is not None,
        B_KMAJOR=b_kmajor,
        E_PAD=triton.next_power_of_2(E),
    )
    if config is None:
        kernel, kw["EVEN_N"] = _autotuned("dual" if dual else "one"), n % 256 == 0
    else:
        kernel, kw = _gmm_kernel, {**kw, **config, "EVEN_N": n % config["BN"] == 0}
    grid = lambda meta: ((triton.cdiv(num_rows, meta["BM"]) + E) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
    kernel[grid](
        a,
        src if src is not None else ends,
        b,
        b2 if dual else b,
        c,
        c2,
        h,
        scale if scale is not None else ends,
        ends,
        a.shape[0],
        E,
        n,
        k,
        **kw,
    )
    return (c, c2, h) if dual else c


def grouped_mm(
    a,
    b,
    ends,
    src: Optional[torch.Tensor] = None,
    b_kmajor: bool = True,
    config: Optional[dict] = None,
) -> torch.Tensor:
    return _rows(a, b, None, ends, src, None, b_kmajor, config)


def grouped_swiglu(a, b1, b3, ends, src=None, scale=None, config: Optional[dict] = None):
    return _rows(a, b1, b3, ends, src, scale, True, config)


def grouped_mm_t(a, b, ends, src_b=None, config: Optional[dict] = None) -> torch.Tensor:
    E, p, q = ends.numel(), a.shape[1], b.shape[1]
    w = torch.empty(E, p, q, dtype=a.dtype, device=a.device)
    kw = dict(GATHER=src_b is not None)
    if config is None:
        kernel, kw["EVEN_P"], kw["EVEN_Q"] = _autotuned("t"), p % 256 == 0, q % 256 == 0
    else:
        kernel, kw = (
            _gmm_t_kernel,
            {**kw, **config, "EVEN_P": p % config["BM"] == 0, "EVEN_Q": q % config["BN"] == 0},
        )
    grid = lambda meta: (E * triton.cdiv(p, meta["BM"]) * triton.cdiv(q, meta["BN"]),)  # noqa: E731
    kernel[grid](a, b, src_b if src_b is not None else ends, w, ends, E, p, q, **kw)
    return w
