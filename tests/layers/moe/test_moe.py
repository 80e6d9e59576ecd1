"""layers.MoE against an independent per-token loop (float32, CPU): outputs, gradients, losses,
noise, bias."""

import math

import pytest
import torch
import torch.nn.functional as F

from moezoo.configs import ConfigError
from moezoo.layers import MoE, NeuronRoutedFFN, moe_aux_loss, moe_update_bias

RTOL = 1e-5


def close(a, b):
    """rtol 1e-5, with an absolute floor of 1e-5 of the tensor's scale (sums that cancel to ~0)."""
    torch.testing.assert_close(a, b, rtol=RTOL, atol=RTOL * float(b.detach().abs().max()) + 1e-12)


def make_moe(dim=12, hidden=10, E=6, K=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = MoE(dim, hidden, E, K, **kw)
    with torch.no_grad():  # fresh random values everywhere (no zero init)
        for p in m.parameters():
            p.normal_(0, 0.5)
        if hasattr(m, "expert_bias"):
            m.expert_bias.normal_(0, 0.3)
    return m


def loop_reference(m: MoE, x: torch.Tensor, eps=None):
    """Token by token, expert by expert, written from the router definitions (no code shared with
    MoE)."""
    c = m.cfg
    E, K = m.num_experts, m.top_k
    T = x.shape[0]
    cap = None if c.capacity_factor is None else math.ceil(c.capacity_factor * T * K / E)
    used = [0] * E
    bias = m.expert_bias if hasattr(m, "expert_bias") else torch.zeros(E)
    outs, kept = [], 0
    for t in range(T):
        xt = x[t]
        logits = m.gate.weight @ xt
        if eps is not None:
            logits = logits + eps[t] * F.softplus(m.noise.weight @ xt)
        if c.router == "sigmoid":
            s = torch.sigmoid(logits)
            rank = [float(s[e].detach() + bias[e]) for e in range(E)]
            chosen = sorted(range(E), key=lambda e: -rank[e])[:K]
            w = torch.stack([s[e] for e in chosen])
            if c.norm_topk:
                w = w / w.sum()
        else:
            ex = torch.exp(logits - logits.max())
            p = ex / ex.sum()
            rank = [float(p[e].detach() + bias[e]) for e in range(E)]
            chosen = sorted(range(E), key=lambda e: -rank[e])[:K]
            w = torch.stack([p[e] for e in chosen])
            if c.norm_topk and c.router != "switch":
                w = w / w.sum()
        y = torch.zeros_like(xt)
        for j, e in enumerate(chosen):
            if cap is not None and used[e] >= cap:
                continue
            used[e] += 1
            kept += 1
            h = F.silu(m.experts.w1[e] @ xt) * (m.experts.w3[e] @ xt)
            y = y + w[j] * (m.experts.w2[e] @ h)
        if hasattr(m, "shared"):
            s = m.shared.w2.weight @ (F.silu(m.shared.w1.weight @ xt) * (m.shared.w3.weight @ xt))
            if hasattr(m, "shared_gate"):
                s = torch.sigmoid(m.shared_gate.weight @ xt) * s
            y = y + s
        outs.append(y)
    return torch.stack(outs), kept


def check_against_loop(m, T=13, noisy_seed=None):
    x = torch.randn(T, m.dim, requires_grad=True)
    g = torch.randn(T, m.dim)
    if noisy_seed is not None:
        torch.manual_seed(noisy_seed)
    y = m(x)
    eps = None
    if noisy_seed is not None:
        torch.manual_seed(noisy_seed)
        eps = torch.randn(T, m.num_experts)
    ref, kept = loop_reference(m, x, eps)
    close(y, ref)
    params = [p for p in m.parameters()]
    got = torch.autograd.grad((y * g).sum(), [x] + params, allow_unused=True)
    want = torch.autograd.grad((ref * g).sum(), [x] + params, allow_unused=True)
    for a, b in zip(got, want):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0
        else:
            close(a, b)
    torch.testing.assert_close(m.stats["dropped_frac"], torch.tensor(1 - kept / (T * m.top_k)))
    return m


ROUTERS = [
    dict(router="softmax"),
    dict(router="softmax", softmax_before_topk=True),
    dict(router="softmax", norm_topk=False),
    dict(router="sigmoid"),
    dict(router="sigmoid", norm_topk=False),
    dict(router="switch", K=1),
    dict(router="noisy_topk"),
]


@pytest.mark.parametrize("kw", ROUTERS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_output_and_grads_equal_per_token_loop_for_every_router(kw, capacity_factor):
    m = make_moe(capacity_factor=capacity_factor, **kw)
    if kw["router"] == "noisy_topk":
        m.train()
        check_against_loop(m, noisy_seed=123)
        m.eval()
    check_against_loop(m)
    if capacity_factor is not None:
        assert m.stats["dropped_frac"] > 0


def test_shared_experts_with_sigmoid_gate_equal_loop():
    check_against_loop(make_moe(shared_experts=2, shared_gate=True, norm_topk=False))
    check_against_loop(make_moe(shared_experts=1, shared_hidden_dim=7))


def test_experts_receiving_no_token_are_fine_and_get_zero_grad():
    m = make_moe(E=8, K=2)
    check_against_loop(m, T=3)  # 6 assignments over 8 experts: some get nothing
    x = torch.randn(3, m.dim)
    m(x).sum().backward()
    idle = m.stats["tokens_per_expert"] == 0
    assert idle.any()
    assert torch.count_nonzero(m.experts.w1.grad[idle]) == 0


def test_leading_shape_is_kept():
    m = make_moe()
    x = torch.randn(2, 5, m.dim)
    assert m(x).shape == x.shape
    torch.testing.assert_close(m(x).reshape(10, -1), m(x.reshape(10, -1)))


def test_noise_absent_in_eval_and_unit_normal_times_softplus_in_training():
    m = make_moe(router="noisy_topk", E=4)
    x = torch.randn(4096, m.dim)
    clean = x @ m.gate.weight.T
    m.eval()
    torch.testing.assert_close(m.router_logits(x), clean)
    torch.testing.assert_close(m(x[:7]), m(x[:7]))
    m.train()
    eps = (m.router_logits(x) - clean) / F.softplus(x @ m.noise.weight.T)
    assert abs(eps.mean().item()) < 0.03
    assert abs(eps.std().item() - 1.0) < 0.03


def test_aux_and_z_losses_equal_hand_computed_values():
    m = MoE(2, 4, 3, 1, aux_loss_coef=0.1, z_loss_coef=0.01)
    with torch.no_grad():
        m.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.5], [-1.0, -1.0]])
    m(x)
    probs, lse, counts = [], [], [0, 0, 0]
    for row in x.tolist():
        logits = [row[0], row[1], -row[0] - row[1]]
        z = sum(math.exp(l) for l in logits)
        probs.append([math.exp(l) / z for l in logits])
        lse.append(math.log(z))
        counts[max(range(3), key=lambda e: logits[e])] += 1
    P = [sum(p[e] for p in probs) / 4 for e in range(3)]
    bal = 3 * sum(counts[e] / 4 * P[e] for e in range(3))
    zl = sum(v * v for v in lse) / 4
    assert counts == [2, 1, 1]
    assert m.aux_parts["balance"].item() == pytest.approx(bal, rel=1e-6)
    assert m.aux_parts["z"].item() == pytest.approx(zl, rel=1e-6)
    assert m.aux_loss.item() == pytest.approx(0.1 * bal + 0.01 * zl, rel=1e-6)
    assert m.aux_loss.requires_grad
    model = torch.nn.Sequential(m, MoE(2, 4, 3, 1, aux_loss_coef=0.0))
    model(x)
    assert moe_aux_loss(model).item() == pytest.approx(0.1 * bal + 0.01 * zl, rel=1e-6)
    ent = -sum(sum(q * math.log(q) for q in p) for p in probs) / 4
    m(x)
    assert m.stats["router_entropy"].item() == pytest.approx(ent, rel=1e-6)
    torch.testing.assert_close(m.stats["tokens_per_expert"], torch.tensor([2.0, 1.0, 1.0]))


