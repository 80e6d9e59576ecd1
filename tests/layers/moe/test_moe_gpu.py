"""The grouped CUDA path (Triton permute/combine/swiglu + torch._grouped_mm) against the float32
loop reference, bf16 tolerances; skipped without CUDA."""

import pytest
import torch

from moezoo.layers import MoE

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(capacity_factor=0.8),
        dict(router="sigmoid", shared_experts=1),
        dict(E=16, K=4, router="noisy_topk"),
    ],
    ids=str,
)
@pytest.mark.parametrize("align", [1, 16])
def test_grouped_bf16_matches_fp32_reference_within_bf16_error(kw, align):
    E, K = kw.pop("E", 8), kw.pop("K", 2)
    torch.manual_seed(0)
    ref = MoE(256, 384, E, K, backend="torch", **kw).cuda().eval()
    # Eager routing: the compiled stage has its own test below, and compiling it for each of these
    # routing specs cost ~50-140 s of a cold GPU suite.
    fast = (
        MoE(256, 384, E, K, backend="grouped", group_align=align, compile_routing=None, **kw)
        .cuda()
        .to(torch.bfloat16)
        .eval()
    )
    fast.load_state_dict(ref.state_dict())
    ref.load_state_dict(fast.state_dict())  # same bf16-representable weights in both
    x = torch.randn(1000, 256, device="cuda").bfloat16().float()  # same values in both dtypes
    xr, xf = x.clone().requires_grad_(), x.bfloat16().requires_grad_()
    dy = torch.randn(1000, 256, device="cuda")
    yr, yf = ref(xr), fast(xf)
    yr.backward(dy)
    yf.backward(dy.bfloat16())
    assert rel(yf, yr) < 2e-2
    assert rel(xf.grad, xr.grad) < 2e-2
    for (n, pr), pf in zip(ref.named_parameters(), fast.parameters()):
        if pr.grad is not None:  # noise.weight has none in eval
            assert rel(pf.grad, pr.grad) < 3e-2, n
    torch.testing.assert_close(fast.stats["tokens_per_expert"], ref.stats["tokens_per_expert"])


def test_low_precision_router_logits_equal_fp32_logits_of_the_same_values():
    from moezoo.kernels.router_matmul import router_matmul

    x = torch.randn(4096, 512, device="cuda").bfloat16()
    w = torch.randn(64, 512, device="cuda").bfloat16()
    fast = router_matmul(x, w)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, x.float() @ w.float().T, rtol=1e-5, atol=1e-4)


def run_grads(m, x, dy):
    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y = m(xi)
    (y.float() * dy).sum().add(m.aux_loss).backward()
    return [y, xi.grad] + [p.grad for p in m.parameters()]


def grads_by_setting(attr, values, E, K, T, **kw):
    """fp32 loop reference grads, and the bf16 grouped path's grads with ``cfg.<attr>`` set to each
    value. Eager routing: each compiled routing spec costs seconds of device time, and the compiled
    stage has its own test (bench/moe.py checks the full default path at the real shapes)."""
    torch.manual_seed(0)
    ref = MoE(256, 384, E, K, backend="torch", **kw).cuda()
    m = MoE(256, 384, E, K, backend="grouped", **kw).cuda().to(torch.bfloat16)
    m.load_state_dict(ref.state_dict())
    ref.load_state_dict(m.state_dict())
    x = torch.randn(T, 256, device="cuda").bfloat16()
    dy = torch.randn(T, 256, device="cuda")
    got = []
    m.cfg.compile_routing = None
    for v in values:
        setattr(m.cfg, attr, v)
        got.append(run_grads(m, x, dy))
    return got, run_grads(ref, x.float(), dy)


