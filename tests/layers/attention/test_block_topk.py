"""Block top-k as the trainable workhorse (GQA-shared selection, sinks + window), MInference's
forced vertical-slash picks, per-call density / selection stats, flex kernel choice, and the config
errors."""

import dataclasses

import pytest
import torch

from helpers import make_inputs, plain_attention, run_criterion
from moezoo.configs import ConfigError
from moezoo.configs.attention import AttentionConfig, validate_pattern
from moezoo.layers import SparsityPattern, pattern_mask, sparse_attention
from moezoo.layers.attention.flex import kernel_options_for, pick_flex_kernel
from moezoo.layers.attention.plan import plan_pattern

BS = 8


def _pooled_topk_reference(q, k, bs, top_k, group_shared, query_max=False, sub_block=None):
    """Independent MoBA/NSA selection: mean-pooled q (group-mean when shared) . mean-pooled k, or
    with ``query_max`` the max over each query block's queries of q (group-mean) . mean-pooled k;
    causal, own block forced, top-k -> bool [B, H, nq, nk]. ``sub_block``: keys pooled over
    sub-blocks of this many, a key block scored by the best of its (non-empty) sub-blocks."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    n = (T + bs - 1) // bs
    sb = sub_block or bs
    # pooled keys per block: [B, Hk, n, sub, D], NaN for sub-blocks past the last key
    kp = torch.full((B, k.shape[1], n, bs // sb, D), float("nan"))
    for i in range(n):
        for j in range(bs // sb):
            lo = i * bs + j * sb
            if lo < T:
                kp[:, :, i, j] = k[:, :, lo : lo + sb].float().mean(2)
    kp = kp.repeat_interleave(g, 1)
    qf = q.float()
    if group_shared:
        qf = qf.view(B, H // g, g, T, D).mean(2).repeat_interleave(g, 1)

    def best_sub(s):  # [.., n, sub] -> [.., n]: the best non-empty sub-block
        return s.nan_to_num(float("-inf")).amax(-1)

    if query_max:  # each query against every pooled key block, then the best query of each block
        per_q = best_sub(torch.einsum("bhtd,bhnsd->bhtns", qf, kp))  # [B, H, T, n]
        s = torch.stack([per_q[:, :, i * bs : (i + 1) * bs].amax(2) for i in range(n)], 2)
    else:
        # [B, H, n, D]
        qp = torch.stack([qf[:, :, i * bs : (i + 1) * bs].mean(2) for i in range(n)], 2)
        s = best_sub(torch.einsum("bhqd,bhnsd->bhqns", qp, kp))
    causal = torch.ones(n, n).tril().bool()
    s = s.masked_fill(~causal, float("-inf")) + torch.diag(
        torch.full((n,), float("inf"))
    ).nan_to_num(posinf=1e9)
    out = torch.zeros_like(s, dtype=torch.bool)
    idx = s.topk(min(top_k, n), -1).indices
    return out.scatter_(-1, idx, True) & causal


@pytest.mark.parametrize("query_max", [0, 1])
@pytest.mark.parametrize("shared", [0, 1])
def test_block_topk_selection_matches_pooled_reference_and_shares_kv_groups(shared, query_max):
    B, H, Hk, T = 2, 8, 2, 64
    q, k, _ = make_inputs(B, H, Hk, T)
    p = SparsityPattern(
        type="block_topk", top_k=3, block_size=BS, share_group=shared, query_max=query_max
    )
    plan = plan_pattern(p, H, 0, T, T, 0, q, k)
    ref = _pooled_topk_reference(q, k, BS, 3, shared, query_max)
    assert torch.equal(plan.blocks, ref)
    same = [torch.equal(plan.blocks[:, h], plan.blocks[:, (h // 4) * 4]) for h in range(H)]
    assert all(same) if shared else not all(same)


def test_query_max_selection_keeps_one_querys_far_block_that_pooling_averages_away(monkeypatch):
    """The last block's queries all lean (weakly) to block 5; one of them looks for a key planted in
    block 2. Pooled over the block, block 5 wins; with query_max the one query's block 2 does.
    Chunking the per-query scores changes nothing."""
    import moezoo.layers.attention.selection as sel

    B, H, Hk, T = 1, 4, 2, 128
    q, k, _ = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=3)
    # two orthonormal directions
    basis = torch.linalg.qr(
        torch.randn(q.shape[-1], 2, generator=torch.Generator().manual_seed(0))
    )[0].T
    k[:, :, 2 * BS + 3] += 16 * basis[0]  # one key of block 2
    q[:, :, T - 2] += 16 * basis[0]  # one query of the last block asks for it
    k[:, :, 5 * BS : 6 * BS] += 4 * basis[1]  # every key of block 5 ...
    q[:, :, T - BS :] += 4 * basis[1]  # ... and every query of the last block
    picks = {}
    for qmax in (0, 1):
        p = SparsityPattern(
            type="block_topk", top_k=2, block_size=BS, share_group=1, query_max=qmax
        )
        # [H, nk] of the last block
        picks[qmax] = plan_pattern(p, H, 0, T, T, 0, q, k).blocks[0, :, -1]
    assert picks[0][:, 5].all() and not picks[0][:, 2].any()
    assert picks[1][:, 2].all() and not picks[1][:, 5].any()
    monkeypatch.setattr(sel, "_QUERY_MAX_CHUNK", Hk * BS * (T // BS))  # one query block per chunk
    p = SparsityPattern(type="block_topk", top_k=3, block_size=BS, share_group=1, query_max=1)
    assert torch.equal(
        plan_pattern(p, H, 0, T, T, 0, q, k).blocks, _pooled_topk_reference(q, k, BS, 3, 1, True)
    )


@pytest.mark.parametrize("query_max", [0, 1])
@pytest.mark.parametrize("sub_block", [BS // 2, BS // 4])
def test_score_block_scores_each_block_by_its_best_sub_block(sub_block, query_max):
    """score_block < block_size: the selection pools keys over sub-blocks and ranks a block by its
    best one (NSA's selection from its finer compression scores); a partial last block included."""
    B, H, Hk, T = 2, 8, 2, 60
    q, k, _ = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=5)
    p = SparsityPattern(
        type="block_topk",
        top_k=3,
        block_size=BS,
        share_group=1,
        query_max=query_max,
        score_block=sub_block,
    )
    plan = plan_pattern(p, H, 0, T, T, 0, q, k)
    assert torch.equal(plan.blocks, _pooled_topk_reference(q, k, BS, 3, 1, query_max, sub_block))
    # sub-blocks the size of the block: the plain rule
    whole = SparsityPattern(
        type="block_topk",
        top_k=3,
        block_size=BS,
        share_group=1,
        query_max=query_max,
        score_block=BS,
    )
    assert torch.equal(
        plan_pattern(whole, H, 0, T, T, 0, q, k).blocks,
        _pooled_topk_reference(q, k, BS, 3, 1, query_max),
    )


