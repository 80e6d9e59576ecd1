"""Weight-level DST (layers.DynamicSparsity): densities, RigL rule, AdamW moments, N:M / block
masks, checkpoints, MoE experts, bad config values."""

import io
import itertools
import math

import pytest
import torch
from torch import nn

from moezoo.configs import ConfigError, DSTConfig, ModelConfig
from moezoo.layers import DynamicSparsity
from moezoo.layers.dst.masks import erk_densities, is_nm, nm_select, transposable_nm_select
from moezoo.layers.dst.schedule import DSTSchedule
from moezoo.zoo import build_model


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32
    )
    return build_model(cfg)


def train(model, opt, dst, steps, start=0, data_seed=123):
    """Deterministic batches keyed by step, so a resumed run sees the same data."""
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(data_seed + step)
        x = torch.randint(0, 64, (2, 12), generator=g)
        loss, _ = model.loss(x, x.roll(-1, 1))
        loss.backward()
        opt.step()
        dst.step(step)
        opt.zero_grad(set_to_none=True)


def masks(model):
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_mask")}


class Stack(nn.Module):
    """Linear layers inside ``layers`` plus an excluded head, like a transformer."""

    def __init__(self, shapes, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(i, o, bias=False) for o, i in shapes)
        self.output = nn.Linear(shapes[-1][0], 3, bias=False)

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return self.output(x)


class Experts(nn.Module):
    """Stand-in with MoE's stacked expert layout: w1/w3 [E, H, D], w2 [E, D, H]."""

    def __init__(self, E=4, D=16, H=32):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, H, D))
        self.w3 = nn.Parameter(torch.randn(E, H, D))
        self.w2 = nn.Parameter(torch.randn(E, D, H))


# ---- densities -----------------------------------------------------------------------------------


@pytest.mark.parametrize("distribution", ["erk", "uniform"])
def test_layer_density_equals_target_after_every_update_and_optimizer_step(distribution):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(
        model,
        opt,
        sparsity=0.8,
        distribution=distribution,
        update_every=2,
        total_steps=12,
        stop_fraction=1.0,
    )
    ks = dst._counts(0.8)
    for step in range(12):
        before = masks(model)
        train(model, opt, dst, 1, start=step)
        after = masks(model)
        for t, k in zip(dst.targets, ks):
            m, w = t.buf("mask"), t.param()
            assert int(m.sum()) == k, (t.name, step)
            assert torch.all(w[~m] == 0)
            if not dst.schedule.is_update(step):  # grown weights are 0 only right after growth
                assert torch.all(w[m] != 0)
        if dst.schedule.is_update(step):
            assert any(not torch.equal(before[k], after[k]) for k in before)
    expected = 1 - 0.8 if distribution == "uniform" else None
    st = dst.stats()
    assert abs(st["density"] - 0.2) < 2e-3 and st["ever_active"] > st["density"]
    if expected is not None:
        assert all(abs(v - expected) < 2e-3 for k, v in st.items() if k.startswith("density/"))


def test_cosine_sparsity_ramp_reaches_each_scheduled_density():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(
        model,
        opt,
        sparsity=0.8,
        initial_sparsity=0.4,
        sparsity_schedule="cosine",
        ramp_fraction=0.5,
        stop_fraction=0.75,
        update_every=2,
        total_steps=16,
    )
    assert abs(dst.stats()["density"] - 0.6) < 2e-3
    for step in range(16):
        train(model, opt, dst, 1, start=step)
        if dst.schedule.is_update(step):
            for t, k in zip(dst.targets, dst._counts(dst.schedule.sparsity_at(step))):
                assert int(t.buf("mask").sum()) == k
    assert abs(dst.stats()["density"] - 0.2) < 2e-3 and dst.stats()["target_sparsity"] == 0.8


def _erk_by_bisection(shapes, density):
    """Independent reference: eps solving sum min(1, eps*raw_l) N_l = density * sum N_l by
    bisection."""
    N = [s * r * c for s, r, c in shapes]
    raw = [(r + c) / (r * c) for _, r, c in shapes]
    lo, hi = 0.0, 1e9
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(min(1.0, mid * a) * n for a, n in zip(raw, N)) < density * sum(N):
            lo = mid
        else:
            hi = mid
    return [min(1.0, lo * a) for a in raw]


@pytest.mark.parametrize("density", [0.05, 0.2, 0.5, 0.9])
def test_erk_densities_give_the_global_target_with_dense_layers_capped(density):
    g = torch.Generator().manual_seed(int(density * 100))
    shapes = [(1, int(r), int(c)) for r, c in torch.randint(2, 300, (12, 2), generator=g)] + [
        (8, 64, 16)
    ]
    d = erk_densities(shapes, density)
    N = [math.prod(s) for s in shapes]
    assert abs(sum(a * n for a, n in zip(d, N)) / sum(N) - density) < 1e-9
    assert all(0 < a <= 1 for a in d)
    assert d == pytest.approx(_erk_by_bisection(shapes, density), rel=1e-6)
    if density == 0.9:
        assert any(a == 1.0 for a in d)


