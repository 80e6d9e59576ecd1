"""The MoE half of zoo.hf_config: HF MoE families <-> ``model.ffn`` / ``ffn_layers`` / ``moe``.

- ``mixtral``: every FFN an MoE, softmax over all experts, top-k, renormalised.
- ``qwen2_moe``: + one always-on shared expert scaled by ``sigmoid(shared_expert_gate(x))``; top-k
  weights renormalised only with ``norm_topk_prob``; dense layers where ``mlp_only_layers`` /
  ``decoder_sparse_step`` say so.
- ``qwen3_moe``: Qwen2-MoE's routing and dense-layer rule, no shared expert.
- ``olmoe``: softmax top-k on every layer, ``norm_topk_prob`` (False in OLMoE-1B-7B).
- ``deepseek_v3``: sigmoid scores; ``e_score_correction_bias`` (moezoo's ``expert_bias`` buffer)
  added for selection only; group-limited top-k (``n_group``, ``topk_group``); ``norm_topk_prob``;
  weights times ``routed_scaling_factor``; ``n_shared_experts`` ungated shared experts of
  ``moe_intermediate_size`` each; the first ``first_k_dense_replace`` layers dense.
- ``deepseek_v2``: softmax over all experts, ``topk_method`` greedy or group_limited_greedy (a group
  scores its best probability), weights the chosen probabilities times ``routed_scaling_factor``,
  never renormalised (HF's V2 router ignores ``norm_topk_prob``); shared experts and dense layers as
  V3.

The balance-loss coefficient is converted, not copied: HF's ``load_balancing_loss_func`` counts each
token K times (``E * sum_e (c_e / T) * P_e``), K times moezoo's Switch/megablocks normalisation, so
``aux_loss_coef = router_aux_loss_coef * K``. (HF also pools all layers into one loss where moezoo
sums per-layer losses; that only matters for training, and HF applies it only with
``output_router_logits``.) DeepSeek-V3 has no auxiliary loss in HF (it balances by the bias):
imported with ``aux_loss_coef: 0``.
"""

from __future__ import annotations

from moezoo.configs import ModelConfig, MoEConfig
from moezoo.configs.errors import check


def _qwen_dense_layers(hc) -> dict:
    return {
        str(i): "dense"
        for i in range(hc.num_hidden_layers)
        if i in (hc.mlp_only_layers or []) or (i + 1) % hc.decoder_sparse_step
    }


def moe_from_hf(hc, cfg: ModelConfig) -> None:
    """Set ``cfg``'s FFN choice from the HF config ``hc`` (dense families leave it alone)."""
    t, K = hc.model_type, getattr(hc, "num_experts_per_tok", 0)
    common = dict(
        top_k=K,
        router="softmax",
        softmax_before_topk=True,
        aux_loss_coef=getattr(hc, "router_aux_loss_coef", 0.0) * (K or 0),
    )
    if t == "mixtral":
        check(
            not hc.router_jitter_noise,
            "hf.router_jitter_noise",
            f"={hc.router_jitter_noise}: multiplicative router jitter has no moezoo equivalent; "
            "set it to 0",
        )
        cfg.ffn = "moe"
        cfg.moe = MoEConfig(
            num_experts=hc.num_local_experts,
            hidden_dim=hc.intermediate_size,
            norm_topk=True,
            **common,
        )
    elif t in ("qwen2_moe", "qwen3_moe") and hc.num_experts > 0:
        cfg.ffn, cfg.ffn_layers = "moe", _qwen_dense_layers(hc)
        shared = (
            dict(
                shared_experts=1,
                shared_hidden_dim=hc.shared_expert_intermediate_size,
                shared_gate=True,
            )
            if t == "qwen2_moe"
            else {}
        )
        cfg.moe = MoEConfig(
            num_experts=hc.num_experts,
            hidden_dim=hc.moe_intermediate_size,
            norm_topk=bool(hc.norm_topk_prob),
            **shared,
            **common,
        )
    elif t == "olmoe":
        cfg.ffn = "moe"
        cfg.moe = MoEConfig(
            num_experts=hc.num_experts,
            hidden_dim=hc.intermediate_size,
            norm_topk=bool(hc.norm_topk_prob),
            **common,
        )
    elif t in ("deepseek_v2", "deepseek_v3"):
        dense = min(hc.first_k_dense_replace or 0, hc.num_hidden_layers)
        cfg.ffn, cfg.ffn_layers = "moe", ({f"0-{dense - 1}": "dense"} if dense else {})
        check(
            hc.n_group is None or hc.n_routed_experts % hc.n_group == 0,
            "hf.n_group",
            f"={hc.n_group} does not divide n_routed_experts={hc.n_routed_experts}",
        )
        grouped = t == "deepseek_v3" or hc.topk_method == "group_limited_greedy"
        if t == "deepseek_v2":
            check(
                hc.topk_method in ("greedy", "group_limited_greedy"),
                "hf.topk_method",
                f"={hc.topk_method!r}: moezoo routes greedy or group_limited_greedy",
            )
            router = dict(router="softmax", softmax_before_topk=True, norm_topk=False)
        else:
            router = dict(router="sigmoid", norm_topk=bool(hc.norm_topk_prob))
        cfg.moe = MoEConfig(
            num_experts=hc.n_routed_experts,
            top_k=K,
            hidden_dim=hc.moe_intermediate_size,
            aux_loss_coef=0.0,
            n_group=(hc.n_group or 1) if grouped else 1,
            topk_group=(hc.topk_group or 1) if grouped else 1,
            routed_scaling_factor=float(hc.routed_scaling_factor),
            shared_experts=hc.n_shared_experts or 0,
            **router,
        )


