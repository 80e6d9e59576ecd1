"""Translate between HF ``transformers`` configs and ``configs.ModelConfig`` (used by zoo.hf).

Ten HF families map onto the one zoo Transformer exactly (same logits); what differs between them is
options of it, not code:

- ``llama``: dense gated FFN, GQA, ``head_dim``, ``attention_bias`` (o_proj bias must be zero)
- ``mistral``: Llama + a sliding window on every layer
- ``qwen2``: q/k/v biases, sliding window on the layers ``layer_types`` names
- ``qwen3``: per-head q/k RMSNorm (``qk_norm: head``), explicit ``head_dim``
- ``mixtral``: every FFN an MoE (softmax top-k, renormalised); zoo.hf_moe
- ``qwen2_moe``: MoE + a sigmoid-gated shared expert, dense layers by ``mlp_only_layers`` /
  ``decoder_sparse_step``, ``norm_topk_prob``
- ``qwen3_moe``: Qwen3 attention + Qwen2-MoE routing without the shared expert
- ``olmoe``: q/k RMSNorm over the whole projection (``qk_norm: full``), MoE every layer
- ``deepseek_v3``: MLA (``attention_type: mla``), sigmoid group-limited routing with the
  selection-only ``e_score_correction_bias``, ``routed_scaling_factor``, ungated shared experts,
  ``first_k_dense_replace`` dense layers
- ``deepseek_v2``: MLA (rope pairs always interleaved) + softmax routing, greedy or group-limited
  (best expert per group), never renormalised, ``routed_scaling_factor``

A sliding window maps to a moezoo ``local`` attention pattern (both let query q see keys ``q-W+1 ..
q``). RoPE: default, linear, llama3, yarn (with DeepSeek's mscale / mscale_all_dim) and dynamic NTK,
as HF computes them (layers.rope). FFN ``hidden_act``: silu, gelu, gelu_pytorch_tanh / gelu_new,
relu2.

Anything else that would change the function raises ``ConfigError("hf.<field>", reason)`` naming the
HF field and value, rather than importing a model that silently differs. Both transformers 5.x
(``rope_parameters``) and 4.x (``rope_theta`` + ``rope_scaling``) configs are read.
"""

from __future__ import annotations

from typing import Optional

from moezoo.configs import AttentionConfig, ConfigError, MLAConfig, ModelConfig, RopeScalingConfig
from moezoo.configs.errors import check, require_extra

from .hf_moe import moe_from_hf, moe_hf_kwargs, moe_model_type

