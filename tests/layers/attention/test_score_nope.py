"""Block top-k selection on the queries and keys before RoPE (``score_nope: 1``, InfLLM-v2's
``use_nope``): the plan selects from the pre-RoPE tensors it is given, exactly as a plain head
selects from its own q and k; a layer's recorded selection is the one its projections give without
RoPE; decode with the cache of pre-RoPE keys equals the full pass; the config checks."""

import dataclasses

import pytest
import torch

from helpers import TOL, decode_layer, tiny_attention_model
from moezoo.configs import AttentionConfig, ConfigError
from moezoo.layers import Attention, SparsityPattern
from moezoo.layers.attention.plan import plan_pattern
from moezoo.layers.rope import RotaryEmbedding

# per-token, the tile's union, per query block by its best query, mean-pooled; single-key and
# pooled scores
RULES = [
    dict(token_select=1, score_block=1),
    dict(token_select=2),
    dict(query_max=1, score_block=2),
    dict(),
]


def _pats(nope: int, **rule):
    sel = SparsityPattern(
        type="block_topk", top_k=2, block_size=4, share_group=1, score_nope=nope, **rule
    )
    return [SparsityPattern(type="a_shape", sinks=2, window=4, block_size=4), sel, sel, sel]


def _blocks(plan):
    """The plan's block table and per-token bits (per head), empty tensors where it has none."""
    none = torch.zeros(0)
    bits = none if plan.tok_bits is None else plan.tok_bits[:, plan.tok_slot]
    return (none if plan.blocks is None else plan.blocks), bits


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_the_plan_selects_from_the_pre_rope_tensors_as_a_plain_head_from_its_own(rule):
    g = torch.Generator().manual_seed(3)
    q, k, q0, k0 = (torch.randn(2, h, 24, 8, generator=g) for h in (4, 2, 4, 2))
    got = plan_pattern(_pats(1, **rule), 4, 0, 24, 24, q=q, k=k, score_qk=(q0, k0, None))
    want = plan_pattern(_pats(0, **rule), 4, 0, 24, 24, q=q0, k=k0)
    assert all(torch.equal(a, b) for a, b in zip(_blocks(got), _blocks(want)))
    with pytest.raises(ValueError, match="score_qk"):
        plan_pattern(_pats(1, **rule), 4, 0, 24, 24, q=q, k=k)


def test_a_layers_selection_is_the_one_its_projections_give_without_rope():
    """The same weights with and without ``score_nope``: the nope layer under RoPE records the
    selection the plain layer records when RoPE is the identity (cos 1, sin 0)."""
    torch.manual_seed(0)
    rule = dict(token_select=1, score_block=1)
    nope = Attention(32, 4, 2, pattern=_pats(1, **rule), backend="reference")
    nope.init_weights(std=0.3)
    plain = Attention(32, 4, 2, pattern=_pats(0, **rule), backend="reference")
    plain.load_state_dict(nope.state_dict())
    x = torch.randn(2, 20, 32)
    cos, sin = RotaryEmbedding(8, 64)(torch.arange(20))
    chosen = []
    for layer, (c, s) in (
        (nope, (cos, sin)),
        (plain, (torch.ones_like(cos), torch.zeros_like(sin))),
    ):
        layer.record_selection = True
        layer(x, c, s)
        chosen.append(_blocks(layer.attn_stats["selection"].plan))
    assert all(torch.equal(a, b) for a, b in zip(*chosen))
    # with RoPE, the plain layer chooses otherwise on these inputs: the option changes something
    plain(x, cos, sin)
    assert not all(
        torch.equal(a, b) for a, b in zip(chosen[0], _blocks(plain.attn_stats["selection"].plan))
    )


@pytest.mark.parametrize("rule", [RULES[0], dict(token_select=1)], ids=str)
def test_decode_with_the_cache_of_pre_rope_keys_equals_the_full_pass(rule):
    """Per-token selection (a query's choice depends on no later query) decodes as the full pass
    computes its rows. Random layer inputs: no two keys are equal, so no choice rests on a tie
    that float rounding in other shapes could turn."""
    torch.manual_seed(1)
    layer = Attention(32, 4, 2, pattern=_pats(1, **rule), backend="reference")
    layer.init_weights(std=0.3)
    x = torch.randn(2, 14, 32)
    cos, sin = RotaryEmbedding(8, 64)(torch.arange(14))
    with torch.no_grad():
        ref = layer(x, cos, sin)
    assert (decode_layer(layer, x, cos, sin, 7) - ref).abs().max().item() < TOL


def test_bad_values_and_mla_fail_naming_the_key():
    base = dict(type="block_topk", top_k=2, block_size=4)
    with pytest.raises(ConfigError, match=r"score_nope"):
        tiny_attention_model(AttentionConfig(patterns={"0": dict(base, score_nope=2)}))
    with pytest.raises(ConfigError, match=r"score_nope"):
        a_shape = dict(type="a_shape", sinks=2, window=4, block_size=4, score_nope=1)
        tiny_attention_model(AttentionConfig(patterns={"0": a_shape}))
    with pytest.raises(ConfigError, match=r"model\.attention\.patterns\.0\.score_nope"):
        tiny_attention_model(AttentionConfig(patterns={"0": dict(base, score_nope=1)}), mla=True)
    assert dataclasses.replace(SparsityPattern(**base), score_nope=1).score_nope == 1
