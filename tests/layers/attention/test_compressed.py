"""NSA's compressed branch (block top-k ``compress: 1``): the branch against a per-query loop, the
layer's gated mix, the gradient it gives blocks the selection left out, decode, density, bad
configs."""

import dataclasses

import pytest
import torch

from helpers import BS
from moezoo.configs import ConfigError, load_config
from moezoo.layers import Attention, RotaryEmbedding, SparsityPattern
from moezoo.layers.attention.compressed import compressed_attention
from moezoo.layers.rope import apply_rotary

NSA = SparsityPattern(
    type="block_topk", top_k=2, share_group=1, query_max=1, compress=1, block_size=BS
)
LAYER = [SparsityPattern(type="a_shape", sinks=2, window=8, block_size=BS)] * 4 + [NSA] * 4


def _loop_reference(q, k, v, bs, q_offset):
    """Float64, one query at a time: softmax over the means of the complete key blocks ending at or
    before it."""
    B, H, S, D = q.shape
    g = H // k.shape[1]
    out = torch.zeros(B, H, S, v.shape[-1], dtype=torch.float64)
    for h in range(H):
        kk, vv = k[:, h // g].double(), v[:, h // g].double()
        for i in range(S):
            p = q_offset + i
            n = (p + 1) // bs  # blocks 0 .. n-1 end at or before p
            if n == 0:
                continue
            # [B, n, D]
            kc = torch.stack([kk[:, j * bs : (j + 1) * bs].mean(1) for j in range(n)], 1)
            vc = torch.stack([vv[:, j * bs : (j + 1) * bs].mean(1) for j in range(n)], 1)
            w = torch.softmax(torch.einsum("bd,bnd->bn", q[:, h, i].double(), kc) / D**0.5, -1)
            out[:, h, i] = torch.einsum("bn,bnd->bd", w, vc)
    return out


@pytest.mark.parametrize(
    "Hk,bs,T,q_offset", [(2, 8, 45, 0), (4, 16, 64, 0), (1, 8, 37, 30), (2, 8, 20, 3)]
)
def test_compressed_branch_equals_a_per_query_loop_fwd_and_grads(Hk, bs, T, q_offset):
    """Every query, GQA groups, a partial last block, and rows of a decode / chunked prefill
    (``q_offset``)."""
    torch.manual_seed(T)
    B, H, D = 2, 4, 16
    S = T - q_offset
    q = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hk, T, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dy = torch.randn(B, H, S, D, dtype=torch.float64)
    got = compressed_attention(q, k, v, bs, q_offset)
    want = _loop_reference(q, k, v, bs, q_offset)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got, (q, k, v), dy)
    g_want = torch.autograd.grad(want, (q, k, v), dy)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)