def test_compiled_routing_equals_eager_routing_on_cuda():
    torch.manual_seed(0)
    m = (
        MoE(256, 384, 16, 4, backend="grouped", z_loss_coef=1e-3, capacity_factor=0.9)
        .cuda()
        .to(torch.bfloat16)
    )
    x = torch.randn(2000, 256, device="cuda").bfloat16()
    dy = torch.randn(2000, 256, device="cuda")
    runs, plans = {}, {}
    for mode in (None, "inductor"):
        m.cfg.compile_routing = mode
        plans[mode] = m._route_and_record(x)[1]
        runs[mode] = (
            [m.aux_loss.detach()] + [v.clone() for v in m.stats.values()] + run_grads(m, x, dy)
        )
    # the same decisions exactly: which tokens go where and which are dropped (earlier tokens win)
    for name in ("inv", "counts", "group_sizes"):
        assert torch.equal(getattr(plans["inductor"], name), getattr(plans[None], name)), name
    n_scalar = 1 + len(m.stats)
    for i, (a, b) in enumerate(zip(runs["inductor"][:n_scalar], runs[None][:n_scalar])):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6, msg=str(i))
    # Output and gradients: the routing weights differ in their last float32 bits (Inductor's
    # softmax sums in another order) and are folded into the bf16 hidden states, so single elements
    # move by a bf16 rounding step (2.4e-4 at most on an H200, no row off by 1e-2); in
    # norm, far below bf16's 3.9e-3.
    for i, (a, b) in enumerate(zip(runs["inductor"][n_scalar:], runs[None][n_scalar:])):
        assert rel(a, b) < 2e-3, i


@pytest.mark.parametrize("capacity_factor", [None, 0.8])
def test_folded_routing_weights_equal_the_weighted_combine(capacity_factor):
    (weighted, folded), want = grads_by_setting(
        "fold_weights", (False, True), 16, 4, 1500, capacity_factor=capacity_factor
    )
    for i, (u, f, w) in enumerate(zip(weighted, folded, want)):
        assert rel(f, w) <= 2 * rel(u, w) + 1e-6, i


@pytest.mark.parametrize("kw", [dict(), dict(capacity=200), dict(align=16)], ids=str)
def test_fused_permute_gate_up_matches_the_unfused_path_and_rounds_dx_once(kw):
    # Fused: dx sums a token's 2K rows of g1 = da w1 and g3 = db w3 in float32 and rounds once;
    # unfused, autograd first rounds g1 + g3 to bf16 per row. Forward and weight gradients are the
    # same GEMMs.
    from moezoo.kernels.moe_combine import moe_combine_reference
    from moezoo.kernels.moe_gate_up import gate_up
    from moezoo.kernels.moe_permute import moe_permute
    from moezoo.layers.moe.experts import make_plan

    torch.manual_seed(0)
    T, K, E, D, H = 1000, 4, 16, 256, 384
    plan = make_plan(torch.rand(T, E, device="cuda").topk(K, dim=1).indices, E, **kw)
    offs = torch.cumsum(plan.group_sizes, 0, dtype=torch.int32)
    x = torch.randn(T, D, device="cuda").bfloat16()
    w1, w3 = ((torch.randn(E, H, D, device="cuda") / D**0.5).bfloat16() for _ in range(2))
    keep = torch.zeros(plan.num_rows, 1, device="cuda")
    keep[plan.inv[plan.inv >= 0].long()] = 1  # rows some assignment maps to
    da, db = ((torch.randn(plan.num_rows, H, device="cuda") * keep).bfloat16() for _ in range(2))

    def grads(fn):
        xi, w1i, w3i = (t.clone().requires_grad_() for t in (x, w1, w3))
        a, b = fn(xi, w1i, w3i)
        torch.autograd.backward((a, b), (da, db))
        used = keep[:, 0].bool()  # other rows of a, b are unspecified (uninitialised memory)
        return a[used], b[used], xi.grad, w1i.grad, w3i.grad

    def unfused(xi, w1i, w3i):
        xs = moe_permute(xi, plan.inv, plan.num_rows, not plan.dense)
        return (
            torch._grouped_mm(xs, w1i.transpose(-2, -1), offs=offs),
            torch._grouped_mm(xs, w3i.transpose(-2, -1), offs=offs),
        )

    fused = grads(
        lambda xi, w1i, w3i: gate_up(xi, w1i, w3i, offs, plan.inv, plan.num_rows, not plan.dense)
    )
    plain = grads(unfused)
    for name, f, p in zip(["a", "b", "dx", "dw1", "dw3"], fused, plain):
        assert f.dtype == torch.bfloat16, name
        assert rel(f, p) < 1e-2, name
    g1, g3 = torch._grouped_mm(da, w1, offs=offs), torch._grouped_mm(db, w3, offs=offs)
    want = sum(moe_combine_reference(g.float(), plan.inv, None) for g in (g1, g3))
    torch.testing.assert_close(fused[2].float(), want, rtol=4e-3, atol=1e-5)  # one bf16 rounding
    assert rel(fused[2], want) <= rel(plain[2], want) + 1e-6