def test_finer_sub_blocks_find_a_needle_that_a_whole_blocks_mean_dilutes():
    """One key of block 2 matches the last block's queries strongly; every key of block 5 matches
    them weakly. A block's mean divides the needle by 8 keys and block 5 wins; over sub-blocks of 2
    keys the needle's sub-block beats block 5's."""
    B, H, Hk, T = 1, 4, 2, 128
    q, k, _ = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=3)
    basis = torch.linalg.qr(
        torch.randn(q.shape[-1], 2, generator=torch.Generator().manual_seed(0))
    )[0].T
    k[:, :, 2 * BS + 3] += 16 * basis[0]
    k[:, :, 5 * BS : 6 * BS] += 4 * basis[1]
    q[:, :, T - BS :] += 4 * basis[0] + 4 * basis[1]
    picks = {}
    for cb in (BS, 2):
        p = SparsityPattern(
            type="block_topk", top_k=2, block_size=BS, share_group=1, query_max=1, score_block=cb
        )
        picks[cb] = plan_pattern(p, H, 0, T, T, 0, q, k).blocks[0, :, -1]
    assert picks[BS][:, 5].all() and not picks[BS][:, 2].any()
    assert picks[2][:, 2].all() and not picks[2][:, 5].any()


@pytest.mark.parametrize("backend,grads", [("reference", True), ("flex", False)])
def test_block_topk_with_sinks_and_window_meets_fa_criterion(backend, grads):
    p = SparsityPattern(
        type="block_topk", top_k=2, sinks=3, window=11, block_size=BS, share_group=1
    )
    run_criterion(p, backend, B=2, H=8, Hk=2, T=75, grads=grads)


def test_block_topk_sinks_window_mask_is_the_union_of_its_parts():
    B, H, T = 1, 4, 48
    q, k, _ = make_inputs(B, H, 2, T)
    both = pattern_mask(
        SparsityPattern(type="block_topk", top_k=2, sinks=2, window=5, block_size=BS),
        T,
        T,
        H,
        q=q,
        k=k,
    )
    topk = pattern_mask(
        SparsityPattern(type="block_topk", top_k=2, block_size=BS), T, T, H, q=q, k=k
    )
    ash = pattern_mask(SparsityPattern(type="a_shape", sinks=2, window=5, block_size=BS), T, T, H)
    assert torch.equal(both, topk | ash[None])


def test_budget_density_counts_block_topk_sinks_and_window():
    from moezoo.layers.attention.density import pattern_density
    from moezoo.layers.attention.plan import budget_plan

    T = 64
    p = SparsityPattern(type="block_topk", top_k=2, sinks=2, window=20, block_size=BS)
    got = budget_plan(p, 1, T).token_mask()[0, 0]
    blocks = budget_plan(
        SparsityPattern(type="block_topk", top_k=2, block_size=BS), 1, T
    ).token_mask()[0, 0]
    ash = pattern_mask(SparsityPattern(type="a_shape", sinks=2, window=20, block_size=BS), T, T, 1)[
        0
    ]
    assert torch.equal(got, blocks | ash)
    assert float(pattern_density(p, 1, T)[0]) == pytest.approx(
        float((blocks | ash).sum()) / (T * (T + 1) / 2)
    )


