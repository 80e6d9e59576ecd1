"""FP8 expert GEMMs (kernels.moe_fp8) on CPU: the rowwise e4m3 quantizers round-trip within e4m3
error, the Triton quantizers (TRITON_INTERPRET) equal the torch references bit for bit, the float32
emulation of torch._scaled_grouped_mm is the per-group product of the dequantized operands, the
autograd op computes the recipe's forward, dgrad and wgrad (any group sizes, empty experts, rows
past the last group), and its arguments pass torch._scaled_grouped_mm's own shape / stride / scale
checks (meta tensors)."""

import pytest
import torch

from helpers import needs_interpreter_loops
from moezoo.kernels import moe_fp8 as f
from moezoo.kernels.moe_fp8 import (
    FP8,
    FP8_MAX,
    fp8_grouped_linear,
    fp8_grouped_linear_reference,
    padded_group_ends,
    padded_rows,
    quantize_groups_t_reference,
    quantize_rows_reference,
    quantize_weight_t_reference,
    scaled_grouped_mm_reference,
)

E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa, relative, for normal e4m3 values
E4M3_SUBNORMAL_STEP = 2.0**-9
OFFS = [7, 7, 40, 41, 100]  # uneven groups, one empty expert, rows 100.. past the last group


def rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def within_e4m3(q, d, x) -> bool:
    """``q * d`` (d broadcast to q's shape) is x up to e4m3 rounding: half an ulp of a normal value,
    half the subnormal step (times d) near zero."""
    err, xf = (q.float() * d - x.float()).abs(), x.float().abs()
    return bool((err <= torch.maximum(E4M3_REL * xf, 0.5 * E4M3_SUBNORMAL_STEP * d)).all())


