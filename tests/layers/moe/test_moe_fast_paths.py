"""MoE fast paths on CPU: the compiled routing stage equals the eager one (values, plan, stats,
router gradients), and the grouped experts path equals the per-expert loop (torch._grouped_mm runs
on CPU in float32 and bfloat16)."""

import pytest
import torch

from helpers import grouped_grads_eager_and_compiled
from moezoo.layers import MoE
from moezoo.layers.moe import layer as moe_module
from moezoo.layers.moe.experts import GroupedExperts
from moezoo.layers.moe.routing_stage import RoutingSpec, compiled_routing_stage, routing_stage

# aot_eager: dynamo + AOTAutograd tracing (what inductor consumes) without a C++ build on CPU.
BACKEND = "aot_eager"


SPECS = [
    dict(router="softmax"),
    dict(router="softmax", softmax_before_topk=True, capacity=9, row_weights=True),
    dict(router="sigmoid", align=4, row_weights=True),
    dict(router="switch", top_k=1, capacity=20),
    dict(router="softmax", local_balance=False, row_weights=True),
]


@pytest.mark.parametrize("kw", SPECS, ids=str)
def test_compiled_routing_stage_equals_eager_values_plan_stats_and_gradients(kw):
    torch.manual_seed(0)
    args = dict(
        router="softmax",
        top_k=2,
        softmax_before_topk=False,
        norm_topk=True,
        num_experts=6,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        capacity=None,
        align=1,
        local_balance=True,
        plan=True,
    )
    args.update(kw)
    spec = RoutingSpec(**args)
    logits = torch.randn(40, 6, requires_grad=True)
    bias = torch.randn(6) * 0.1 if spec.router == "sigmoid" else None
    got, want = (
        compiled_routing_stage(BACKEND, spec)(logits, bias, spec),
        routing_stage(logits, bias, spec),
    )
    torch.testing.assert_close(got.indices, want.indices, rtol=0, atol=0)
    torch.testing.assert_close(got.routed, want.routed, rtol=0, atol=0)
    for a, b in zip(got.plan_tensors, want.plan_tensors):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for k in want.stats:
        torch.testing.assert_close(got.stats[k], want.stats[k])
    g = torch.randn(40, spec.top_k)

    if spec.row_weights:
        torch.testing.assert_close(got.row_weights, want.row_weights)
        inv = want.plan_tensors[0]
        for t, j in zip(*torch.nonzero(inv >= 0, as_tuple=True)):  # each kept assignment's row
            assert want.row_weights[inv[t, j]] == want.weights[t, j]
        used = torch.zeros(want.row_weights.shape[0], dtype=torch.bool)
        used[inv[inv >= 0].long()] = True
        assert torch.all(want.row_weights[~used] == 0)  # padding / unused rows
    gr = torch.randn(want.row_weights.shape) if spec.row_weights else None

    def loss(r):
        extra = r.p_mean.square().sum() if r.p_mean is not None else 0.0
        if gr is not None:
            extra = extra + (r.row_weights * gr).sum()
        return (r.weights * g).sum() + r.aux_loss + extra

    torch.testing.assert_close(
        torch.autograd.grad(loss(got), logits)[0], torch.autograd.grad(loss(want), logits)[0]
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(capacity_factor=0.6),
        dict(router="sigmoid", bias_update_rate=1e-3),
        dict(router="noisy_topk"),
    ],
    ids=str,
)
def test_moe_with_compiled_routing_equals_moe_with_eager_routing(kw, monkeypatch):
    torch.manual_seed(0)
    eager = MoE(16, 24, 6, 2, z_loss_coef=1e-3, **kw)
    fast = MoE(16, 24, 6, 2, z_loss_coef=1e-3, **kw)
    fast.load_state_dict(eager.state_dict())
    x = torch.randn(13, 16)
    g = torch.randn(13, 16)
    outs = []
    for m, compiled in ((eager, False), (fast, True)):
        monkeypatch.setattr(
            moe_module,
            "routing_fn",
            lambda device, backend, spec, compiled=compiled: (
                compiled_routing_stage(BACKEND, spec) if compiled else routing_stage
            ),
        )
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)  # same gating noise in both
        y = m(xi)
        ((y * g).sum() + m.aux_loss).backward()
        outs.append((y, xi.grad, [p.grad for p in m.parameters()], m.stats, m.aux_parts))
    (y0, dx0, gp0, st0, ap0), (y1, dx1, gp1, st1, ap1) = outs
    torch.testing.assert_close(y1, y0)
    torch.testing.assert_close(dx1, dx0)
    for a, b in zip(gp1, gp0):
        torch.testing.assert_close(a, b)
    for k in st0:
        torch.testing.assert_close(st1[k], st0[k])
    for k in ap0:
        torch.testing.assert_close(ap1[k], ap0[k])


def experts_and_inputs(dtype, E=6, D=16, H=24, counts=(5, 0, 9, 3, 1, 12)):
    torch.manual_seed(0)
    ex = GroupedExperts(E, D, H)
    ex.init_weights(0.3, 0.3)
    ex = ex.to(dtype)
    counts = torch.tensor(counts)
    xs = torch.randn(int(counts.sum()), D).to(dtype)
    dy = torch.randn(int(counts.sum()), D).to(dtype)
    return ex, xs, dy, counts


