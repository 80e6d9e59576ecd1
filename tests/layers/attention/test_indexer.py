"""Block top-k heads with a learned indexer (``indexer: Di``, DeepSeek-V3.2's lightning indexer /
MiniMax's MSA): the distillation target and loss against per-query loops, in one chunk and in many;
the loss trains the indexer alone; the selection scores the indexer's q, k exactly as a plain head
scores its own; decode with the cache of indexer keys equals the full pass; the config checks."""

import pytest
import torch

from helpers import TOL, decode_layer, tiny_attention_model
from moezoo.configs import AttentionConfig, ConfigError
from moezoo.layers import Attention, SparsityPattern
from moezoo.layers.attention import indexer as indexer_mod
from moezoo.layers.attention.indexer import (
    attention_block_mass,
    distillation_loss,
    indexer_block_log_probs,
)
from moezoo.layers.attention.plan import plan_pattern
from moezoo.layers.rope import RotaryEmbedding, apply_rotary

BS = 4


def _pats(indexer: int, nope: int = 0, **rule):
    rule = {"token_select": 2, "score_block": 1, "union_blocks": 2, **rule}
    sel = SparsityPattern(
        type="block_topk",
        top_k=2,
        block_size=BS,
        share_group=1,
        indexer=indexer,
        score_nope=nope,
        **rule,
    )
    return [sel] * 4