def test_zero_coefficients_give_a_zero_aux_loss():
    m = make_moe(aux_loss_coef=0.0, z_loss_coef=0.0)
    m(torch.randn(5, m.dim))
    assert m.aux_loss.item() == 0.0


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_bias_balancing_lowers_imbalance_on_a_skewed_stream(router):
    torch.manual_seed(0)
    m = MoE(16, 8, 8, 2, router=router, bias_update_rate=1e-3)
    skew = torch.randn(16) * 2.0  # a shared direction: the stream prefers a few experts

    def imbalance():
        with torch.no_grad():
            m(torch.randn(512, 16) + skew)
        load = m.stats["tokens_per_expert"]
        return (load.max() / load.mean()).item()

    m.train()
    before = imbalance()
    moe_update_bias(m)
    for _ in range(150):
        imbalance()
        moe_update_bias(m)
    after = imbalance()
    assert after < 0.6 * before, (before, after)
    assert m.expert_bias.abs().sum() > 0


def test_bias_state_stays_exact_under_a_bfloat16_cast():
    m = MoE(8, 8, 4, 2, router="sigmoid", bias_update_rate=1e-3).to(torch.bfloat16)
    assert m.expert_bias.dtype == torch.float32 and m.load_accum.dtype == torch.int64
    m.train()
    m(torch.randn(5, 8, dtype=torch.bfloat16))
    assert int(m.load_accum.sum()) == 10
    moe_update_bias(m)
    # 10 assignments over 4 experts: no load equals the mean 2.5, so every bias moved by exactly
    # 1e-3
    torch.testing.assert_close(m.expert_bias.abs(), torch.full((4,), 1e-3), rtol=0, atol=0)


