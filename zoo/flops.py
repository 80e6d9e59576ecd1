"""Parameter counts (total and active) and training FLOPs per token, from a config or a model.

Counting walks a model's parameters, so it is exact for whatever ``build_model`` builds; a config is
first built on the meta device (no memory). A routed MoE layer is any module with ``num_experts``,
``top_k`` and an ``experts`` child: a token touches ``top_k / num_experts`` of its expert weights
and all of its router. A neuron-routed FFN (layers.NeuronRoutedFFN: ``num_groups``,
``top_k_groups``, ``experts``) computes ``top_k_groups / num_groups`` of its groups in a sparse step
and all of them in a dense one; its active weights are the run's average over the schedule
(``neuron_active_fraction``), so MFU counts the groups actually computed.

FLOPs follow torchtitan / PaLM (appendix B): a matmul with N weights costs 2N per token forward and
4N backward, so ``6 * N_matmul`` per token for training, where N_matmul is the *active* parameters
minus the input embedding (a lookup; it counts again when tied to the output). Attention scores and
values cost ``4 * Dh`` per (query, key) pair forward and twice that backward, over the causal pairs
only: a token at length S meets ``(S + 1) / 2`` keys on average, so ``6 * L * H * Dh * (S + 1)`` per
token for dense causal attention (FlashAttention's causal convention; PaLM's ``12 * L * D * S``
counts the full square). Two totals (the trainer logs both):

- *model FLOPs* (``flops_per_token``, density 1): what the dense model would compute for these
  tokens; ``mfu_model`` divides by it, so a sparse model that trains faster shows more than its
  hardware did.
- *hardware FLOPs* (``flops_per_token(..., attn_density=d)``): the attention work actually done,
  ``d`` = the mean over every head of every layer of its kernel's visited blocks over the causal
  blocks (partial blocks count whole, as they cost whole; dense heads 1;
  layers.attention.density.attention_metrics). ``mfu`` uses this one: it can never exceed what the
  GPU did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from torch import nn

from moezoo.configs import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter once (tied weights once)
    active: int  # parameters one token uses: experts scaled by top_k / num_experts
    embedding: int  # input token embedding (not a matmul)
    expert: int  # routed expert weights, all experts
    tied: bool  # output projection shares the embedding weight
    neuron: int = 0  # neuron-routed FFN group weights, all groups

    @property
    def matmul_active(self) -> int:
        """Active parameters that take part in a matmul per token (what 6N counts)."""
        return self.active - (0 if self.tied else self.embedding)


def is_routed_moe(m: nn.Module) -> bool:
    return (
        hasattr(m, "num_experts")
        and hasattr(m, "top_k")
        and isinstance(getattr(m, "experts", None), nn.Module)
    )


def is_neuron_routed(m: nn.Module) -> bool:
    return (
        hasattr(m, "num_groups")
        and hasattr(m, "top_k_groups")
        and isinstance(getattr(m, "experts", None), nn.Module)
    )


def sparse_step_share(cfg) -> float:
    """Share of a run's training steps that are sparse under a NeuronConfig's schedule
    (layers.neuron.schedule): ``(1 - warmup_fraction - finish_fraction) * sparse_ratio`` (exact up
    to the rounding of the bounds)."""
    return max(0.0, 1.0 - cfg.warmup_fraction - cfg.finish_fraction) * cfg.sparse_ratio


def neuron_active_fraction(m: nn.Module, sparse_share: float | None = None) -> float:
    """Share of a neuron-routed FFN's group weights a token uses, averaged over steps: ``K/G`` in
    the ``sparse_share`` of sparse steps (default: the layer's schedule), 1 in the dense rest."""
    s = sparse_step_share(m.cfg) if sparse_share is None else sparse_share
    return 1.0 - s + s * m.top_k_groups / m.num_groups


def count_params(model: nn.Module, sparse_share: float | None = None) -> ParamCounts:
    """Counts for a built model (any device, meta included). Expert shards count as held.
    ``sparse_share``: the share of sparse steps for neuron-routed FFNs (None: their schedule's; 1.0:
    a sparse step's count, 0.0: a dense step's)."""
    seen: set[int] = set()

    def numel(params) -> int:
        n = 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    emb = getattr(model, "tok_embeddings", None)
    embedding = numel(emb.parameters()) if emb is not None else 0
    expert = active_expert = neuron = active_neuron = 0
    for m in model.modules():
        if is_neuron_routed(m):
            n = numel(m.experts.parameters())
            neuron += n
            active_neuron += n * neuron_active_fraction(m, sparse_share)
        elif is_routed_moe(m):
            n = numel(m.experts.parameters())
            expert += n
            # an EP-sharded layer holds num_local_experts of num_experts; top_k/E of all E are
            # active
            held = getattr(m, "num_local_experts", m.num_experts)
            active_expert += n * m.top_k / held if held else 0
    rest = numel(model.parameters())
    total = embedding + expert + neuron + rest
    out = getattr(model, "output", None)
    tied = emb is not None and out is not None and out.weight is emb.weight
    active = total - expert + active_expert - neuron + active_neuron
    return ParamCounts(
        total=total,
        active=int(round(active)),
        embedding=embedding,
        expert=expert,
        tied=tied,
        neuron=neuron,
    )


def param_counts(cfg_or_model: Union[ModelConfig, nn.Module]) -> ParamCounts:
    """Counts from a ``ModelConfig`` (built on the meta device, nothing allocated) or a model."""
    if isinstance(cfg_or_model, nn.Module):
        return count_params(cfg_or_model)
    from .model import build_model

    return count_params(build_model(cfg_or_model, "meta"))


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, density: float = 1.0) -> float:
    """Scores (QK^T) and weighted values (PV) over the causal pairs, forward + backward: ``3 * L * H
    * (Dqk + Dv) * (S + 1) * density`` (``6 * L * H * Dh * (S + 1)`` when q, k and v share the head
    dim; MLA's values have their own ``v_head_dim``; ``density``: the mean per-head fraction of
    causal pairs computed)."""
    dv = cfg.mla.v_head_dim if cfg.attention_type == "mla" else cfg.head_dim
    return 3.0 * cfg.n_layers * cfg.n_heads * (cfg.head_dim + dv) * (seq_len + 1) * density


def flops_per_token(
    cfg: ModelConfig, seq_len: int, counts: ParamCounts | None = None, attn_density: float = 1.0
) -> float:
    """Training FLOPs (forward + backward) per token on active parameters: ``6 N + attention``."""
    counts = counts or param_counts(cfg)
    return 6.0 * counts.matmul_active + attention_flops_per_token(cfg, seq_len, attn_density)
