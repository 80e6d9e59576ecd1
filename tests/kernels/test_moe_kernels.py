"""MoE Triton kernels (permute, combine + its backward) against their torch references, run through
TRITON_INTERPRET=1 on CPU at tiny shapes; and the whole fast dispatch path against the reference
path."""

import pytest
import torch

from moezoo.kernels.moe_combine import (
    combine_rows,
    combine_rows_backward,
    moe_combine,
    moe_combine_reference,
)
from moezoo.kernels.moe_permute import moe_permute, moe_permute_reference, permute_rows
from moezoo.layers import MoE
from moezoo.layers.moe.experts import make_plan

pytestmark = pytest.mark.usefixtures("triton_interpreter")

PLANS = [dict(capacity=None, align=1), dict(capacity=3, align=1), dict(capacity=None, align=4)]


def random_plan(T=9, E=5, K=2, **kw):
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return make_plan(idx, E, **kw)


@pytest.mark.parametrize("kw", PLANS, ids=str)
@pytest.mark.parametrize("D", [8, 37])
def test_permute_kernel_matches_reference(kw, D):
    plan = random_plan(**kw)
    x = torch.randn(plan.inv.shape[0], D)
    got = permute_rows(x, plan.inv, plan.num_rows, zero_fill=True)
    torch.testing.assert_close(
        got, moe_permute_reference(x, plan.inv, plan.num_rows), rtol=0, atol=0
    )
    if plan.dense:  # dropless, unpadded: every row written even without the memset
        got = permute_rows(x, plan.inv, plan.num_rows, zero_fill=False)
        torch.testing.assert_close(
            got, moe_permute_reference(x, plan.inv, plan.num_rows), rtol=0, atol=0
        )


@pytest.mark.parametrize("kw", PLANS, ids=str)
@pytest.mark.parametrize("D", [8, 37])
def test_combine_kernel_and_its_backward_match_reference(kw, D):
    plan = random_plan(**kw)
    T = plan.inv.shape[0]
    ys = torch.randn(plan.num_rows, D, requires_grad=True)
    w = torch.rand(T, plan.inv.shape[1], requires_grad=True)
    torch.testing.assert_close(
        combine_rows(ys, plan.inv, w), moe_combine_reference(ys, plan.inv, w)
    )
    torch.testing.assert_close(
        combine_rows(ys, plan.inv, None), moe_combine_reference(ys, plan.inv, None)
    )
    dout = torch.randn(T, D)
    want_dys, want_dw = torch.autograd.grad(moe_combine_reference(ys, plan.inv, w), (ys, w), dout)
    dys, dw = combine_rows_backward(dout, ys.detach(), plan.inv, w.detach(), zero_fill=True)
    torch.testing.assert_close(dys, want_dys)
    torch.testing.assert_close(dw, want_dw)


@pytest.mark.parametrize("kw", PLANS, ids=str)
def test_custom_ops_forward_and_autograd_match_reference(kw):
    plan = random_plan(**kw)
    T, D = plan.inv.shape[0], 16
    x = torch.randn(T, D, requires_grad=True)
    w = torch.rand(T, plan.inv.shape[1], requires_grad=True)
    lin = torch.randn(D, D)

    def run(permute, combine, *extra):
        xs = permute(x, plan.inv, plan.num_rows, *extra)
        return combine(torch.tanh(xs @ lin), plan.inv, w, *extra)

    g = torch.randn(T, D)
    got = run(moe_permute, moe_combine, not plan.dense)
    want = run(moe_permute_reference, moe_combine_reference)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, w), g), torch.autograd.grad(want, (x, w), g)):
        torch.testing.assert_close(a, b)


def test_custom_ops_pass_opcheck():
    plan = random_plan(capacity=3)
    x = torch.randn(plan.inv.shape[0], 8, requires_grad=True)
    ys = torch.randn(plan.num_rows, 8, requires_grad=True)
    w = torch.rand(plan.inv.shape, requires_grad=True)
    torch.library.opcheck(moe_permute, (x, plan.inv, plan.num_rows, True))
    torch.library.opcheck(moe_combine, (ys, plan.inv, w, True))


@pytest.mark.parametrize("capacity_factor", [None, 0.7])
def test_fast_dispatch_path_equals_reference_path(capacity_factor):
    torch.manual_seed(0)
    ref = MoE(16, 24, 6, 2, capacity_factor=capacity_factor, backend="torch")
    fast = MoE(16, 24, 6, 2, capacity_factor=capacity_factor, backend="torch")
    fast.load_state_dict(ref.state_dict())
    fast._backend = "grouped"  # Triton permute/combine (interpreted); loop experts on CPU
    x = torch.randn(11, 16, requires_grad=True)
    g = torch.randn(11, 16)
    y_ref, y_fast = ref(x), fast(x)
    torch.testing.assert_close(y_fast, y_ref)
    gr = torch.autograd.grad((y_ref * g).sum(), [x] + list(ref.parameters()))
    gf = torch.autograd.grad((y_fast * g).sum(), [x] + list(fast.parameters()))
    for a, b in zip(gf, gr):
        torch.testing.assert_close(a, b)