def test_bias_changes_selection_only_not_weights():
    m = make_moe(router="sigmoid", norm_topk=False)
    x = torch.randn(9, m.dim)
    idx, w, logits, _ = m.route(x)
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(-1, idx))


@pytest.mark.parametrize(
    "kw,key",
    [
        (dict(top_k=7), "moe.top_k"),
        (dict(top_k=0), "moe.top_k"),
        (dict(num_experts=0), "moe.num_experts"),
        (dict(hidden_dim=0), "moe.hidden_dim"),
        (dict(dim=-1), "moe.dim"),
        (dict(capacity_factor=0.0), "moe.capacity_factor"),
        (dict(router="expert_choice"), "moe.router"),
        (dict(backend="cutlass"), "moe.backend"),
        (dict(aux_loss_coef=-1.0), "moe.aux_loss_coef"),
        (dict(router="switch", top_k=2), "moe.top_k"),
        (dict(shared_experts=-1), "moe.shared_experts"),
    ],
)
def test_bad_values_raise_config_error_naming_the_key(kw, key):
    args = dict(dim=8, hidden_dim=8, num_experts=4, top_k=2)
    args.update(kw)
    with pytest.raises(ConfigError) as e:
        MoE(args.pop("dim"), args.pop("hidden_dim"), **args)
    assert e.value.key == key
    assert "\n" not in str(e.value)


def test_experts_that_do_not_split_over_the_ep_ranks_raise_config_error():
    class FiveRanks:
        def size(self):
            return 5

    with pytest.raises(ConfigError) as e:
        MoE(8, 8, 12, 2, ep_group=FiveRanks())
    assert e.value.key == "moe.num_experts" and "\n" not in str(e.value)


def test_unknown_expert_activation_raises_config_error_naming_the_key():
    from moezoo.layers.moe.experts import GroupedExperts

    with pytest.raises(ConfigError) as e:
        GroupedExperts(4, 8, 8, activation="gelu")
    assert e.value.key == "activation" and "\n" not in str(e.value)


def test_megablocks_backend_without_megablocks_raises_config_error():
    import importlib.util

    if importlib.util.find_spec("megablocks") is not None:
        pytest.skip("megablocks is installed")
    with pytest.raises(ConfigError) as e:
        MoE(8, 8, 4, 2, backend="megablocks")
    assert e.value.key == "moe.backend"


def test_init_weights_uses_out_std_for_down_projections():
    m = MoE(64, 128, 4, 2, shared_experts=1)
    m.init_weights(0.02, 0.001)
    assert m.experts.w2.std().item() == pytest.approx(0.001, rel=0.1)
    assert m.experts.w1.std().item() == pytest.approx(0.02, rel=0.1)
    assert m.shared.w2.weight.std().item() == pytest.approx(0.001, rel=0.1)


def test_moe_presets_build_with_the_documented_sizes():
    from moezoo.configs import load_config
    from moezoo.zoo import build_model

    cfg = load_config("zoo/moe_65b.yaml")
    m = cfg.model
    assert (m.n_layers, m.dim, m.n_heads, m.vocab_size) == (80, 8192, 64, 32000)
    assert (m.moe.num_experts, m.moe.top_k, m.expert_hidden_dim) == (256, 8, 2752)
    assert m.moe.top_k * m.expert_hidden_dim == m.hidden_dim == 22016
    model = build_model(m, device="meta")
    total = sum(p.numel() for p in model.parameters())
    assert 1.35e12 < total < 1.45e12
    tiny = load_config("zoo/tiny_moe.yaml")
    model = build_model(tiny.model)
    tokens = torch.randint(0, tiny.model.vocab_size, (2, 16))
    loss, parts = model.loss(tokens, tokens)
    assert parts["aux"] > 0 and torch.isfinite(loss)
    assert moe_aux_loss(model).item() == pytest.approx(parts["aux"].item())


