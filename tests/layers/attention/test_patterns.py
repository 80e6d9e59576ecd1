"""Pattern semantics: each pattern's token mask against an independent brute-force definition."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, subprocess_env
from moezoo.configs import AttentionConfig, ConfigError, load_config
from moezoo.configs.attention import minference_patterns
from moezoo.layers import SparsityPattern, pattern_mask
from moezoo.layers.attention.plan import budget_plan, plan_pattern
from moezoo.zoo import build_model


def brute_static(p: SparsityPattern, T: int) -> torch.Tensor:
    """allowed(q, k) by docs/sparse_attention.md's sentences, one pair at a time (random blocks
    excluded)."""
    m = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for k in range(q + 1):
            if p.type == "dense":
                m[q, k] = True
            else:
                m[q, k] = (p.window > 0 and q - k <= p.window - 1) or k < p.sinks
    return m


@pytest.mark.parametrize(
    "p",
    [
        SparsityPattern(type="local", window=7, block_size=8),
        SparsityPattern(type="local", window=5, sinks=3, block_size=8),
        SparsityPattern(type="a_shape", sinks=4, window=9, block_size=16),
        SparsityPattern(type="dense"),
    ],
)
def test_static_pattern_mask_matches_brute_force_definition(p):
    T = 37
    m = pattern_mask(p, T, T, n_heads=2)
    assert m.shape == (2, T, T)
    assert torch.equal(m[0], brute_static(p, T)) and torch.equal(m[1], m[0])


def test_window_counts_exactly_w_keys_including_self():
    m = pattern_mask(SparsityPattern(type="local", window=4), 20, 20, 1)[0]
    assert m[10].nonzero().flatten().tolist() == [7, 8, 9, 10]


def test_decode_rows_are_the_last_rows_of_the_square_mask():
    p = SparsityPattern(type="bigbird", window=6, sinks=2, random_blocks=2, block_size=4)
    full = pattern_mask(p, 45, 45, 3, layer=2)
    assert torch.equal(pattern_mask(p, 1, 45, 3, layer=2), full[:, -1:])
    assert torch.equal(pattern_mask(p, 7, 45, 3, layer=2), full[:, -7:])


def test_random_blocks_are_r_whole_earlier_blocks_per_query_block_and_vary_by_head_and_layer():
    bs, r, T = 4, 3, 64
    p = SparsityPattern(type="bigbird", window=1, sinks=1, random_blocks=r, block_size=bs)
    m = pattern_mask(p, T, T, 4, layer=1)
    base = pattern_mask(SparsityPattern(type="a_shape", window=1, sinks=1, block_size=bs), T, T, 4)
    extra = m & ~base
    for h in range(4):
        for qb in range(T // bs):
            rows = extra[h, qb * bs : (qb + 1) * bs]
            # every query of the block sees the same whole key blocks, all strictly earlier
            blocks = rows.view(bs, T // bs, bs).any(-1)
            assert (blocks == blocks[0]).all()
            chosen = blocks[0].nonzero().flatten()
            assert (chosen < qb).all()
            whole = m[h, qb * bs : (qb + 1) * bs].view(bs, T // bs, bs)[:, chosen].all()
            assert whole
            # blocks already inside sinks/window may coincide, so at most r show up as extra
            assert len(chosen) <= min(r, qb)
    assert not torch.equal(m[0], m[1])
    assert not torch.equal(m, pattern_mask(p, T, T, 4, layer=2))
    # the draw of a query block does not depend on the sequence length
    assert torch.equal(pattern_mask(p, 32, 32, 4, layer=1), m[:, :32, :32])


def test_random_pattern_identical_across_two_processes():
    code = (
        "import hashlib; from moezoo.layers import SparsityPattern, pattern_mask; "
        "p = SparsityPattern(type='bigbird', window=8, sinks=4, random_blocks=3, block_size=8, "
        "seed=11); "
        "m = pattern_mask(p, 200, 200, 4, layer=3); "
        "print(hashlib.sha256(m.numpy().tobytes()).hexdigest())"
    )
    root = ROOT
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
            env=subprocess_env(PYTHONHASHSEED=seed),
        ).stdout.strip()
        for seed in ("1", "2")
    ]
    p = SparsityPattern(type="bigbird", window=8, sinks=4, random_blocks=3, block_size=8, seed=11)
    here = hashlib.sha256(pattern_mask(p, 200, 200, 4, layer=3).numpy().tobytes()).hexdigest()
    assert outs[0] == outs[1] == here


def brute_vertical_slash(q, k, nv, ns, last_q, bs):
    """MInference estimation written independently: loops over columns and diagonals, float64."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    out = torch.zeros(B, H, T, T, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            rows = range(T - min(last_q, T), T)
            s = torch.full((len(rows), T), float("-inf"), dtype=torch.float64)
            for i, qi in enumerate(rows):
                for kk in range(qi + 1):
                    s[i, kk] = (q[b, h, qi].double() @ k[b, h // g, kk].double()) / D**0.5
            p = s.softmax(-1)
            col = p.sum(0)
            cols = set(col.topk(min(nv, T)).indices.tolist())
            # diagonals rank the mass outside the columns
            diag = torch.zeros(T, dtype=torch.float64)
            for i, qi in enumerate(rows):
                for kk in range(qi + 1):
                    if kk not in cols:
                        diag[qi - kk] += p[i, kk]
            diags = set(diag.topk(min(ns, T)).indices.tolist()) | {0}
            for qi in range(T):
                qs = qi // bs * bs  # the query's block start: diagonals dilate to its block
                for kk in range(qi + 1):
                    out[b, h, qi, kk] = kk in cols or any(
                        qs - kk <= d <= qs - kk + bs - 1 for d in diags
                    )
    return out


def test_vertical_slash_mask_matches_independent_estimation():
    torch.manual_seed(0)
    B, H, Hk, T, D = 2, 4, 2, 29, 8
    q, k = torch.randn(B, H, T, D), torch.randn(B, Hk, T, D)
    p = SparsityPattern(type="vertical_slash", n_vertical=4, n_slash=3, last_q=6, block_size=8)
    m = pattern_mask(p, T, T, H, q=q, k=k)
    assert torch.equal(m, brute_vertical_slash(q, k, 4, 3, 6, bs=8))


def _vs_union_mass(q, k, cols, diags, last_q):
    """Softmax mass of the last ``last_q`` queries inside ``cols | diags`` (bool ``[B, H, T]``), per
    head."""
    T, D = k.shape[2], q.shape[-1]
    g = q.shape[1] // k.shape[1]
    pos = torch.arange(T - last_q, T)
    s = (q[:, :, -last_q:].double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) / D**0.5
    kk = torch.arange(T)
    s = s.masked_fill(kk[None, :] > pos[:, None], float("-inf"))
    d = (pos[:, None] - kk[None, :]).clamp(min=0)
    inside = cols[:, :, None, :] | diags[:, :, d]
    return (s.softmax(-1) * inside).sum((-1, -2))


def test_vertical_slash_rule_leaves_the_other_heads_of_a_mixed_layer_unchanged():
    # the slash rule keeps a vertical-slash head's whole own query block; a window head beside it
    # must not
    torch.manual_seed(1)
    T, D = 40, 8
    local = SparsityPattern(type="local", window=3, block_size=8)
    pats = [
        local,
        SparsityPattern(type="vertical_slash", n_vertical=2, n_slash=2, last_q=4, block_size=8),
    ]
    q, k = torch.randn(1, 2, T, D), torch.randn(1, 2, T, D)
    mixed = pattern_mask(pats, T, T, 2, q=q, k=k)[0]
    assert torch.equal(mixed[0], pattern_mask(local, T, T, 1)[0])
    assert torch.equal(mixed[1], pattern_mask(pats[1], T, T, 2, q=q, k=k)[0, 1])


@pytest.mark.parametrize("seed", range(4))
def test_slash_ranking_skips_column_shadows_and_covers_at_least_minference_mass(seed):
    # heavy-hitter keys: every query scores them high, so each also adds one row's mass to L
    # diagonals
    from moezoo.layers.attention.selection import estimate_vertical_slash

    g = torch.Generator().manual_seed(seed)
    B, H, Hk, T, D, L, nv, ns = 1, 4, 2, 96, 16, 8, 3, 6
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hk, T, D, generator=g)
    w = torch.randn(D, generator=g)
    heavy = torch.randperm(T - L, generator=g)[:3]
    k[:, :, heavy] += 1.5 * w
    q += 0.5 * w
    cols, diags = estimate_vertical_slash(
        q[:, :, -L:], k.repeat_interleave(H // Hk, 1), range(T - L, T), [nv] * H, [ns] * H
    )
    # MInference's ranking: diagonals by all their mass (the columns' shadows included)
    pos = torch.arange(T - L, T)
    s = q[:, :, -L:] @ k.repeat_interleave(H // Hk, 1).transpose(-1, -2) / D**0.5
    p = s.masked_fill(torch.arange(T)[None, :] > pos[:, None], float("-inf")).softmax(-1)
    dsum = torch.zeros(B, H, T)
    for i in range(L):
        dsum[..., pos[i] - torch.arange(pos[i] + 1)] += p[..., i, : pos[i] + 1]
    mi_diags = torch.zeros_like(diags).scatter_(-1, dsum.topk(ns).indices, True)
    mi_diags[..., 0] = True
    assert torch.equal(cols.sum(-1), torch.full((B, H), nv))
    ours = _vs_union_mass(q, k, cols, diags, L)
    theirs = _vs_union_mass(q, k, cols, mi_diags, L)
    assert (ours >= theirs - 1e-9).all(), (ours, theirs)
    # the shadows cost MInference's ranking mass here
    assert (ours > theirs + 1e-3).any(), (ours, theirs)


@pytest.mark.parametrize("T, L, p0", [(29, 6, 23), (40, 40, 0), (31, 5, 10), (1, 1, 0)])
def test_diagonal_sums_add_each_rows_mass_by_q_minus_k(T, L, p0):
    from moezoo.layers.attention.selection import _diagonal_sums

    prob = torch.rand(2, 3, L, T)
    # zero where k > q
    prob = prob * (torch.arange(T)[None, :] <= torch.arange(p0, p0 + L)[:, None])
    want = torch.zeros(2, 3, T, dtype=torch.float64)
    for i in range(L):
        for kk in range(p0 + i + 1):
            want[..., p0 + i - kk] += prob[:, :, i, kk].double()
    torch.testing.assert_close(_diagonal_sums(prob, p0).double(), want, rtol=1e-5, atol=1e-5)


def test_block_topk_mask_matches_independent_pooling():
    torch.manual_seed(1)
    B, H, Hk, T, D, bs, top = 2, 2, 1, 27, 8, 4, 3
    q, k = torch.randn(B, H, T, D), torch.randn(B, Hk, T, D)
    m = pattern_mask(
        SparsityPattern(type="block_topk", top_k=top, block_size=bs), T, T, H, q=q, k=k
    )
    n = (T + bs - 1) // bs
    for b in range(B):
        for h in range(H):
            qp = torch.stack([q[b, h, i * bs : (i + 1) * bs].double().mean(0) for i in range(n)])
            kp = torch.stack([k[b, 0, i * bs : (i + 1) * bs].double().mean(0) for i in range(n)])
            for qb in range(n):
                scores = {kb: float(qp[qb] @ kp[kb]) for kb in range(qb)}
                keep = {qb} | set(sorted(scores, key=scores.get, reverse=True)[: top - 1])
                for qi in range(qb * bs, min((qb + 1) * bs, T)):
                    want = torch.tensor([kk <= qi and kk // bs in keep for kk in range(T)])
                    assert torch.equal(m[b, h, qi], want), (b, h, qi)


def test_block_layout_covers_every_allowed_pair_and_full_blocks_are_all_allowed():
    torch.manual_seed(2)
    T, bs, H = 90, 16, 4
    q, k = torch.randn(1, H, T, 8), torch.randn(1, 2, T, 8)
    pats = [
        SparsityPattern(type="bigbird", window=20, sinks=5, random_blocks=2, block_size=bs),
        SparsityPattern(type="vertical_slash", n_vertical=5, n_slash=7, last_q=8, block_size=bs),
        SparsityPattern(type="block_topk", top_k=2, block_size=bs),
        SparsityPattern(type="dense", block_size=bs),
    ]
    plan = plan_pattern(pats, H, 0, T, T, 0, q, k)
    m = plan.token_mask()
    partial, full = plan.block_layout()
    n = (T + bs - 1) // bs
    pad = n * bs - T
    mp = torch.nn.functional.pad(m, (0, pad, 0, pad)).view(1, H, n, bs, n, bs)
    valid = torch.nn.functional.pad(torch.ones(T, T, dtype=torch.bool), (0, pad, 0, pad)).view(
        n, bs, n, bs
    )
    any_allowed = mp.any(3).any(-1)
    all_allowed = (mp | ~valid).all(3).all(-1)
    assert partial.shape == full.shape  # same batch size, as flex indexes both lists alike
    assert not (partial & full).any()
    assert (partial | full)[any_allowed].all()
    assert all_allowed[full].all()


def test_budget_plan_places_dynamic_budgets_at_the_layer_block_size():
    T, bs, k = 128, 16, 3
    pats = [
        SparsityPattern(type="block_topk", top_k=k, block_size=bs),
        SparsityPattern(),
        SparsityPattern(type="vertical_slash", n_vertical=2, n_slash=3, block_size=bs),
        SparsityPattern(),
    ]
    m = budget_plan(pats, 4, T).token_mask()[0]
    # block top-k stand-in: the diagonal block and the k-1 before it
    assert int(m[0].sum()) == sum(q + 1 - max(0, q // bs - k + 1) * bs for q in range(T))
    # vertical-slash stand-in: columns 0, 1 and diagonals 0..2 dilated to the query block: keys qs-2
    # .. q
    assert int(m[2].sum()) == sum(
        len({c for c in range(min(2, q + 1))} | set(range(max(0, q // bs * bs - 2), q + 1)))
        for q in range(T)
    )
    assert int(m[1].sum()) == T * (T + 1) // 2


def test_budget_plan_density_of_local_pattern_is_exact():
    T, W = 64, 8
    m = budget_plan(SparsityPattern(type="local", window=W), 1, T).token_mask()
    assert int(m.sum()) == sum(min(W, q + 1) for q in range(T))


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "patterns, key",
    [
        ({"0-1:*": {"type": "local", "window": 0}}, "model.attention.patterns.0-1:*.window"),
        (
            {"1:0-3": {"type": "a_shape", "sinks": -1, "window": 4}},
            "model.attention.patterns.1:0-3.sinks",
        ),
        (
            {
                "0:*": {
                    "type": "bigbird",
                    "window": 4,
                    "sinks": 2,
                    "random_blocks": 1,
                    "block_size": 48,
                }
            },
            "model.attention.patterns.0:*.block_size",
        ),
        ({"0:0-5": {"type": "local", "window": 4}}, "model.attention.patterns.0.0-5"),
        (
            {"0:0-2": {"type": "local", "window": 4}, "0:2-3": {"type": "dense"}},
            "model.attention.patterns.0.2-3",
        ),
        (
            {"0:*": {"type": "vertical_slash", "n_vertical": 0, "n_slash": 8}},
            "model.attention.patterns.0:*.n_vertical",
        ),
        (
            {"0:*": {"type": "vertical_slash", "n_vertical": 8, "n_slash": 0}},
            "model.attention.patterns.0:*.n_slash",
        ),
        ({"0:*": {"type": "swirl", "window": 3}}, "model.attention.patterns.0:*.type"),
        ({"7:*": {"type": "local", "window": 4}}, "model.attention.patterns.7"),
        (
            {
                "0:0-1": {"type": "local", "window": 4, "block_size": 16},
                "0:2-3": {"type": "local", "window": 4},
            },
            "model.attention.patterns.0",
        ),
        (
            {"1:2-3": {"type": "vertical_slash", "n_vertical": 8, "n_slash": 8, "dense_below": -1}},
            "model.attention.patterns.1:2-3.dense_below",
        ),
        (
            {"0:*": {"type": "dense", "dense_below": 4.5}},
            "model.attention.patterns.0:*.dense_below",
        ),
    ],
)
def test_bad_pattern_config_raises_config_error_naming_the_layer_head_key(patterns, key):
    with pytest.raises(ConfigError) as e:
        AttentionConfig(patterns=patterns).validate(n_layers=2, n_heads=4)
    assert e.value.key.startswith(key), (e.value.key, key)
    assert "\n" not in str(e.value)


def test_bad_pattern_in_yaml_fails_at_load_with_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model:\n  n_layers: 2\n  dim: 64\n  n_heads: 4\n  attention:\n    patterns:\n"
        "      '1:0-1': {type: a_shape, sinks: 0, window: 16}\n"
    )
    with pytest.raises(ConfigError, match=r"model\.attention\.patterns\.1:0-1\.sinks"):
        load_config(str(cfg))


def test_sparsity_pattern_constructor_and_from_dict_validate():
    with pytest.raises(ConfigError, match="window"):
        SparsityPattern(type="local")
    with pytest.raises(ConfigError, match=r"L3\.top_k"):
        SparsityPattern.from_dict({"type": "block_topk", "top_k": 0}, key="L3")
    p = SparsityPattern.from_dict({"type": "a_shape", "sinks": 4, "window": 16, "block_size": 32})
    assert SparsityPattern.from_dict(p.to_dict()) == p


# ------------------------------------------------------------------------------------- dense_below


def test_dense_below_is_a_common_parameter_of_every_type_and_round_trips():
    from moezoo.configs.attention import PATTERN_TYPES

    need = {"window": 4, "sinks": 2, "random_blocks": 1, "n_vertical": 3, "n_slash": 3, "top_k": 2}
    for t, (required, _) in PATTERN_TYPES.items():
        d = {"type": t, **{p: need[p] for p in required}, "dense_below": 4096}
        p = SparsityPattern.from_dict(d)
        assert (
            p.dense_below == 4096
            and p.to_dict() == d
            and SparsityPattern.from_dict(p.to_dict()) == p
        )
    # default 0 = never
    assert "dense_below" not in SparsityPattern(type="local", window=4).to_dict()
    with pytest.raises(ConfigError, match=r"^L2\.dense_below: must be >= 0"):
        SparsityPattern.from_dict({"type": "local", "window": 4, "dense_below": -3}, key="L2")


VS_DB = SparsityPattern(
    type="vertical_slash", n_vertical=3, n_slash=4, last_q=6, block_size=8, dense_below=40
)


@pytest.mark.parametrize(
    "p",
    [
        VS_DB,
        SparsityPattern(
            type="bigbird", window=5, sinks=2, random_blocks=2, block_size=8, dense_below=40
        ),
    ],
)
def test_dense_below_head_is_causal_below_and_the_unchanged_pattern_from_there(p):
    torch.manual_seed(4)
    H, Hk, D = 4, 2, 8
    plain = dataclasses.replace(p, dense_below=0)
    for T in (39, 40, 47):
        q, k = torch.randn(2, H, T, D), torch.randn(2, Hk, T, D)
        m = pattern_mask(p, T, T, H, q=q, k=k)
        if T < 40:
            assert p.is_dense_at(T) and torch.equal(
                m, torch.ones(T, T, dtype=torch.bool).tril().expand_as(m)
            )
        else:
            assert not p.is_dense_at(T) and torch.equal(m, pattern_mask(plain, T, T, H, q=q, k=k))
            assert not m.all(-1).all()


def test_mixed_layer_plans_only_the_dense_below_heads_dense_and_skips_their_estimation():
    torch.manual_seed(5)
    H, T, bs = 4, 33, 8
    pats = [
        VS_DB,
        SparsityPattern(type="a_shape", sinks=2, window=5, block_size=bs),
        dataclasses.replace(VS_DB, dense_below=0),
        SparsityPattern(type="block_topk", top_k=2, block_size=bs),
    ]
    q, k = torch.randn(1, H, T, 8), torch.randn(1, 2, T, 8)
    m = pattern_mask(pats, T, T, H, q=q, k=k)
    plain = pattern_mask([dataclasses.replace(p, dense_below=0) for p in pats], T, T, H, q=q, k=k)
    assert torch.equal(m[:, 0], torch.ones(T, T, dtype=torch.bool).tril()[None])
    assert torch.equal(m[:, 1:], plain[:, 1:]) and not torch.equal(m[:, 0], plain[:, 0])
    # a layer whose only input-dependent heads are dense at T needs no q, k: nothing is estimated
    static = plan_pattern([VS_DB, pats[1]], 2, 0, T, T)
    assert static.cols is None and static.window.tolist() == [T + 1, 5]
    with pytest.raises(ValueError, match="need q and k"):
        plan_pattern([VS_DB, pats[1]], 2, 0, 40, 40)


def test_budget_plan_and_density_follow_dense_below():
    from moezoo.layers.attention.density import pattern_density

    pats = [VS_DB, SparsityPattern(type="local", window=4, block_size=8, dense_below=40)]
    assert pattern_density(pats, 2, 39).tolist() == [1.0, 1.0]
    assert torch.equal(
        budget_plan(pats, 2, 39).token_mask()[0], torch.ones(2, 39, 39, dtype=torch.bool).tril()
    )
    plan = budget_plan(pats, 2, 40)
    assert (pattern_density(pats, 2, 40) < 1).all() and plan.col_budget == 3


def test_long_context_presets_select_per_token_in_every_head_with_a_capped_union():
    """The presets' recipe (BENCHMARKS.md, Long-context quality): every head of every layer block
    top-k chosen per query token by single-key scores, the tile's union capped at top_k, SSMax, a
    short dense phase of 3/4 of the steps at 1/8 of the length."""
    from moezoo.zoo.model import build_attention_pattern

    for name, T in (
        ("sparse_attn_1b_64k.yaml", 65536),
        ("sparse_attn_1b_128k.yaml", 131072),
        ("sparse_attn_small_16k.yaml", 16384),
    ):
        cfg = load_config(os.path.join(ROOT, "zoo", name))
        assert cfg.train.seq_len == T and T in cfg.eval.passkey_lengths
        t, att = cfg.train, cfg.model.attention
        assert t.short_seq_len * 8 == T and t.short_steps * 4 == t.steps * 3
        assert att.ssmax and att.dense_warmup == 0.75 and not att.dense_layers
        L, H = cfg.model.n_layers, cfg.model.n_heads
        grid = att.layer_head_patterns(L, H)
        for layer in range(L):
            pats = build_attention_pattern(cfg.model, layer, grid)
            pats = pats if isinstance(pats, list) else [pats]  # one pattern: every head's
            assert {p.type for p in pats} == {"block_topk"} and not any(
                p.is_dense_at(T) for p in pats
            )
            assert all(
                (p.token_select, p.score_block, p.union_blocks, p.share_group, p.top_k)
                == (2, 1, 8, 1, 8)
                for p in pats
            )


def test_vertical_slash_dense_below_shows_as_dense_in_the_pictures():
    """vertical-slash's dense_below switch (for continued training of a trained model) as pictures
    show it."""
    from moezoo.zoo.show_attention import layer_images

    cfg = load_config(os.path.join(ROOT, "zoo", "sparse_attn_small_16k.yaml"))
    cfg.model.n_layers = 1
    cfg.model.attention.patterns = {
        "0:0-1": {
            "type": "vertical_slash",
            "n_vertical": 1000,
            "n_slash": 6096,
            "last_q": 64,
            "block_size": 128,
            "dense_below": 256,
        }
    }
    heads = layer_images(cfg.model, 128)[0][1]
    assert heads[0][2:] == (1.0, "vertical_slash (dense)") and heads[2][3] == "dense"


def test_minference_json_maps_to_our_patterns_and_is_checked(tmp_path):
    data = [
        {"0": ["vertical_and_slash", 1000, 6096, 0.9], "1": ["stream_llm", 100, 800, 0.5]},
        {"0": ["block_sparse", 8, 1, 0.7]},
    ]
    pats = minference_patterns(data, n_layers=2, n_heads=2)
    # what MInference's runtime computes: forced first 30 columns / nearest 100 diagonals, budgets
    # of at least 30 / 50, and block_sparse always as top-100 blocks of 64x64 (the JSON's 8 is
    # ignored there)
    assert pats["0:0"] == {
        "type": "vertical_slash",
        "n_vertical": 1000,
        "n_slash": 6096,
        "last_q": 64,
        "keep_columns": 30,
        "keep_diagonals": 100,
        "block_size": 64,
    }
    assert pats["0:1"] == {"type": "a_shape", "sinks": 100, "window": 800}
    assert pats["1:0"] == {"type": "block_topk", "top_k": 100, "block_size": 64}
    small = minference_patterns([{"0": ["vertical_and_slash", 10, 20, 0.9]}], 1, 1)["0:0"]
    assert (small["n_vertical"], small["n_slash"]) == (30, 50)
    path = tmp_path / "mi.json"
    path.write_text(json.dumps(data))
    grid = AttentionConfig(
        minference_json=str(path), patterns={"1:1": {"type": "local", "window": 8}}
    ).layer_head_patterns(2, 2)
    assert (
        grid[0][1]["type"] == "a_shape"
        and grid[1][1]["type"] == "local"
        and grid[1][0]["type"] == "block_topk"
    )
    with pytest.raises(ConfigError, match=r"minference_json\[0\]\[5\]"):
        minference_patterns([{"5": ["stream_llm", 1, 2, 0.0]}], 2, 2)
    with pytest.raises(ConfigError, match=r"minference_json\[0\]\[0\]\.type"):
        minference_patterns([{"0": ["mystery", 1, 2, 0.0]}], 2, 2)
    for bad in ("abc", None, 3.5):
        with pytest.raises(
            ConfigError, match=r"minference_json\[0\]\[0\]: v_size and s_size must be integers"
        ):
            minference_patterns([{"0": ["stream_llm", bad, 2, 0.0]}], 2, 2)
    assert minference_patterns([{"0": ["stream_llm", 4.0, 16, 0.0]}], 1, 1)["0:0"]["sinks"] == 4


def test_minference_tool_folds_identical_heads_into_ranges(tmp_path):
    from moezoo.zoo.minference import load_minference

    vs = ["vertical_and_slash", 1000, 6096, 0.9]
    data = [{"0": vs, "1": vs, "2": ["stream_llm", 100, 800, 0.5], "3": vs}]
    path = tmp_path / "mi.json"
    path.write_text(json.dumps(data))
    pats = load_minference(str(path), n_layers=1, n_heads=4)
    assert list(pats) == ["0:0-1", "0:2", "0:3"]
    grid = AttentionConfig(patterns=pats).layer_head_patterns(1, 4)
    assert grid == [[minference_patterns(data, 1, 4)[f"0:{h}"] for h in range(4)]]
    assert all("dense_below" not in p for p in pats.values())  # only when asked for
    asked = load_minference(str(path), n_layers=1, n_heads=4, dense_below=4096)
    assert list(asked) == list(pats) and all(
        asked[s] == {**pats[s], "dense_below": 4096} for s in pats
    )
    AttentionConfig(patterns=asked).validate(n_layers=1, n_heads=4)
    with pytest.raises(ConfigError, match="dense_below"):
        load_minference(str(path), n_layers=1, n_heads=4, dense_below=-1)


def test_show_attention_draws_a_png_of_every_sparse_layer(tmp_path):
    from moezoo.zoo.show_attention import layer_images, main

    cfg = load_config(os.path.join(ROOT, "zoo", "tiny_sparse_attn.yaml"))
    imgs = layer_images(cfg.model, 64)
    assert [layer for layer, _ in imgs] == [0, 1, 2, 3]
    assert imgs[3][1][2][2] == 1.0 and 0 < imgs[0][1][0][2] < 1  # dense head, local head densities
    out = tmp_path / "a.png"
    main(
        [
            "--config",
            os.path.join(ROOT, "zoo", "tiny_sparse_attn.yaml"),
            "--length",
            "64",
            "--out",
            str(out),
        ]
    )
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_estimated_indices_do_not_change_under_bf16_autocast():
    torch.manual_seed(3)
    q, k = torch.randn(1, 4, 50, 16), torch.randn(1, 2, 50, 16)
    for p in (
        SparsityPattern(type="vertical_slash", n_vertical=4, n_slash=4, last_q=8),
        SparsityPattern(type="block_topk", top_k=2, block_size=8),
    ):
        plain = pattern_mask(p, 50, 50, 4, q=q, k=k)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(pattern_mask(p, 50, 50, 4, q=q, k=k), plain)


@pytest.mark.parametrize(
    "spec,dense",
    [
        ("last:2", [6, 7]),
        ("every:4", [3, 7]),
        ("every:1", list(range(8))),
        ("0,5", [0, 5]),
        ("2-3", [2, 3]),
        ("", []),
    ],
)
def test_dense_layers_make_those_layers_dense_attention_next_to_sparse_ones(spec, dense):
    cfg = load_config("zoo/sparse_attn_small_16k.yaml", [f"model.attention.dense_layers='{spec}'"])
    model = build_model(
        dataclasses.replace(cfg.model, dim=64, vocab_size=64, ffn_hidden=64), device="meta"
    )
    got = [i for i, b in enumerate(model.layers) if b.attention.pattern is None]
    assert got == dense
    grid = cfg.model.attention.layer_head_patterns(cfg.model.n_layers, cfg.model.n_heads)
    assert all((all(p is None for p in row)) == (i in dense) for i, row in enumerate(grid))


@pytest.mark.parametrize(
    "spec,why",
    [
        ("last:9", "more layers"),
        ("every:0", "positive integer"),
        ("every:9", "names no layer"),
        ("8", "outside 0..7"),
        ("first:2", "unknown form"),
        ("last:x", "positive integer"),
    ],
)
def test_bad_dense_layers_fail_at_load_naming_the_key(spec, why):
    with pytest.raises(ConfigError, match=f"model.attention.dense_layers: .*{why}"):
        load_config("zoo/sparse_attn_small_16k.yaml", [f"model.attention.dense_layers='{spec}'"])