def _qkv(attn, x, cos, sin):
    q = attn.wq(x).unflatten(-1, (attn.n_heads, attn.head_dim)).transpose(1, 2)
    k = attn.wk(x).unflatten(-1, (attn.n_kv_heads, attn.head_dim)).transpose(1, 2)
    v = attn.wv(x).unflatten(-1, (attn.n_kv_heads, attn.head_dim)).transpose(1, 2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def test_layer_output_is_the_gated_sum_of_the_fine_and_compressed_branches():
    """Per compressed head ``sigmoid(g_fine) * fine + sigmoid(g_cmp) * compressed``, gates from the
    layer input; the other heads as without the branch. The fine branch is the same layer with
    ``compress: 0``."""
    torch.manual_seed(0)
    dim, H, Hk, T = 64, 8, 2, 50
    attn = Attention(dim, H, Hk, pattern=LAYER)
    attn.init_weights(0.2, 0.2)
    fine = Attention(dim, H, Hk, pattern=[dataclasses.replace(p, compress=0) for p in LAYER])
    fine.load_state_dict(
        {n: t for n, t in attn.state_dict().items() if not n.startswith("branch_gate")}
    )
    rope = RotaryEmbedding(dim // H)
    x = torch.randn(2, T, dim)
    cos, sin = rope(torch.arange(T))
    heads_in = {}
    fine.wo.register_forward_pre_hook(lambda m, a: heads_in.update(fine=a[0]))
    with torch.no_grad():
        got = attn(x, cos, sin)
        fine(x, cos, sin)
        q, k, v = _qkv(attn, x, cos, sin)
        # heads 4-7: KV head 1
        cmp = compressed_attention(q[:, 4:], k, v, BS, kv_heads=torch.tensor([1, 1, 1, 1]))
        # [2, B, 4, S, 1]
        g = torch.sigmoid(attn.branch_gate(x)).unflatten(-1, (2, 4)).permute(2, 0, 3, 1)[..., None]
        per_head = heads_in["fine"].unflatten(-1, (H, dim // H)).transpose(1, 2).clone()
        per_head[:, 4:] = g[0] * per_head[:, 4:] + g[1] * cmp
        want = attn.wo(per_head.transpose(1, 2).flatten(2))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - fine(x, cos, sin)).abs().max() > 1e-2  # the branch changes the output


def test_compressed_branch_gives_gradient_to_a_far_block_the_selection_left_out():
    """The point of the branch: keys of a block outside every query block's top-k get a gradient
    from the last query only through it (hard top-k selection passes none; MoBA, NSA)."""
    torch.manual_seed(3)
    dim, H, Hk, T = 32, 2, 1, 64
    far = slice(8, 16)  # key block 1 (BS = 8), far before the last query's window
    grads = {}
    for c in (0, 1):
        # own block only
        pat = SparsityPattern(type="block_topk", top_k=1, compress=c, block_size=BS)
        attn = Attention(dim, H, Hk, pattern=pat)
        attn.init_weights(0.2, 0.2)
        rope = RotaryEmbedding(dim // H)
        x = torch.randn(1, T, dim, requires_grad=True)
        cos, sin = rope(torch.arange(T))
        attn(x, cos, sin)[:, -1].square().sum().backward()  # the loss of the last position only
        grads[c] = x.grad[0, far].norm()
    assert grads[0] == 0 and grads[1] > 1e-3


def test_decode_steps_equal_prefill_rows_with_the_compressed_branch():
    torch.manual_seed(1)
    dim, H, Hk, T = 64, 8, 2, 53
    attn = Attention(dim, H, Hk, pattern=LAYER, layer_id=1)
    attn.init_weights(0.2, 0.2)
    rope = RotaryEmbedding(dim // H)
    x = torch.randn(2, T, dim)
    cos, sin = rope(torch.arange(T))
    with torch.no_grad():
        attn.setup_cache(2, T)
        attn(x[:, : T - 3], cos[: T - 3], sin[: T - 3], 0)
        steps = [attn(x[:, t : t + 1], cos[t : t + 1], sin[t : t + 1], t) for t in range(T - 3, T)]
        attn.cache = None
        for t, out in zip(range(T - 3, T), steps):
            torch.testing.assert_close(
                out[:, 0],
                attn(x[:, : t + 1], cos[: t + 1], sin[: t + 1])[:, -1],
                atol=1e-5,
                rtol=1e-5,
            )


def test_density_stat_adds_the_compressed_pairs_to_the_visited_blocks():
    torch.manual_seed(2)
    dim, H, Hk, T = 64, 8, 2, 64
    attn = Attention(dim, H, Hk, pattern=LAYER)
    fine = Attention(dim, H, Hk, pattern=[dataclasses.replace(p, compress=0) for p in LAYER])
    fine.load_state_dict(
        {n: t for n, t in attn.state_dict().items() if not n.startswith("branch_gate")}
    )
    rope = RotaryEmbedding(dim // H)
    x = torch.randn(1, T, dim)
    cos, sin = rope(torch.arange(T))
    with torch.no_grad():
        attn(x, cos, sin)
        fine(x, cos, sin)
    n = T // BS
    extra = (T - (BS - 1)) * n / (BS * BS * n * (n + 1) / 2)  # rows that see a block x pooled keys
    want = fine.attn_stats["density"] + torch.tensor([0.0] * 4 + [extra] * 4)
    torch.testing.assert_close(attn.attn_stats["density"], want)


def test_bad_compress_configs_fail_naming_the_key(tmp_path):
    from moezoo.configs.attention import validate_pattern

    with pytest.raises(ConfigError, match="p.compress: must be 0 or 1"):
        validate_pattern({"type": "block_topk", "top_k": 2, "compress": 2}, "p")
    with pytest.raises(
        ConfigError, match="p.compress: unknown parameter for pattern type 'a_shape'"
    ):
        validate_pattern({"type": "a_shape", "sinks": 2, "window": 8, "compress": 1}, "p")
    with pytest.raises(
        ConfigError,
        match="model.attention.patterns: block top-k compress: 1 runs with attention_type mha",
    ):
        load_config(
            "zoo/deepseek_v3_671b.yaml",
            ['model.attention.patterns={"0:*": {type: block_topk, top_k: 2, compress: 1}}'],
        ).validate()
    attn = Attention(32, 2, 1, pattern=NSA)
    from moezoo.layers.attention.masking import AttnMask

    x, (cos, sin) = torch.randn(1, 16, 32), RotaryEmbedding(16)(torch.arange(16))
    mask = AttnMask.build(1, 16, 16, 0, torch.ones(1, 16, dtype=torch.long), None, x.device)
    with pytest.raises(
        ValueError, match="compress: 1 cannot run with padding or packed-document masks"
    ):
        attn(x, cos, sin, 0, mask)


def test_compiled_blocks_count_the_compressed_pairs_and_dst_leaves_the_gates_alone():
    """The budget density a compiled block logs (no stats recorded there) includes the branch's
    pairs, and DST's default targets skip the branch gates (gates, like routers)."""
    from moezoo.configs.dst import DSTConfig
    from moezoo.layers.attention.density import attention_metrics
    from moezoo.layers.dst.targets import dst_parameters

    T = 64
    attn = Attention(64, 8, 2, pattern=LAYER)
    fine = Attention(64, 8, 2, pattern=[dataclasses.replace(p, compress=0) for p in LAYER])
    n = T // BS
    extra = (T - (BS - 1)) * n / (T * (T + 1) / 2) * 4 / 8  # 4 of 8 heads, token-level share
    got = float(attention_metrics(attn, T)["attn/density"]) - float(
        attention_metrics(fine, T)["attn/density"]
    )
    assert abs(got - extra) < 1e-6
    names = [
        n
        for n, _ in dst_parameters(
            torch.nn.Sequential(attn, torch.nn.Linear(64, 64)), None, DSTConfig().exclude
        )
    ]
    assert "0.wq.weight" in names and not any("branch_gate" in n for n in names)


def test_trainer_learns_the_branch_gates_and_resumes_them(tmp_path, corpus_dir):
    """A tiny model with NSA heads through the trainer: the gates train, and a resumed run continues
    from the saved gates (they are ordinary parameters of the checkpoint)."""
    from helpers import tiny_overrides
    from moezoo.training.loop import Trainer

    pats = (
        '{"0-1:0-1": {type: a_shape, sinks: 2, window: 8, block_size: 8}, '
        '"0-1:2-3": {type: block_topk, top_k: 2, share_group: 1, query_max: 1, compress: 1, '
        "block_size: 8}}"
    )

    def ov(sub, **kw):
        extra = {"model.attention.patterns": pats, "train.steps": 6, **kw}
        return tiny_overrides(tmp_path / sub, corpus_dir, **extra)

    t = Trainer(load_config("zoo/tiny_dense.yaml", ov("a")))
    g0 = t.model.layers[0].attention.branch_gate.weight.detach().clone()
    losses = [float(t.train_step()["loss/total"]) for _ in range(3)]
    t.save()
    assert all(torch.isfinite(torch.tensor(losses))) and not torch.equal(
        g0, t.model.layers[0].attention.branch_gate.weight
    )
    more = [float(t.train_step()["loss/total"]) for _ in range(3)]
    r = Trainer(load_config("zoo/tiny_dense.yaml", ov("a", **{"checkpoint.resume": True})))
    assert r.step == 3 and [float(r.train_step()["loss/total"]) for _ in range(3)] == more


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compressed_branch_on_cuda_bf16_meets_the_float64_loop_fwd_bwd():
    """The SDPA kernel CUDA picks for the block-causal bool mask, in bf16 (the trainer's autocast
    dtype), against the float64 per-query loop: bf16-sized errors in the output and every
    gradient."""
    torch.manual_seed(0)
    B, H, Hk, T, D, bs = 1, 4, 2, 1024, 64, 128
    q = torch.randn(B, H, T, D, device="cuda")
    k, v = torch.randn(B, Hk, T, D, device="cuda"), torch.randn(B, Hk, T, D, device="cuda")
    dy = torch.randn(B, H, T, D, device="cuda")
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    got = compressed_attention(*leaves, bs)
    grads = torch.autograd.grad(got, leaves, dy.bfloat16())
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    want = _loop_reference(*ref_leaves, bs, 0)
    ref_grads = torch.autograd.grad(want, ref_leaves, dy.bfloat16().double().cpu())
    for a, b in [(got, want), *zip(grads, ref_grads)]:
        err = float((a.double().cpu() - b).norm() / b.norm())
        assert err < 2e-2, err


def test_heads_with_different_compress_blocks_each_get_their_own_pooling():
    """``compress_block`` pools the branch's keys in blocks other than the selection's; heads of one
    layer with different ones each get their own call, back in head order, and the density counts
    each."""
    torch.manual_seed(0)
    A = SparsityPattern(type="a_shape", sinks=2, window=8, block_size=BS)
    N8 = dataclasses.replace(NSA, compress_block=8)
    pats = [A, N8, NSA, N8, A, NSA, N8, A]
    dim, H, Hk, T = 64, 8, 2, 50
    attn = Attention(dim, H, Hk, pattern=pats)
    attn.init_weights(0.2, 0.2)
    fine = Attention(
        dim, H, Hk, pattern=[dataclasses.replace(p, compress=0, compress_block=0) for p in pats]
    )
    fine.load_state_dict(
        {n: t for n, t in attn.state_dict().items() if not n.startswith("branch_gate")}
    )
    rope = RotaryEmbedding(dim // H)
    x = torch.randn(2, T, dim)
    cos, sin = rope(torch.arange(T))
    heads_in = {}
    fine.wo.register_forward_pre_hook(lambda m, a: heads_in.update(fine=a[0]))
    with torch.no_grad():
        got = attn(x, cos, sin)
        fine(x, cos, sin)
        q, k, v = _qkv(attn, x, cos, sin)
        per_head = heads_in["fine"].unflatten(-1, (H, dim // H)).transpose(1, 2).clone()
        g = torch.sigmoid(attn.branch_gate(x)).unflatten(-1, (2, 5)).permute(2, 0, 3, 1)[..., None]
        for i, h in enumerate(attn.compress_heads):
            kv = slice(h // 4, h // 4 + 1)
            cmp = compressed_attention(
                q[:, h : h + 1], k[:, kv], v[:, kv], pats[h].compress_block or BS
            )[:, 0]
            per_head[:, h] = g[0][:, i] * per_head[:, h] + g[1][:, i] * cmp
        want = attn.wo(per_head.transpose(1, 2).flatten(2))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    from moezoo.layers.attention.compressed import compressed_density

    share = compressed_density(pats, 64, 1.0)
    assert share[1] == (64 - 7) * 8 and share[2] == (64 - 15) * 4 and share[0] == 0


def test_bad_compress_block_fails_naming_the_key():
    from moezoo.configs.attention import validate_pattern

    with pytest.raises(ConfigError, match="p.compress_block: must be a power of two, got 24"):
        validate_pattern(
            {"type": "block_topk", "top_k": 2, "compress": 1, "compress_block": 24}, "p"
        )
    with pytest.raises(
        ConfigError, match="p.compress_block: sizes the compressed branch: set compress: 1 too"
    ):
        validate_pattern({"type": "block_topk", "top_k": 2, "compress_block": 32}, "p")