# HF model_type -> transformers class name
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "olmoe": "OlmoeConfig",
    "deepseek_v2": "DeepseekV2Config",
    "deepseek_v3": "DeepseekV3Config",
}
ACTS_FROM_HF = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu2": "relu2",
}
ACTS_TO_HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu2": "relu2"}
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def hf_rope(hc) -> tuple[float, RopeScalingConfig]:
    """``(rope_theta, scaling)`` from a 5.x ``rope_parameters`` dict or 4.x
    ``rope_theta``/``rope_scaling``."""
    params = {
        **(getattr(hc, "rope_scaling", None) or {}),
        **(getattr(hc, "rope_parameters", None) or {}),
    }
    theta = float(params.get("rope_theta", getattr(hc, "rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    prf = params.get("partial_rotary_factor", getattr(hc, "partial_rotary_factor", 1.0))
    check(prf in (None, 1.0), "hf.partial_rotary_factor", f"={prf}: moezoo rotates every head dim")
    if kind != "yarn" and params.get("mscale_all_dim"):
        raise ConfigError(
            "hf.rope_parameters.mscale_all_dim",
            f"={params['mscale_all_dim']} is read only with yarn here",
        )
    if kind == "default":
        return theta, RopeScalingConfig()
    if kind == "linear":
        factor = float(params["factor"])
        orig = int(round(hc.max_position_embeddings / factor))
        return theta, RopeScalingConfig(type="linear", factor=factor, original_max_seq_len=orig)
    if kind == "llama3":
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check(name in params, f"hf.rope_parameters.{name}", "llama3 RoPE scaling needs it")
        # 5.x fills a missing original_max_position_embeddings with max_position_embeddings; so do
        # we
        orig = int(params.get("original_max_position_embeddings") or hc.max_position_embeddings)
        return theta, RopeScalingConfig(
            type="llama3",
            factor=float(params["factor"]),
            original_max_seq_len=orig,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    if kind == "dynamic":  # HF grows theta past max_position_embeddings (its L0)
        return theta, RopeScalingConfig(
            type="dynamic",
            factor=float(params["factor"]),
            original_max_seq_len=int(hc.max_position_embeddings),
        )
    if kind == "yarn":
        orig = params.get("original_max_position_embeddings")
        check(
            orig is not None,
            "hf.rope_parameters.original_max_position_embeddings",
            "yarn RoPE scaling needs it",
        )
        factor = params.get("factor") or hc.max_position_embeddings / orig
        y = {k: params[k] for k in _YARN_KEYS if params.get(k) is not None}
        y.setdefault("beta_fast", 32.0)
        y.setdefault("beta_slow", 1.0)
        return theta, RopeScalingConfig(
            type="yarn", factor=float(factor), original_max_seq_len=int(orig), **y
        )
    raise ConfigError(
        "hf.rope_parameters.rope_type",
        f"RoPE type {kind!r} has no moezoo equivalent "
        "(supported: default, linear, llama3, yarn, dynamic)",
    )


def hf_rope_scaling(rs: RopeScalingConfig) -> Optional[dict]:
    """The HF ``rope_scaling`` dict of ``rs``; None for none/ntk (ntk is a larger theta)."""
    if rs.type == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    if rs.type == "llama3":
        return {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_seq_len,
        }
    if rs.type == "dynamic":
        return {"rope_type": "dynamic", "factor": rs.factor}
    if rs.type == "yarn":
        d = {
            "rope_type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_seq_len,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim,
            "truncate": rs.truncate,
        }
        return d if rs.attention_factor is None else {**d, "attention_factor": rs.attention_factor}
    return None


def _check_common(hc) -> None:
    check(
        hc.model_type in ARCHITECTURES,
        "hf.model_type",
        f"unsupported model type {hc.model_type!r}; expected one of {', '.join(ARCHITECTURES)}",
    )
    check(
        hc.hidden_act in ACTS_FROM_HF,
        "hf.hidden_act",
        f"={hc.hidden_act!r}; moezoo's gated FFNs take {', '.join(ACTS_FROM_HF)}",
    )
    check(not getattr(hc, "mlp_bias", False), "hf.mlp_bias", "=True; moezoo FFNs have no bias")
    if hc.model_type == "olmoe":
        check(hc.clip_qkv is None, "hf.clip_qkv", f"={hc.clip_qkv}: moezoo does not clamp q/k/v")


def _hf_windowed_layers(hc) -> tuple[Optional[int], list[int]]:
    """``(W, layers)``: the sliding window of an HF config and the layers using it (``(None, [])``:
    none)."""
    window = getattr(hc, "sliding_window", None)
    if not window or not getattr(hc, "use_sliding_window", True):
        return None, []
    types = getattr(hc, "layer_types", None)
    if hc.model_type in ("qwen2", "qwen3", "qwen2_moe"):
        check(
            types is not None,
            "hf.layer_types",
            "use_sliding_window needs layer_types to say which layers slide",
        )
        return window, [i for i, t in enumerate(types) if t == "sliding_attention"]
    if hc.model_type in ("mistral", "mixtral", "qwen3_moe"):  # one window on every layer
        return window, list(range(hc.num_hidden_layers))
    raise ConfigError(
        "hf.sliding_window", f"={window}: {hc.model_type} models have no sliding window in moezoo"
    )


def _mla_from_hf(hc) -> MLAConfig:
    check(not hc.attention_bias, "hf.attention_bias", "=True: moezoo MLA projections have no bias")
    check(
        hc.num_key_value_heads == hc.num_attention_heads,
        "hf.num_key_value_heads",
        f"={hc.num_key_value_heads}: MLA expands its latent to "
        f"num_attention_heads={hc.num_attention_heads} heads",
    )
    # V2: complex pairs
    return MLAConfig(
        q_lora_rank=hc.q_lora_rank,
        kv_lora_rank=hc.kv_lora_rank,
        qk_nope_head_dim=hc.qk_nope_head_dim,
        qk_rope_head_dim=hc.qk_rope_head_dim,
        v_head_dim=hc.v_head_dim,
        rope_interleave=bool(getattr(hc, "rope_interleave", True)),
    )


def config_from_hf(hc) -> ModelConfig:
    """A ``ModelConfig`` computing the same function as the HF config ``hc`` (validated)."""
    _check_common(hc)
    theta, scaling = hf_rope(hc)
    t = hc.model_type
    head_dim = getattr(hc, "head_dim", None)
    natural = hc.hidden_size // hc.num_attention_heads
    cfg = ModelConfig(
        vocab_size=hc.vocab_size,
        dim=hc.hidden_size,
        n_layers=hc.num_hidden_layers,
        n_heads=hc.num_attention_heads,
        n_kv_heads=hc.num_key_value_heads or hc.num_attention_heads,
        ffn_hidden=hc.intermediate_size,
        norm_eps=hc.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=hc.max_position_embeddings,
        tie_embeddings=bool(hc.tie_word_embeddings),
        init_std=hc.initializer_range,
        ffn_act=ACTS_FROM_HF[hc.hidden_act],
        qk_norm=QK_NORM.get(t, "none"),
        # Qwen2 always biases q/k/v; Llama-style attention_bias also biases o_proj, accepted only
        # when zero.
        attn_bias=t == "qwen2"
        or bool(getattr(hc, "attention_bias", False) or getattr(hc, "qkv_bias", False)),
    )
    if t in ("deepseek_v2", "deepseek_v3"):
        cfg.attention_type, cfg.mla, cfg.attn_bias = "mla", _mla_from_hf(hc), False
    elif head_dim not in (None, natural):
        cfg.attn_head_dim = head_dim
    window, windowed = _hf_windowed_layers(hc)
    if windowed:
        cfg.attention = AttentionConfig(
            patterns={",".join(map(str, windowed)): {"type": "local", "window": window}}
        )
    moe_from_hf(hc, cfg)
    cfg.validate("hf")
    return cfg


def windowed_layers(cfg: ModelConfig) -> tuple[Optional[int], list[int]]:
    """``(W, layers)`` when ``cfg``'s attention patterns are one sliding window (type local, no
    sinks, every head) on some layers and dense elsewhere: the only sparse attention HF models
    express."""
    key = "model.attention.patterns"
    check(
        not cfg.attention.minference_json,
        "model.attention.minference_json",
        "MInference patterns have no HF equivalent",
    )
    windows: dict[int, int] = {}
    for i, heads in enumerate(cfg.attention.layer_head_patterns(cfg.n_layers, cfg.n_heads)):
        heads = [None if h is None or h["type"] == "dense" else h for h in heads]
        if all(h is None for h in heads):
            continue
        p = heads[0]
        check(
            p is not None
            and all(h == p for h in heads)
            and p["type"] == "local"
            and not p.get("sinks")
            and not p.get("dense_below"),
            key,
            f"layer {i}: only a sliding window "
            "(type local, no sinks or dense_below, on every head) exports to HF",
        )
        windows[i] = p["window"]
    check(
        len(set(windows.values())) <= 1,
        key,
        f"HF models take one sliding window, got {sorted(set(windows.values()))}",
    )
    return next(iter(windows.values()), None), sorted(windows)


def hf_model_type(cfg: ModelConfig) -> str:
    """The HF family that expresses ``cfg`` exactly; ConfigError naming the blocking key
    otherwise."""
    _, windowed = windowed_layers(cfg)
    types = cfg.layer_ffn_types()
    check(not cfg.attention.ssmax, "model.attention.ssmax", "HF models have no SSMax query scale")
    check(
        not cfg.attention.key_conv, "model.attention.key_conv", "HF models have no key convolution"
    )
    check(
        set(types) <= {"dense", "moe"},
        "model.ffn",
        f"only dense and moe FFNs export to HF, got {sorted(set(types))}",
    )
    every = len(windowed) == cfg.n_layers
    if cfg.attention_type == "mla" or "moe" in types:
        return moe_model_type(cfg, windowed)
    if cfg.qk_norm == "head":
        return "qwen3"
    check(
        cfg.qk_norm == "none",
        "model.qk_norm",
        "a whole-projection q/k norm exports only as OLMoE (an MoE)",
    )
    if cfg.attn_bias:
        return "qwen2"
    if windowed:
        check(
            every,
            "model.attention.patterns",
            "Mistral's sliding window applies to every layer "
            "(a per-layer window needs q/k/v biases: Qwen2)",
        )
        return "mistral"
    return "llama"


def config_to_hf(cfg: ModelConfig):
    """The transformers config of the HF family that computes the same function as ``cfg``."""
    require_extra("transformers", "hf", "zoo.hf_config.config_to_hf")
    import transformers

    model_type = hf_model_type(cfg)
    window, windowed = windowed_layers(cfg)
    rope_theta, rs = cfg.rope_theta, cfg.rope_scaling
    if rs.type == "ntk":  # static NTK-aware scaling is just a larger theta
        rope_theta = cfg.rope_theta * rs.factor ** (cfg.rope_dim / (cfg.rope_dim - 2))
    # HF dynamic's L0
    max_pos = rs.original_max_seq_len if rs.type == "dynamic" else cfg.max_seq_len
    # rope_theta + rope_scaling: the 4.x keywords, which 5.x folds into rope_parameters
    kw = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        hidden_act=ACTS_TO_HF[cfg.ffn_act],
        max_position_embeddings=max_pos,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_theta=rope_theta,
        rope_scaling=hf_rope_scaling(rs),
    )
    if cfg.attention_type != "mla":
        kw["head_dim"] = cfg.head_dim
    if model_type in ("llama", "qwen3", "qwen3_moe", "olmoe"):
        kw["attention_bias"] = cfg.attn_bias
    if model_type in ("mistral", "mixtral", "qwen3_moe"):
        kw["sliding_window"] = window
        if model_type == "qwen3_moe":
            kw["use_sliding_window"] = bool(windowed)
    if model_type in ("qwen2", "qwen3", "qwen2_moe"):
        kw.update(
            use_sliding_window=bool(windowed),
            sliding_window=window,
            max_window_layers=cfg.n_layers,
            layer_types=[
                "sliding_attention" if i in windowed else "full_attention"
                for i in range(cfg.n_layers)
            ],
        )
    if cfg.attention_type == "mla":
        m = cfg.mla
        check(
            model_type == "deepseek_v3" or m.rope_interleave,
            "model.mla.rope_interleave",
            "DeepSeek-V2 rotates interleaved pairs; must be true",
        )
        kw.update(
            q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim,
            rope_interleave=m.rope_interleave,
            attention_bias=False,
            num_key_value_heads=cfg.n_heads,
        )
    kw.update(moe_hf_kwargs(cfg, model_type))
    return getattr(transformers, CONFIG_CLASSES[model_type])(**kw)
