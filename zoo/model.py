"""LLaMA-style decoder assembled from ``ModelConfig``: per-layer FFN (dense SwiGLU or MoE) and attention pattern.

Parameter names follow Meta's LLaMA (``tok_embeddings``, ``layers.{i}.attention.wq``,
``layers.{i}.feed_forward.w1``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) so weights map
one-to-one to HF checkpoints (zoo.hf).

Shapes: B batch, S sequence, D model dim, V vocab.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from configs import ModelConfig
from layers import Attention, RMSNorm, RotaryEmbedding, SwiGLU


def build_ffn(cfg: ModelConfig, ffn_type: str) -> nn.Module:
    if ffn_type == "dense":
        return SwiGLU(cfg.dim, cfg.hidden_dim)
    if ffn_type == "moe":
        from layers import MoE
        return MoE(cfg.dim, cfg.expert_hidden_dim, cfg=cfg.moe, key="model.moe")
    if ffn_type == "neuron":
        from layers import NeuronRoutedFFN
        return NeuronRoutedFFN(cfg.dim, cfg.hidden_dim, cfg=cfg.neuron, key="model.neuron")
    raise ValueError(f"unknown ffn type {ffn_type!r}")


def build_attention_pattern(cfg: ModelConfig, layer_id: int, grid: list):
    """None when every head of the layer is dense, else one ``SparsityPattern`` or a per-head list."""
    per_head = grid[layer_id]
    if all(p is None for p in per_head):
        return None
    from layers import SparsityPattern
    pats = [SparsityPattern.from_dict(p or {"type": "dense"}) for p in per_head]
    return pats[0] if all(p == pats[0] for p in pats) else pats


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``h + ffn(norm(h))``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ffn_type: str, pattern=None):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.kv_heads, pattern=pattern,
                                   backend=cfg.attention.backend, layer_id=layer_id,
                                   reference_below=cfg.attention.reference_below, bias=cfg.attn_bias)
        self.feed_forward = build_ffn(cfg, ffn_type)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(tokens[B, S], start_pos=0) -> logits[B, S, V]``; ``loss(tokens, targets) -> (loss, parts)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        rs = cfg.rope_scaling
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, rs.type, rs.factor, rs.low_freq_factor,
                                    rs.high_freq_factor, rs.original_max_seq_len)
        grid = cfg.attention.layer_head_patterns(cfg.n_layers, cfg.n_heads)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, i, t, build_attention_pattern(cfg, i, grid))
            for i, t in enumerate(cfg.layer_ffn_types()))
        self.has_moe = "moe" in cfg.layer_ffn_types()
        self.has_aux = self.has_moe or "neuron" in cfg.layer_ffn_types()   # layers with an aux_loss
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; residual-output projections scaled by 1/sqrt(2 L) (GPT-2)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)
        for m in self.modules():
            if m is not self and hasattr(m, "init_weights"):
                m.init_weights(std, out_std)

    def setup_cache(self, batch: int, max_len: int, dtype=None, device=None) -> None:
        """Allocate KV caches for prefill + decode through ``forward(tokens, start_pos)``."""
        for layer in self.layers:
            layer.attention.setup_cache(batch, max_len, dtype, device)

    def clear_cache(self) -> None:
        for layer in self.layers:
            layer.attention.cache = None

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *, start_pos: int = 0):
        """Logits ``[B, S, V]`` (float32); with ``targets [B, S]``, ``(loss, parts)`` as in ``loss``.

        Training calls ``model(tokens, targets)`` so that DDP/FSDP2 forward hooks run on the root module.
        """
        S = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(torch.arange(start_pos, start_pos + S, device=tokens.device))
        for layer in self.layers:
            h = layer(h, cos, sin, start_pos)
        logits = self.output(self.norm(h)).float()
        return logits if targets is None else self._loss(logits, targets)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Cross-entropy plus the weighted auxiliary losses of every MoE and neuron-routed FFN layer.

        Returns ``(total, parts)`` with ``parts = {"ce": ..., "aux": ...}`` as detached scalars.
        """
        return self(tokens, targets)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        parts = {"ce": ce.detach()}
        total = ce
        if self.has_aux:
            from layers import total_aux_loss
            aux = total_aux_loss(self)
            total = total + aux
            parts["aux"] = aux.detach()
        return total, parts


def build_model(cfg: ModelConfig, device=None) -> Transformer:
    """Build and initialise. ``device="meta"`` allocates nothing (for --plan and FSDP2 init)."""
    with torch.device(device or "cpu"):
        model = Transformer(cfg)
    if str(device) != "meta":
        model.init_weights()
    return model
