"""Translate between HF ``transformers`` configs and ``configs.ModelConfig`` (used by zoo.hf).

Three HF families map onto the zoo Transformer exactly (same logits):

- ``llama``: dense SwiGLU, GQA, rope_theta, linear or Llama 3.1 (``llama3``) RoPE scaling, tied or untied
  embeddings.
- ``mixtral``: every FFN an MoE, softmax router over all experts, top-k, renormalised.
- ``qwen2_moe``: MoE with one always-on shared expert scaled by ``sigmoid(shared_expert_gate(x))``,
  top-k weights renormalised only with ``norm_topk_prob``, q/k/v biases, dense layers where
  ``mlp_only_layers`` / ``decoder_sparse_step`` say so.

A sliding window (Mixtral ``sliding_window``, Qwen2-MoE ``use_sliding_window`` + ``layer_types``) maps
to a moezoo ``local`` attention pattern: both let query q see keys ``q-W+1 .. q``.

Anything else that would change the function (another activation, HF's dynamic NTK RoPE whose theta
depends on the current sequence length, a separate head_dim) raises ``ConfigError("hf.<field>", reason)``
rather than importing a model that silently differs.
Both transformers 5.x (``rope_parameters``) and 4.x (``rope_theta`` + ``rope_scaling``) configs are read.

The balance-loss coefficient is converted, not copied: HF's ``load_balancing_loss_func`` counts each
token K times (``E * sum_e (c_e / T) * P_e``), K times moezoo's Switch/megablocks normalisation, so
``aux_loss_coef = router_aux_loss_coef * K``. (HF also pools all layers into one loss where moezoo sums
per-layer losses; that only matters for training, and HF applies it only with ``output_router_logits``.)
"""
from __future__ import annotations

from typing import Optional

from configs import AttentionConfig, ConfigError, ModelConfig, MoEConfig, RopeScalingConfig
from configs.errors import check

