"""NeuronRoutedFFN: balanced clustering, exactness against the dense FFN, top-k routing against a
per-token loop, router training, schedule phases, config validation and the Transformer loss seam.
Tiny, CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import ROOT, subprocess_env
from moezoo.configs import ConfigError, load_config
from moezoo.layers import (
    MoE,
    NeuronRoutedFFN,
    SwiGLU,
    moe_aux_loss,
    neuron_schedule_step,
    neuron_stats,
    total_aux_loss,
)
from moezoo.layers.neuron.cluster import balanced_assign, balanced_kmeans, cluster_neurons
from moezoo.layers.neuron.schedule import neuron_phase
from moezoo.zoo import build_model

TINY = [
    "model.vocab_size=64",
    "model.dim=16",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_hidden=32",
    "model.max_seq_len=16",
    "model.neuron.num_groups=4",
    "model.neuron.top_k_groups=2",
    "train.seq_len=8",
]


class ReLU2FFN(nn.Module):
    """Independent dense squared-ReLU FFN: ``w2(relu(w1 x)^2)``."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)) ** 2)


def dense_ffn(activation, dim, hidden, seed):
    torch.manual_seed(seed)
    ffn = SwiGLU(dim, hidden) if activation == "swiglu" else ReLU2FFN(dim, hidden)
    for p in ffn.parameters():
        nn.init.normal_(p, std=0.3)
    return ffn


# -- clustering ------------------------------------------------------------------------------------
def test_balanced_kmeans_gives_equal_size_groups_that_partition_the_units():
    torch.manual_seed(1)
    labels = balanced_kmeans(torch.randn(96, 12), 6, iters=10, seed=3)
    assert labels.shape == (96,) and labels.min() >= 0 and labels.max() < 6
    assert torch.bincount(labels, minlength=6).tolist() == [16] * 6
    order = cluster_neurons(torch.randn(96, 12), torch.randn(96, 12), 6)
    assert sorted(order.tolist()) == list(range(96))


def test_balanced_kmeans_recovers_planted_equal_clusters():
    torch.manual_seed(2)
    centres = torch.linalg.qr(torch.randn(10, 4))[0].T  # 4 orthonormal directions
    truth = torch.randperm(32) % 4
    points = centres[truth] + 0.05 * torch.randn(32, 10)
    labels = balanced_kmeans(points, 4, iters=20, seed=0)
    # same partition up to renaming: each found cluster is exactly one planted cluster
    pairs = {(int(a), int(b)) for a, b in zip(labels, truth)}
    assert len(pairs) == 4 and len({a for a, _ in pairs}) == 4


def test_balanced_assign_respects_capacity_and_takes_the_nearest_first():
    dist = torch.tensor([[0.0, 5.0], [0.1, 5.0], [0.2, 0.3], [9.0, 0.0]])
    labels = balanced_assign(dist, capacity=2)
    assert labels.tolist() == [0, 0, 1, 1]


# -- exactness with all groups ---------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("sparse", [True, False])
def test_from_dense_with_all_groups_equals_dense_ffn_output_and_grads(activation, sparse):
    D, H, G = 12, 32, 4
    dense = dense_ffn(activation, D, H, seed=4)
    nr = NeuronRoutedFFN.from_dense(dense, G, G, backend="torch")
    nr.sparse = sparse
    assert nr.activation == activation
    x = torch.randn(3, 5, D)
    r = torch.randn(3, 5, D)
    xd, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd, yn = dense(xd), nr(xn)
    torch.testing.assert_close(yn, yd, atol=1e-5, rtol=1e-5)
    (yd * r).sum().backward()
    (yn * r).sum().backward()
    torch.testing.assert_close(xn.grad, xd.grad, atol=1e-5, rtol=1e-5)
    order = nr.neuron_index
    torch.testing.assert_close(
        nr.experts.w1.grad.reshape(H, D), dense.w1.weight.grad[order], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        nr.experts.w2.grad.permute(1, 0, 2).reshape(D, H),
        dense.w2.weight.grad[:, order],
        atol=1e-5,
        rtol=1e-5,
    )
    if activation == "swiglu":
        torch.testing.assert_close(
            nr.experts.w3.grad.reshape(H, D), dense.w3.weight.grad[order], atol=1e-5, rtol=1e-5
        )
    # the grouping is a permutation of the dense units, and undoing it gives the dense weights back
    w1, w2, w3 = nr.dense_weights()
    assert torch.equal(w1, dense.w1.weight) and torch.equal(w2, dense.w2.weight)
    assert (w3 is None) == (activation == "relu2") and (
        w3 is None or torch.equal(w3, dense.w3.weight)
    )


