"""``model.moe.precision: fp8`` on CPU: the config checks (choice, backend, dims, gate) name the
key; where FP8 cannot run, the layer and the trainer fail at once with one line; and the grouped
experts' fp8 path (torch._scaled_grouped_mm emulated in float32 off CUDA) is within FP8 error of the
float32 loop, eager and traced by torch.compile (fullgraph)."""

import pytest
import torch

from helpers import grouped_grads_eager_and_compiled
from moezoo.configs import ConfigError, MoEConfig, load_config
from moezoo.configs.moe import fp8_missing
from moezoo.layers import MoE
from moezoo.layers.moe.experts import GroupedExperts, make_plan

FP8_HERE = fp8_missing("cuda") is None
cpu_only = pytest.mark.skipif(FP8_HERE, reason="this machine runs FP8 grouped GEMMs")


def rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize(
    "override,reason",
    [
        (["model.moe.precision=fp16"], "unknown value 'fp16'"),
        (
            ["model.moe.precision=fp8", "model.moe.backend=reference"],
            "fp8 runs on the grouped backend",
        ),
        (["model.moe.precision=fp8", "model.moe.hidden_dim=100"], "hidden_dim=100"),
        (["model.moe.precision=fp8", "model.dim=72", "model.n_heads=4"], "dim=72"),
        (["model.moe.precision=fp8", "model.ffn_act=gelu"], "whose gate is silu"),
    ],
    ids=["choice", "backend", "hidden", "dim", "gate"],
)
def test_bad_precision_settings_are_config_errors_naming_the_key(override, reason):
    with pytest.raises(ConfigError) as e:
        load_config("zoo/tiny_moe.yaml", override)
    assert (
        e.value.key == "model.moe.precision" and reason in str(e.value) and "\n" not in str(e.value)
    )
    assert (
        load_config("zoo/tiny_moe.yaml", ["model.moe.precision=fp8"]).model.moe.precision == "fp8"
    )
    assert MoEConfig().precision == "bf16"


@cpu_only
def test_fp8_layer_where_fp8_cannot_run_is_a_config_error_but_a_meta_build_is_not():
    with pytest.raises(ValueError) as e:  # ConfigError is a ValueError
        MoE(32, 64, 4, 2, precision="fp8")
    assert (
        isinstance(e.value, ConfigError)
        and e.value.key == "moe.precision"
        and "\n" not in str(e.value)
    )
    assert "cannot run here" in str(e.value)
    with torch.device("meta"):  # --plan and FSDP2 builds plan fp8 runs anywhere
        assert MoE(32, 64, 4, 2, precision="fp8").cfg.precision == "fp8"
    with pytest.raises(ConfigError, match="multiples of 16"):
        MoE(32, 40, 4, 2, precision="fp8")


def test_fp8_forward_on_cpu_tensors_raises_value_error():
    m = MoE(32, 64, 4, 2)
    m.cfg.precision = "fp8"  # read at each forward, as the speed switches
    with pytest.raises(ValueError, match="precision fp8 runs on the grouped CUDA path"):
        m(torch.randn(5, 32))
    m.cfg.precision = "bf16"
    assert m(torch.randn(5, 32)).shape == (5, 32)


def experts(activation="swiglu", E=5, D=32, H=48, seed=0):
    torch.manual_seed(seed)
    ex = GroupedExperts(E, D, H, activation)
    ex.init_weights(0.1, 0.1)
    return ex


def run(ex, x, plan, dy, rows, scale=None):
    ex.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    s = None if scale is None else scale.clone().requires_grad_()
    y = (
        ex._grouped(xi, plan.group_sizes, s, plan)
        if ex.precision == "fp8"
        else ex._loop(xi, plan.group_sizes, s, plan)
    )
    (y[rows].float() * dy[rows]).sum().backward()
    return [y[rows], xi.grad] + [p.grad for p in ex.parameters()] + ([] if s is None else [s.grad])


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("row_scale", [False, True], ids=["unscaled", "row_scale"])
def test_fp8_grouped_experts_are_within_fp8_error_of_the_float32_loop(activation, row_scale):
    ex = experts(activation)
    T, K, E = 60, 2, 5
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    idx[idx == 3] = 4  # expert 3 gets no token
    plan = make_plan(idx, E, capacity=30)
    x = torch.randn(T, 32).bfloat16().float()
    dy = torch.randn(plan.num_rows, 32)
    rows = plan.inv[plan.inv >= 0].long()
    scale = torch.rand(plan.num_rows) if row_scale else None
    want = run(ex, x, plan, dy, rows, scale)  # float32 per-expert loop
    ex.precision = "fp8"
    got = run(ex, x.bfloat16(), plan, dy, rows, scale)  # float32 master weights, bf16 activations
    names = ["y", "dx"] + [n for n, _ in ex.named_parameters()] + (["dscale"] if row_scale else [])
    for name, g, w in zip(names, got, want):
        assert g.dtype == (torch.bfloat16 if name in ("y", "dx") else torch.float32), name
        assert rel(g, w) < 0.1, name
    assert torch.count_nonzero(ex.w1.grad[3]) == 0 and torch.count_nonzero(ex.w2.grad[3]) == 0


# rows past the last group
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_fp8_moe_layer_path_on_cpu_is_within_fp8_error_of_the_reference(monkeypatch):
    # The CUDA code path of MoE with precision fp8 (flipped after a CPU build), run on CPU through
    # the emulated GEMM: routing, folded weights, fused permute, fp8 gate/up and down projections.
    torch.manual_seed(0)
    ref = MoE(32, 48, 6, 2, capacity_factor=0.9, backend="torch")
    fast = MoE(32, 48, 6, 2, capacity_factor=0.9, backend="torch", compile_routing=None)
    fast.load_state_dict(ref.state_dict())
    fast._backend = "grouped"
    fast.cfg.precision = "fp8"
    x = torch.randn(50, 32).bfloat16().float()  # the same routing in both
    g = torch.randn(50, 32)
    monkeypatch.setattr(GroupedExperts, "forward", GroupedExperts._loop)
    y_ref = ref(x)
    gr = torch.autograd.grad((y_ref * g).sum(), list(ref.parameters()))
    monkeypatch.setattr(GroupedExperts, "forward", GroupedExperts._grouped)
    y = fast(x.bfloat16())
    assert fast.experts.precision == "fp8"
    gf = torch.autograd.grad((y.float() * g).sum(), list(fast.parameters()))
    assert rel(y, y_ref) < 0.1
    for (name, _), a, b in zip(ref.named_parameters(), gf, gr):
        assert rel(a, b) < 0.1, name


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_compiled_fp8_experts_equal_eager():
    # torch.compile (dynamo + AOTAutograd, no C++ build) traces the fp8 gate/up and linear autograd
    # Functions and their custom ops without a graph break; aot_eager runs the same ops, so equal
    # results.
    ex = experts().to(torch.bfloat16)
    ex.precision = "fp8"
    outs = grouped_grads_eager_and_compiled(ex, tokens=30, top_k=2, align=4)
    for name, a, b in zip(["dx", "dw1", "dw2", "dw3"], *outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5, msg=name)
