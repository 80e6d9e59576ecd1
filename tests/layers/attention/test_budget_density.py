"""budget_density: the closed-form per-head density --plan counts, against the token-level masks."""

import pytest
import torch

from moezoo.layers import SparsityPattern as P
from moezoo.layers.attention.density import budget_density, pattern_density, selection_work
from moezoo.layers.attention.selection import selection_density

STATIC = [
    P(type="a_shape", sinks=4, window=24, block_size=8),
    P(type="local", window=20, block_size=8),
    P(type="local", window=9, sinks=3, block_size=8),
    P(type="dense", block_size=8),
    P(type="a_shape", sinks=4, window=400, block_size=8),  # a window over the whole input: dense
]
BUDGETED = [
    P(type="block_topk", top_k=3, block_size=8),
    P(type="block_topk", top_k=3, window=5, sinks=2, block_size=8, token_select=1),
    P(type="bigbird", window=17, sinks=4, random_blocks=2, block_size=8),
    P(type="vertical_slash", n_vertical=6, n_slash=5, last_q=8, block_size=8),
]


@pytest.mark.parametrize("T", [37, 200])
def test_static_heads_count_exactly_their_token_mask(T):
    got = budget_density(STATIC, len(STATIC), T)
    assert torch.allclose(got, pattern_density(STATIC, len(STATIC), T), rtol=0, atol=1e-12)


@pytest.mark.parametrize("T,tol", [(64, 0.12), (200, 0.03), (2048, 0.005)])
def test_budgeted_heads_approach_the_budget_plans_token_count(T, tol):
    # the budget plan places blocks next to the window (overlapping it), the closed form beyond it:
    # they differ by the overlap, which shrinks as the input grows
    got = budget_density(BUDGETED, len(BUDGETED), T)
    ref = pattern_density(BUDGETED, len(BUDGETED), T)
    assert (got <= 1).all() and (got - ref).abs().max() < tol


def test_block_topk_without_window_is_exact():
    p = P(type="block_topk", top_k=3, block_size=8)
    assert abs(float(budget_density(p, 1, 200)[0]) - float(pattern_density(p, 1, 200)[0])) < 1e-12


def test_a_capped_union_counts_its_cap():
    """``union_blocks``: the bound of a query block's union, counted as that many blocks a query."""
    capped = P(type="block_topk", top_k=2, block_size=8, token_select=2, union_blocks=5)
    as_budget = P(type="block_topk", top_k=5, block_size=8)
    for T in (37, 200):
        assert torch.equal(budget_density(capped, 1, T), budget_density(as_budget, 1, T))
        assert torch.equal(pattern_density(capped, 1, T), pattern_density(as_budget, 1, T))


def test_compressed_branch_adds_its_pooled_pairs():
    plain = P(type="block_topk", top_k=2, block_size=8)
    nsa = P(type="block_topk", top_k=2, block_size=8, compress=1)
    T = 128
    extra = (T - 7) * (T // 8) / (T * (T + 1) / 2)  # rows that see a block x pooled keys
    assert abs(float(budget_density(nsa, 1, T)[0] - budget_density(plain, 1, T)[0]) - extra) < 1e-12


@pytest.mark.parametrize(
    "extra,scored",
    [
        # single-key scores per token: each query scores every key of its causal blocks
        (
            dict(token_select=1, score_block=1),
            lambda T, bs: sum(min((q // bs + 1) * bs, T) for q in range(T)),
        ),
        # pooled per token (score_block 4): every query against all T / 4 pooled keys
        (dict(token_select=1, score_block=4), lambda T, bs: T * (T // 4)),
        # mean-pooled per query block: one row of T / bs pooled keys per query block
        (dict(), lambda T, bs: (T // bs) ** 2),
    ],
    ids=["token_single_key", "token_pooled", "block_mean"],
)
def test_selection_work_counts_the_scores_once_per_shared_group(extra, scored):
    """A sixth of an attended pair's training work per scored pair (q . k forward only, against q .
    k and p v forward and twice that backward), the heads of a KV group that share one selection
    splitting it; heads without a selection add nothing. Forward only: half."""
    T, bs = 64, 8
    sel = P(type="block_topk", top_k=2, block_size=bs, share_group=1, **extra)
    pats = [sel, sel, P(type="a_shape", sinks=4, window=8, block_size=bs), sel]
    got = selection_work(pats, 4, T, n_kv_heads=2)  # groups {0, 1} and {2, 3}
    per_pair = 1 / 6 / (T * (T + 1) / 2)
    want = [scored(T, bs) * per_pair / 2] * 2 + [0.0, scored(T, bs) * per_pair]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    fwd = torch.tensor(selection_density(tuple(pats), T, 2, training=False), dtype=torch.float64)
    assert torch.allclose(fwd, 3 * got, rtol=1e-12, atol=0)


def test_a_calls_stats_carry_its_selection_work_and_the_metrics_add_it():
    """``sparse_attention`` reports the scores' work beside the visited density, and a layer's
    ``attn/density`` is their sum."""
    from moezoo.layers import Attention, sparse_attention
    from moezoo.layers.attention.density import attention_metrics

    sel = P(type="block_topk", top_k=2, block_size=8, share_group=1, token_select=1, score_block=1)
    pats = [sel, sel, P(type="a_shape", sinks=4, window=8, block_size=8), sel]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 16, generator=g) for h in (4, 2, 2))
    stats = {}
    sparse_attention(q, k, v, pats, backend="reference", stats=stats)
    want = torch.tensor(selection_density(tuple(pats), 64, 2), dtype=torch.float32)
    assert torch.equal(stats["score_work"], want) and want[2] == 0 and (want[[0, 1, 3]] > 0).all()

    attn = Attention(dim=64, n_heads=4, n_kv_heads=2, pattern=pats)
    attn.attn_stats = stats
    got = attention_metrics(attn, 64)["attn/density"]
    assert torch.allclose(got, (stats["density"] + want).mean())