def run_experts(ex, path, xs, dy, counts, scale=None):
    ex.zero_grad(set_to_none=True)
    x = xs.clone().requires_grad_()
    extra = () if scale is None else (scale.detach().clone().requires_grad_(),)
    y = path(x, counts, *extra)
    y.backward(dy)
    return [y, x.grad, ex.w1.grad, ex.w2.grad, ex.w3.grad] + [s.grad for s in extra]


@pytest.mark.parametrize("row_scale", [False, True], ids=["unscaled", "row_scale"])
def test_grouped_experts_equal_the_per_expert_loop_in_float32(row_scale):
    ex, xs, dy, counts = experts_and_inputs(torch.float32)
    scale = torch.rand(xs.shape[0]) if row_scale else None
    loop = run_experts(ex, ex._loop, xs, dy, counts, scale)
    got = run_experts(ex, ex._grouped, xs, dy, counts, scale)
    for name, a, b in zip(["y", "dx", "dw1", "dw2", "dw3", "dscale"], got, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    # no rows
    assert torch.count_nonzero(ex.w1.grad[1]) == 0 and torch.count_nonzero(ex.w3.grad[1]) == 0


def test_grouped_experts_in_bfloat16_are_within_twice_the_bfloat16_loop_error():
    import copy

    ex32, xs, dy, counts = experts_and_inputs(
        torch.float32, D=64, H=96, counts=(40, 0, 90, 30, 10, 120)
    )
    ex = copy.deepcopy(ex32).to(torch.bfloat16)
    ex32.load_state_dict(ex.state_dict())  # the same bf16-representable weights in both
    xs, dy = xs.bfloat16(), dy.bfloat16()
    want = run_experts(ex32, ex32._loop, xs.float(), dy.float(), counts)
    loop = run_experts(ex, ex._loop, xs, dy, counts)
    grouped = run_experts(ex, ex._grouped, xs, dy, counts)

    def rel(a, b):
        return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())

    for name, g, p, w in zip(["y", "dx", "dw1", "dw2", "dw3"], grouped, loop, want):
        assert g.dtype == torch.bfloat16
        assert rel(g, w) <= 2 * rel(p, w) + 1e-6, name


# Rows past the last group are unspecified in torch._grouped_mm's output (uninitialised memory on
# CPU) and nobody reads what the SwiGLU kernels make of them; the interpreter warns when they
# overflow.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("fold", [False, True], ids=["weighted_combine", "folded_weights"])
@pytest.mark.parametrize("capacity_factor", [None, 0.7])
def test_grouped_moe_path_on_cpu_equals_the_reference_path(fold, capacity_factor, monkeypatch):
    # The CUDA code path, run on CPU: torch._grouped_mm experts, folded weights or a weighted
    # combine, the permute / unpermute / combine ops (their torch bodies off CUDA).
    torch.manual_seed(0)
    ref = MoE(16, 24, 6, 2, capacity_factor=capacity_factor, z_loss_coef=1e-3, backend="torch")
    fast = MoE(
        16,
        24,
        6,
        2,
        capacity_factor=capacity_factor,
        z_loss_coef=1e-3,
        backend="torch",
        fold_weights=fold,
    )
    fast.load_state_dict(ref.state_dict())
    fast._backend = "grouped"
    x = torch.randn(21, 16, requires_grad=True)
    g = torch.randn(21, 16)
    monkeypatch.setattr(GroupedExperts, "forward", GroupedExperts._loop)
    y_ref = ref(x)
    gr = torch.autograd.grad((y_ref * g).sum() + ref.aux_loss, [x] + list(ref.parameters()))
    monkeypatch.setattr(GroupedExperts, "forward", GroupedExperts._grouped)
    y = fast(x)
    gf = torch.autograd.grad((y * g).sum() + fast.aux_loss, [x] + list(fast.parameters()))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(gf, gr):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_swiglu_backward_cpu_fallback_returns_float32_dscale_as_its_fake_says(monkeypatch):
    """The closed-form CPU fallback (no Triton) agrees with the registered fake for any scale
    dtype."""
    from moezoo.kernels.moe_swiglu import swiglu_backward

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a, b, dh = (torch.randn(5, 24, dtype=torch.bfloat16) for _ in range(3))
    scale = torch.rand(5, dtype=torch.bfloat16)
    assert swiglu_backward(dh, a, b, scale)[2].dtype == torch.float32
    torch.library.opcheck(swiglu_backward, (dh, a, b, scale))


# rows past the last group
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("align", [1, 4])
def test_compiled_experts_with_the_fused_permute_equal_eager(align):
    # torch.compile traces the permute + gate/up autograd.Function and the two-source unpermute op
    # of its backward (fullgraph: no graph break). bfloat16: the only dtype torch._grouped_mm's meta
    # kernel (what tracing runs) accepts; aot_eager runs the same ops, so the results are equal.
    ex, _, _, _ = experts_and_inputs(torch.bfloat16)
    outs = grouped_grads_eager_and_compiled(ex, tokens=10, top_k=2, align=align, backend=BACKEND)
    for name, a, b in zip(["dx", "dw1", "dw2", "dw3"], *outs):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5, msg=name)
