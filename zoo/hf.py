"""Import/export between HF ``transformers`` models and the zoo Transformer, with logit parity.

    from moezoo.zoo.hf import from_hf, to_hf
    # a Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE or DeepSeek-V3
    # ...ForCausalLM -> Transformer
    model = from_hf(hf_model)
    # the inverse: a fresh HF model of the family that expresses model.cfg
    hf_model = to_hf(model)

Configs are translated by zoo.hf_config (MoE part: zoo.hf_moe). Weights go through one table of
``Link``s (HF names <-> zoo names, plus how tensors are joined or split), used in both directions,
so import and export cannot drift apart. The table is built against the HF model at hand, so both
expert layouts load:

- transformers 5.x: ``mlp.experts.gate_up_proj [E, 2H, D]`` (gate rows first) and
  ``mlp.experts.down_proj [E, D, H]``; the router is ``mlp.gate.weight [E, D]``.
- transformers 4.x: per-expert Linears, ``block_sparse_moe.experts.{e}.w1/w3/w2`` (Mixtral) or
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (Qwen2-MoE).

Zoo MoE weights are stacked (docs/moe.md): ``experts.w1/w3 [E, H, D]``, ``experts.w2 [E, D, H]``.
RoPE uses HF's rotate-half layout, so q/k weights copy without permutation; DeepSeek's interleaved
rope dims stay interleaved in the weights (``model.mla.rope_interleave``, applied at run time as HF
does). MLA (DeepSeek's own names): ``q_proj | q_a_proj, q_a_layernorm, q_b_proj`` <-> ``wq | wq_a,
q_norm, wq_b``, ``kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj`` <-> ``wkv_a, kv_norm,
wkv_b, wo``; the router's ``e_score_correction_bias`` <-> the MoE's ``expert_bias`` buffer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from moezoo.configs import ConfigError, ModelConfig
from moezoo.configs.errors import require_extra

from .hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from .model import Transformer


@dataclass(frozen=True)
class Link:
    """HF tensors ``hf`` <-> zoo tensors ``zoo``.

    kind: ``copy`` (one to one), ``stack`` (E per-expert HF matrices <-> one zoo [E, ...] tensor),
    ``fuse`` (HF ``gate_up_proj [E, 2H, D]`` <-> zoo ``w1, w3 [E, H, D]``), ``zero`` (an HF bias
    moezoo lacks: must be zero on import, written as zeros on export).
    """

    hf: tuple[str, ...]
    zoo: tuple[str, ...]
    kind: str = "copy"

    def to_zoo(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.kind == "stack":
            return [torch.stack(ts)]
        if self.kind == "fuse":
            return list(ts[0].chunk(2, dim=1))
        if self.kind == "zero":
            if any(t.count_nonzero() for t in ts):
                raise ConfigError(
                    "hf.attention_bias",
                    f"{self.hf[0]} is nonzero; moezoo attention has no output bias",
                )
            return []
        return ts

    def to_hf(self, ts: list[torch.Tensor], like: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if self.kind == "stack":
            return list(ts[0].unbind(0))
        if self.kind == "fuse":
            return [torch.cat(ts, dim=1)]
        if self.kind == "zero":
            return [torch.zeros_like(like[k]) for k in self.hf]
        return ts


def _linear(hf: str, zoo: str, bias: bool = False) -> list[Link]:
    links = [Link((f"{hf}.weight",), (f"{zoo}.weight",))]
    return links + [Link((f"{hf}.bias",), (f"{zoo}.bias",))] if bias else links


def _swiglu(hf: str, zoo: str) -> list[Link]:
    return (
        _linear(f"{hf}.gate_proj", f"{zoo}.w1")
        + _linear(f"{hf}.up_proj", f"{zoo}.w3")
        + _linear(f"{hf}.down_proj", f"{zoo}.w2")
    )


def _experts(
    hf_model: nn.Module, keys: set[str], hf: str, zoo: str, num_experts: int
) -> list[Link]:
    if f"{hf}.gate_up_proj" in keys:  # transformers 5.x: fused 3-D parameters
        mod = hf_model.get_submodule(hf)
        if getattr(mod, "is_transposed", False) or not getattr(mod, "is_concatenated", True):
            raise ConfigError(
                "hf.experts", f"{hf}: only the concatenated, untransposed gate_up_proj layout maps"
            )
        return [
            Link((f"{hf}.gate_up_proj",), (f"{zoo}.w1", f"{zoo}.w3"), "fuse"),
            Link((f"{hf}.down_proj",), (f"{zoo}.w2",)),
        ]
    names = (
        ("w1", "w3", "w2") if f"{hf}.0.w1.weight" in keys else ("gate_proj", "up_proj", "down_proj")
    )
    return [
        Link(tuple(f"{hf}.{e}.{n}.weight" for e in range(num_experts)), (f"{zoo}.{w}",), "stack")
        for n, w in zip(names, ("w1", "w3", "w2"))
    ]


def _attention(cfg: ModelConfig, keys: set[str], hf: str, zoo: str) -> list[Link]:
    """``hf`` = ``model.layers.{i}.self_attn``, ``zoo`` = ``layers.{i}.attention``."""
    if cfg.attention_type == "mla":
        q = (
            [("q_a_proj", "wq_a"), ("q_a_layernorm", "q_norm"), ("q_b_proj", "wq_b")]
            if cfg.mla.q_lora_rank
            else [("q_proj", "wq")]
        )
        pairs = q + [
            ("kv_a_proj_with_mqa", "wkv_a"),
            ("kv_a_layernorm", "kv_norm"),
            ("kv_b_proj", "wkv_b"),
            ("o_proj", "wo"),
        ]
        return [link for h, z in pairs for link in _linear(f"{hf}.{h}", f"{zoo}.{z}")]
    links = []
    for p, w in (("q", "wq"), ("k", "wk"), ("v", "wv")):
        links += _linear(f"{hf}.{p}_proj", f"{zoo}.{w}", cfg.attn_bias)
    links += _linear(f"{hf}.o_proj", f"{zoo}.wo")
    if f"{hf}.o_proj.bias" in keys:
        links.append(Link((f"{hf}.o_proj.bias",), (), "zero"))
    if cfg.qk_norm != "none":
        links += _linear(f"{hf}.q_norm", f"{zoo}.q_norm") + _linear(f"{hf}.k_norm", f"{zoo}.k_norm")
    return links


def weight_links(cfg: ModelConfig, hf_model: nn.Module) -> list[Link]:
    """Every weight of ``cfg``'s zoo model linked to the HF model's names and layout."""
    keys = set(hf_model.state_dict())
    links = [
        Link(("model.embed_tokens.weight",), ("tok_embeddings.weight",)),
        Link(("model.norm.weight",), ("norm.weight",)),
        Link(("lm_head.weight",), ("output.weight",)),
    ]
    for i, ffn in enumerate(cfg.layer_ffn_types()):
        hf, zoo = f"model.layers.{i}", f"layers.{i}"
        links += _attention(cfg, keys, f"{hf}.self_attn", f"{zoo}.attention")
        links += _linear(f"{hf}.input_layernorm", f"{zoo}.attention_norm")
        links += _linear(f"{hf}.post_attention_layernorm", f"{zoo}.ffn_norm")
        mlp = (
            f"{hf}.block_sparse_moe"
            if any(k.startswith(f"{hf}.block_sparse_moe.") for k in keys)
            else f"{hf}.mlp"
        )
        ff = f"{zoo}.feed_forward"
        if ffn == "dense":
            links += _swiglu(mlp, ff)
            continue
        links += _linear(f"{mlp}.gate", f"{ff}.gate")
        if f"{mlp}.gate.e_score_correction_bias" in keys:  # DeepSeek-V3's selection bias
            links.append(Link((f"{mlp}.gate.e_score_correction_bias",), (f"{ff}.expert_bias",)))
        links += _experts(hf_model, keys, f"{mlp}.experts", f"{ff}.experts", cfg.moe.num_experts)
        if cfg.moe.shared_experts and cfg.moe.shared_gate:  # Qwen2-MoE
            links += _swiglu(f"{mlp}.shared_expert", f"{ff}.shared") + _linear(
                f"{mlp}.shared_expert_gate", f"{ff}.shared_gate"
            )
        elif cfg.moe.shared_experts:  # DeepSeek-V3
            links += _swiglu(f"{mlp}.shared_experts", f"{ff}.shared")
    return links


def _load(module: nn.Module, sd: dict[str, torch.Tensor], side: str) -> None:
    """Load ``sd`` into ``module``: every parameter must be given, with its exact shape."""
    own = module.state_dict()
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    missing, unexpected = sorted(params - sd.keys()), sorted(sd.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(
            f"{side} weight mapping incomplete: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for k, v in sd.items():
        if v.shape != own[k].shape:
            raise ValueError(
                f"{side} weight {k}: shape {tuple(v.shape)} != expected {tuple(own[k].shape)}"
            )
    module.load_state_dict(sd, strict=False)


def zoo_state_dict(cfg: ModelConfig, hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """``hf_model``'s weights under zoo names and layout, for a zoo model of config ``cfg``."""
    hf_sd = hf_model.state_dict()
    sd: dict[str, torch.Tensor] = {}
    for link in weight_links(cfg, hf_model):
        sd.update(zip(link.zoo, link.to_zoo([hf_sd[k] for k in link.hf])))
    return sd