# ---- the RigL rule -------------------------------------------------------------------------------


def test_rigl_grows_top_grad_inactive_and_drops_smallest_on_a_hand_made_case():
    model = Stack([(4, 4)])
    lin = model.layers[0]
    # lr 0: W moves only by DST
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    dst = DynamicSparsity(
        model,
        opt,
        sparsity=0.5,
        distribution="uniform",
        drop_fraction=0.5,
        drop_schedule="constant",
        update_every=1,
        total_steps=10,
        stop_fraction=1.0,
    )
    W = torch.tensor(
        [
            [9.0, 1.0, 8.0, 2.0],
            [7.0, 3.0, 6.0, 4.0],
            [0.5, 5.0, 0.25, 10.0],
            [11.0, 12.0, 13.0, 14.0],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    G = torch.tensor(
        [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 9.0, 0.8], [0.9, 8.0, 0.05, 0.06], [7.0, 0.1, 6.0, 0.2]]
    )
    with torch.no_grad():
        lin.weight.copy_(W * mask)
        lin.weight_mask.copy_(mask)
    lin.weight.grad = G.clone()
    opt.step()
    dst.step(1)
    # 8 active, drop 4 smallest |W| among active: 1 (0,1), 2 (0,3), 3 (1,1), 0.25 (2,2). Grow 4
    # largest |grad| among the rest (dropped ones included): 9 (1,2), 8 (2,1), 7 (3,0), 6 (3,2).
    kept = {(0, 0), (0, 2), (1, 0), (2, 3)}
    grown = {(1, 2), (2, 1), (3, 0), (3, 2)}
    new = {tuple(ix) for ix in lin.weight_mask.nonzero().tolist()}
    assert new == kept | grown
    for i, j in kept:
        assert lin.weight[i, j] == W[i, j]
    for i, j in grown:
        assert lin.weight[i, j] == 0  # grown weights start at zero
    assert dst.stats()["flip_rate"] == 8 / 16


def test_adamw_moments_are_zero_for_pruned_grown_and_inactive_weights():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(
        model,
        opt,
        sparsity=0.7,
        update_every=3,
        total_steps=12,
        stop_fraction=1.0,
        drop_schedule="constant",
    )
    train(model, opt, dst, 2)
    old = masks(model)
    train(model, opt, dst, 2, start=2)  # step 3 is an update
    for t in dst.targets:
        p, m = t.param(), t.buf("mask")
        o = old[t.name + "_mask"]
        grown, pruned, stay = m & ~o, o & ~m, m & o
        assert grown.any() and pruned.any()
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.all(st[key][pruned] == 0), (t.name, key)
            assert torch.all(st[key][grown] == 0)
            # kept weights keep their moments (a few are 0: hidden units cut off by the sparse w3
            # get no grad)
            assert (st[key][stay] != 0).float().mean() > 0.95
        assert torch.all(p[grown] == 0) and torch.all(p[pruned] == 0)
    # one more optimizer step: grown weights now train, inactive ones stay exactly zero
    grown = {t.name: t.buf("mask") & ~old[t.name + "_mask"] for t in dst.targets}
    train(model, opt, dst, 1, start=4)
    for t in dst.targets:
        m = t.buf("mask")
        assert torch.all(t.param()[~m] == 0)
        assert (t.param()[grown[t.name]] != 0).float().mean() > 0.95


def test_grad_ema_score_is_a_times_grad_plus_one_minus_a_times_previous():
    model = Stack([(8, 8), (8, 8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dst = DynamicSparsity(
        model, opt, sparsity=0.5, grad_ema=0.3, update_every=100, total_steps=1000
    )
    ref = [torch.zeros(8, 8) for _ in dst.targets]
    for step in range(3):
        model(torch.randn(5, 8)).square().sum().backward()
        grads = [t.param().grad.clone() for t in dst.targets]
        opt.step()
        dst.step(step + 1)
        for r, g in zip(ref, grads):
            r.mul_(0.7).add_(0.3 * g.abs())
        opt.zero_grad()
    for r, t in zip(ref, dst.targets):
        torch.testing.assert_close(t.buf("score"), r)


def test_set_and_magnitude_keep_density_and_set_is_seeded():
    for method in ("set", "magnitude"):
        runs = []
        for _ in range(2):
            model = tiny_model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            dst = DynamicSparsity(
                model,
                opt,
                sparsity=0.75,
                method=method,
                update_every=2,
                total_steps=8,
                stop_fraction=1.0,
            )
            init = masks(model)
            train(model, opt, dst, 8)
            for t, k in zip(dst.targets, dst._counts(0.75)):
                assert int(t.buf("mask").sum()) == k
            runs.append(masks(model))
        assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
        changed = any(not torch.equal(init[k], runs[0][k]) for k in init)
        assert changed == (method == "set")  # magnitude never regrows a zeroed weight


def test_schedule_updates_decay_stop_and_dense_finish():
    s = DSTSchedule(
        total_steps=1000, update_every=100, stop_fraction=0.75, drop_fraction=0.3, dense_finish=True
    )
    assert [t for t in range(1000) if s.is_update(t)] == [100, 200, 300, 400, 500, 600, 700]
    assert s.drop_fraction_at(0) == pytest.approx(0.3) and s.drop_fraction_at(750) == pytest.approx(
        0.0
    )
    assert s.drop_fraction_at(375) == pytest.approx(0.15)
    assert not s.is_dense(749) and s.is_dense(750)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(
        model,
        opt,
        sparsity=0.8,
        update_every=2,
        total_steps=8,
        stop_fraction=0.5,
        dense_finish=True,
    )
    train(model, opt, dst, 8)
    assert dst.stats()["density"] == 1.0
    # formerly pruned weights train again
    assert all(bool((t.param() != 0).all()) for t in dst.targets)


# ---- structured masks ----------------------------------------------------------------------------


def test_nm_select_keeps_the_n_largest_of_every_group_of_m():
    s = torch.randn(2, 8, 16)
    mask = nm_select(s, 2, 4)
    assert is_nm(mask, 2, 4)
    groups, gm = s.view(2, 8, 4, 4), mask.view(2, 8, 4, 4)
    assert torch.all(
        groups.masked_fill(~gm, math.inf).amin(-1) >= groups.masked_fill(gm, -math.inf).amax(-1)
    )


def test_transposable_nm_picks_the_best_tile_pattern_by_brute_force():
    pats = [
        b
        for b in itertools.product((0, 1), repeat=16)
        if all(sum(b[4 * i : 4 * i + 4]) == 2 and sum(b[i::4]) == 2 for i in range(4))
    ]
    pats = [torch.tensor(b, dtype=torch.float32).view(4, 4) for b in pats]
    assert len(pats) == 90
    s = torch.rand(1, 8, 8)
    mask = transposable_nm_select(s, 2, 4)
    assert is_nm(mask, 2, 4, transposable=True)
    for i, j in itertools.product(range(2), range(2)):
        tile = s[0, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4]
        best = max(float((tile * p).sum()) for p in pats)
        got = float((tile * mask[0, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4]).sum())
        assert got == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize("transposable", [False, True])
def test_nm_masks_stay_valid_through_rigl_updates(transposable):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(
        model,
        opt,
        sparsity=0.5,
        granularity="nm",
        n=2,
        m=4,
        transposable=transposable,
        update_every=2,
        total_steps=8,
        stop_fraction=1.0,
        drop_schedule="constant",
    )
    init = masks(model)
    train(model, opt, dst, 8)
    for t in dst.targets:
        m = t.buf("mask").view(t.shape)
        assert is_nm(m, 2, 4, transposable)
        assert torch.all(t.param().view(t.shape)[~m] == 0)
    assert any(not torch.equal(init[k], v) for k, v in masks(model).items())


def test_block_masks_are_whole_blocks_at_the_target_count():
    model = Stack([(16, 32), (32, 16)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(
        model,
        opt,
        sparsity=0.75,
        distribution="uniform",
        granularity="block",
        block=[1, 8],
        update_every=1,
        total_steps=6,
        stop_fraction=1.0,
    )
    for step in range(6):
        model(torch.randn(4, 32)).square().sum().backward()
        opt.step()
        dst.step(step)
        opt.zero_grad()
        for t in dst.targets:
            m = t.buf("mask").view(-1, 8)
            assert torch.all(m.all(1) | ~m.any(1))  # each 1 x 8 block all on or all off
            assert int(m.all(1).sum()) == round(0.25 * m.shape[0])


# ---- checkpoints ---------------------------------------------------------------------------------


def test_masks_are_in_state_dict_and_save_load_continues_bit_exactly():
    def setup():
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dst = DynamicSparsity(
            model,
            opt,
            sparsity=0.8,
            update_every=3,
            total_steps=20,
            stop_fraction=1.0,
            grad_ema=0.5,
        )
        return model, opt, dst

    model_a, opt_a, dst_a = setup()
    train(model_a, opt_a, dst_a, 14)

    model_b, opt_b, dst_b = setup()
    train(model_b, opt_b, dst_b, 7)
    sd = model_b.state_dict()
    assert {k for k in sd if k.endswith(("_mask", "_ever", "_score"))} == {
        t.name + s for t in dst_b.targets for s in ("_mask", "_ever", "_score")
    }
    buf = io.BytesIO()
    torch.save({"model": sd, "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)

    model_c, opt_c, dst_c = setup()  # fresh masks from a fresh init
    model_c.load_state_dict(ck["model"])
    opt_c.load_state_dict(ck["opt"])
    train(model_c, opt_c, dst_c, 7, start=7)
    a, c = model_a.state_dict(), model_c.state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)
    sa, sc = opt_a.state_dict()["state"], opt_c.state_dict()["state"]
    assert all(torch.equal(sa[i][n], sc[i][n]) for i in sa for n in ("exp_avg", "exp_avg_sq"))


# ---- MoE experts ---------------------------------------------------------------------------------


def test_stacked_experts_are_masked_per_expert_slice():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].experts = Experts()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(
        model,
        opt,
        sparsity=0.75,
        update_every=1,
        total_steps=4,
        stop_fraction=1.0,
        drop_schedule="constant",
    )
    exp = model.layers[0].experts
    # expert 0 gets all the gradient: growth must still happen in every expert, at the same count
    for p in exp.parameters():
        p.grad = torch.zeros_like(p)
        p.grad[0] = torch.rand_like(p[0])
    old = exp.w1_mask.clone()
    opt.step()
    dst.step(1)
    for t, k in zip(dst.targets, dst._counts(0.75)):
        m = t.buf("mask")
        assert m.shape == t.param().shape
        assert (m.flatten(1).sum(1) == k).all()  # per expert
    assert all(not torch.equal(old[e], exp.w1_mask[e]) for e in range(4))


def test_dst_on_layers_moe_experts():
    try:
        from moezoo.layers import MoE
    except ImportError:
        pytest.skip("layers.MoE not available")
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([MoE(16, 32, num_experts=4, top_k=2)])
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dst = DynamicSparsity(
        model, opt, sparsity=0.75, update_every=2, total_steps=8, stop_fraction=1.0
    )
    names = {t.name for t in dst.targets}
    assert {"layers.0.experts.w1", "layers.0.experts.w2", "layers.0.experts.w3"} <= names
    assert not any("gate" in n or "noise" in n for n in names)
    for step in range(8):
        model.layers[0](torch.randn(3, 5, 16)).square().mean().backward()
        opt.step()
        dst.step(step)
        opt.zero_grad()
    for t, k in zip(dst.targets, dst._counts(0.75)):
        m = t.buf("mask")
        if t.name.endswith(("w1", "w2", "w3")):
            assert (m.flatten(1).sum(1) == k).all() and torch.all(t.param()[~m] == 0)


# ---- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"sparsity": 1.0}, "dst.sparsity"),
        ({"sparsity": -0.1}, "dst.sparsity"),
        ({"update_every": 0}, "dst.update_every"),
        ({"granularity": "nm", "sparsity": 0.5, "n": 4, "m": 4}, "dst.n"),
        ({"granularity": "nm", "sparsity": 0.8}, "dst.sparsity"),
        ({"granularity": "block", "block": [1, 7]}, "dst.block"),
        ({"granularity": "nm", "sparsity": 0.5, "m": 6, "n": 3}, "dst.m"),
        ({"include": ["nothing.*"]}, "dst.include"),
        ({"sparsity": 0.9999}, "dst.sparsity"),  # ERK infeasible: a layer gets no weights
        ({"method": "snip"}, "dst.method"),
        ({"drop_fraction": 0.0}, "dst.drop_fraction"),
        (
            {"sparsity_schedule": "cosine", "initial_sparsity": 0.5, "ramp_fraction": 0.9},
            "dst.ramp_fraction",
        ),
    ],
)
def test_bad_dst_values_raise_config_error_naming_the_key(kw, key):
    with pytest.raises(ConfigError) as e:
        DynamicSparsity(tiny_model(), None, total_steps=10, **kw)
    assert e.value.key == key and "\n" not in str(e.value)


def test_from_config_mirrors_the_keywords():
    cfg = DSTConfig(enabled=True, sparsity=0.6, method="set", update_every=7)
    model = tiny_model()
    dst = DynamicSparsity.from_config(model, cfg, None, total_steps=100)
    assert dst.cfg.sparsity == 0.6 and dst.cfg.method == "set" and dst.schedule.update_every == 7
    assert abs(dst.stats()["density"] - 0.4) < 2e-3