def _loop_block_mass(q, k, q0, bs):
    """Per (batch, KV group, query): the group's heads' causal softmax over keys, summed per block,
    averaged over the heads; float64 loops."""
    B, Hq, S, D = q.shape
    Hk, T = k.shape[1], k.shape[2]
    g, nk = Hq // Hk, (T + bs - 1) // bs
    out = torch.zeros(B, Hk, S, nk, dtype=torch.float64)
    for b in range(B):
        for kv in range(Hk):
            for i in range(S):
                n = q0 + i + 1  # keys up to the query
                for h in range(kv * g, kv * g + g):
                    logits = [
                        float(q[b, h, i].double() @ k[b, kv, t].double()) / D**0.5 for t in range(n)
                    ]
                    p = torch.tensor(logits, dtype=torch.float64).softmax(0)
                    for t in range(n):
                        out[b, kv, i, t // bs] += p[t] / g
    return out


def _loop_log_probs(qi, ki, q0, bs):
    """Per query: log softmax over its causal blocks of the best qi . ki / sqrt(Di) in each (keys up
    to the query), float64; -inf after its own block."""
    B, Hk, S, D = qi.shape
    T = ki.shape[2]
    nk = (T + bs - 1) // bs
    out = torch.full((B, Hk, S, nk), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for kv in range(Hk):
            for i in range(S):
                pos = q0 + i
                best = [
                    max(
                        float(qi[b, kv, i].double() @ ki[b, kv, t].double()) / D**0.5
                        for t in range(j * bs, min(T, j * bs + bs, pos + 1))
                    )
                    for j in range(pos // bs + 1)
                ]
                out[b, kv, i, : len(best)] = torch.tensor(best, dtype=torch.float64).log_softmax(0)
    return out


def _inputs(seed, S=13, T=13):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, S, 8, generator=g)
    k = torch.randn(2, 2, T, 8, generator=g)
    qi = torch.randn(2, 2, S, 6, generator=g, requires_grad=True)
    ki = torch.randn(2, 2, T, 6, generator=g, requires_grad=True)
    return q, k, qi, ki


@pytest.mark.parametrize("chunk", [indexer_mod.CHUNK_ELEMENTS, 2 * 4 * 13 * 3], ids=["one", "many"])
def test_target_and_loss_match_per_query_loops_in_one_chunk_and_many(chunk, monkeypatch):
    monkeypatch.setattr(indexer_mod, "CHUNK_ELEMENTS", chunk)
    q, k, qi, ki = _inputs(0)
    q0 = 0
    mass = attention_block_mass(q, k, q0, BS)
    want = _loop_block_mass(q, k, q0, BS)
    torch.testing.assert_close(mass.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass.sum(-1), torch.ones(2, 2, 13))
    logq = _loop_log_probs(qi.detach(), ki.detach(), q0, BS)
    torch.testing.assert_close(
        indexer_block_log_probs(qi, ki, q0, BS).double(), logq, rtol=1e-5, atol=1e-6
    )
    kl = torch.where(want > 0, want * (want.log() - logq), torch.zeros_like(want)).sum() / (
        2 * 2 * 13
    )
    loss = distillation_loss(qi, ki, q, k, q0, BS)
    torch.testing.assert_close(loss.double(), kl, rtol=1e-5, atol=1e-6)
    # the chunked, checkpointed gradient is the one-pass autograd gradient of the same KL
    loss.backward()
    got = (qi.grad.clone(), ki.grad.clone())
    qi.grad = ki.grad = None
    lp = indexer_block_log_probs(qi, ki, q0, BS)
    m = mass.detach()
    (-(m * lp.masked_fill(m == 0, 0.0)).sum() / (2 * 2 * 13)).backward()
    torch.testing.assert_close(got[0], qi.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ki.grad, rtol=1e-5, atol=1e-6)


def test_queries_after_a_prefix_count_their_keys_from_position_zero():
    q, k, qi, ki = _inputs(1, S=5, T=13)
    torch.testing.assert_close(
        attention_block_mass(q, k, 8, BS).double(),
        _loop_block_mass(q, k, 8, BS),
        rtol=1e-5,
        atol=1e-6,
    )
    torch.testing.assert_close(
        indexer_block_log_probs(qi, ki, 8, BS).double(),
        _loop_log_probs(qi.detach(), ki.detach(), 8, BS),
        rtol=1e-5,
        atol=1e-6,
    )


def _layer(indexer=6, seed=0, weight=1.0, **rule):
    torch.manual_seed(seed)
    pats = _pats(indexer, **rule)
    layer = Attention(32, 4, 2, pattern=pats, backend="reference", indexer_weight=weight)
    layer.init_weights(std=0.3)
    layer.indexer.init_weights(std=0.3)
    return layer


def test_the_distillation_trains_the_indexer_alone():
    """The layer's gradients with the loss added equal those without it, but for the indexer's,
    which only the loss reaches (the selection has no gradient)."""
    layer = _layer()
    x = torch.randn(2, 20, 32)
    cos, sin = RotaryEmbedding(8, 64)(torch.arange(20))
    out = layer(x, cos, sin)
    assert layer.aux_loss.item() > 0
    (out.square().sum() + layer.aux_loss).backward()
    with_loss = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    layer(x, cos, sin).square().sum().backward()
    for n, p in layer.named_parameters():
        if n.startswith("indexer."):
            assert p.grad is None and with_loss[n].abs().sum() > 0, n
        else:
            torch.testing.assert_close(p.grad, with_loss[n], msg=n)
    # evaluation forwards leave it at 0, weight 0 skips it
    layer.eval()
    layer(x, cos, sin)
    assert layer.aux_loss.item() == 0
    off = _layer(weight=0.0)
    off(x, cos, sin)
    assert off.aux_loss.item() == 0


def test_the_selection_scores_the_indexer_as_a_plain_head_scores_its_own():
    """The layer's recorded blocks are the plan's over its indexer's q (repeated over each KV
    group's heads) and k, as a plain head's over the same tensors given as its own q and k."""
    layer = _layer(seed=2)
    x = torch.randn(2, 20, 32)
    cos, sin = RotaryEmbedding(8, 64)(torch.arange(20))
    layer.record_selection = True
    layer(x, cos, sin)
    got = layer.attn_stats["selection"].plan
    qi, ki = layer.indexer(x, cos, sin)
    want = plan_pattern(_pats(0), 4, 0, 20, 20, q=qi.repeat_interleave(2, 1), k=ki)
    assert torch.equal(got.blocks, want.blocks)
    # the layer's own q, k choose otherwise on these inputs: the indexer changes something
    plain = Attention(32, 4, 2, pattern=_pats(0), backend="reference")
    plain.load_state_dict({n: p for n, p in layer.state_dict().items() if "indexer" not in n})
    plain.record_selection = True
    plain(x, cos, sin)
    assert not torch.equal(plain.attn_stats["selection"].plan.blocks, got.blocks)


def test_the_indexer_rotates_its_first_half_as_rope_of_that_width():
    """The first ``rope_dim`` dims of the indexer's q and k are RoPE of that width with the
    attention's theta (an independent RotaryEmbedding), the rest are the plain projections; so a
    query's score of a key depends on their distance, not on where both sit."""
    torch.manual_seed(0)
    ind = indexer_mod.Indexer(32, 2, 16)
    assert ind.rope_dim == 8
    x = torch.randn(2, 9, 32)
    pos = torch.arange(9)
    qi, ki = ind(x, *RotaryEmbedding(32, theta=500.0)(pos))
    q0, k0 = (t.unflatten(-1, (2, 16)).transpose(1, 2) for t in (ind.wq(x), ind.wk(x)))
    cos, sin = RotaryEmbedding(8, theta=500.0)(pos)
    for got, plain in ((qi, q0), (ki, k0)):
        torch.testing.assert_close(got[..., :8], apply_rotary(plain[..., :8], cos, sin))
        torch.testing.assert_close(got[..., 8:], plain[..., 8:])
    qs, ks = ind(x, *RotaryEmbedding(32, theta=500.0)(pos + 37))
    torch.testing.assert_close(
        qs @ ks.transpose(-1, -2), qi @ ki.transpose(-1, -2), atol=1e-5, rtol=1e-5
    )


def test_decode_with_the_cache_of_indexer_keys_equals_the_full_pass():
    """Per-token selection (a query's choice depends on no later query, unlike the tile's union)
    decodes as the full pass computes its rows."""
    layer = _layer(seed=1, indexer=6, token_select=1, union_blocks=0)
    layer.eval()
    x = torch.randn(2, 14, 32)
    cos, sin = RotaryEmbedding(8, 64)(torch.arange(14))
    with torch.no_grad():
        ref = layer(x, cos, sin)
    assert (decode_layer(layer, x, cos, sin, 7) - ref).abs().max().item() < TOL
    assert layer.cache.k_nope.shape == (2, 2, 14, 6)


def test_bad_values_fail_naming_the_key():
    base = dict(type="block_topk", top_k=2, block_size=4, token_select=2, score_block=1)
    with pytest.raises(ConfigError, match=r"patterns\.0\.indexer: scores single keys"):
        tiny_attention_model(AttentionConfig(patterns={"0": dict(base, score_block=2, indexer=8)}))
    with pytest.raises(ConfigError, match=r"patterns\.0\.indexer: .*drop score_nope"):
        tiny_attention_model(AttentionConfig(patterns={"0": dict(base, score_nope=1, indexer=8)}))
    with pytest.raises(ConfigError, match=r"patterns\.0\.indexer: must be >= 0"):
        tiny_attention_model(AttentionConfig(patterns={"0": dict(base, indexer=-1)}))
    with pytest.raises(ConfigError, match=r"share indexer"):
        pats = {"0:0-1": dict(base, indexer=8), "0:2-3": dict(base, indexer=16)}
        tiny_attention_model(AttentionConfig(patterns=pats))
    with pytest.raises(ConfigError, match=r"model\.attention\.indexer_weight: .*>= 0"):
        tiny_attention_model(
            AttentionConfig(patterns={"0": dict(base, indexer=8)}, indexer_weight=-1)
        )
    with pytest.raises(ConfigError, match=r"model\.attention\.patterns\.0\.indexer: .*not MLA"):
        tiny_attention_model(AttentionConfig(patterns={"0": dict(base, indexer=8)}), mla=True)


def test_the_scores_work_counts_the_indexer_width():
    """Scored pairs at width Di count Di / Dh of the attention's (never above what ran)."""
    from moezoo.layers.attention.selection import selection_density

    plain = selection_density(tuple(_pats(0)), 64, 2, head_dim=8)
    narrow = selection_density(tuple(_pats(4)), 64, 2, head_dim=8)
    assert all(a > 0 and abs(b - a / 2) < 1e-12 for a, b in zip(plain, narrow))
    with pytest.raises(ValueError, match="head_dim"):
        selection_density(tuple(_pats(4)), 64, 2)