def hf_state_dict(model: Transformer, hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under ``hf_model``'s names and expert layout (5.x fused or 4.x
    per-expert)."""
    zoo_sd, like = model.state_dict(), hf_model.state_dict()
    sd: dict[str, torch.Tensor] = {}
    for link in weight_links(model.cfg, hf_model):
        sd.update(zip(link.hf, link.to_hf([zoo_sd[k] for k in link.zoo], like)))
    return sd


@contextlib.contextmanager
def _built_like(param: torch.Tensor):
    """Build on ``param``'s device with its dtype as the default: parameters are made directly in
    that dtype (no float32 copy first), while buffers made explicitly in float32, like the RoPE
    frequencies, stay float32 as HF's ``from_pretrained`` leaves them."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(param.dtype)
    try:
        with param.device:
            yield
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def from_hf(hf_model: nn.Module, moe_backend: str = "auto") -> Transformer:
    """A zoo ``Transformer`` computing the same logits as ``hf_model`` (same device, dtype,
    train/eval mode).

    ``moe_backend`` picks the MoE compute path (``model.moe.backend``: auto | torch | grouped |
    megablocks).
    """
    cfg = config_from_hf(hf_model.config)
    cfg.moe.backend = moe_backend
    cfg.validate("model")
    with _built_like(next(hf_model.parameters())):
        model = Transformer(cfg)
    _load(model, zoo_state_dict(cfg, hf_model), "zoo")
    return model.train(hf_model.training)


@torch.no_grad()
def to_hf(model: Transformer) -> nn.Module:
    """A fresh HF model (of the family zoo.hf_config.hf_model_type picks for ``model.cfg``) with the
    same logits."""
    require_extra("transformers", "hf", "zoo.hf.to_hf")
    import transformers

    hc = config_to_hf(model.cfg)
    with _built_like(next(model.parameters())):
        hf_model = getattr(transformers, ARCHITECTURES[hc.model_type])(hc)
    _load(hf_model, hf_state_dict(model, hf_model), "HF")
    return hf_model.train(model.training)
