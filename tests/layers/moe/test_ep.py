"""Expert-parallel MoE (layers.moe_ep) equals the single-process layer: outputs and gradients.

Each test spawns P CPU processes (gloo). Every process builds the same MoE and the same global
tokens, runs the single-process layer on all tokens as the reference, then the EP layer (experts
split over the P ranks) on its own uneven slice of tokens, and compares: its output rows, its input
gradient, the gradient of its local experts, and the all-reduced router gradient (float32, 1e-5).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from helpers import spawn  # forks P gloo ranks
from moezoo.layers import MoE
from moezoo.layers.moe.expert_parallel import shard_experts

D, H, E = 16, 24, 12  # 12 experts split over 2, 3 and 4 ranks
TOL = dict(atol=1e-5, rtol=1e-5)


def _tokens_per_rank(world):
    return [3 + 4 * r for r in range(world)]  # uneven: 3, 7, 11, 15


def _make_moe(scenario, top_k):
    torch.manual_seed(1234)
    moe = MoE(D, H, E, top_k)
    if scenario != "random":
        with torch.no_grad():
            # x > 0 below, so row 0 (then row 1) of the router wins for every token
            moe.gate.weight.copy_(-torch.rand(E, D))
            moe.gate.weight[0] = 2.0
            moe.gate.weight[1] = 1.0
    return moe


def _check_ep_matches_single_process(rank, world, scenario, top_k):
    ref = _make_moe(scenario, top_k)
    ep = copy.deepcopy(ref)
    counts = _tokens_per_rank(world)
    g = torch.Generator().manual_seed(99)
    x_all = torch.randn(sum(counts), D, generator=g)
    if scenario != "random":
        x_all = x_all.abs() + 0.1
    dy_all = torch.randn(sum(counts), D, generator=g)

    xr = x_all.clone().requires_grad_(True)
    y_ref = ref(xr)
    (y_ref * dy_all).sum().backward()

    lo = sum(counts[:rank])
    sl = slice(lo, lo + counts[rank])
    shard_experts(ep, dist.group.WORLD, rank)
    L = E // world
    assert ep.experts.w1.shape == (L, H, D) and ep.num_local_experts == L
    x = x_all[sl].clone().requires_grad_(True)
    y = ep(x)
    (y * dy_all[sl]).sum().backward()

    routed = ref.stats["tokens_per_expert"]
    if scenario == "one_expert":
        assert routed[0] == sum(counts) and routed[top_k:].sum() == 0  # experts with no tokens
    torch.testing.assert_close(y, y_ref[sl].detach(), **TOL)
    torch.testing.assert_close(x.grad, xr.grad[sl], **TOL)
    for name in ("w1", "w2", "w3"):
        mine = getattr(ep.experts, name).grad
        want = getattr(ref.experts, name).grad[rank * L : (rank + 1) * L]
        torch.testing.assert_close(mine, want, **TOL)
    gate = ep.gate.weight.grad.clone()
    dist.all_reduce(gate)
    torch.testing.assert_close(gate, ref.gate.weight.grad, **TOL)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ep_matches_single_process_with_uneven_random_routing(world):
    spawn(_check_ep_matches_single_process, world, "random", 2)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ep_matches_single_process_when_all_tokens_go_to_one_expert(world):
    # top-1 to expert 0: every other expert is empty and every rank but 0 receives nothing
    spawn(_check_ep_matches_single_process, world, "one_expert", 1)


def test_ep_matches_single_process_with_skewed_top2_routing():
    # experts 0 and 1 take all tokens: on 4 ranks both live on rank 0, ranks 1-3 receive nothing
    spawn(_check_ep_matches_single_process, 4, "one_expert", 2)
