"""layers.attention.mla.MLA: the latent cache, decode equal to the full pass under sparse patterns,
and the patterns acting on it exactly as the token mask says (against a textbook softmax with
pattern_mask)."""

import pytest
import torch

from helpers import plain_attention, randomize_
from moezoo.layers import SparsityPattern, pattern_mask
from moezoo.layers.attention.mla import MLA
from moezoo.layers.rope import RotaryEmbedding

PATTERNS = [
    None,
    SparsityPattern(type="a_shape", sinks=2, window=3, block_size=4),
    [
        SparsityPattern(type="local", window=2, block_size=4),
        SparsityPattern(type="dense"),
        SparsityPattern(type="bigbird", sinks=1, window=2, random_blocks=1, block_size=4),
        SparsityPattern(type="a_shape", sinks=1, window=4, block_size=4),
    ],
]


def mla(pattern=None, q_lora_rank=12, interleave=True):
    torch.manual_seed(0)
    m = MLA(32, 4, q_lora_rank, 10, 6, 4, 5, interleave, pattern=pattern).eval()
    randomize_(m, 0, std=0.3)
    return m


def inputs(S=11):
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = RotaryEmbedding(4, 100.0)(torch.arange(S))
    return x, cos, sin


@pytest.mark.parametrize("pattern", PATTERNS, ids=["dense", "a_shape", "per_head"])
def test_decode_with_the_latent_cache_equals_the_full_pass(pattern):
    m = mla(pattern)
    x, cos, sin = inputs()
    with torch.no_grad():
        full = m(x, cos, sin)
        m.setup_cache(2, 11)
        outs = [m(x[:, :4], cos[:4], sin[:4])]
        outs += [
            m(x[:, t : t + 1], cos[t : t + 1], sin[t : t + 1], start_pos=t) for t in range(4, 11)
        ]
    # R and Dr per token, no heads
    assert m.cache.c.shape == (2, 11, 10) and m.cache.kr.shape == (2, 11, 4)
    assert (torch.cat(outs, 1) - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("q_lora_rank, interleave", [(12, True), (None, False)])
def test_sparse_pattern_on_mla_is_the_token_mask_applied_to_its_expanded_q_k_v(
    q_lora_rank, interleave
):
    pat = PATTERNS[2]
    m, dense = mla(pat, q_lora_rank, interleave), mla(None, q_lora_rank, interleave)
    x, cos, sin = inputs()
    seen = {}
    dense._attend = lambda q, k, v, off, mask=None: (
        seen.setdefault("qkv", (q, k, v))[0][..., :5] * 0
    )
    with torch.no_grad():
        dense(x, cos, sin)
        q, k, v = seen["qkv"]
        ref = plain_attention(q, k, v, pattern_mask(pat, 11, 11, 4)[None])
        got = m(x, cos, sin)
    want = m.wo(ref.transpose(1, 2).reshape(2, 11, 20))
    assert (got - want).abs().max().item() < 1e-5