def test_vertical_slash_keeps_first_columns_and_nearest_diagonals_like_minference():
    B, H, T = 1, 2, 96
    q, k, _ = make_inputs(B, H, 2, T)
    k[:, :, 40] += 5 * q[:, :, -1:].mean(2)  # one heavy column far from the forced ones
    p = SparsityPattern(
        type="vertical_slash",
        n_vertical=6,
        n_slash=12,
        last_q=8,
        block_size=BS,
        keep_columns=4,
        keep_diagonals=10,
    )
    plan = plan_pattern(p, H, 0, T, T, 0, q, k)
    assert plan.cols[..., :4].all() and plan.diags[..., :10].all()
    assert int(plan.cols.sum(-1).max()) == 6 and int(plan.diags.sum(-1).max()) == 12
    assert plan.cols[..., 40].all()  # the estimate still picks within the rest of the budget
    tight = SparsityPattern(
        type="vertical_slash",
        n_vertical=2,
        n_slash=3,
        last_q=8,
        block_size=BS,
        keep_columns=4,
        keep_diagonals=10,
    )
    # a budget below the forced count keeps the first / nearest
    plan = plan_pattern(tight, H, 0, T, T, 0, q, k)
    assert (
        plan.cols[..., :2].all() and int(plan.cols.sum(-1).max()) == 2 and plan.diags[..., :3].all()
    )
    run_criterion(p, "reference", B=1, H=4, Hk=2, T=70)


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_stats_report_visited_block_density_and_selection_sharpness(backend):
    B, H, T = 2, 4, 64
    q, k, v = make_inputs(B, H, 2, T)
    pats = [SparsityPattern(type="block_topk", top_k=2, block_size=BS)] * 2 + [
        SparsityPattern(type="a_shape", sinks=2, window=9, block_size=BS),
        SparsityPattern(block_size=BS),
    ]
    stats = {}
    with torch.no_grad():
        sparse_attention(q, k, v, pats, backend=backend, stats=stats)
    n = T // BS
    # top-2 of the causal blocks per query block (1 for the first), a_shape: window blocks + sink
    # column
    topk_blocks = sum(min(2, i + 1) for i in range(n))
    a_blocks = sum(
        len({0} | {j for j in range(n) if j <= i and (i - j) * BS - (BS - 1) < 9}) for i in range(n)
    )
    want = torch.tensor([topk_blocks, topk_blocks, a_blocks, n * (n + 1) / 2]) / (n * (n + 1) / 2)
    assert torch.allclose(stats["density"].cpu(), want.float())
    assert 0 < float(stats["entropy"]) <= 1 and 0 < float(stats["topk_mass"]) <= 1


def test_flex_kernel_choice_and_options(monkeypatch):
    import moezoo.layers.attention.flex as flex

    a = SparsityPattern(type="a_shape", sinks=128, window=2048, block_size=128)
    t = SparsityPattern(type="block_topk", top_k=16, block_size=128)
    v = SparsityPattern(type="vertical_slash", n_vertical=64, n_slash=64, block_size=128)
    # as on a Hopper GPU with flash-attn-4
    monkeypatch.setattr(flex, "flash_kernel_available", lambda: True)
    assert pick_flex_kernel("triton", [a], 65536, 128) == "triton"
    # the presets' layer at 64k (measured)
    assert pick_flex_kernel("auto", [a, t], 65536, 128) == "flash"
    # block top-k: FLASH measured from 64k
    assert pick_flex_kernel("auto", [t], 32768, 128) == "triton"
    assert pick_flex_kernel("auto", [a], 8192, 128) == "triton"  # below the measured length
    assert pick_flex_kernel("auto", [a, v], 65536, 128) == "triton"  # one unmeasured type: Triton
    assert pick_flex_kernel("auto", [a], 65536, 64) == "triton"  # FLASH tiles 128-token blocks
    # per-token selection: its bit-table mask_mod fails FLASH's code generation; the tile union's
    # whole blocks run as block top-k's
    token, union = (dataclasses.replace(t, token_select=n) for n in (1, 2))
    assert pick_flex_kernel("auto", [a, token], 65536, 128) == "triton"
    assert pick_flex_kernel("auto", [union], 65536, 128) == "flash"
    assert pick_flex_kernel("auto", [union], 32768, 128) == "triton"
    # flash-attn-4 missing: never FLASH
    monkeypatch.setattr(flex, "flash_kernel_available", lambda: False)
    assert pick_flex_kernel("auto", [a, t], 65536, 128) == "triton"
    assert kernel_options_for("flash", {"num_stages": 2}) == {"num_stages": 2, "BACKEND": "FLASH"}
    assert kernel_options_for("triton", {}) is None


