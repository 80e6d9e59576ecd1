"""zoo.hf with Llama 3.1 (``llama3``) RoPE scaling: bit-identical frequencies, float32 logit parity
both ways at a length past the original context, and both transformers config forms (5.x
``rope_parameters``, 4.x ``rope_theta`` + ``rope_scaling``)."""

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import TOL, V, randomize_, tokens  # noqa: E402
from moezoo.configs import ConfigError, ModelConfig, RopeScalingConfig  # noqa: E402
from moezoo.zoo import build_model  # noqa: E402
from moezoo.zoo.hf import from_hf, to_hf  # noqa: E402
from moezoo.zoo.hf_config import config_from_hf  # noqa: E402

# head_dim 8, theta 500: wavelengths 6.3, 30, 140, 660 fall kept / blended / scaled / scaled for an
# original context of 32 with bands at 32/4 and 32/1; 64 tokens run past that context.
ORIG, S = 32, 64
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIG,
}
SMALL = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def llama3(seed: int, scaling=LLAMA3):
    torch.manual_seed(seed)
    params = (
        {"rope_theta": 500.0, **scaling}
        if scaling
        else {"rope_type": "default", "rope_theta": 500.0}
    )
    m = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SMALL, rope_parameters=params)
    ).eval()
    randomize_(m, seed)
    return m


def max_logit_diff(hf_model, model, seed: int) -> float:
    x = tokens(seed, s=S)
    with torch.no_grad():
        ref = hf_model(x).logits.float()
        out = model(x)
    assert ref.std() > 0.1, "logits too small for the tolerance to mean anything"
    return (out - ref).abs().max().item()


def test_from_hf_llama3_scaling_matches_hf_logits_past_the_original_context():
    hf = llama3(seed=1)
    model = from_hf(hf)
    rs = model.cfg.rope_scaling
    assert (
        rs.type,
        rs.factor,
        rs.low_freq_factor,
        rs.high_freq_factor,
        rs.original_max_seq_len,
    ) == ("llama3", 8.0, 1.0, 4.0, ORIG)
    assert torch.equal(model.rope.inv_freq, hf.model.rotary_emb.inv_freq)
    assert max_logit_diff(hf, model, seed=1) < TOL
    # the scaling matters here: HF without it, same weights, is far off
    plain = llama3(seed=1, scaling=None)
    assert max_logit_diff(plain, model, seed=1) > 1e-2


def test_to_hf_of_zoo_model_with_llama3_scaling_matches_zoo_logits():
    rs = RopeScalingConfig(
        type="llama3",
        factor=4.0,
        original_max_seq_len=ORIG,
        low_freq_factor=2.0,
        high_freq_factor=6.0,
    )
    model = build_model(
        ModelConfig(
            vocab_size=V,
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_hidden=48,
            max_seq_len=256,
            rope_theta=500.0,
            rope_scaling=rs,
        )
    ).eval()
    randomize_(model, 2)
    hf = to_hf(model).eval()
    p = hf.config.rope_parameters
    assert (
        p["rope_type"],
        p["factor"],
        p["low_freq_factor"],
        p["high_freq_factor"],
        p["original_max_position_embeddings"],
        p["rope_theta"],
    ) == ("llama3", 4.0, 2.0, 6.0, ORIG, 500.0)
    assert torch.equal(hf.model.rotary_emb.inv_freq, model.rope.inv_freq)
    assert max_logit_diff(hf, model, seed=3) < TOL
    back = from_hf(hf)
    assert back.cfg.rope_scaling == rs


def test_llama3_frequencies_are_bit_identical_to_transformers_at_llama31_size():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moezoo.layers import RotaryEmbedding

    hc = transformers.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_theta": 500000.0,
            **LLAMA3,
            "original_max_position_embeddings": 8192,
        },
    )
    ref, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hc, "cpu")
    theta, rs = config_from_hf(hc).rope_theta, config_from_hf(hc).rope_scaling
    ours = RotaryEmbedding(
        128,
        theta,
        rs.type,
        rs.factor,
        rs.low_freq_factor,
        rs.high_freq_factor,
        rs.original_max_seq_len,
    ).inv_freq
    assert attention_factor == 1.0 and torch.equal(ours, ref)


def hf4_config(**rope):
    return SimpleNamespace(
        model_type="llama",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=256,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        **rope,
    )


def test_transformers4_style_llama31_rope_scaling_is_read():
    hc = hf4_config(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    cfg = config_from_hf(hc)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScalingConfig(
        type="llama3",
        factor=8.0,
        original_max_seq_len=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )


@pytest.mark.parametrize(
    "scaling, key",
    [
        (
            {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"},
            "hf.rope_parameters.low_freq_factor",
        ),
        ({**LLAMA3, "high_freq_factor": 1.0}, "hf.rope_scaling.high_freq_factor"),
        ({**LLAMA3, "factor": 0.5}, "hf.rope_scaling.factor"),
    ],
)
def test_llama3_rope_scaling_moezoo_cannot_take_raises_config_error_naming_the_key(scaling, key):
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf4_config(rope_theta=500.0, rope_scaling=scaling))
    assert e.value.key == key
