"""zoo.hf for HF MixtralForCausalLM and Qwen2MoeForCausalLM: logit parity both ways (eval, dropless,
torch reference experts), the transformers 4.x per-expert layout, and MoE configs HF cannot
express."""

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from helpers import V, assert_same_logits, randomize_, tokens  # noqa: E402
from moezoo.configs import ConfigError, ModelConfig, MoEConfig  # noqa: E402
from moezoo.zoo import build_model  # noqa: E402
from moezoo.zoo.hf import from_hf, hf_state_dict, to_hf, zoo_state_dict  # noqa: E402
from moezoo.zoo.hf_config import hf_model_type  # noqa: E402

SMALL = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=500.0,
)


def mixtral(seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        **{**SMALL, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2, **kw}
    )
    m = transformers.MixtralForCausalLM(cfg).eval()
    randomize_(m, seed)
    return m


def qwen2_moe(seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2MoeConfig(
        **{
            **SMALL,
            "num_hidden_layers": 3,
            "intermediate_size": 40,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            **kw,
        }
    )
    m = transformers.Qwen2MoeForCausalLM(cfg).eval()
    randomize_(m, seed)
    return m


def zoo_moe(seed: int = 0, ffn_layers=None, **moe):
    cfg = ModelConfig(
        vocab_size=V,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=40,
        max_seq_len=64,
        rope_theta=500.0,
        ffn="moe",
        ffn_layers=ffn_layers or {},
        moe=MoEConfig(
            **{"num_experts": 4, "top_k": 2, "hidden_dim": 16, "backend": "torch", **moe}
        ),
    )
    m = build_model(cfg).eval()
    randomize_(m, seed)
    return m


@pytest.mark.parametrize("tie", [False, True])
def test_from_hf_mixtral_matches_hf_logits(tie):
    hf = mixtral(seed=1, tie_word_embeddings=tie)
    model = from_hf(hf, moe_backend="torch")
    m = model.cfg.moe
    assert model.cfg.layer_ffn_types() == ["moe", "moe"]
    assert (m.num_experts, m.top_k, model.cfg.expert_hidden_dim, m.shared_experts) == (4, 2, 24, 0)
    assert_same_logits(hf, model, seed=1)


def test_to_hf_of_random_zoo_moe_model_is_mixtral_with_same_logits():
    model = zoo_moe(seed=2)
    hf = to_hf(model).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert hf.config.num_local_experts == 4 and hf.config.intermediate_size == 16
    assert_same_logits(hf, model, seed=2)


@pytest.mark.parametrize("norm_topk", [False, True])
@pytest.mark.parametrize("layers", [dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2)])
def test_from_hf_qwen2_moe_with_shared_expert_dense_layers_and_qkv_bias_matches_hf_logits(
    norm_topk, layers
):
    hf = qwen2_moe(seed=3, norm_topk_prob=norm_topk, **layers)
    model = from_hf(hf, moe_backend="torch")
    cfg = model.cfg
    expected = ["moe", "dense", "moe"] if "mlp_only_layers" in layers else ["dense", "moe", "dense"]
    assert cfg.layer_ffn_types() == expected and cfg.attn_bias
    assert (cfg.moe.shared_experts, cfg.moe.shared_gate, cfg.moe.norm_topk) == (1, True, norm_topk)
    assert model.layers[0].attention.wq.bias is not None
    assert_same_logits(hf, model, seed=3)


@pytest.mark.parametrize("norm_topk, dense_layers", [(False, {}), (True, {"0": "dense"})])
def test_to_hf_of_zoo_model_with_gated_shared_expert_is_qwen2_moe_with_same_logits(
    norm_topk, dense_layers
):
    model = zoo_moe(
        seed=4,
        ffn_layers=dense_layers,
        norm_topk=norm_topk,
        softmax_before_topk=True,
        shared_experts=1,
        shared_hidden_dim=24,
        shared_gate=True,
    )
    hf = to_hf(model).eval()
    assert type(hf).__name__ == "Qwen2MoeForCausalLM" and hf.config.norm_topk_prob == norm_topk
    assert hf.config.mlp_only_layers == [int(k) for k in dense_layers]
    assert_same_logits(hf, model, seed=4)
    back = from_hf(hf)
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_mixtral_sliding_window_maps_to_a_local_pattern_with_same_logits_both_ways():
    hf = mixtral(seed=8, sliding_window=5)
    model = from_hf(hf, moe_backend="torch")
    assert model.cfg.attention.patterns == {"0,1": {"type": "local", "window": 5}}
    assert_same_logits(hf, model, seed=8)  # 13 tokens: the window matters
    back = to_hf(model).eval()
    assert back.config.sliding_window == 5
    assert_same_logits(back, model, seed=9)
    with torch.no_grad():
        assert (mixtral(seed=8)(tokens(8)).logits - model(tokens(8))).abs().max() > 1e-2


