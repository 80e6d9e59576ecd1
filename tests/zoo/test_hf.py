"""zoo.hf for HF LlamaForCausalLM: logit parity both ways, layouts, and configs that must be
refused.

Weights are re-drawn at a large scale (not HF's 0.02 init) so logits are O(1) and a wrong mapping
(a swapped projection, a missed bias, a wrong RoPE) shows far above the 1e-4 tolerance.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import V, assert_same_logits, randomize_, tokens  # noqa: E402
from moezoo.configs import AttentionConfig, ConfigError, ModelConfig, RopeScalingConfig  # noqa: E402
from moezoo.zoo import build_model  # noqa: E402
from moezoo.zoo.hf import from_hf, to_hf  # noqa: E402


def llama(seed: int = 0, **kw):
    base = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500.0,
    )
    base.update(kw)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)).eval()
    randomize_(m, seed)
    return m


def zoo_model(seed: int = 0, **kw):
    base = dict(
        vocab_size=V,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=48,
        max_seq_len=64,
        rope_theta=500.0,
    )
    base.update(kw)
    m = build_model(ModelConfig(**base)).eval()
    randomize_(m, seed)
    return m


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_from_hf_llama_matches_hf_logits_with_gqa_and_tied_or_untied_embeddings(tie, kv_heads):
    hf = llama(seed=kv_heads, num_key_value_heads=kv_heads, tie_word_embeddings=tie)
    model = from_hf(hf)
    assert (
        model.cfg.kv_heads == kv_heads
        and model.cfg.tie_embeddings == tie
        and model.cfg.rope_theta == 500.0
    )
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    assert_same_logits(hf, model, seed=kv_heads)


def test_from_hf_llama_with_linear_rope_scaling_matches_hf_logits():
    hf = llama(seed=3, rope_scaling={"rope_type": "linear", "factor": 4.0})
    model = from_hf(hf)
    assert model.cfg.rope_scaling.type == "linear" and model.cfg.rope_scaling.factor == 4.0
    assert_same_logits(hf, model, seed=3)
    # the scaling matters at this size: the unscaled model is measurably different
    plain = llama(seed=3)
    with torch.no_grad():
        assert (plain(tokens(3)).logits - model(tokens(3))).abs().max() > 1e-2


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("rope", ["none", "linear", "ntk"])
def test_to_hf_of_random_zoo_model_matches_zoo_logits(tie, rope):
    scaling = RopeScalingConfig(type=rope, factor=1.0 if rope == "none" else 3.0)
    model = zoo_model(seed=7, tie_embeddings=tie, rope_scaling=scaling)
    hf = to_hf(model).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.num_key_value_heads == 2 and hf.config.tie_word_embeddings == tie
    assert_same_logits(hf, model, seed=8)


def test_round_trip_zoo_to_hf_to_zoo_preserves_every_weight():
    model = zoo_model(seed=11, n_kv_heads=1)
    back = from_hf(to_hf(model))
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_bf16_round_trip_keeps_dtype_mode_and_float32_rope_frequencies():
    hf = llama(seed=4).to(torch.bfloat16)
    model = from_hf(hf)
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    assert model.rope.inv_freq.dtype == torch.float32
    assert torch.equal(
        model.layers[1].attention.wk.weight, hf.model.layers[1].self_attn.k_proj.weight
    )
    back = to_hf(model.train())
    assert next(back.parameters()).dtype == torch.bfloat16 and back.training
    assert back.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(back.lm_head.weight, hf.lm_head.weight)


def test_llama_attention_bias_imports_when_output_bias_is_zero_and_exports_as_qwen2():
    hf = llama(seed=5, attention_bias=True)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    model = from_hf(hf)
    assert model.cfg.attn_bias and model.layers[0].attention.wq.bias is not None
    assert_same_logits(hf, model, seed=5)
    back = to_hf(model).eval()  # q/k/v biases without an o_proj bias: Qwen2's layout exactly
    assert type(back).__name__ == "Qwen2ForCausalLM"
    assert_same_logits(back, model, seed=6)


def test_llama_nonzero_output_bias_is_refused():
    with pytest.raises(ConfigError, match="o_proj.bias"):
        from_hf(llama(seed=6, attention_bias=True))


def test_transformers4_style_llama_config_with_rope_theta_and_rope_scaling_is_read():
    from types import SimpleNamespace

    from moezoo.zoo.hf_config import config_from_hf

    hc = SimpleNamespace(
        model_type="llama",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=64,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=500.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        attention_bias=False,
        mlp_bias=False,
        pretraining_tp=1,
    )
    cfg = config_from_hf(hc)
    assert (cfg.rope_theta, cfg.rope_scaling.type, cfg.rope_scaling.factor) == (
        500.0,
        "linear",
        2.0,
    )
    assert (cfg.kv_heads, cfg.hidden_dim, cfg.norm_eps, cfg.ffn) == (2, 48, 1e-6, "dense")


ROPE_KEY = "hf.rope_parameters.rope_type"


@pytest.mark.parametrize(
    "override, key",
    [
        (
            dict(rope_parameters={"rope_type": "longrope", "factor": 2.0, "rope_theta": 500.0}),
            ROPE_KEY,
        ),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 500.0}),
            "hf.rope_parameters.original_max_position_embeddings",
        ),
        (
            dict(
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 500.0,
                    "partial_rotary_factor": 0.5,
                }
            ),
            "hf.partial_rotary_factor",
        ),
        (dict(hidden_act="gelu_fast"), "hf.hidden_act"),
        (dict(mlp_bias=True), "hf.mlp_bias"),
    ],
)
def test_hf_configs_moezoo_cannot_express_raise_config_error_naming_the_field(override, key):
    hf_cfg = llama().config
    for k, v in override.items():
        setattr(hf_cfg, k, v)
    from moezoo.zoo.hf_config import config_from_hf

    with pytest.raises(ConfigError) as e:
        config_from_hf(hf_cfg)
    assert e.value.key == key


@pytest.mark.parametrize(
    "patterns",
    [
        {"0:*": {"type": "local", "window": 4}},  # Mistral windows every layer
        {"0:*": {"type": "a_shape", "sinks": 2, "window": 4}},  # no HF model has sinks
        {"0:0-1": {"type": "local", "window": 4}},  # HF windows cover every head
    ],
)
def test_zoo_model_with_sparse_attention_hf_cannot_express_is_refused_by_to_hf(patterns):
    cfg = ModelConfig(
        vocab_size=V,
        dim=32,
        n_layers=2,
        n_heads=4,
        ffn_hidden=48,
        attention=AttentionConfig(patterns=patterns),
    )
    from moezoo.zoo.hf_config import hf_model_type

    with pytest.raises(ConfigError) as e:
        hf_model_type(cfg)
    assert e.value.key == "model.attention.patterns"