# HF model_type -> transformers class name
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def hf_rope(hc) -> tuple[float, RopeScalingConfig]:
    """``(rope_theta, scaling)`` from a 5.x ``rope_parameters`` dict or 4.x ``rope_theta``/``rope_scaling``."""
    params = {**(getattr(hc, "rope_scaling", None) or {}), **(getattr(hc, "rope_parameters", None) or {})}
    theta = float(params.get("rope_theta", getattr(hc, "rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, RopeScalingConfig()
    if kind == "linear":
        factor = float(params["factor"])
        orig = int(round(hc.max_position_embeddings / factor))
        return theta, RopeScalingConfig(type="linear", factor=factor, original_max_seq_len=orig)
    if kind == "llama3":
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check(name in params, f"hf.rope_parameters.{name}", "llama3 RoPE scaling needs it")
        # 5.x fills a missing original_max_position_embeddings with max_position_embeddings; so do we
        orig = int(params.get("original_max_position_embeddings") or hc.max_position_embeddings)
        return theta, RopeScalingConfig(type="llama3", factor=float(params["factor"]), original_max_seq_len=orig,
                                        low_freq_factor=float(params["low_freq_factor"]),
                                        high_freq_factor=float(params["high_freq_factor"]))
    if kind == "dynamic":
        raise ConfigError("hf.rope_parameters.rope_type",
                          "HF dynamic NTK recomputes theta from the current sequence length; moezoo's ntk "
                          "scaling is static (theta * factor**(d/(d-2))), so no moezoo RoPE matches it at every length")
    raise ConfigError("hf.rope_parameters.rope_type", f"RoPE type {kind!r} has no moezoo equivalent "
                      "(supported: default, linear, llama3)")


def _check_common(hc) -> None:
    check(hc.model_type in ARCHITECTURES, "hf.model_type",
          f"unsupported model type {hc.model_type!r}; expected one of {', '.join(ARCHITECTURES)}")
    check(hc.hidden_act == "silu", "hf.hidden_act", f"moezoo FFNs are SwiGLU (silu), got {hc.hidden_act!r}")
    head_dim = getattr(hc, "head_dim", None)
    natural = hc.hidden_size // hc.num_attention_heads
    check(head_dim in (None, natural), "hf.head_dim",
          f"head_dim={head_dim} != hidden_size/num_attention_heads={natural}; moezoo derives it from dim")
    check(not getattr(hc, "mlp_bias", False), "hf.mlp_bias", "moezoo FFNs have no bias")


def _hf_windowed_layers(hc) -> tuple[Optional[int], list[int]]:
    """``(W, layers)``: the sliding window of an HF config and the layers using it (``(None, [])``: none)."""
    if hc.model_type == "mixtral" and hc.sliding_window:
        return hc.sliding_window, list(range(hc.num_hidden_layers))
    if hc.model_type == "qwen2_moe" and hc.use_sliding_window and hc.sliding_window:
        types = getattr(hc, "layer_types", None)
        check(types is not None, "hf.layer_types", "use_sliding_window needs layer_types to say which layers slide")
        return hc.sliding_window, [i for i, t in enumerate(types) if t == "sliding_attention"]
    return None, []


def config_from_hf(hc) -> ModelConfig:
    """A ``ModelConfig`` computing the same function as the HF config ``hc`` (validated)."""
    _check_common(hc)
    theta, scaling = hf_rope(hc)
    cfg = ModelConfig(
        vocab_size=hc.vocab_size, dim=hc.hidden_size, n_layers=hc.num_hidden_layers,
        n_heads=hc.num_attention_heads, n_kv_heads=hc.num_key_value_heads or hc.num_attention_heads,
        ffn_hidden=hc.intermediate_size, norm_eps=hc.rms_norm_eps, rope_theta=theta, rope_scaling=scaling,
        max_seq_len=hc.max_position_embeddings, tie_embeddings=bool(hc.tie_word_embeddings),
        init_std=hc.initializer_range,
        # Llama's attention_bias also biases o_proj; zoo.hf accepts that only when those biases are zero.
        attn_bias=bool(getattr(hc, "attention_bias", False) or getattr(hc, "qkv_bias", False)))
    window, windowed = _hf_windowed_layers(hc)
    if windowed:
        cfg.attention = AttentionConfig(patterns={",".join(map(str, windowed)): {"type": "local", "window": window}})
    if hc.model_type == "mixtral":
        check(not hc.router_jitter_noise, "hf.router_jitter_noise",
              "multiplicative router jitter has no moezoo equivalent; set it to 0")
        cfg.ffn = "moe"
        cfg.moe = MoEConfig(num_experts=hc.num_local_experts, top_k=hc.num_experts_per_tok,
                            hidden_dim=hc.intermediate_size, router="softmax", softmax_before_topk=True,
                            norm_topk=True, aux_loss_coef=hc.router_aux_loss_coef * hc.num_experts_per_tok)
    elif hc.model_type == "qwen2_moe" and hc.num_experts > 0:
        cfg.ffn = "moe"
        cfg.ffn_layers = {str(i): "dense" for i in range(hc.num_hidden_layers)
                          if i in (hc.mlp_only_layers or []) or (i + 1) % hc.decoder_sparse_step}
        cfg.moe = MoEConfig(num_experts=hc.num_experts, top_k=hc.num_experts_per_tok,
                            hidden_dim=hc.moe_intermediate_size, router="softmax", softmax_before_topk=True,
                            norm_topk=bool(hc.norm_topk_prob),
                            aux_loss_coef=hc.router_aux_loss_coef * hc.num_experts_per_tok,
                            shared_experts=1, shared_hidden_dim=hc.shared_expert_intermediate_size,
                            shared_gate=True)
    cfg.validate("hf")
    return cfg


def windowed_layers(cfg: ModelConfig) -> tuple[Optional[int], list[int]]:
    """``(W, layers)`` when ``cfg``'s attention patterns are one sliding window (type local, no sinks,
    every head) on some layers and dense elsewhere: the only sparse attention HF models express."""
    key = "model.attention.patterns"
    check(not cfg.attention.minference_json, "model.attention.minference_json",
          "MInference patterns have no HF equivalent")
    windows: dict[int, int] = {}
    for i, heads in enumerate(cfg.attention.layer_head_patterns(cfg.n_layers, cfg.n_heads)):
        heads = [None if h is None or h["type"] == "dense" else h for h in heads]
        if all(h is None for h in heads):
            continue
        p = heads[0]
        check(p is not None and all(h == p for h in heads) and p["type"] == "local" and not p.get("sinks")
              and not p.get("dense_below"), key,
              f"layer {i}: only a sliding window (type local, no sinks or dense_below, on every head) exports to HF")
        windows[i] = p["window"]
    check(len(set(windows.values())) <= 1, key,
          f"HF models take one sliding window, got {sorted(set(windows.values()))}")
    return next(iter(windows.values()), None), sorted(windows)


def hf_model_type(cfg: ModelConfig) -> str:
    """The HF family that expresses ``cfg`` exactly; ConfigError naming the blocking key otherwise."""
    _, windowed = windowed_layers(cfg)
    types = cfg.layer_ffn_types()
    check(set(types) <= {"dense", "moe"}, "model.ffn",
          f"only dense and moe FFNs export to HF, got {sorted(set(types))}")
    if "moe" not in types:
        check(not windowed, "model.attention.patterns", "HF Llama has no sliding window")
        return "llama"
    m = cfg.moe
    check(m.router == "softmax", "model.moe.router", f"HF routers are softmax top-k, got {m.router!r}")
    check(m.capacity_factor is None, "model.moe.capacity_factor", "HF MoE is dropless; capacity_factor must be null")
    check(m.bias_update_rate == 0, "model.moe.bias_update_rate",
          "aux-loss-free selection bias has no HF equivalent; must be 0")
    if m.shared_experts:
        check(m.shared_gate, "model.moe.shared_gate", "Qwen2-MoE gates its shared expert; shared_gate must be true")
        return "qwen2_moe"
    check(not cfg.attn_bias, "model.attn_bias", "Mixtral attention has no bias")
    check(len(windowed) in (0, cfg.n_layers), "model.attention.patterns",
          "Mixtral's sliding window applies to every layer or none")
    check("dense" not in types, "model.ffn_layers",
          "Mixtral has an MoE in every layer; dense layers need a shared-expert (Qwen2-MoE) model")
    check(_renormalised(m), "model.moe.norm_topk", "Mixtral renormalises the top-k weights; norm_topk must be true")
    return "mixtral"


def _renormalised(m: MoEConfig) -> bool:
    # top-k-then-softmax weights sum to one whatever norm_topk says
    return m.norm_topk or not m.softmax_before_topk


def hf_rope_scaling(rs: RopeScalingConfig) -> Optional[dict]:
    """The HF ``rope_scaling`` dict of a linear or llama3 scaling; None for none/ntk (ntk is a larger theta)."""
    if rs.type == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    if rs.type == "llama3":
        return {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor, "original_max_position_embeddings": rs.original_max_seq_len}
    return None


def config_to_hf(cfg: ModelConfig):
    """The transformers config of the HF family that computes the same function as ``cfg``."""
    import transformers

    model_type = hf_model_type(cfg)
    window, windowed = windowed_layers(cfg)
    rope_theta, rope_type = cfg.rope_theta, cfg.rope_scaling.type
    if rope_type == "ntk":  # static NTK-aware scaling is just a larger theta
        rope_theta = cfg.rope_theta * cfg.rope_scaling.factor ** (cfg.head_dim / (cfg.head_dim - 2))
    # rope_theta + rope_scaling: the 4.x keywords, which 5.x folds into rope_parameters
    scaling = hf_rope_scaling(cfg.rope_scaling)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                  num_key_value_heads=cfg.kv_heads, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
                  initializer_range=cfg.init_std, rms_norm_eps=cfg.norm_eps,
                  tie_word_embeddings=cfg.tie_embeddings, rope_theta=rope_theta, rope_scaling=scaling)
    if model_type == "llama":
        return transformers.LlamaConfig(attention_bias=cfg.attn_bias, **common)
    m = cfg.moe
    if model_type == "mixtral":
        common["intermediate_size"] = cfg.expert_hidden_dim
        return transformers.MixtralConfig(num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
                                          router_aux_loss_coef=m.aux_loss_coef / m.top_k, sliding_window=window,
                                          **common)
    dense = [i for i, t in enumerate(cfg.layer_ffn_types()) if t == "dense"]
    return transformers.Qwen2MoeConfig(
        num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=cfg.expert_hidden_dim,
        shared_expert_intermediate_size=cfg.shared_expert_hidden_dim, norm_topk_prob=_renormalised(m),
        router_aux_loss_coef=m.aux_loss_coef / m.top_k, decoder_sparse_step=1, mlp_only_layers=dense,
        qkv_bias=cfg.attn_bias, use_sliding_window=bool(windowed), sliding_window=window,
        max_window_layers=cfg.n_layers,
        layer_types=["sliding_attention" if i in windowed else "full_attention" for i in range(cfg.n_layers)],
        **common)

