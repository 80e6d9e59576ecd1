"""Flex vertical-slash through gathered columns (K' = cat(K[cols], K)): the same mask as the
reference, each pair counted once, GQA, ragged lengths, mixed heads; backward of the gather on CPU,
of flex on the GPU."""

import pytest
import torch

from helpers import (
    emulated_counts,
    fa_check,
    make_inputs,
    mask_mod_covers_whole_tiles,
    plain_attention,
    run_criterion,
)
from moezoo.layers import SparsityPattern
from moezoo.layers.attention.flex import (
    column_slots,
    flex_attention_call,
    flex_block_mask,
    gather_columns,
)
from moezoo.layers.attention.plan import plan_pattern

BS = 16


def vs(nv, ns, last_q=8, bs=BS):
    return SparsityPattern(
        type="vertical_slash", n_vertical=nv, n_slash=ns, last_q=last_q, block_size=bs
    )


MIXED = [
    vs(6, 5),
    SparsityPattern(type="a_shape", sinks=3, window=10, block_size=BS),
    vs(20, 3),
    SparsityPattern(type="bigbird", window=7, sinks=2, random_blocks=1, block_size=BS),
    vs(1, 40),
    SparsityPattern(type="block_topk", top_k=2, block_size=BS),
    SparsityPattern(type="dense", block_size=BS),
    vs(33, 9),
]


def handmade_plan(B, H, T, seed=0):
    """A plan whose columns overlap everything else: random windows, sinks, whole blocks, a
    contiguous run of diagonals (full blocks) plus random ones, and per-head column counts from 0 to
    25 (some inside the window)."""
    g = torch.Generator().manual_seed(seed)
    plan = plan_pattern(
        [SparsityPattern(type="bigbird", window=1, sinks=1, random_blocks=1, block_size=BS)] * H,
        H,
        0,
        T,
        T,
        0,
    )
    plan.window = torch.randint(0, 12, (H,), generator=g)
    plan.sinks = torch.randint(0, 4, (H,), generator=g)
    plan.blocks = plan.blocks & (torch.rand(plan.blocks.shape, generator=g) < 0.5)
    counts = [0, 25, 3, 11, 1, 7, 18, 5][:H]
    cols = torch.zeros(B, H, T, dtype=torch.bool)
    for b in range(B):
        for h, c in enumerate(counts):
            cols[b, h, torch.randperm(T, generator=g)[:c]] = True
    cols[:, 3, T - 5 :] = True  # the last keys: inside every late query's window/diagonals
    diags = torch.rand(B, H, T, generator=g) < 0.15
    diags[..., 0] = True
    diags[:, 1, : 2 * BS + 8] = True  # offsets 1 (and 2 partly) fully covered: full blocks
    plan.cols, plan.diags = cols, diags
    plan.col_budget = int(cols.sum(-1).max())
    return plan


@pytest.mark.parametrize("tile", [0, 64])  # 0: the plan's blocks; 64: tiles of 4 blocks (flex_tile)
@pytest.mark.parametrize("case", ["handmade", "mixed", "vs_only"])
def test_gathered_block_lists_count_every_allowed_pair_exactly_once(case, tile):
    B, H, T = 2, 8, 75
    if case == "handmade":
        plan = handmade_plan(B, H, T)
    else:
        q, k, _ = make_inputs(B, H, 2, T)
        plan = plan_pattern(MIXED if case == "mixed" else vs(10, 6), H, 0, T, T, 0, q, k)
    slots = column_slots(plan)
    assert slots.shape[-1] % BS == 0 and slots.shape[-1] >= plan.col_budget
    bm = flex_block_mask(plan, slots, tile=tile)
    counts = emulated_counts(bm, T, slots)
    want = plan.token_mask().expand(B, H, T, T).long()
    assert torch.equal(counts, want)
    mask_mod_covers_whole_tiles(bm, T, slots.shape[-1] + T)


def test_column_slots_hold_each_heads_columns_ascending_then_empty():
    plan = handmade_plan(2, 8, 75)
    slots = column_slots(plan)
    for b in range(2):
        for h in range(8):
            want = plan.cols[b, h].nonzero()[:, 0].to(torch.int32)
            n = want.numel()
            assert torch.equal(slots[b, h, :n], want) and (slots[b, h, n:] == 75).all()


