"""sparse_attention backends against a float32 reference (FlashAttention's 2x criterion), GQA,
decode, density."""

import dataclasses

import pytest
import torch

from helpers import (
    BS,
    emulated_counts,
    make_inputs,
    mask_mod_covers_whole_tiles,
    plain_attention,
    run_criterion,
)
from moezoo.layers import (
    Attention,
    RotaryEmbedding,
    SparsityPattern,
    attention_density,
    pattern_mask,
    sparse_attention,
)
from moezoo.layers.attention.functional import dense_causal_attention

PATTERNS = {
    "local": SparsityPattern(type="local", window=20, block_size=BS),
    "local_sinks": SparsityPattern(type="local", window=9, sinks=3, block_size=BS),
    "a_shape": SparsityPattern(type="a_shape", sinks=5, window=24, block_size=BS),
    "bigbird": SparsityPattern(type="bigbird", window=17, sinks=4, random_blocks=2, block_size=BS),
    "vertical_slash": SparsityPattern(
        type="vertical_slash", n_vertical=6, n_slash=5, last_q=8, block_size=BS
    ),
    "block_topk": SparsityPattern(type="block_topk", top_k=2, block_size=BS),
    "block_topk_shared": SparsityPattern(
        type="block_topk", top_k=2, sinks=2, window=5, share_group=1, block_size=BS
    ),
    "block_topk_qmax": SparsityPattern(
        type="block_topk", top_k=2, sinks=2, window=5, share_group=1, query_max=1, block_size=BS
    ),
    "block_topk_token": SparsityPattern(
        type="block_topk", top_k=2, sinks=2, window=5, share_group=1, token_select=1, block_size=BS
    ),
    "block_topk_token_union": SparsityPattern(
        type="block_topk", top_k=2, sinks=2, window=5, share_group=1, token_select=2, block_size=BS
    ),
    # the tile union cut to its union_blocks best blocks by share, with min_share
    "block_topk_token_union_capped": SparsityPattern(
        **dict(type="block_topk", top_k=2, sinks=2, window=5, share_group=1, block_size=BS),
        **dict(token_select=2, score_block=1, min_share=5, union_blocks=2),
    ),
    # per-token choices per head (no sharing), scored by sub-blocks, next to per-block heads
    "block_topk_token_mixed": [
        SparsityPattern(type="block_topk", top_k=3, token_select=1, score_block=4, block_size=BS),
        SparsityPattern(type="block_topk", top_k=2, query_max=1, block_size=BS),
    ]
    * 4,
    # one layer, both scoring rules: one estimate per rule
    "block_topk_rules": [
        SparsityPattern(type="block_topk", top_k=3, block_size=BS),
        SparsityPattern(type="block_topk", top_k=2, query_max=1, block_size=BS),
    ]
    * 4,
    "dense": SparsityPattern(type="dense", block_size=BS),
    "mixed": [
        SparsityPattern(type="a_shape", sinks=2, window=8, block_size=BS),
        SparsityPattern(type="vertical_slash", n_vertical=4, n_slash=4, last_q=4, block_size=BS),
        SparsityPattern(type="bigbird", window=5, sinks=1, random_blocks=1, block_size=BS),
        SparsityPattern(type="block_topk", top_k=3, block_size=BS),
    ]
    * 2,
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_reference_backend_meets_fa_criterion_fwd_bwd_every_pattern(name):
    run_criterion(PATTERNS[name], "reference", B=2, H=8, Hk=2, T=75)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "name", ["bigbird", "vertical_slash", "block_topk", "block_topk_shared", "block_topk_qmax"]
)
def test_reference_backend_gqa_groups(name, group):
    run_criterion(PATTERNS[name], "reference", B=2, H=8, Hk=8 // group, T=41)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_flex_backend_forward_meets_fa_criterion_on_cpu(name):
    # FlexAttention has no CPU backward; forward runs its eager path here (compiled on GPU).
    run_criterion(PATTERNS[name], "flex", B=2, H=8, Hk=4, T=75, grads=False)


@pytest.mark.parametrize("group", [1, 8])
def test_flex_backend_forward_gqa_extremes(group):
    run_criterion(PATTERNS["mixed"], "flex", B=2, H=8, Hk=8 // group, T=50, grads=False)


@pytest.mark.parametrize("name", ["a_shape", "bigbird", "vertical_slash", "block_topk", "mixed"])
def test_flex_block_lists_reproduce_the_token_mask(name):
    # Eager flex (the CPU path) ignores the block lists and evaluates mask_mod everywhere; the GPU
    # kernel visits only listed blocks: emulated, every allowed pair once and no other.
    from moezoo.layers.attention.flex import flex_block_mask
    from moezoo.layers.attention.plan import plan_pattern

    B, H, T = 2, 8, 75
    q, k, _ = make_inputs(B, H, 2, T)
    plan = plan_pattern(PATTERNS[name], H, 0, T, T, 0, q, k)
    bm = flex_block_mask(plan)
    assert bm.kv_num_blocks.shape[0] == bm.full_kv_num_blocks.shape[0]
    # block lists without a batch dimension of their own (static patterns) serve every batch element
    assert torch.equal(
        emulated_counts(bm, T).expand(B, H, T, T), plan.token_mask().expand(B, H, T, T).long()
    )


@pytest.mark.parametrize(
    "name", ["a_shape", "bigbird", "vertical_slash", "block_topk", "block_topk_qmax", "mixed"]
)
@pytest.mark.parametrize("T,tile", [(75, 64), (75, 32), (130, 64), (16, 64)])
def test_flex_tiles_of_several_blocks_reproduce_the_token_mask(name, T, tile):
    # CUDA's flex templates need 128-token tiles; smaller blocks are laid out on tiles of several
    # blocks (flex_tile): a tile listed when any of its blocks is, full only when all are, mask_mod
    # inside.
    from moezoo.layers.attention.flex import flex_block_mask
    from moezoo.layers.attention.plan import plan_pattern

    B, H = 2, 8
    q, k, _ = make_inputs(B, H, 2, T, seed=T + tile)
    plan = plan_pattern(PATTERNS[name], H, 0, T, T, 0, q, k)
    bm = flex_block_mask(plan, tile=tile)
    assert bm.BLOCK_SIZE == (tile, tile) and bm.kv_num_blocks.shape[-1] == -(-T // tile)
    assert torch.equal(
        emulated_counts(bm, T).expand(B, H, T, T), plan.token_mask().expand(B, H, T, T).long()
    )
    mask_mod_covers_whole_tiles(bm, T)
    # each tile pools several blocks: its lists are no longer than theirs
    fine = flex_block_mask(plan)
    assert (bm.kv_num_blocks + bm.full_kv_num_blocks).sum() <= (
        fine.kv_num_blocks + fine.full_kv_num_blocks
    ).sum()
    with pytest.raises(ValueError, match="not a multiple"):
        flex_block_mask(plan, tile=BS + 8)


def test_flex_tile_is_128_tokens_on_cuda_and_the_block_elsewhere():
    from moezoo.layers.attention.flex import flex_tile

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [flex_tile(b, cuda) for b in (16, 32, 64, 128, 256, 48)] == [
        128,
        128,
        128,
        128,
        256,
        384,
    ]
    assert [flex_tile(b, cpu) for b in (16, 64, 128)] == [16, 64, 128]


def test_tiled_flex_forward_and_density_on_cpu(monkeypatch):
    # The whole call with 64-token tiles over 16-token blocks (what CUDA runs for blocks under 128):
    # the output meets the reference and the logged density counts tiles, the work a tiled kernel
    # does.
    import importlib

    sa = importlib.import_module("moezoo.layers.attention.functional")
    monkeypatch.setattr(sa, "flex_tile", lambda bs, device: 64)
    B, H, T = 2, 8, 150
    q, k, v = make_inputs(B, H, 4, T, dtype=torch.float32, seed=11)
    pats = PATTERNS["mixed"]
    stats = {}
    got = sparse_attention(q, k, v, pats, backend="flex", stats=stats)
    want = sparse_attention(q, k, v, pats, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    n = -(-T // 64)
    # tiles visited per head, summed over the batch
    tiles = stats["density"] * (n * (n + 1) / 2) * B
    assert stats["density"].shape == (H,) and torch.allclose(tiles, tiles.round(), atol=1e-4)
    assert (tiles > 0).all()


def test_static_block_mask_cache_drops_the_least_recently_used(monkeypatch):
    import importlib
    from collections import OrderedDict

    # the module, not the function layers exports
    sa = importlib.import_module("moezoo.layers.attention.functional")
    monkeypatch.setattr(sa, "_MASK_CACHE", OrderedDict())
    monkeypatch.setattr(sa, "_MASK_CACHE_SIZE", 2)
    pats, cpu = [PATTERNS["bigbird"]] * 2, torch.device("cpu")
    first = sa._static_block_mask(pats, 2, 32, 0, cpu)
    sa._static_block_mask(pats, 2, 48, 0, cpu)
    assert sa._static_block_mask(pats, 2, 32, 0, cpu) is first  # a hit, and now the most recent
    sa._static_block_mask(pats, 2, 64, 0, cpu)  # evicts length 48, not 32
    assert [key[2] for key in sa._MASK_CACHE] == [32, 64]


@pytest.mark.parametrize(
    "name",
    [
        "local_sinks",
        "bigbird",
        "vertical_slash",
        "block_topk",
        "block_topk_shared",
        "block_topk_qmax",
        "mixed",
    ],
)
def test_decode_output_equals_last_row_of_prefill(name):
    torch.manual_seed(0)
    dim, H, Hk, T = 64, 8, 2, 53
    attn = Attention(dim, H, Hk, pattern=PATTERNS[name], layer_id=1)
    attn.init_weights(0.2, 0.2)
    rope = RotaryEmbedding(dim // H)
    x = torch.randn(2, T, dim)
    cos, sin = rope(torch.arange(T))
    with torch.no_grad():
        full = attn(x, cos, sin)  # training-style prefill, no cache
        attn.setup_cache(2, T)
        pre = attn(x[:, : T - 3], cos[: T - 3], sin[: T - 3], 0)  # prefill with cache
        steps = [attn(x[:, t : t + 1], cos[t : t + 1], sin[t : t + 1], t) for t in range(T - 3, T)]
    torch.testing.assert_close(steps[-1][:, 0], full[:, -1], atol=1e-5, rtol=1e-5)
    pats = PATTERNS[name] if isinstance(PATTERNS[name], list) else [PATTERNS[name]]
    # input-dependent masks are estimated from the input's own tail
    if not any(p.dynamic for p in pats):
        torch.testing.assert_close(pre, full[:, : T - 3], atol=1e-5, rtol=1e-5)
    for i, out in enumerate(steps):  # and each step equals the last row of a prefill that long
        t = T - 3 + i
        with torch.no_grad():
            attn.cache = None
            pref = attn(x[:, : t + 1], cos[: t + 1], sin[: t + 1])
        torch.testing.assert_close(out[:, 0], pref[:, -1], atol=1e-5, rtol=1e-5)


VS_DB = dataclasses.replace(PATTERNS["vertical_slash"], dense_below=46)


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_vertical_slash_head_below_dense_below_equals_dense_causal_attention(backend):
    q, k, v = make_inputs(2, 4, 2, 45, dtype=torch.float32, seed=3)
    want = dense_causal_attention(q, k, v)
    torch.testing.assert_close(
        sparse_attention(q, k, v, VS_DB, backend=backend), want, atol=1e-5, rtol=1e-5
    )
    # from dense_below keys on, the pattern is the one without dense_below (and not dense)
    q, k, v = make_inputs(2, 4, 2, 46, dtype=torch.float32, seed=4)
    got = sparse_attention(q, k, v, VS_DB, backend=backend)
    torch.testing.assert_close(
        got,
        sparse_attention(q, k, v, PATTERNS["vertical_slash"], backend=backend),
        atol=1e-6,
        rtol=1e-6,
    )
    assert (got - dense_causal_attention(q, k, v)).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_mixed_layer_with_dense_below_heads_matches_the_reference_per_head(backend):
    """Heads 0 and 2 are dense at 45 keys (dense_below 46), the others sparse: per head, the plain
    float32 softmax under causal rows for the former and the estimated pattern for the latter."""
    B, H, Hk, T = 2, 8, 2, 45
    mixed = PATTERNS["mixed"]
    pats = [
        dataclasses.replace(p, dense_below=46) if h in (0, 2) else p for h, p in enumerate(mixed)
    ]
    q, k, v = make_inputs(B, H, Hk, T, dtype=torch.float32, seed=5)
    mask = pattern_mask(mixed, T, T, H, q=q, k=k).clone()
    mask[:, [0, 2]] = torch.ones(T, T, dtype=torch.bool).tril()
    want = plain_attention(q.double(), k.double(), v.double(), mask).float()
    torch.testing.assert_close(
        sparse_attention(q, k, v, pats, backend=backend), want, atol=1e-5, rtol=1e-5
    )


def test_decode_at_t_keys_follows_prefill_over_t_keys_when_crossing_dense_below():
    """Prefill of 50 keys and the decode step at 51 keys are below dense_below = 52 (vertical-slash
    heads dense); decode steps at 52 and 53 keys are sparse again: each step equals the last row of
    a prefill over the same keys, and that row is the dense (resp. sparse) layer's."""
    torch.manual_seed(2)
    dim, H, Hk, T, db = 64, 8, 2, 53, 52
    mixed = PATTERNS["mixed"]
    with_db = [dataclasses.replace(p, dense_below=db) if p.dynamic else p for p in mixed]
    as_dense = [SparsityPattern(type="dense", block_size=BS) if p.dynamic else p for p in mixed]
    attn = Attention(dim, H, Hk, pattern=with_db, layer_id=1)
    attn.init_weights(0.2, 0.2)
    twins = {}
    for name, pat in (("dense", as_dense), ("sparse", mixed)):
        twins[name] = Attention(dim, H, Hk, pattern=pat, layer_id=1)
        twins[name].load_state_dict(attn.state_dict())
    rope = RotaryEmbedding(dim // H)
    x = torch.randn(2, T, dim)
    cos, sin = rope(torch.arange(T))
    with torch.no_grad():
        attn.setup_cache(2, T)
        pre = attn(x[:, : T - 3], cos[: T - 3], sin[: T - 3], 0)
        steps = [attn(x[:, t : t + 1], cos[t : t + 1], sin[t : t + 1], t) for t in range(T - 3, T)]
        attn.cache = None
        torch.testing.assert_close(
            pre, twins["dense"](x[:, : T - 3], cos[: T - 3], sin[: T - 3]), atol=1e-5, rtol=1e-5
        )
        for t, out in zip(range(T - 3, T), steps):
            n = t + 1  # keys this step attends over
            pref = attn(x[:, :n], cos[:n], sin[:n])
            twin = twins["dense" if n < db else "sparse"](x[:, :n], cos[:n], sin[:n])
            torch.testing.assert_close(out[:, 0], pref[:, -1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[:, 0], twin[:, -1], atol=1e-5, rtol=1e-5)
        # the sparse rows differ
        assert (twins["dense"](x, cos, sin)[:, -1] - steps[-1][:, 0]).abs().max() > 1e-3


def test_flex_backend_module_decodes_through_the_reference_rows():
    torch.manual_seed(1)
    dim, H, T = 32, 4, 40
    attn = Attention(dim, H, 2, pattern=PATTERNS["bigbird"], backend="flex")
    attn.init_weights(0.2, 0.2)
    rope = RotaryEmbedding(dim // H)
    x = torch.randn(1, T, dim)
    cos, sin = rope(torch.arange(T))
    with torch.no_grad():
        full = attn(x, cos, sin)
        attn.setup_cache(1, T)
        attn(x[:, : T - 1], cos[: T - 1], sin[: T - 1], 0)
        last = attn(x[:, T - 1 :], cos[T - 1 :], sin[T - 1 :], T - 1)
    torch.testing.assert_close(last[:, 0], full[:, -1], atol=1e-5, rtol=1e-5)


def test_sparse_output_differs_from_dense_where_mask_differs():
    q, k, v = make_inputs(1, 2, 2, 64, dtype=torch.float32)
    dense = sparse_attention(q, k, v, SparsityPattern(), backend="reference")
    local = sparse_attention(q, k, v, PATTERNS["local"], backend="reference")
    assert torch.allclose(dense[:, :, :20], local[:, :, :20], atol=1e-6)
    assert not torch.allclose(dense[:, :, 40:], local[:, :, 40:], atol=1e-3)


def test_attention_density_per_layer_and_head():
    T, W = 96, 16
    attn = Attention(
        32,
        4,
        2,
        pattern=[SparsityPattern(type="local", window=W)] * 2 + [SparsityPattern()] * 2,
        layer_id=3,
    )
    d = attention_density(attn, T, chunk=40)  # exact: every row counted
    exact = sum(min(W, q + 1) for q in range(T)) / (T * (T + 1) / 2)
    assert d["layer3/head0"] == pytest.approx(exact) and d["layer3/head3"] == 1.0
    assert d["layer3"] == pytest.approx((2 * exact + 2) / 4) and d["mean"] == d["layer3"]
    vs = Attention(
        32,
        2,
        2,
        pattern=SparsityPattern(type="vertical_slash", n_vertical=4, n_slash=4, block_size=16),
        layer_id=0,
    )
    # budget stand-in: columns 0..3, diagonals 0..3 dilated to the query block (keys qs-3 .. q)
    want = sum(
        len(set(range(min(4, q + 1))) | set(range(max(0, q // 16 * 16 - 3), q + 1)))
        for q in range(T)
    )
    assert attention_density(vs, T)["layer0/head1"] == pytest.approx(want / (T * (T + 1) / 2))
    T = 6000  # long: evenly spaced row chunks estimate it
    est = attention_density(attn, T, max_rows=512, chunk=64)["layer3/head0"]
    exact = sum(min(W, q + 1) for q in range(T)) / (T * (T + 1) / 2)
    assert est == pytest.approx(exact, rel=0.01)


def test_flash_attn_backend_maps_window_to_flash_attn_convention(monkeypatch):
    """flash-attn is not installed here: a stand-in with flash-attn's documented semantics (BSHD
    layout, query i sees keys i - window_size[0] .. i + window_size[1], causal) checks our call."""
    import sys
    import types

    def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
        assert causal and window_size[1] == 0
        S = q.shape[1]
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        mask = (j <= i) & (j >= i - window_size[0])
        return plain_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask
        ).transpose(1, 2)

    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=flash_attn_func)
    )
    q, k, v = make_inputs(2, 4, 2, 70, dtype=torch.float32)
    got = sparse_attention(q, k, v, PATTERNS["local"], backend="flash_attn")
    want = sparse_attention(q, k, v, PATTERNS["local"], backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one causal window"):
        sparse_attention(q, k, v, PATTERNS["a_shape"], backend="flash_attn")


def test_attention_rejects_a_bad_per_head_pattern_list_at_construction():
    with pytest.raises(ValueError, match="3 entries for 4 heads"):
        Attention(32, 4, 2, pattern=[PATTERNS["local"]] * 3)
    with pytest.raises(ValueError, match="block_size"):
        Attention(
            32,
            4,
            2,
            pattern=[PATTERNS["local"], SparsityPattern(type="local", window=4, block_size=32)] * 2,
        )


def test_unknown_backend_and_bad_gqa_raise():
    q, k, v = make_inputs(1, 4, 3, 8)
    with pytest.raises(ValueError, match="multiple"):
        sparse_attention(q, k, v, SparsityPattern())
    q, k, v = make_inputs(1, 4, 2, 8)
    with pytest.raises(ValueError, match="backend"):
        sparse_attention(q, k, v, SparsityPattern(), backend="cuda-magic")


# ------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "name", ["a_shape", "vertical_slash", "mixed", "block_topk_token_union_capped"]
)
def test_flex_backend_on_gpu_meets_fa_criterion_fwd_bwd(name):
    pats = PATTERNS[name]
    big = [
        SparsityPattern(**{**p.to_dict(), "block_size": 128})
        for p in (pats if isinstance(pats, list) else [pats])
    ]
    run_criterion(
        big if isinstance(pats, list) else big[0],
        "flex",
        B=2,
        H=8,
        Hk=2,
        T=1000,
        D=64,
        device="cuda",
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bs,D", [(64, 128), (64, 64), (32, 64)])
def test_flex_blocks_under_128_tokens_run_on_gpu_through_128_token_tiles(bs, D):
    # CUDA's flex templates tile 128 tokens at bf16 head dims 64-128 (torch's defaults): a BlockMask
    # of smaller blocks fails there (forward "Q and KV block size must be divisible by BLOCK_M and
    # BLOCK_N", backward with no config), so such layers run on 128-token tiles (flex.flex_tile).
    pats = [SparsityPattern(**{**p.to_dict(), "block_size": bs}) for p in PATTERNS["mixed"]]
    run_criterion(pats, "flex", B=2, H=8, Hk=2, T=1000, D=D, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["bigbird", "vertical_slash"])
def test_reference_backend_on_gpu_meets_fa_criterion_fwd_bwd(name):
    run_criterion(PATTERNS[name], "reference", B=2, H=8, Hk=2, T=300, D=64, device="cuda")