def _renormalised(m: MoEConfig) -> bool:
    # top-k-then-softmax weights sum to one whatever norm_topk says
    return m.norm_topk or not m.softmax_before_topk


def _check_softmax_family(cfg: ModelConfig, family: str) -> None:
    m = cfg.moe
    check(
        m.router == "softmax",
        "model.moe.router",
        f"{family} routers are softmax top-k, got {m.router!r}",
    )
    check(
        m.n_group == 1,
        "model.moe.n_group",
        f"{family} has no group-limited routing; n_group must be 1",
    )
    check(
        m.routed_scaling_factor == 1,
        "model.moe.routed_scaling_factor",
        f"{family} has none; must be 1",
    )
    check(
        m.bias_update_rate == 0,
        "model.moe.bias_update_rate",
        "aux-loss-free selection bias exports only to DeepSeek-V3 (MLA); must be 0",
    )


def moe_model_type(cfg: ModelConfig, windowed: list[int]) -> str:
    """The HF MoE family (or DeepSeek-V3 for MLA) expressing ``cfg``; ConfigError naming the
    blocking key."""
    m, types = cfg.moe, cfg.layer_ffn_types()
    check(
        m.capacity_factor is None,
        "model.moe.capacity_factor",
        "HF MoE is dropless; capacity_factor must be null",
    )
    dense = [i for i, t in enumerate(types) if t == "dense"]
    if cfg.attention_type == "mla":
        check(
            dense == list(range(len(dense))),
            "model.ffn_layers",
            "DeepSeek's dense layers are the first first_k_dense_replace ones",
        )
        check(
            m.router in ("sigmoid", "softmax"),
            "model.moe.router",
            "DeepSeek routes by sigmoid scores (V3) or softmax probabilities (V2)",
        )
        check(
            not m.shared_gate, "model.moe.shared_gate", "DeepSeek-V3's shared experts are ungated"
        )
        check(
            not m.shared_hidden_dim
            or m.shared_hidden_dim == cfg.expert_hidden_dim * max(m.shared_experts, 1),
            "model.moe.shared_hidden_dim",
            "DeepSeek's shared experts are n_shared_experts * moe_intermediate_size",
        )
        check(not windowed, "model.attention.patterns", "DeepSeek has no sliding window")
        if m.router == "sigmoid":
            return "deepseek_v3"
        check(
            not (m.norm_topk and m.softmax_before_topk),
            "model.moe.norm_topk",
            "DeepSeek-V2 never renormalises its softmax weights; must be false",
        )
        check(
            m.softmax_before_topk or m.top_k == 1,
            "model.moe.softmax_before_topk",
            "DeepSeek-V2 weights are the full-softmax probabilities; must be true",
        )
        check(
            m.bias_update_rate == 0,
            "model.moe.bias_update_rate",
            "DeepSeek-V2 has no selection bias; must be 0",
        )
        return "deepseek_v2"
    check(
        cfg.attention_type == "mha",
        "model.attention_type",
        "only MHA/GQA MoE models export as Mixtral/Qwen/OLMoE",
    )
    _check_softmax_family(cfg, "HF")
    if cfg.qk_norm == "full":
        check(not m.shared_experts, "model.moe.shared_experts", "OLMoE has no shared experts")
        check(not dense, "model.ffn_layers", "OLMoE has an MoE in every layer")
        check(not windowed, "model.attention.patterns", "OLMoE has no sliding window")
        return "olmoe"
    if cfg.qk_norm == "head":
        check(not m.shared_experts, "model.moe.shared_experts", "Qwen3-MoE has no shared experts")
        check(
            len(windowed) in (0, cfg.n_layers),
            "model.attention.patterns",
            "Qwen3-MoE's sliding window applies to every layer or none",
        )
        return "qwen3_moe"
    if m.shared_experts:
        check(
            m.shared_gate,
            "model.moe.shared_gate",
            "Qwen2-MoE gates its shared expert; shared_gate must be true",
        )
        return "qwen2_moe"
    check(not cfg.attn_bias, "model.attn_bias", "Mixtral attention has no bias")
    check(
        len(windowed) in (0, cfg.n_layers),
        "model.attention.patterns",
        "Mixtral's sliding window applies to every layer or none",
    )
    check(
        not dense,
        "model.ffn_layers",
        "Mixtral has an MoE in every layer; dense layers need a shared-expert (Qwen2-MoE) model",
    )
    check(
        _renormalised(m),
        "model.moe.norm_topk",
        "Mixtral renormalises the top-k weights; norm_topk must be true",
    )
    return "mixtral"