@pytest.mark.parametrize(
    "pat,match",
    [
        ({"type": "block_topk", "top_k": 0}, r"pattern\.top_k: must be > 0"),
        (
            {"type": "block_topk", "top_k": 2, "share_group": 2},
            r"pattern\.share_group: must be 0 or 1",
        ),
        (
            {"type": "block_topk", "top_k": 2, "query_max": 3},
            r"pattern\.query_max: must be 0 \(the pooled query block\), 1 .* or 2 .*got 3",
        ),
        (
            {"type": "a_shape", "sinks": 2, "window": 8, "query_max": 1},
            r"pattern\.query_max: unknown parameter",
        ),
        (
            {"type": "block_topk", "top_k": 2, "token_select": 2, "min_share": 100},
            r"pattern\.min_share: a percent of a query's attention: must be in \[0, 100\), got 100",
        ),
        (
            {"type": "block_topk", "top_k": 2, "min_share": 10},
            r"pattern\.min_share: filters each query's own choices: set token_select",
        ),
        (
            {"type": "block_topk", "top_k": 2, "token_select": 1, "union_blocks": 4},
            r"pattern\.union_blocks: caps the blocks a query block's union visits: "
            r"set token_select: 2",
        ),
        (
            {"type": "block_topk", "top_k": 4, "token_select": 2, "union_blocks": 3},
            r"pattern\.union_blocks: a query block must fit one query's choices: must be >= top_k "
            r"\(4\), got 3",
        ),
        (
            {"type": "block_topk", "top_k": 2, "token_select": 2, "union_blocks": -1},
            r"pattern\.union_blocks: must be >= 0, got -1",
        ),
        ({"type": "block_topk", "top_k": 2, "n_slash": 3}, r"pattern\.n_slash: unknown parameter"),
        (
            {"type": "vertical_slash", "n_vertical": 2, "n_slash": 2, "keep_columns": -1},
            r"pattern\.keep_columns",
        ),
        (
            {"type": "block_topk", "top_k": 2, "score_block": 12},
            r"pattern\.score_block: must be a power of two",
        ),
        (
            {"type": "block_topk", "top_k": 2, "block_size": 32, "score_block": 64},
            r"pattern\.score_block: .*<= block_size \(32\)",
        ),
        (
            {"type": "a_shape", "sinks": 2, "window": 8, "score_block": 8},
            r"pattern\.score_block: unknown parameter",
        ),
    ],
)
def test_bad_pattern_dicts_fail_naming_the_key(pat, match):
    with pytest.raises(ConfigError, match=match):
        validate_pattern(pat, "pattern")


def test_backend_that_cannot_tile_or_is_missing_fails_before_any_work():
    pats = {"0:*": {"type": "block_topk", "top_k": 2, "block_size": 8}}
    with pytest.raises(
        ConfigError, match=r"model\.attention\.patterns: block_size 8 is below the 16"
    ):
        AttentionConfig(backend="flex", patterns=pats).validate(1, 2)
    with pytest.raises(
        ConfigError, match=r"model\.attention\.flex_kernel: flash tiles 128-token blocks"
    ):
        AttentionConfig(flex_kernel="flash", patterns=pats).validate(1, 2)
    with pytest.raises(ConfigError, match=r"model\.attention\.flex_kernel"):
        AttentionConfig(flex_kernel="cute").validate(1, 2)
    with pytest.raises(
        ConfigError, match=r"model\.attention\.backend: needs flash-attn-4 .*device is cpu"
    ):
        AttentionConfig(backend="flash_attn").check_runtime("cpu")
    AttentionConfig(backend="flex").check_runtime("cpu")  # nothing asked of flash: no error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["triton", "auto"])
def test_preset_layer_on_gpu_flex_meets_fa_criterion_fwd_bwd(kernel):
    # the long-context presets' layer: A-shape heads and GQA-shared block top-k heads (plus a topk
    # head with its own sinks + window), 128-token blocks, compiled flex forward and backward
    a = SparsityPattern(type="a_shape", sinks=16, window=200, block_size=128)
    t = SparsityPattern(type="block_topk", top_k=3, share_group=1, block_size=128)
    tw = SparsityPattern(type="block_topk", top_k=2, sinks=4, window=100, block_size=128)
    pats = [a, a, a, a, t, t, tw, tw]
    run_criterion(pats, "flex", B=2, H=8, Hk=2, T=1000, D=64, device="cuda")
    q, k, v = make_inputs(1, 8, 2, 1024, D=64, device="cuda")
    # also asks for the chosen blocks (the passkey eval's needle recall)
    stats = {"selection": None}
    with torch.no_grad():
        sparse_attention(q, k, v, pats, backend="flex", kernel=kernel, stats=stats)
    assert (stats["density"] <= 1).all() and (stats["density"][4:6] < 1).all()
    sel = stats["selection"]
    assert sel.heads == (4, 5, 6, 7) and torch.equal(
        sel.blocks, plan_pattern(pats, 8, 0, 1024, 1024, 0, q, k).blocks
    )


