"""Llama 3.1 RoPE scaling: inv_freq against a per-frequency float64 formula, the model wiring, and
the config checks that name the bad key."""

import math

import pytest
import torch

from moezoo.configs import ConfigError, ModelConfig, RopeScalingConfig
from moezoo.layers import RotaryEmbedding, apply_rotary
from moezoo.zoo import build_model


def naive_llama3_inv_freq(D, theta, factor, low, high, orig):
    """Meta's ``apply_scaling`` written out one frequency at a time in float64; also returns each
    band."""
    out, bands = [], []
    for i in range(D // 2):
        f = theta ** (-2 * i / D)
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f), bands.append("kept")
        elif wavelen > orig / low:
            out.append(f / factor), bands.append("scaled")
        else:
            s = (orig / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f), bands.append("blended")
    return torch.tensor(out, dtype=torch.float64), bands


@pytest.mark.parametrize(
    "D, theta, factor, low, high, orig",
    [
        (16, 10000.0, 4.0, 1.0, 8.0, 256),  # tiny: two frequencies in each band
        (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B/70B/405B
    ],
)
def test_llama3_inv_freq_matches_per_frequency_formula_in_every_band(
    D, theta, factor, low, high, orig
):
    rope = RotaryEmbedding(
        D,
        theta,
        "llama3",
        factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_seq_len=orig,
    )
    ref, bands = naive_llama3_inv_freq(D, theta, factor, low, high, orig)
    assert {"kept", "scaled", "blended"} <= set(bands)
    assert rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq.double(), ref, rtol=1e-6, atol=0)
    # the rotation uses those frequencies at unscaled positions (past orig for the tiny case)
    pos = torch.randint(0, 1024, (7,))  # float32 angles lose ~1e-4 per 1e3 of position
    cos, sin = rope(pos)
    angles = pos.double()[:, None] * ref[None]
    torch.testing.assert_close(
        cos.double(), torch.cat([angles, angles], -1).cos(), rtol=0, atol=2e-4
    )
    torch.testing.assert_close(
        sin.double(), torch.cat([angles, angles], -1).sin(), rtol=0, atol=2e-4
    )


def test_llama3_inv_freq_is_recomputed_by_init_weights_after_a_meta_build():
    with torch.device("meta"):
        rope = RotaryEmbedding(16, 10000.0, "llama3", 4.0, 1.0, 8.0, 256)
    rope.inv_freq = torch.empty_like(rope.inv_freq, device="cpu")
    rope.init_weights()
    assert torch.equal(
        rope.inv_freq, RotaryEmbedding(16, 10000.0, "llama3", 4.0, 1.0, 8.0, 256).inv_freq
    )


def test_model_with_llama3_scaling_rotates_by_the_configured_frequencies():
    rs = RopeScalingConfig(
        type="llama3",
        factor=4.0,
        original_max_seq_len=64,
        low_freq_factor=1.0,
        high_freq_factor=8.0,
    )
    cfg = ModelConfig(
        vocab_size=64,
        dim=64,
        n_layers=1,
        n_heads=4,
        ffn_hidden=32,
        max_seq_len=256,
        rope_theta=10000.0,
        rope_scaling=rs,
    )
    cfg.validate()
    model = build_model(cfg)
    ref, bands = naive_llama3_inv_freq(16, 10000.0, 4.0, 1.0, 8.0, 64)
    assert {"kept", "scaled", "blended"} <= set(bands)
    torch.testing.assert_close(model.rope.inv_freq.double(), ref, rtol=1e-6, atol=0)
    x = torch.randn(1, 2, 5, 16)
    plain = RotaryEmbedding(16, 10000.0)
    pos = torch.arange(100, 105)
    assert (apply_rotary(x, *model.rope(pos)) - apply_rotary(x, *plain(pos))).abs().max() > 1e-2


@pytest.mark.parametrize(
    "field, value, key",
    [
        ("low_freq_factor", 0.0, "model.rope_scaling.low_freq_factor"),
        ("high_freq_factor", -4.0, "model.rope_scaling.high_freq_factor"),
        # must exceed low_freq_factor=1
        ("high_freq_factor", 1.0, "model.rope_scaling.high_freq_factor"),
        ("original_max_seq_len", 0, "model.rope_scaling.original_max_seq_len"),
        ("factor", 0.5, "model.rope_scaling.factor"),
        ("type", "llama4", "model.rope_scaling.type"),
    ],
)
def test_bad_llama3_rope_scaling_raises_config_error_naming_the_key(field, value, key):
    rs = RopeScalingConfig(type="llama3", factor=8.0)
    setattr(rs, field, value)
    with pytest.raises(ConfigError) as e:
        ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, rope_scaling=rs).validate()
    assert e.value.key == key


def test_layer_refuses_llama3_bands_in_the_wrong_order():
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        RotaryEmbedding(16, scaling="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)