def moe_hf_kwargs(cfg: ModelConfig, model_type: str) -> dict:
    """The HF config keywords of the MoE part of ``cfg`` for ``model_type`` (empty for dense
    families)."""
    m, types = cfg.moe, cfg.layer_ffn_types()
    dense = [i for i, t in enumerate(types) if t == "dense"]
    aux = dict(num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef / m.top_k)
    if model_type == "mixtral":
        return dict(num_local_experts=m.num_experts, intermediate_size=cfg.expert_hidden_dim, **aux)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        kw = dict(
            num_experts=m.num_experts,
            moe_intermediate_size=cfg.expert_hidden_dim,
            norm_topk_prob=_renormalised(m),
            decoder_sparse_step=1,
            mlp_only_layers=dense,
            **aux,
        )
        if model_type == "qwen2_moe":
            kw.update(
                shared_expert_intermediate_size=cfg.shared_expert_hidden_dim, qkv_bias=cfg.attn_bias
            )
        return kw
    if model_type == "olmoe":
        return dict(
            num_experts=m.num_experts,
            intermediate_size=cfg.expert_hidden_dim,
            norm_topk_prob=_renormalised(m),
            **aux,
        )
    if model_type == "deepseek_v2":
        return dict(
            n_routed_experts=m.num_experts,
            num_experts_per_tok=m.top_k,
            moe_intermediate_size=cfg.expert_hidden_dim,
            n_shared_experts=m.shared_experts,
            topk_method="group_limited_greedy" if m.n_group > 1 else "greedy",
            n_group=m.n_group,
            topk_group=m.topk_group,
            routed_scaling_factor=m.routed_scaling_factor,
            first_k_dense_replace=len(dense),
        )
    if model_type == "deepseek_v3":
        return dict(
            n_routed_experts=m.num_experts,
            num_experts_per_tok=m.top_k,
            moe_intermediate_size=cfg.expert_hidden_dim,
            n_shared_experts=m.shared_experts,
            n_group=m.n_group,
            topk_group=m.topk_group,
            routed_scaling_factor=m.routed_scaling_factor,
            norm_topk_prob=m.norm_topk,
            first_k_dense_replace=len(dense),
        )
    return {}