def test_dropless_plan_shortcut_equals_the_general_plan_and_sorts_stably():
    from moezoo.layers.moe.experts import make_plan

    idx = torch.stack([torch.randperm(6)[:3] for _ in range(17)])
    fast, general = make_plan(idx, 6), make_plan(idx, 6, capacity=17 * 3)
    assert fast.dense and not general.dense
    torch.testing.assert_close(fast.inv, general.inv)
    torch.testing.assert_close(fast.counts, general.counts)
    flat_inv, flat_e = fast.inv.reshape(-1).long(), idx.reshape(-1)
    by_row = torch.empty_like(flat_e)
    by_row[flat_inv] = flat_e
    assert torch.all(by_row[1:] >= by_row[:-1])  # rows grouped by expert
    for e in range(6):  # earlier assignments first within an expert
        rows = flat_inv[flat_e == e]
        assert torch.all(rows[1:] > rows[:-1])


def test_under_autocast_the_experts_get_the_autocast_dtype_from_a_float32_residual():
    """Mixed-precision training: float32 residual in, bf16 expert GEMM inputs (the grouped path's
    dtype)."""
    torch.manual_seed(0)
    moe = MoE(32, 48, 4, 2)
    seen = []
    moe.experts.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    x = torch.randn(2, 8, 32)
    want = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = moe(x)
    assert seen == [torch.float32, torch.bfloat16]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("low_precision_router", [True, False])
def test_under_autocast_routing_reads_the_bf16_copy_only_with_low_precision_router(
    low_precision_router,
):
    """low_precision_router (default): the router reads the autocast-dtype copy, as the experts do,
    so its logits, losses and stats are the float32 ones of the bf16-rounded input. Off: those of
    the float32 residual itself."""
    moe = make_moe(
        dim=32, hidden=48, E=4, K=2, z_loss_coef=1e-2, low_precision_router=low_precision_router
    )
    x = torch.randn(2, 8, 32)
    moe(x.bfloat16().float() if low_precision_router else x)
    want = moe.aux_loss.detach().clone(), dict(moe.stats)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
    assert torch.equal(moe.aux_loss.detach(), want[0])
    for k, v in want[1].items():
        assert torch.equal(moe.stats[k], v), k


@pytest.mark.parametrize(
    "make",
    [
        lambda: MoE(32, 48, 4, 2, backend="torch"),
        lambda: NeuronRoutedFFN(32, 64, 8, 2, backend="torch"),
    ],
    ids=["moe", "neuron"],
)
def test_a_compiled_block_does_not_recompile_on_its_second_call(make):
    # The backend is resolved when the weights are made or moved: resolved in a forward, it would be
    # a module mutation that fails the graph's guard `_backend is None`, and the second call would
    # recompile.
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(32, 32), make())
    # the guards are dynamo's: no inductor codegen needed
    block.compile(dynamic=False, backend="eager")
    x = torch.randn(16, 32)
    want = block(x)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(block(x), want)


def test_a_compiled_block_on_the_loop_backend_does_not_recompile_when_the_expert_counts_change():
    # The loop reads the counts on the host; traced, the code after that read would be specialised
    # on each count's value and recompiled for every new batch. It runs eagerly inside a compiled
    # block instead.
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(32, 32), MoE(32, 48, 4, 2, backend="torch"))
    block.compile(dynamic=False, backend="eager")
    xs = [torch.randn(16, 32) for _ in range(3)]
    ys, counts = [], []
    # the first call compiles, no later one
    with torch._dynamo.config.patch(error_on_recompile=True):
        for x in xs:
            ys.append(block(x))
            counts.append(tuple(block[1].stats["tokens_per_expert"].tolist()))
    assert len(set(counts)) > 1, counts  # the batches did route differently
    torch.testing.assert_close(ys[0], block(xs[0]))


@pytest.mark.parametrize(
    "make",
    [lambda: MoE(32, 48, 4, 2), lambda: NeuronRoutedFFN(32, 64, 8, 2)],
    ids=["moe", "neuron"],
)
def test_the_backend_follows_the_weights_device_from_construction_and_to_empty(make):
    assert make()._backend == "reference"  # auto on CPU, resolved before any forward
    with torch.device("meta"):
        m = make()
    assert m._backend is None  # meta weights: left to the first forward
    m.to_empty(device="cpu")  # moving the weights resolves it (Module._apply)
    assert m._backend == "reference" and m.experts.backend == "loop"
