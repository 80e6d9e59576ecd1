"""The short causal key convolution (model.attention.key_conv): identity at init, the convolution
itself against a per-position loop, decode equal to the full pass with sparse and dense layers, and
the config checks."""

import pytest
import torch

from helpers import TOL, tiny_attention_model, tokens
from moezoo.configs import AttentionConfig, ConfigError
from moezoo.layers import Attention
from moezoo.layers.rope import RotaryEmbedding

PATS = {
    "0:0-1": {"type": "a_shape", "sinks": 2, "window": 4, "block_size": 4},
    "0:2-3": {"type": "block_topk", "top_k": 2, "token_select": 1, "block_size": 4},
}


def model(key_conv: int, seed: int = 0, mla: bool = False, patterns=None):
    return tiny_attention_model(
        AttentionConfig(key_conv=key_conv, patterns=patterns or {}), seed, mla
    )


def _layers(W):
    torch.manual_seed(0)
    conv = Attention(32, 4, 2, key_conv=W)
    conv.init_weights()
    plain = Attention(32, 4, 2)
    plain.load_state_dict({k: v for k, v in conv.state_dict().items() if k != "k_conv"})
    return conv, plain


def test_identity_at_init_is_the_layer_without_it():
    conv, plain = _layers(4)
    rope = RotaryEmbedding(8, 64)
    x = torch.randn(2, 11, 32)
    cos, sin = rope(torch.arange(11))
    assert torch.allclose(conv(x, cos, sin), plain(x, cos, sin), atol=1e-6, rtol=0)


def test_the_convolution_mixes_each_key_channel_with_its_past_positions_only():
    conv, _ = _layers(3)
    with torch.no_grad():
        conv.k_conv.copy_(torch.randn_like(conv.k_conv))
    k = torch.randn(2, 9, conv.k_conv.shape[0])
    got = conv._convolve_keys(k, 0)
    W = 3
    want = torch.zeros_like(k)
    for t in range(9):
        for j in range(W):
            src = t - W + 1 + j
            if src >= 0:
                want[:, t] += conv.k_conv[:, j] * k[:, src]
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("patterns", [None, PATS])
def test_decode_with_a_cache_equals_the_full_pass(patterns):
    m = model(4, 3, patterns=patterns)
    for layer in m.layers:  # a filter that mixes positions, not the identity
        torch.nn.init.normal_(layer.attention.k_conv, std=0.5)
    x = tokens(5, b=2, s=12)
    with torch.no_grad():
        ref = m(x)
        m.setup_cache(2, 12)
        outs = [m(x[:, :7])] + [m(x[:, t : t + 1], start_pos=t) for t in range(7, 12)]
        m.clear_cache()
    assert (torch.cat(outs, 1) - ref).abs().max().item() < TOL


@pytest.mark.parametrize("taps", [1, 9, -2])
def test_bad_taps_fail_naming_the_key(taps):
    with pytest.raises(ConfigError, match=r"model\.attention\.key_conv"):
        model(taps)


def test_mla_and_hf_export_refuse_it_by_key():
    with pytest.raises(ConfigError, match=r"model\.attention\.key_conv"):
        model(3, mla=True)
    from moezoo.zoo.hf_config import hf_model_type

    with pytest.raises(ConfigError, match=r"model\.attention\.key_conv"):
        hf_model_type(model(3).cfg)