def test_swiglu_kernel_and_op_gradients_match_reference():
    from moezoo.kernels.moe_swiglu import swiglu, swiglu_reference, swiglu_rows_bwd, swiglu_rows_fwd

    a = torch.randn(7, 300, requires_grad=True)  # 2100 elements: a partial second block
    b = torch.randn(7, 300, requires_grad=True)
    torch.testing.assert_close(swiglu_rows_fwd(a, b), swiglu_reference(a, b))
    dh = torch.randn(7, 300)
    want = torch.autograd.grad(swiglu_reference(a, b), (a, b), dh)
    for got in (
        swiglu_rows_bwd(dh, a.detach(), b.detach()),
        torch.autograd.grad(swiglu(a, b), (a, b), dh),
    ):
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
    torch.library.opcheck(swiglu, (a, b))


@pytest.mark.parametrize("H", [300, 4096])  # one partial block per row; two full blocks per row
def test_swiglu_with_a_row_scale_matches_autograd_of_the_scaled_reference(H):
    from moezoo.kernels.moe_swiglu import swiglu, swiglu_reference

    a = torch.randn(6, H, requires_grad=True)
    b = torch.randn(6, H, requires_grad=True)
    scale = torch.rand(6, requires_grad=True)
    dh = torch.randn(6, H)
    want = torch.nn.functional.silu(a) * b * scale[:, None]  # independent of the kernel file
    want_g = torch.autograd.grad(want, (a, b, scale), dh)
    got = swiglu(a, b, scale)
    got_g = torch.autograd.grad(got, (a, b, scale), dh)
    torch.testing.assert_close(got, want)
    for x, y in zip(got_g, want_g):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(swiglu_reference(a, b, scale), want)


def test_unpermute_op_and_its_permute_backward_match_reference():
    from moezoo.kernels.moe_permute import moe_unpermute

    for kw in PLANS:
        plan = random_plan(**kw)
        ys = torch.randn(plan.num_rows, 12, requires_grad=True)
        got = moe_unpermute(ys, plan.inv, not plan.dense)
        want = moe_combine_reference(ys, plan.inv, None)
        torch.testing.assert_close(got, want)
        g = torch.randn_like(want)
        torch.testing.assert_close(
            torch.autograd.grad(got, ys, g)[0], torch.autograd.grad(want, ys, g)[0]
        )
    torch.library.opcheck(moe_unpermute, (ys, plan.inv, True))


@pytest.mark.parametrize("kw", PLANS, ids=str)
@pytest.mark.parametrize("D", [8, 37])
def test_combine_of_two_sources_equals_the_combine_of_their_sum(kw, D):
    plan = random_plan(**kw)
    ys, ys2 = torch.randn(plan.num_rows, D), torch.randn(plan.num_rows, D)
    w = torch.rand(plan.inv.shape)
    for weights in (None, w):
        want = moe_combine_reference(ys + ys2, plan.inv, weights)
        torch.testing.assert_close(combine_rows(ys, plan.inv, weights, ys2), want)
        torch.testing.assert_close(moe_combine_reference(ys, plan.inv, weights, ys2), want)


def test_unpermute_of_two_sources_and_its_backward_match_reference():
    from moezoo.kernels.moe_permute import moe_unpermute

    for kw in PLANS:
        plan = random_plan(**kw)
        ys = torch.randn(plan.num_rows, 12, requires_grad=True)
        ys2 = torch.randn(plan.num_rows, 12, requires_grad=True)
        got = moe_unpermute(ys, plan.inv, not plan.dense, ys2)
        want = moe_combine_reference(ys, plan.inv, None) + moe_combine_reference(
            ys2, plan.inv, None
        )
        torch.testing.assert_close(got, want)
        g = torch.randn_like(want)
        for a, b in zip(
            torch.autograd.grad(got, (ys, ys2), g), torch.autograd.grad(want, (ys, ys2), g)
        ):
            torch.testing.assert_close(a, b)
    torch.library.opcheck(moe_unpermute, (ys, plan.inv, True, ys2))


def unfused_gate_up(x, w1, w3, offs, plan):
    """The path before the fusion: a permute, then two grouped GEMMs under plain autograd."""
    xs = moe_permute_reference(x, plan.inv, plan.num_rows)
    return (
        torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs),
        torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs),
    )


@pytest.mark.parametrize("kw", PLANS, ids=str)
def test_fused_permute_gate_up_gives_the_unfused_outputs_and_gradients(kw):
    # The backward's dx is the interpreted two-source combine kernel; a, b rows that no assignment
    # maps to (past the last group) are unspecified, so only assigned rows are compared.
    from moezoo.kernels.moe_gate_up import gate_up

    plan = random_plan(T=9, E=5, K=2, **kw)
    T, D, H, E = plan.inv.shape[0], 8, 12, 5
    x = torch.randn(T, D, requires_grad=True)
    w1, w3 = (torch.randn(E, H, D, requires_grad=True) for _ in range(2))
    offs = torch.cumsum(plan.group_sizes, 0, dtype=torch.int32)
    rows = plan.inv[plan.inv >= 0].long()
    da, db = torch.randn(plan.num_rows, H), torch.randn(plan.num_rows, H)
    outs = []
    for fn in (
        lambda: gate_up(x, w1, w3, offs, plan.inv, plan.num_rows, not plan.dense),
        lambda: unfused_gate_up(x, w1, w3, offs, plan),
    ):
        a, b = fn()
        loss = (a[rows] * da[rows]).sum() + (b[rows] * db[rows]).sum()
        outs.append([a[rows], b[rows], *torch.autograd.grad(loss, (x, w1, w3))])
    for name, got, want in zip(["a", "b", "dx", "dw1", "dw3"], *outs):
        torch.testing.assert_close(got, want, msg=name)