@pytest.mark.parametrize(
    "N,start,nb", [(256, 0, 4), (200, 0, 4), (200, 30, 5), (5, 130, 1), (1, 63, 1), (300, 70, 6)]
)
def test_block_means_equal_a_per_row_scatter_and_repeat_exactly(N, start, nb):
    # pooled scores choose the blocks: a recompute under activation checkpointing must see the same
    # sums
    from moezoo.layers.attention.selection import _block_mean

    x = torch.randn(2, 3, N, 8, generator=torch.Generator().manual_seed(N + start)).bfloat16()
    blk = torch.div(torch.arange(N) + start, 64, rounding_mode="floor") - start // 64
    sums = torch.zeros(2, 3, nb, 8).index_add_(2, blk, x.float())
    ref = sums / torch.zeros(nb).index_add_(0, blk, torch.ones(N)).clamp(min=1)[:, None]
    got = _block_mean(x, start, 64, nb)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(got, _block_mean(x, start, 64, nb))


def _token_topk_reference(q, k, bs, top_k, group_shared, sub_block=None):
    """Independent per-token selection (NSA Eq. 9-11, MoBA's gate), one query at a time: the
    (group-mean) query . each mean-pooled key block (or its best ``sub_block``-key sub-block), the
    blocks after the query's own masked, its own block forced, top-k -> bool [B, H, T, nk]."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    n = (T + bs - 1) // bs
    sb = sub_block or bs
    out = torch.zeros(B, H, T, n, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            kv = k[b, h // g].float()
            subs = [
                [kv[lo : min(lo + sb, T)].mean(0) for lo in range(i * bs, min((i + 1) * bs, T), sb)]
                for i in range(n)
            ]
            qh = q[b, (h // g) * g : (h // g + 1) * g].float().mean(0) if group_shared else q[b, h]
            for t in range(T):
                own = t // bs
                score = torch.tensor(
                    [max(float(qh[t].float() @ s) for s in subs[i]) for i in range(n)]
                )
                score[own + 1 :] = float("-inf")
                score[own] = float("inf")
                out[b, h, t, score.topk(min(top_k, own + 1)).indices] = True
    return out


@pytest.mark.parametrize("shared,sub", [(0, None), (1, None), (1, 4)])
def test_token_select_keeps_each_querys_own_top_k_blocks(shared, sub):
    B, H, Hk, T = 2, 4, 2, 45  # a ragged last block
    q, k, _ = make_inputs(B, H, Hk, T)
    p = SparsityPattern(
        type="block_topk",
        top_k=3,
        block_size=BS,
        share_group=shared,
        token_select=1,
        score_block=sub or 0,
    )
    plan = plan_pattern(p, H, 0, T, T, 0, q, k)
    assert torch.equal(plan.token_blocks(), _token_topk_reference(q, k, BS, 3, shared, sub))
    # the token mask is exactly: causal, and the key's block among the query's choices
    kb = torch.arange(T) // BS
    want = _token_topk_reference(q, k, BS, 3, shared, sub)[..., kb] & torch.ones(T, T).tril().bool()
    assert torch.equal(pattern_mask(p, T, T, H, q=q, k=k), want)


def _union_reference(per_token, bs, cap=0, share=None):
    """The key blocks any query of each query block chose (``token_select: 2``), with ``cap`` only
    the ``cap`` that a query of the block gives the highest ``share`` of its softmax (its own block
    first, ties to the later block), one query block at a time: ``per_token`` bool [B, H, T, nk],
    ``share`` float [B, H, T, nk] -> bool [B, H, nq, nk]."""
    B, H, T, n = per_token.shape
    out = torch.zeros(B, H, n, n, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(n):
                rows = range(i * bs, min((i + 1) * bs, T))
                best = {
                    j: max(
                        float(share[b, h, t, j]) if share is not None else 0.0
                        for t in rows
                        if per_token[b, h, t, j]
                    )
                    for j in range(n)
                    if per_token[b, h, rows.start : rows.stop, j].any()
                }
                best[i] = float("inf")
                ranked = sorted(best, key=lambda j: (best[j], j), reverse=True)
                out[b, h, i, ranked[: cap or None]] = True
    return out


@pytest.mark.parametrize("shared", [0, 1])
def test_token_select_union_attends_every_block_its_query_block_chose(shared):
    B, H, Hk, T = 2, 4, 2, 45
    q, k, _ = make_inputs(B, H, Hk, T)
    p = SparsityPattern(
        type="block_topk", top_k=3, block_size=BS, share_group=shared, token_select=2
    )
    per_token = _token_topk_reference(q, k, BS, 3, shared)  # [B, H, T, nk]
    union = _union_reference(per_token, BS)  # [B, H, nq, nk]
    plan = plan_pattern(p, H, 0, T, T, 0, q, k)
    assert plan.tok_bits is None and torch.equal(plan.blocks, union)
    kb = torch.arange(T) // BS
    want = union[:, :, kb][..., kb] & torch.ones(T, T).tril().bool()
    assert torch.equal(pattern_mask(p, T, T, H, q=q, k=k), want)


@pytest.mark.parametrize("shared,min_share", [(0, 0), (1, 0), (1, 10)])
def test_union_blocks_keeps_the_blocks_a_query_of_the_block_points_at_most(shared, min_share):
    """``union_blocks``: a query block attends at most that many blocks of its union, those that
    one of its queries gives the highest share of its softmax; the own block always stays."""
    B, H, Hk, T, cap = 2, 4, 2, 64, 3
    q, k, v = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=5)
    q = q * 3
    if min_share:
        per_token = _min_share_reference(q, k, BS, 3, BS, min_share)
    else:
        per_token = _token_topk_reference(q, k, BS, 3, shared)
    union = _union_reference(per_token, BS)
    want = _union_reference(per_token, BS, cap, _share_reference(q, k, BS, BS, shared))
    assert (union.sum(-1) > cap).any() and want.sum() < union.sum()  # the cap binds somewhere
    assert (want & ~union).sum() == 0 and want.diagonal(dim1=2, dim2=3).all()
    kw = dict(token_select=2, min_share=min_share, union_blocks=cap)
    p = SparsityPattern(type="block_topk", top_k=3, block_size=BS, share_group=shared, **kw)
    assert torch.equal(plan_pattern(p, H, 0, T, T, 0, q, k).blocks, want)
    kb = torch.arange(T) // BS
    mask = want[:, :, kb][..., kb] & torch.ones(T, T).tril().bool()
    assert torch.equal(pattern_mask(p, T, T, H, q=q, k=k), mask)
    torch.testing.assert_close(
        sparse_attention(q, k, v, p), plain_attention(q, k, v, mask), rtol=1e-5, atol=1e-5
    )


def test_capped_and_uncapped_unions_beside_a_static_head_in_one_layer():
    """A layer with a capped union (its union read from the tile shares), an uncapped one with
    another budget (the shares are computed for it too) and A-shape heads (no per-token choice):
    each head gets its own union, and the static heads none."""
    B, H, Hk, T = 2, 6, 3, 64
    q, k, v = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=7)
    q = q * 3
    a = SparsityPattern(type="a_shape", sinks=8, window=16, block_size=BS)
    kw = dict(type="block_topk", block_size=BS, share_group=1, token_select=2)
    capped = SparsityPattern(**kw, top_k=3, union_blocks=3)
    free = SparsityPattern(**kw, top_k=2)
    plan = plan_pattern([a, a, capped, capped, free, free], H, 0, T, T, 0, q, k)
    qc, kc = q[:, 2:4], k[:, 1:2]
    per_token = _token_topk_reference(qc, kc, BS, 3, 1)
    want = _union_reference(per_token, BS, 3, _share_reference(qc, kc, BS, BS))
    assert (_union_reference(per_token, BS).sum(-1) > 3).any()  # the cap binds somewhere
    assert torch.equal(plan.blocks[:, 2:4], want)
    free_want = _union_reference(_token_topk_reference(q[:, 4:], k[:, 2:], BS, 2, 1), BS)
    assert torch.equal(plan.blocks[:, 4:], free_want)
    assert not plan.blocks[:, :2].any()


@pytest.mark.parametrize("token_select", [0, 1])
def test_selection_records_no_graph_and_skips_its_sharpness_on_request(token_select):
    """The selection runs outside autograd in a training forward (q, k requiring grad): its stats
    carry no graph; with ``sharpness: False`` it leaves them out and picks the same blocks."""
    B, H, Hk, T = 1, 4, 2, 64
    q, k, _ = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=3)
    q.requires_grad_(True)
    k.requires_grad_(True)
    p = SparsityPattern(
        type="block_topk", top_k=2, block_size=BS, share_group=1, token_select=token_select
    )
    stats, quiet = {}, {"sharpness": False}
    plan = plan_pattern(p, H, 0, T, T, 0, q, k, stats=stats)
    again = plan_pattern(p, H, 0, T, T, 0, q, k, stats=quiet)
    assert not stats["entropy"].requires_grad and not stats["topk_mass"].requires_grad
    assert "entropy" not in quiet and "topk_mass" not in quiet
    if token_select:
        assert torch.equal(plan.token_blocks(), again.token_blocks())
    else:
        assert torch.equal(plan.blocks, again.blocks)


def test_token_select_serves_different_far_keys_for_queries_of_one_block():
    # Two queries of the last block each point at a different far block; one per-block choice of
    # top_k = 2 (own block + one) can hold only one of them, per-token choices hold both.
    B, H, T, D = 1, 1, 64, 16
    q = torch.randn(B, H, T, D) * 0.01
    k = torch.randn(B, H, T, D) * 0.01
    e0, e1 = torch.zeros(D), torch.zeros(D)
    e0[0], e1[1] = 10.0, 10.0
    k[0, 0, 8:16] += e0  # block 1
    k[0, 0, 24:32] += e1  # block 3
    q[0, 0, 60] += e0
    q[0, 0, 61] += e1
    per_block = SparsityPattern(type="block_topk", top_k=2, block_size=BS, query_max=1)
    per_token = SparsityPattern(type="block_topk", top_k=2, block_size=BS, token_select=1)
    mb = pattern_mask(per_block, T, T, H, q=q, k=k)[0, 0]
    mt = pattern_mask(per_token, T, T, H, q=q, k=k)[0, 0]
    assert not (mb[60, 8:16].all() and mb[61, 24:32].all())
    assert mt[60, 8:16].all() and mt[61, 24:32].all()
    assert not mt[60, 24:32].any() and not mt[61, 8:16].any()


def test_token_select_selection_record_answers_per_query():
    B, H, Hk, T = 1, 2, 1, 64  # one KV group: the heads share each query's choice
    q, k, _ = make_inputs(B, H, Hk, T)
    p = SparsityPattern(type="block_topk", top_k=2, block_size=BS, token_select=1, share_group=1)
    stats = {"selection": None}
    plan = plan_pattern(p, H, 0, T, T, 0, q, k, stats=stats)
    sel = stats["selection"]
    rows = plan.token_blocks()
    for t in (9, 40, 63):
        chosen = rows[0, :, t].nonzero()[:, -1].tolist()
        far = next(b for b in range(T // BS) if b not in chosen)
        assert sel.covers(t, [chosen[0] * BS]).all()
        assert not sel.covers(t, [far * BS + 1]).any()
    assert 0 <= float(stats["entropy"]) <= 1 and 0 < float(stats["topk_mass"]) <= 1


def test_token_select_refuses_query_max_and_unknown_modes():
    with pytest.raises(ConfigError, match="query_max"):
        validate_pattern({"type": "block_topk", "top_k": 2, "token_select": 1, "query_max": 1}, "p")
    with pytest.raises(ConfigError, match="token_select"):
        validate_pattern({"type": "block_topk", "top_k": 2, "token_select": 3}, "p")


def _share_topk_reference(q, k, bs, top_k, sub_block, start=0):
    """``query_max: 2`` by a loop over queries: each query (its KV group's mean query) scores every
    key up to itself, a key block by its best pooled sub-block (a sub-block counts from its first
    key on), takes the log softmax over its causal blocks, and each query block keeps the top-k
    blocks by its queries' best log share, its own block forced -> bool [B, H, nq, nk]. ``q`` holds
    the queries at positions ``start ..``; the query blocks from ``start``'s on."""
    B, H, S, D = q.shape
    T = k.shape[2]
    g = H // k.shape[1]
    n = (T + bs - 1) // bs
    qf = q.float().view(B, H // g, g, S, D).mean(2)  # [B, Hk, S, D]
    qf = torch.nn.functional.pad(qf, (0, 0, start, 0))  # row t = position t
    share = torch.full((B, H // g, T, n), float("-inf"))
    for t in range(start, T):
        blocks = torch.full((B, H // g, n), float("-inf"))
        for lo in range(0, t + 1, sub_block):  # the sub-blocks starting at or before t
            key = k[:, :, lo : min(lo + sub_block, T)].float().mean(2)
            s = (qf[:, :, t] * key).sum(-1) / D**0.5
            blocks[:, :, lo // bs] = torch.maximum(blocks[:, :, lo // bs], s)
        share[:, :, t] = blocks.log_softmax(-1)
    out = torch.zeros(B, H, n, n, dtype=torch.bool)
    for i in range(start // bs, n):
        best = share[:, :, i * bs : (i + 1) * bs].amax(2)  # [B, Hk, n]
        best[:, :, i] = float("inf")
        best[:, :, i + 1 :] = float("-inf")
        for b in range(B):
            for h in range(H // g):
                order = sorted(range(i + 1), key=lambda j: (-best[b, h, j].item(), j))
                for j in order[:top_k]:
                    out[b, h * g : (h + 1) * g, i, j] = True
    return out[:, :, start // bs :]


@pytest.mark.parametrize("sub_block", [1, BS // 2, BS])
def test_query_max_share_matches_a_per_query_loop(sub_block):
    """``query_max: 2``: the best query's log share of each block, single keys and pooled sub-blocks
    alike, a partial last block included."""
    B, H, Hk, T = 2, 8, 2, 60
    q, k, _ = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=9)
    p = SparsityPattern(
        type="block_topk",
        top_k=3,
        block_size=BS,
        share_group=1,
        query_max=2,
        score_block=sub_block,
    )
    plan = plan_pattern(p, H, 0, T, T, 0, q, k)
    assert torch.equal(plan.blocks, _share_topk_reference(q, k, BS, 3, sub_block))
    # a chunk of queries starting inside a block (chunked prefill): its rows alone
    start = 2 * BS + 3
    plan = plan_pattern(p, H, start, T - start, T, 0, q[:, :, start:], k)
    assert torch.equal(
        plan.blocks, _share_topk_reference(q[:, :, start:], k, BS, 3, sub_block, start)
    )


def test_query_max_share_prefers_the_query_that_gives_a_block_its_attention():
    """One query of the last block puts nearly all its attention on a key in block 2; another
    query's scores run high everywhere, a little higher in block 5. The best raw score picks block
    5, the best share block 2."""
    B, H, Hk, T = 1, 4, 2, 64
    q, k, _ = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=4)
    q, k = q * 0.1, k * 0.1
    basis = torch.linalg.qr(
        torch.randn(q.shape[-1], 2, generator=torch.Generator().manual_seed(1))
    )[0].T
    k[:, :, 2 * BS + 1] += 6 * basis[0]
    q[:, :, T - 3] += 6 * basis[0]  # 36 / sqrt(D) above every other key
    k[:, :, : 7 * BS] += 4 * basis[1]  # every earlier key leans one way ...
    k[:, :, 5 * BS : 6 * BS] += 1 * basis[1]  # ... block 5's a little more
    q[:, :, T - 5] += 12 * basis[1]  # a query that scores every block high
    picks = {}
    for qmax in (1, 2):
        p = SparsityPattern(
            type="block_topk", top_k=2, block_size=BS, share_group=1, query_max=qmax, score_block=1
        )
        picks[qmax] = plan_pattern(p, H, 0, T, T, 0, q, k).blocks[0, :, -1]
    assert picks[1][:, 5].all() and not picks[1][:, 2].any()
    assert picks[2][:, 2].all() and not picks[2][:, 5].any()


def _share_reference(q, k, bs, sub_block, shared=1):
    """Each query's share of each causal block, one query at a time: the softmax over its causal
    blocks of the (group-mean) query . each block's best (pooled) sub-block that starts at or
    before the query, 0 after it -> float [B, H, T, nk]."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    n = (T + bs - 1) // bs
    out = torch.zeros(B, H, T, n)
    for b in range(B):
        for h in range(H):
            kv = k[b, h // g].float()
            qh = q[b, (h // g) * g : (h // g + 1) * g].float().mean(0) if shared else q[b, h]
            for t in range(T):
                score = torch.full((n,), float("-inf"))
                for lo in range(0, t + 1, sub_block):
                    s = float(qh[t].float() @ kv[lo : min(lo + sub_block, T)].mean(0)) / D**0.5
                    score[lo // bs] = max(score[lo // bs], s)
                out[b, h, t] = score.softmax(0)
    return out


def _min_share_reference(q, k, bs, top_k, sub_block, min_share):
    """``token_select`` with ``min_share``: the group-mean query's top-k as
    ``_token_topk_reference``, then a far choice stays only if its block holds at least
    ``min_share`` % of the query's softmax over the causal blocks (``_share_reference``) -> bool
    [B, H, T, nk]."""
    T = q.shape[2]
    keep = _share_reference(q, k, bs, sub_block) >= min_share / 100
    keep[:, :, torch.arange(T), torch.arange(T) // bs] = True  # the own block
    return _token_topk_reference(q, k, bs, top_k, 1, sub_block) & keep


@pytest.mark.parametrize("sub", [1, 4, BS])
@pytest.mark.parametrize("min_share", [10, 40])
def test_min_share_drops_the_far_choices_a_query_gives_little_attention(sub, min_share):
    """``min_share``: each query's far choices whose block holds less than that share of its
    softmax over its causal blocks drop out, per token and from the tile's union."""
    B, H, Hk, T = 2, 4, 2, 45
    q, k, _ = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=11)
    q = q * 3  # peaked rows as well as spread ones
    kw = dict(type="block_topk", top_k=3, block_size=BS, share_group=1, score_block=sub)
    want = _min_share_reference(q, k, BS, 3, sub, min_share)
    assert want.sum() < _token_topk_reference(q, k, BS, 3, 1, sub).sum()  # some dropped
    assert want.sum(-1).gt(1).any()  # and some kept
    p = SparsityPattern(**kw, token_select=1, min_share=min_share)
    assert torch.equal(plan_pattern(p, H, 0, T, T, 0, q, k).token_blocks(), want)
    union = _union_reference(want, BS)
    p = SparsityPattern(**kw, token_select=2, min_share=min_share)
    assert torch.equal(plan_pattern(p, H, 0, T, T, 0, q, k).blocks, union)


def test_min_share_keeps_every_block_holding_a_key_the_attention_would_weight_that_much():
    """A block's max-pooled share is at least the softmax weight of any of its keys (the block's
    max bounds each key's term; each block's exp(max) is at most the sum over its keys), so with
    single-key scores ``min_share: P`` keeps every block holding a key that the (group-mean)
    query's causal softmax gives at least P%."""
    B, H, Hk, T = 2, 4, 2, 64
    q, k, _ = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=13)
    q = q * 4
    p = SparsityPattern(
        type="block_topk",
        top_k=T // BS - 1,  # room for all the heavy blocks (at most 6 keys hold 15%) and the own
        block_size=BS,
        share_group=1,
        token_select=1,
        score_block=1,
        min_share=15,
    )
    kept = plan_pattern(p, H, 0, T, T, 0, q, k).token_blocks()  # [B, H, T, nk]
    qg = q.view(B, Hk, H // Hk, T, -1).mean(2)
    w = (
        (qg @ k.transpose(-1, -2) / q.shape[-1] ** 0.5)
        .masked_fill(~torch.ones(T, T).tril().bool(), float("-inf"))
        .softmax(-1)
    )  # [B, Hk, T, T]
    heavy = (w >= 0.15).unflatten(-1, (T // BS, BS)).any(-1).repeat_interleave(H // Hk, 1)
    assert heavy.any() and not kept.all()
    assert (kept | ~heavy).all()