def wide_rows(R=24, C=50, seed=0):
    """bf16 rows spanning 12 decades, one all-zero row, one whose amax is 3.5 (448 / 3.5 a power of
    two)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, C, generator=g) * torch.logspace(-6, 6, R)[:, None]
    x[3] = 0
    x[5] = x[5].clamp(-3.5, 3.5)
    x[5, 0] = 3.5
    return x.bfloat16()


def test_rowwise_e4m3_round_trip_is_within_e4m3_rounding_and_scales_are_powers_of_two():
    x = wide_rows()
    q, d = quantize_rows_reference(x)
    assert q.dtype == FP8 and d.dtype == torch.float32 and q.is_contiguous()
    assert torch.equal(d, torch.exp2(torch.log2(d).round())), (
        "dequantization scales are powers of two"
    )
    amax = x.float().abs().amax(-1)
    used = amax[amax > 0] / d[amax > 0]  # each row's amax in e4m3 units: (224, 448]
    assert bool((used > FP8_MAX / 2).all() and (used <= FP8_MAX).all())
    assert float(amax[5] / d[5]) == FP8_MAX  # 448 / 3.5 = 128 exactly: no lost power of two
    assert within_e4m3(q, d[:, None], x)
    assert torch.count_nonzero(q[3].float()) == 0 and torch.isfinite(d[3])


def test_column_and_weight_quantizers_store_each_groups_transpose_with_zero_padding():
    x = wide_rows(110, 48)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    pends = padded_group_ends(offs)
    psizes = torch.diff(pends, prepend=pends.new_zeros(1))
    # sizes 7, 0, 33, 1, 59: each rounded up to a multiple of 16 rows, at least 16 (an empty expert
    # too)
    assert torch.equal(psizes, torch.tensor([16, 16, 48, 16, 64], dtype=torch.int32))
    P = padded_rows(110, len(OFFS))
    assert P % 16 == 0 and P >= int(pends[-1])
    qt, d = quantize_groups_t_reference(x, offs, pends, P)
    assert qt.shape == (48, P) and d.shape == (len(OFFS), 48)
    start = pstart = 0
    for e, (end, pend) in enumerate(zip(OFFS, pends.tolist())):
        block = qt[:, pstart:pend].float()
        n = end - start
        if n:
            assert within_e4m3(block[:, :n], d[e][:, None], x[start:end].t()), e
        assert torch.count_nonzero(block[:, n:]) == 0, "pad rows are zero"
        start, pstart = end, pend
    w = torch.randn(3, 40, 32)
    wt, wd = quantize_weight_t_reference(w)
    assert wt.shape == (3, 32, 40) and wt.is_contiguous() and wd.shape == (3, 32)
    assert within_e4m3(wt, wd[..., None], w.transpose(-2, -1))


@needs_interpreter_loops
@pytest.mark.usefixtures("triton_interpreter")
def test_triton_quantizers_equal_the_reference_bit_for_bit(monkeypatch):
    # Small blocks, so every loop of the kernels runs several steps; float32 outputs cast by torch
    # (the interpreter's own fp8 cast is not IEEE round-to-nearest-even).
    monkeypatch.setattr(f, "ROWS_BLOCK", 16)
    monkeypatch.setattr(f, "AMAX_TILE", (16, 16, 4))
    monkeypatch.setattr(f, "CAST_TILE", (16, 16, 4))

    def bits(q):
        return q.to(FP8).view(torch.uint8)

    x = wide_rows(24, 50)
    q, d = f.quantize_rows_triton(x, torch.float32)
    qr, dr = quantize_rows_reference(x)
    assert torch.equal(bits(q), qr.view(torch.uint8)) and torch.equal(d, dr)

    y = wide_rows(110, 37, seed=1)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    pends = padded_group_ends(offs)
    P = padded_rows(110, len(OFFS))
    qt, dt = f.quantize_groups_t_triton(y, offs, pends, P, torch.float32)
    qtr, dtr = quantize_groups_t_reference(y, offs, pends, P)
    n = int(pends[-1])  # columns past the last padded group are unwritten
    assert torch.equal(bits(qt[:, :n]), qtr[:, :n].view(torch.uint8)) and torch.equal(dt, dtr)

    # the dual pass: both layouts from the same two reads; tiles of 16 rows cross group boundaries
    # (groups of 7, 0, 33, 1 and 59 rows) and the last tile holds rows past the last group
    got = f.quantize_dual_triton(y, offs, pends, P, torch.float32)
    want = f.quantize_dual_reference(y, offs, pends, P)
    assert torch.equal(bits(got[0]), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert torch.equal(bits(got[2][:, :n]), want[2][:, :n].view(torch.uint8)) and torch.equal(
        got[3], want[3]
    )

    w = torch.randn(3, 40, 33)
    got = f.quantize_weight_dual_triton(w, torch.float32)
    qwr, dwr = quantize_weight_t_reference(w)  # the dgrad operand: per input channel, transposed
    assert torch.equal(bits(got[2]), qwr.view(torch.uint8)) and torch.equal(got[3], dwr)
    want = f.quantize_weight_dual_reference(w)
    assert [t.shape for t in got] == [t.shape for t in want]
    for g_, w_ in zip(got, want):
        assert (
            torch.equal(bits(g_), w_.view(torch.uint8)) if w_.dtype == FP8 else torch.equal(g_, w_)
        )


@pytest.mark.parametrize("triton_path", [False, pytest.param(True, marks=needs_interpreter_loops)])
def test_quantize_ops_pass_opcheck(triton_path, request):
    # Both implementations behind each op: the torch reference, and the Triton launchers
    # (interpreted), where opcheck's schema test catches outputs that are views of one buffer
    # (refused on the GPU).
    if triton_path:
        request.getfixturevalue("triton_interpreter")
    x = wide_rows(20, 32)
    offs = torch.tensor([5, 5, 18], dtype=torch.int32)
    torch.library.opcheck(f.fp8_quantize_rows, (x,))
    torch.library.opcheck(
        f.fp8_quantize_groups_t, (x, offs, padded_group_ends(offs), padded_rows(20, 3))
    )
    torch.library.opcheck(
        f.fp8_quantize_dual, (x, offs, padded_group_ends(offs), padded_rows(20, 3))
    )
    torch.library.opcheck(f.fp8_quantize_weight_dual, (torch.randn(2, 16, 32),))


def test_emulated_scaled_grouped_mm_equals_float32_products_of_the_dequantized_operands():
    # The oracle is written another way: every row against its own group's weights (a gather) for
    # the row-grouped layout, a masked full product for the contraction-grouped one.
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    R, K, N, E = 110, 32, 48, len(OFFS)
    aq, da = quantize_rows_reference(torch.randn(R, K, generator=g))
    bq, db = quantize_rows_reference(torch.randn(E, N, K, generator=g))  # [E, N, K], scales per n
    got = scaled_grouped_mm_reference(aq, bq.transpose(-2, -1), da, db, offs)
    group = torch.bucketize(torch.arange(R), offs, right=True)  # E for rows past the end
    rows = group < E
    A = aq.float() * da[:, None]
    B = bq.float() * db[..., None]  # [E, N, K]
    want = torch.einsum("rk,rnk->rn", A[rows], B[group[rows]])
    torch.testing.assert_close(got[rows].float(), want.bfloat16().float(), rtol=2**-7, atol=1e-6)
    assert torch.count_nonzero(got[~rows]) == 0

    pends = padded_group_ends(offs)
    P = padded_rows(R, E)
    M = 24
    at, dat = quantize_groups_t_reference(torch.randn(R, M, generator=g), offs, pends, P)  # [M, P]
    bt, dbt = quantize_groups_t_reference(torch.randn(R, N, generator=g), offs, pends, P)  # [N, P]
    got = scaled_grouped_mm_reference(at, bt.t(), dat.reshape(-1), dbt.reshape(-1), pends)
    cols = torch.bucketize(torch.arange(P), pends, right=True)
    for e in range(E):
        mask = (cols == e).float()
        want = (at.float() * dat[e][:, None] * mask) @ (bt.float() * dbt[e][:, None]).t()
        torch.testing.assert_close(got[e].float(), want.bfloat16().float(), rtol=2**-7, atol=1e-6)


def exact_grouped_linear(x, w, offs, dy):
    """float32 per-expert products: y, dx, dw (rows past the last group: zero)."""
    x, w, dy = x.float(), w.float(), dy.float()
    y, dx, dw = torch.zeros(x.shape[0], w.shape[1]), torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        y[start:end] = x[start:end] @ w[e].t()
        dx[start:end] = dy[start:end] @ w[e]
        dw[e] = dy[start:end].t() @ x[start:end]
        start = end
    return y, dx, dw


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_fp8_grouped_linear_computes_the_recipe_forward_dgrad_and_wgrad(wdtype):
    torch.manual_seed(0)
    R, I, O = 110, 32, 48
    offs = torch.tensor(OFFS, dtype=torch.int32)
    x = torch.randn(R, I).bfloat16().requires_grad_()
    w = (torch.randn(len(OFFS), O, I) * 0.1).to(wdtype).requires_grad_()
    dy = torch.randn(R, O).bfloat16()
    y = fp8_grouped_linear(x, w, offs)
    y.backward(dy)
    n = OFFS[-1]
    yr, dxr, dwr = fp8_grouped_linear_reference(x.detach(), w.detach(), offs, dy)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == wdtype
    assert (
        torch.equal(y[:n], yr[:n]) and torch.equal(x.grad[:n], dxr[:n]) and torch.equal(w.grad, dwr)
    )
    assert torch.count_nonzero(w.grad[1]) == 0  # the expert with no rows
    ye, dxe, dwe = exact_grouped_linear(x.detach(), w.detach(), offs, dy)
    for name, got, want in (("y", y[:n], ye[:n]), ("dx", x.grad[:n], dxe[:n]), ("dw", w.grad, dwe)):
        assert 1e-3 < rel(got, want) < 0.1, name  # FP8 error: a few percent, and really quantized


def test_fp8_gate_up_equals_two_fp8_linears_on_the_permuted_rows():
    # The fused permute + gate/up op with fp8=True against fp8_grouped_linear of the permuted rows:
    # the same forward and weight gradients; dx sums the two GEMMs' rows in float32 and rounds once
    # (within bf16).
    from moezoo.kernels.moe_gate_up import gate_up
    from moezoo.kernels.moe_permute import moe_permute_reference
    from moezoo.layers.moe.experts import make_plan

    torch.manual_seed(0)
    T, K, E, D, H = 40, 2, 5, 32, 48
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    idx[idx == 1] = 0  # expert 1 gets no token
    plan = make_plan(idx, E, capacity=14)
    offs = torch.cumsum(plan.group_sizes, 0, dtype=torch.int32)
    x = torch.randn(T, D).bfloat16().requires_grad_()
    w1, w3 = ((torch.randn(E, H, D) * 0.1).requires_grad_() for _ in range(2))
    rows = plan.inv[plan.inv >= 0].long()
    da, db = torch.randn(plan.num_rows, H), torch.randn(plan.num_rows, H)
    outs = []
    for fused in (True, False):
        if fused:
            a, b = gate_up(x, w1, w3, offs, plan.inv, plan.num_rows, True, fp8=True)
        else:
            xs = moe_permute_reference(x, plan.inv, plan.num_rows)
            a, b = fp8_grouped_linear(xs, w1, offs), fp8_grouped_linear(xs, w3, offs)
        loss = (a[rows].float() * da[rows]).sum() + (b[rows].float() * db[rows]).sum()
        outs.append([a[rows], b[rows], *torch.autograd.grad(loss, (x, w1, w3))])
    for name, got, want in zip(["a", "b", "dx", "dw1", "dw3"], *outs):
        if name == "dx":
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2, msg=name)
        else:
            assert torch.equal(got, want), name


def test_fp8_gemm_arguments_pass_torch_scaled_grouped_mm_checks_on_meta():
    # On meta tensors the quantizers run their fakes and torch._scaled_grouped_mm its meta function,
    # which checks dtypes, row / column-major layouts, 16-byte strides, scale shapes and offsets as
    # the CUDA op does.
    from moezoo.kernels.moe_gate_up import gate_up

    R, D, H, E, T = 1000, 64, 96, 5, 400
    meta = dict(device="meta")
    x = torch.empty(R, D, dtype=torch.bfloat16, requires_grad=True, **meta)
    w = torch.empty(E, H, D, requires_grad=True, **meta)
    offs = torch.empty(E, dtype=torch.int32, **meta)
    y = fp8_grouped_linear(x, w, offs)
    y.backward(torch.empty_like(y))
    assert (
        y.shape == (R, H)
        and x.grad.shape == x.shape
        and w.grad.shape == w.shape
        and w.grad.dtype == w.dtype
    )
    xt = torch.empty(T, D, dtype=torch.bfloat16, requires_grad=True, **meta)
    inv = torch.empty(T, 2, dtype=torch.int32, **meta)
    w3 = torch.empty(E, H, D, dtype=torch.bfloat16, requires_grad=True, **meta)
    a, b = gate_up(xt, w, w3, offs, inv, R, True, fp8=True)
    (a.sum() + b.sum()).backward()
    assert a.shape == (R, H) and xt.grad.shape == xt.shape and w3.grad.dtype == torch.bfloat16