# -- top-k routing against a per-token loop --------------------------------------------------------
def per_token_reference(dense, groups, router_w, x, k, activation):
    """Each token computes only its top-k groups (by x . router_w) with the dense weights, one token
    at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = (router_w @ x[t]).topk(k).indices
        for g in chosen.tolist():
            units = groups[g]
            a = dense.w1.weight[units] @ x[t]
            h = (
                F.silu(a) * (dense.w3.weight[units] @ x[t])
                if activation == "swiglu"
                else torch.relu(a) ** 2
            )
            out[t] += dense.w2.weight[:, units] @ h
    return out


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_topk_routed_output_equals_per_token_loop_over_selected_groups(activation):
    D, H, G, K = 10, 48, 8, 3
    dense = dense_ffn(activation, D, H, seed=5)
    nr = NeuronRoutedFFN.from_dense(dense, G, K, backend="torch")
    with torch.no_grad():
        nr.router.weight.normal_()  # a router unrelated to the clustering
    x = torch.randn(2, 9, D)
    y = nr(x)
    groups = nr.neuron_index.view(G, H // G)
    ref = per_token_reference(dense, groups, nr.router.weight, x.reshape(-1, D), K, activation)
    torch.testing.assert_close(y.reshape(-1, D), ref, atol=1e-5, rtol=1e-5)
    assert nr.stats["active_frac"].item() == pytest.approx(K / G)
    assert nr.stats["tokens_per_group"].sum().item() == 18 * K
    assert nr.aux_loss.item() == 0.0
    # sparse output differs from the dense FFN: groups really were skipped
    assert (y - dense(x)).abs().max() > 1e-3


# -- router ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("router_loss", ["ce", "mse"])
def test_router_learns_to_predict_group_mass_and_only_the_router_gets_its_gradient(router_loss):
    torch.manual_seed(6)
    D, G, Hg = 16, 4, 8
    dirs = torch.linalg.qr(torch.randn(D, G))[0].T  # [G, D] orthonormal
    dense = SwiGLU(D, G * Hg)
    with torch.no_grad():  # group g's units read direction g
        dense.w1.weight.copy_(dirs.repeat_interleave(Hg, 0) + 0.1 * torch.randn(G * Hg, D))
        dense.w3.weight.copy_(dirs.repeat_interleave(Hg, 0) + 0.1 * torch.randn(G * Hg, D))
        dense.w2.weight.normal_(std=0.1)
    nr = NeuronRoutedFFN.from_dense(
        dense, G, 1, router_loss=router_loss, router_loss_coef=1.0, backend="torch"
    )
    nr.sparse = False
    with torch.no_grad():
        nr.router.weight.normal_(std=0.02)  # forget the centroid init
    opt = torch.optim.Adam(nr.router.parameters(), lr=0.05)
    x = 3 * dirs[torch.randint(0, G, (256,))] + 0.3 * torch.randn(256, D)
    losses, recalls = [], []
    for _ in range(60):
        nr(x)
        losses.append(nr.stats["router_loss"].item())
        recalls.append(nr.stats["recall"].item())
        opt.zero_grad()
        nr.aux_loss.backward()
        opt.step()
    # router loss trains only the router
    assert nr.experts.w1.grad is None and nr.experts.w2.grad is None
    assert losses[-1] < 0.3 * losses[0]
    assert recalls[-1] > 0.95 and nr.stats["mass_captured"].item() > 0.8


def test_dense_step_router_loss_is_the_kl_to_each_tokens_per_group_activation_mass():
    # independent: the dense SwiGLU's hidden state, |h| summed over each group's units, normalised
    # per token
    D, G, Hg, T = 16, 4, 8, 40
    dense = dense_ffn("swiglu", D, G * Hg, seed=8)
    nr = NeuronRoutedFFN.from_dense(
        dense, G, 1, router_loss="ce", router_loss_coef=0.5, backend="torch"
    )
    nr.sparse = False
    x = torch.randn(T, D)
    nr(x)
    w1 = nr.experts.w1.detach().reshape(G * Hg, D)
    w3 = nr.experts.w3.detach().reshape(G * Hg, D)
    h = F.silu(x @ w1.T) * (x @ w3.T)  # [T, H], the layer's group order
    mass = torch.stack([h[:, g * Hg : (g + 1) * Hg].abs().sum(-1) for g in range(G)], -1)
    target = mass / mass.sum(-1, keepdim=True)
    logp = torch.log_softmax(x @ nr.router.weight.detach().T, -1)
    kl = (target * (target.log() - logp)).sum(-1).mean()
    torch.testing.assert_close(nr.aux_loss.detach(), 0.5 * kl, rtol=1e-5, atol=1e-7)
    pred = logp.topk(1, -1).indices
    torch.testing.assert_close(nr.stats["mass_captured"], target.gather(1, pred).sum(-1).mean())


# -- schedule --------------------------------------------------------------------------------------
def test_schedule_runs_dense_warmup_then_alternates_at_the_ratio_then_dense_finish():
    phases = [neuron_phase(s, 100, 0.1, 0.75, 0.2) for s in range(100)]
    assert phases[:10] == ["warmup"] * 10 and phases[80:] == ["finish"] * 20
    middle = phases[10:80]
    assert middle[:8] == ["dense", "sparse", "sparse", "sparse"] * 2
    assert middle.count("sparse") == 52 and set(middle) == {"sparse", "dense"}  # floor(0.75 * 70)
    assert "sparse" not in [neuron_phase(s, 50, 0.2, 0.0, 0.2) for s in range(50)]
    assert [neuron_phase(s, 10, 0.0, 1.0, 0.0) for s in range(10)] == ["sparse"] * 10
    assert neuron_phase(120, 100, 0.1, 0.75, 0.2) == "finish"


def test_neuron_schedule_step_switches_every_layer_between_dense_and_sparse():
    cfg = load_config("zoo/tiny_neuron.yaml", TINY)
    model = build_model(cfg.model)
    tokens = torch.randint(0, 64, (2, 8))
    layers = [layer.feed_forward for layer in model.layers]
    assert neuron_schedule_step(model, 0, 100) == "warmup" and not any(m.sparse for m in layers)
    model(tokens)
    assert all(m.stats["active_frac"].item() == 1.0 and "recall" in m.stats for m in layers)
    assert neuron_schedule_step(model, 11, 100) == "sparse" and all(m.sparse for m in layers)
    model(tokens)
    assert all(m.stats["active_frac"].item() == 0.5 and "recall" not in m.stats for m in layers)
    stats = neuron_stats(model)  # router numbers of the last dense step stay for logging
    assert stats["neuron/active_frac"].item() == 0.5 and 0.0 <= stats["neuron/recall"].item() <= 1.0
    assert set(stats) == {
        "neuron/active_frac",
        "neuron/router_loss",
        "neuron/recall",
        "neuron/mass_captured",
    }
    assert neuron_schedule_step(model, 95, 100) == "finish" and not any(m.sparse for m in layers)
    assert neuron_schedule_step(nn.Linear(2, 2), 0, 10) is None


# -- Transformer loss seam -------------------------------------------------------------------------
def test_transformer_loss_adds_every_router_loss_and_still_sums_moe_aux_losses():
    cfg = load_config(
        "zoo/tiny_neuron.yaml",
        TINY + ["model.ffn_layers={'1': moe}", "model.moe.num_experts=4", "model.moe.hidden_dim=8"],
    )
    model = build_model(cfg.model)
    assert isinstance(model.layers[0].feed_forward, NeuronRoutedFFN) and isinstance(
        model.layers[1].feed_forward, MoE
    )
    neuron_schedule_step(model, 0, 100)  # dense warm-up: router loss on
    tokens, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    total, parts = model(tokens, targets)
    nr, moe = model.layers[0].feed_forward, model.layers[1].feed_forward
    assert nr.aux_loss.item() > 0
    torch.testing.assert_close(parts["aux"], (nr.aux_loss + moe.aux_loss).detach())
    torch.testing.assert_close(total.detach(), parts["ce"] + parts["aux"])
    total.backward()
    assert nr.router.weight.grad is not None and nr.router.weight.grad.abs().sum() > 0
    assert torch.equal(moe_aux_loss(model), moe.aux_loss)  # MoE-only sum unchanged
    assert torch.equal(total_aux_loss(nn.Linear(2, 2)), torch.zeros(()))


# -- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key,value",
    [
        ("num_groups", 0),
        ("top_k_groups", 9),
        ("top_k_groups", 0),
        ("activation", "gelu"),
        ("router_loss", "l1"),
        ("router_loss_coef", -1.0),
        ("warmup_fraction", 1.5),
        ("sparse_ratio", -0.1),
        ("finish_fraction", 0.95),
        ("kmeans_iters", 0),
        ("backend", "megablocks"),
        ("num_groups", 5),
    ],
)
def test_bad_neuron_config_raises_config_error_naming_the_key(key, value):
    with pytest.raises(ConfigError) as err:
        load_config("zoo/tiny_neuron.yaml", [f"model.neuron.{key}={value}"])
    assert err.value.key == f"model.neuron.{key}"
    assert "\n" not in str(err.value)


def test_layer_constructor_validates_like_the_config():
    with pytest.raises(ConfigError, match=r"^neuron\.top_k_groups: "):
        NeuronRoutedFFN(8, 16, num_groups=4, top_k_groups=5)
    with pytest.raises(ConfigError, match=r"^neuron\.num_groups: "):
        NeuronRoutedFFN(8, 18, num_groups=4, top_k_groups=2)


def test_from_dense_rejects_an_activation_that_does_not_fit_the_ffn():
    with pytest.raises(ConfigError, match=r"^neuron\.activation: relu2 has no w3"):
        NeuronRoutedFFN.from_dense(SwiGLU(8, 16), 4, 2, activation="relu2")
    with pytest.raises(ConfigError, match=r"^neuron\.activation: swiglu needs a w3"):
        NeuronRoutedFFN.from_dense(ReLU2FFN(8, 16), 4, 2, activation="swiglu")


def test_neuron_section_is_ignored_when_no_layer_uses_it():
    cfg = load_config("zoo/tiny_dense.yaml", ["model.neuron.num_groups=5"])
    assert cfg.model.neuron.num_groups == 5


FAST_PATH_CHECK = """
import torch
from moezoo.layers import NeuronRoutedFFN, SwiGLU
torch.manual_seed(7)
dense = SwiGLU(8, 32)
ref = NeuronRoutedFFN.from_dense(dense, 4, 2, backend="torch")
fast = NeuronRoutedFFN.from_dense(dense, 4, 2, backend="torch")
fast._backend = "grouped"              # what auto picks on CUDA; the experts keep their CPU loop
x, r = torch.randn(7, 8), torch.randn(7, 8)
xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
yr, yf = ref(xr), fast(xf)
torch.testing.assert_close(yf, yr, atol=1e-5, rtol=1e-5)
(yr * r).sum().backward()
(yf * r).sum().backward()
torch.testing.assert_close(xf.grad, xr.grad, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(fast.experts.w1.grad, ref.experts.w1.grad, atol=1e-5, rtol=1e-5)
"""


def test_fast_dispatch_path_under_triton_interpreter_equals_reference_path():
    """The Triton permute/combine ops (interpreted on CPU) give the reference path's output and
    grads.

    A subprocess, because the interpreter must be switched on before triton is first imported.
    """
    import subprocess
    import sys

    root = ROOT
    env = subprocess_env(TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", FAST_PATH_CHECK],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


# -- re-clustering ---------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_recluster_keeps_the_function_and_permutes_adam_state_with_the_weights(activation):
    import copy

    torch.manual_seed(8)
    D, H, G = 8, 32, 4
    a = NeuronRoutedFFN(D, H, G, 2, activation=activation, backend="torch")
    for p in a.experts.parameters():
        nn.init.normal_(p, std=0.3)
    b = copy.deepcopy(a)
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b))
    x, r = torch.randn(16, D), torch.randn(16, D)

    def step(m, opt):
        m.sparse = False
        opt.zero_grad()
        (m(x) * r).sum().backward()  # task loss only: the router has no gradient and is not stepped
        opt.step()

    for _ in range(3):
        step(a, opt_a), step(b, opt_b)
    before = b(x)
    b.recluster(opt_b)
    assert not torch.equal(b.neuron_index, torch.arange(H))  # units really moved
    assert sorted(b.neuron_index.tolist()) == list(range(H))
    torch.testing.assert_close(b(x), before, atol=1e-5, rtol=1e-5)
    step(a, opt_a), step(b, opt_b)
    for wa, wb in zip(a.dense_weights(), b.dense_weights()):
        if wa is not None:
            torch.testing.assert_close(wb, wa, atol=1e-6, rtol=1e-6)


def test_schedule_reclusters_once_when_the_warmup_ends():
    torch.manual_seed(9)
    m = NeuronRoutedFFN(
        8, 32, 4, 2, backend="torch", recluster=True, warmup_fraction=0.2, finish_fraction=0.2
    )
    nn.init.normal_(m.experts.w1, std=0.3)
    phases = []
    for s in range(4):
        phases.append(m.set_step(s, 10))
    assert phases == ["warmup", "warmup", "dense", "sparse"]
    moved = m.neuron_index.clone()
    assert not torch.equal(moved, torch.arange(32)) and sorted(moved.tolist()) == list(range(32))
    m.set_step(4, 10)
    assert torch.equal(m.neuron_index, moved)  # only at the boundary


def _check_recluster_under_fsdp2_matches_one_process(rank, world):
    import copy

    from moezoo.training.parallel import ParallelState, build_meshes, parallelize

    cfg = load_config("zoo/tiny_neuron.yaml", TINY + ["train.device=cpu", "train.batch_size=2"])
    mesh, dense = build_meshes("cpu", 1, world, 1)
    state = ParallelState(world, rank, rank, torch.device("cpu"), 1, world, 1, mesh, dense)
    torch.manual_seed(0)
    ref = build_model(cfg.model)
    model = parallelize(copy.deepcopy(ref), cfg, state)
    opt_ref, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model))
    g = torch.Generator().manual_seed(3)
    batch = (torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
    for m, o in ((ref, opt_ref), (model, opt)):  # one dense step: every rank sees the same batch
        neuron_schedule_step(m, 0, 10)
        m.loss(*batch)[0].backward()
        o.step()
        o.zero_grad()
        for layer in m.layers:
            layer.feed_forward.recluster(o)
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].full_tensor(), p, atol=1e-6, rtol=1e-6, msg=name)
        if ".experts." in name:
            got = opt.state[params[name]]["exp_avg"].full_tensor()
            torch.testing.assert_close(
                got, opt_ref.state[p]["exp_avg"], atol=1e-6, rtol=1e-6, msg=name
            )
    for a, b in zip(ref.layers, model.layers):
        assert torch.equal(a.feed_forward.neuron_index, b.feed_forward.neuron_index)
        assert not torch.equal(a.feed_forward.neuron_index, torch.arange(32))


def test_recluster_of_fsdp2_sharded_weights_matches_one_process():
    from helpers import spawn

    spawn(_check_recluster_under_fsdp2_matches_one_process, 2)


@pytest.mark.parametrize("low_precision_router", [True, False])
@pytest.mark.parametrize("sparse", [False, True])
def test_under_autocast_the_router_reads_the_groups_bf16_copy_only_with_low_precision_router(
    sparse, low_precision_router
):
    """Default: the router reads the bf16 copy the groups read, so its float32 logits are those of
    the bf16-rounded input; ``low_precision_router: false``: those of the float32 input."""
    torch.manual_seed(0)
    m = NeuronRoutedFFN(16, 32, 4, 2, backend="torch", low_precision_router=low_precision_router)
    m.sparse = sparse
    seen, route = [], m.router_logits
    m.router_logits = lambda x: (seen.append((x.dtype, route(x))), seen[-1][1])[1]
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    ((dtype, logits),) = seen
    assert (
        dtype == (torch.bfloat16 if low_precision_router else torch.float32)
        and y.dtype == torch.bfloat16
    )
    assert logits.dtype == torch.float32
    xr = (x.bfloat16().float() if low_precision_router else x).reshape(-1, 16)
    torch.testing.assert_close(logits, xr @ m.router.weight.t(), rtol=1e-6, atol=1e-6)


def test_flops_count_the_groups_a_neuron_routed_ffn_computes():
    # a sparse step computes K/G of the group weights, a dense step all; the default is the
    # schedule's mean
    from moezoo.zoo.flops import count_params, sparse_step_share

    m = NeuronRoutedFFN(
        8, 32, 8, 2, backend="torch", warmup_fraction=0.1, finish_fraction=0.2, sparse_ratio=0.5
    )
    model = torch.nn.Sequential(m)
    groups = sum(p.numel() for p in m.experts.parameters())
    router = m.router.weight.numel()
    assert count_params(model, sparse_share=1.0).active == router + groups * 2 // 8
    assert count_params(model, sparse_share=0.0).active == router + groups
    s = sparse_step_share(m.cfg)
    assert s == pytest.approx(0.7 * 0.5)
    c = count_params(model)
    assert c.active == round(router + groups * (1 - s + s * 2 / 8)) and c.total == router + groups
    assert c.neuron == groups and c.expert == 0
