"""budget_density: the closed-form per-head density --plan counts, against the token-level masks."""

import pytest
import torch

from moezoo.layers import SparsityPattern as P
from moezoo.layers.attention.density import budget_density, pattern_density

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


def test_compressed_branch_adds_its_pooled_pairs():
    plain = P(type="block_topk", top_k=2, block_size=8)
    nsa = P(type="block_topk", top_k=2, block_size=8, compress=1)
    T = 128
    extra = (T - 7) * (T // 8) / (T * (T + 1) / 2)  # rows that see a block x pooled keys
    assert abs(float(budget_density(nsa, 1, T)[0] - budget_density(plain, 1, T)[0]) - extra) < 1e-12