def test_qwen2_moe_sliding_layers_map_to_local_patterns_with_same_logits_both_ways():
    hf = qwen2_moe(
        seed=9,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    model = from_hf(hf, moe_backend="torch")
    assert model.cfg.attention.patterns == {"0,2": {"type": "local", "window": 4}}
    assert_same_logits(hf, model, seed=9)
    back = to_hf(model).eval()
    assert back.config.layer_types == hf.config.layer_types and back.config.sliding_window == 4
    assert_same_logits(back, model, seed=10)


def test_aux_loss_coefficient_converts_between_hf_and_moezoo_normalisation():
    hf = mixtral(seed=5, router_aux_loss_coef=0.02, num_experts_per_tok=2)
    model = from_hf(hf)
    assert model.cfg.moe.aux_loss_coef == pytest.approx(0.04)  # HF's loss is K times moezoo's
    assert to_hf(model).config.router_aux_loss_coef == pytest.approx(0.02)


def as_transformers4(hf_model: nn.Module) -> nn.Module:
    """The same weights in the transformers 4.x layout: one Linear per expert, Mixtral under
    block_sparse_moe."""
    mixtral_names = hf_model.config.model_type == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    sd = {}
    for k, v in hf_model.state_dict().items():
        if mixtral_names:
            k = k.replace(".mlp.", ".block_sparse_moe.")
        if k.endswith("experts.gate_up_proj"):
            g, u = v.chunk(2, dim=1)
            for e in range(v.shape[0]):
                sd[k.replace("gate_up_proj", f"{e}.{gate}.weight")] = g[e]
                sd[k.replace("gate_up_proj", f"{e}.{up}.weight")] = u[e]
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                sd[k.replace("down_proj", f"{e}.{down}.weight")] = v[e]
        else:
            sd[k] = v
    root = nn.Module()
    for k, v in sd.items():
        *path, leaf = k.split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, nn.Module())
            mod = getattr(mod, p)
        mod.register_parameter(leaf, nn.Parameter(v.clone()))
    root.config = hf_model.config
    return root.eval()


@pytest.mark.parametrize("make", [mixtral, qwen2_moe])
def test_transformers4_per_expert_layout_maps_to_the_same_zoo_weights(make):
    hf = make(seed=6)
    old = as_transformers4(hf)
    assert any(".experts.3." in k for k in old.state_dict())
    model = from_hf(old, moe_backend="torch")
    new_sd, old_sd = zoo_state_dict(model.cfg, hf), zoo_state_dict(model.cfg, old)
    assert new_sd.keys() == old_sd.keys() and all(torch.equal(new_sd[k], old_sd[k]) for k in new_sd)
    assert_same_logits(hf, model, seed=6)
    exported = hf_state_dict(model, old)
    assert exported.keys() == old.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in old.state_dict().items())


@pytest.mark.parametrize(
    "moe, key",
    [
        (dict(router="sigmoid"), "model.moe.router"),
        (dict(capacity_factor=1.0), "model.moe.capacity_factor"),
        (dict(bias_update_rate=1e-3), "model.moe.bias_update_rate"),
        (dict(shared_experts=1), "model.moe.shared_gate"),
        (dict(norm_topk=False, softmax_before_topk=True), "model.moe.norm_topk"),
    ],
)
def test_moe_configs_without_an_hf_equivalent_raise_config_error_naming_the_key(moe, key):
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn="moe", moe=MoEConfig(**moe))
    with pytest.raises(ConfigError) as e:
        hf_model_type(cfg)
    assert e.value.key == key


def test_dense_layers_without_shared_expert_are_refused_for_mixtral():
    cfg = ModelConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn="moe", ffn_layers={"0": "dense"}
    )
    with pytest.raises(ConfigError) as e:
        hf_model_type(cfg)
    assert e.value.key == "model.ffn_layers"


def test_mixtral_router_jitter_is_refused():
    with pytest.raises(ConfigError) as e:
        from_hf(mixtral(seed=7, router_jitter_noise=0.1))
    assert e.value.key == "hf.router_jitter_noise"
