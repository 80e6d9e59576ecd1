"""zoo.hf for the families beyond Llama/Mixtral/Qwen2-MoE: Mistral, Qwen2, Qwen3, Qwen3-MoE, OLMoE
and DeepSeek-V3 (MLA + group-limited sigmoid routing). Logit parity from_hf and to_hf, KV-cache
decode equal to HF's full pass, YaRN / dynamic NTK RoPE, gate activations, padding masks against HF,
and the HF fields moezoo cannot express refused by name. Tiny float32 models, weights re-drawn large
(helpers)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import HF_FAMILIES, TOL, assert_same_logits, tiny_hf, tokens  # noqa: E402
from moezoo.configs import ConfigError  # noqa: E402
from moezoo.zoo.hf import from_hf, to_hf  # noqa: E402


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_from_hf_and_back_matches_hf_logits_for_each_family(family):
    hf = tiny_hf(family, seed=1)
    model = from_hf(hf, moe_backend="torch")
    assert_same_logits(hf, model, seed=1)
    back = to_hf(model).eval()
    assert type(back).__name__ == type(hf).__name__
    assert_same_logits(back, model, seed=2)


def test_imported_options_say_what_each_family_is():
    q3 = from_hf(tiny_hf("qwen3")).cfg
    assert (q3.qk_norm, q3.head_dim, q3.attn_head_dim) == ("head", 12, 12)
    ol = from_hf(tiny_hf("olmoe")).cfg
    assert (ol.qk_norm, ol.moe.norm_topk, ol.layer_ffn_types()) == ("full", False, ["moe", "moe"])
    ds = from_hf(tiny_hf("deepseek_v3")).cfg
    m = ds.moe
    assert ds.attention_type == "mla" and ds.layer_ffn_types() == ["dense", "moe", "moe"]
    assert (m.router, m.n_group, m.topk_group, m.routed_scaling_factor, m.shared_experts) == (
        "sigmoid",
        4,
        2,
        2.5,
        1,
    )


def _decode_matches_full_pass(hf, model, prefill: int = 5):
    x = tokens(3)
    with torch.no_grad():
        ref = hf(x).logits.float()
        model.setup_cache(x.shape[0], x.shape[1])
        outs = [model(x[:, :prefill])]
        for t in range(prefill, x.shape[1]):
            outs.append(model(x[:, t : t + 1], start_pos=t))
        model.clear_cache()
    assert (torch.cat(outs, 1) - ref).abs().max().item() < TOL


# mistral: sliding-window decode
@pytest.mark.parametrize("family", ["mistral", "qwen3", "deepseek_v3"])
def test_kv_cache_decode_equals_hf_full_pass(family):
    hf = tiny_hf(family, seed=4)
    _decode_matches_full_pass(hf, from_hf(hf, moe_backend="torch"))


def test_deepseek_without_q_lora_and_with_rotate_half_rope_matches_hf():
    hf = tiny_hf(
        "deepseek_v3", seed=5, q_lora_rank=None, rope_interleave=False, norm_topk_prob=False
    )
    model = from_hf(hf, moe_backend="torch")
    assert not hasattr(model.layers[0].attention, "wq_a")
    assert_same_logits(hf, model, seed=5)


YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500.0,
}


@pytest.mark.parametrize(
    "family, rope",
    [
        ("qwen3", YARN),
        (
            "deepseek_v3",
            {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2},
        ),
        ("mistral", {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 500.0}),
    ],
)
def test_yarn_and_dynamic_ntk_rope_match_hf(family, rope):
    kw = dict(rope_parameters=rope)
    if rope["rope_type"] == "dynamic":
        kw["max_position_embeddings"] = 8  # the 13-token input runs past it: theta grows
    hf = tiny_hf(family, seed=6, **kw)
    model = from_hf(hf, moe_backend="torch")
    assert model.cfg.rope_scaling.type == rope["rope_type"]
    assert_same_logits(hf, model, seed=6)
    assert_same_logits(to_hf(model).eval(), model, seed=7)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu2"])
def test_ffn_activations_match_hf_in_dense_and_expert_ffns(act):
    hf = tiny_hf("qwen3_moe", seed=7, hidden_act=act)
    model = from_hf(hf, moe_backend="torch")
    assert model.cfg.layer_ffn_types() == ["dense", "moe"]
    assert_same_logits(hf, model, seed=7)
    assert to_hf(model).config.hidden_act == act


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("with_positions", [False, True])
def test_left_padded_batch_with_attention_mask_matches_hf_on_kept_positions(family, with_positions):
    hf = tiny_hf(family, seed=8)
    model = from_hf(hf, moe_backend="torch")
    x = tokens(8)
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # row 0 left-padded by 4, row 1 full
    kw = dict(attention_mask=mask)
    if with_positions:
        kw["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(x, **kw).logits
        out = model(x, **kw)
    keep = mask.bool()
    assert (out[keep] - ref[keep]).abs().max().item() < TOL
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("override, key", [(dict(clip_qkv=4.0), "hf.clip_qkv")])
def test_olmoe_features_moezoo_lacks_are_refused_by_name(override, key):
    with pytest.raises(ConfigError) as e:
        from_hf(tiny_hf("olmoe", **override))
    assert e.value.key == key


def test_deepseek_features_moezoo_lacks_are_refused_by_name():
    with pytest.raises(ConfigError) as e:
        from_hf(tiny_hf("deepseek_v3", attention_bias=True))
    assert e.value.key == "hf.attention_bias"