def test_layout_without_columns_drops_only_column_blocks():
    plan = handmade_plan(2, 8, 75)
    p_all, f_all = plan.block_layout()
    p_rest, f_rest = plan.block_layout(include_cols=False)
    assert torch.equal(f_all, f_rest)  # columns never make a block full
    assert not ((p_rest | f_rest) & ~(p_all | f_all)).any()
    assert f_all[:, 1].diagonal(-1, -2, -1).all()  # head 1: every diagonal of offset 1 chosen
    q, k, _ = make_inputs(2, 8, 2, 75)
    # few diagonals: columns touch extra blocks
    plan = plan_pattern(vs(10, 2), 8, 0, 75, 75, 0, q, k)
    p_all, f_all = plan.block_layout()
    p_rest, f_rest = plan.block_layout(include_cols=False)
    extra = (p_all | f_all) & ~(p_rest | f_rest)
    assert extra.any() and not ((p_rest | f_rest) & ~(p_all | f_all)).any()


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("T", [75, 64])
def test_flex_vertical_slash_mixed_heads_forward_meets_fa_criterion_on_cpu(group, T):
    run_criterion(MIXED, "flex", B=2, H=8, Hk=8 // group, T=T, grads=False)


def test_flex_handmade_overlapping_plan_forward_meets_fa_criterion_on_cpu():
    B, H, Hk, T = 2, 8, 2, 75
    plan = handmade_plan(B, H, T, seed=3)
    q, k, v = make_inputs(B, H, Hk, T)
    mask = plan.token_mask()
    ref32 = plain_attention(q.float(), k.float(), v.float(), mask)
    plain = plain_attention(q, k, v, mask)
    slots = column_slots(plan)
    got = flex_attention_call(q, *gather_columns(k, v, slots), flex_block_mask(plan, slots))
    fa_check("out", got, ref32, plain)


@pytest.mark.parametrize("group", [1, 4])
def test_gathered_keys_and_mask_give_reference_output_and_grads_float64(group):
    # Flex has no CPU backward: materialise the gathered mask and run textbook attention over K', V'
    # so the gather's autograd (prefix + main gradients summed back into k, v; GQA expansion summed
    # over the group) is checked against the reference on the token mask.
    from torch.nn.attention.flex_attention import create_mask

    B, H, T = 2, 8, 75
    plan = handmade_plan(B, H, T, seed=5)
    q, k, v = make_inputs(B, H, H // group, T, dtype=torch.float64, seed=2)
    leaves_a = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_b = [t.clone().requires_grad_() for t in (q, k, v)]
    slots = column_slots(plan)
    bm = flex_block_mask(plan, slots)
    gmask = create_mask(bm.mask_mod, B, H, T, slots.shape[-1] + T, device="cpu")
    qa, ka, va = leaves_a
    out_a = plain_attention(qa, *gather_columns(ka, va, slots), gmask)
    out_b = plain_attention(*leaves_b, plan.token_mask())
    torch.testing.assert_close(out_a, out_b)
    do = torch.randn(out_a.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    out_a.backward(do)
    out_b.backward(do)
    for name, a, b in zip(("dq", "dk", "dv"), leaves_a, leaves_b):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("bs,tile", [(128, 0), (32, 128)])
def test_compiled_cpu_flex_visiting_only_listed_blocks_equals_reference(bs, tile):
    # Eager flex ignores the block lists; compiled flex (inductor's CPU kernel, forward only) visits
    # only the listed blocks, as the GPU kernel does. Block 128, or blocks of 32 on CUDA's 128-token
    # tiles (flex_tile); ragged length, GQA 4, batch 2, float32.
    from torch.nn.attention.flex_attention import flex_attention

    pats = [SparsityPattern(**{**p.to_dict(), "block_size": bs}) for p in MIXED]
    B, H, T = 2, 8, 300
    q, k, v = make_inputs(B, H, 2, T, D=32, dtype=torch.float32, seed=4)
    plan = plan_pattern(pats, H, 0, T, T, 0, q, k)
    slots = column_slots(plan)
    bm = flex_block_mask(plan, slots, tile=tile)
    with torch.no_grad():
        # static shapes: a second compile in one process goes dynamic, and inductor's CPU flex
        # template then fails to build ("cur_qSplitSize5 was not declared", torch 2.13; each case
        # alone compiles)
        got = torch.compile(flex_attention, dynamic=False)(
            q, *gather_columns(k, v, slots), block_mask=bm
        )
    want = plain_attention(q, k, v, plan.token_mask())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,group,T", [("vs", 1, 4096), ("mixed", 4, 4000)])
def test_flex_gathered_columns_on_gpu_meet_fa_criterion_fwd_bwd(name, group, T):
    # Compiled flex, block 128, dq, dk, dv: GQA groups 1 and 4, a length that is not a multiple of
    # the block.
    big = vs(200, 300, last_q=64, bs=128)
    pats = (
        big
        if name == "vs"
        else [SparsityPattern(**{**p.to_dict(), "block_size": 128}) for p in MIXED]
    )
    run_criterion(pats, "flex", B=2, H=8, Hk=8 // group, T=T, D=64, device="cuda")
