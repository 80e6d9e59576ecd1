"""LLaMA-style decoder assembled from ``ModelConfig``: per-layer FFN (dense SwiGLU or MoE) and
attention pattern.

The HF families of zoo.hf are options of this one model, not copies of it: q/k RMSNorm and a
separate head_dim (Qwen3, OLMoE), Multi-head Latent Attention (DeepSeek-V2/V3,
layers.attention.mla), routed MoE options (group-limited sigmoid routing, shared experts), gate
activations, RoPE scalings. Padding (``attention_mask``), explicit ``position_ids`` and packed
documents (``document_ids``) follow HF.

Parameter names follow Meta's LLaMA (``tok_embeddings``, ``layers.{i}.attention.wq``,
``layers.{i}.feed_forward.w1``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) so weights
map one-to-one to HF checkpoints (zoo.hf).

Shapes: B batch, S sequence, D model dim, V vocab.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from moezoo.configs import ModelConfig
from moezoo.layers import Attention, RMSNorm, RotaryEmbedding, SwiGLU


def build_ffn(cfg: ModelConfig, ffn_type: str) -> nn.Module:
    if ffn_type == "dense":
        return SwiGLU(cfg.dim, cfg.hidden_dim, cfg.ffn_act)
    if ffn_type == "moe":
        from moezoo.layers import MoE

        return MoE(cfg.dim, cfg.expert_hidden_dim, cfg=cfg.moe, act=cfg.ffn_act, key="model.moe")
    if ffn_type == "neuron":
        from moezoo.layers import NeuronRoutedFFN

        return NeuronRoutedFFN(cfg.dim, cfg.hidden_dim, cfg=cfg.neuron, key="model.neuron")
    raise ValueError(f"unknown ffn type {ffn_type!r}")


def build_attention_pattern(cfg: ModelConfig, layer_id: int, grid: list):
    """None when every head of the layer is dense, else one ``SparsityPattern`` or a per-head
    list."""
    per_head = grid[layer_id]
    if all(p is None for p in per_head):
        return None
    from moezoo.layers import SparsityPattern

    pats = [SparsityPattern.from_dict(p or {"type": "dense"}) for p in per_head]
    return pats[0] if all(p == pats[0] for p in pats) else pats


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``h + ffn(norm(h))``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ffn_type: str, pattern=None):
        super().__init__()
        self.layer_id = layer_id
        common = dict(
            pattern=pattern,
            backend=cfg.attention.backend,
            layer_id=layer_id,
            reference_below=cfg.attention.reference_below,
            flex_kernel=cfg.attention.flex_kernel,
            kernel_options=cfg.attention.kernel_options,
        )
        if cfg.attention_type == "mla":
            from moezoo.layers.attention.mla import MLA

            self.attention = MLA.from_config(cfg, **common)
        else:
            self.attention = Attention(
                cfg.dim,
                cfg.n_heads,
                cfg.kv_heads,
                bias=cfg.attn_bias,
                head_dim=cfg.attn_head_dim,
                qk_norm=cfg.qk_norm,
                norm_eps=cfg.norm_eps,
                ssmax=cfg.attention.ssmax,
                key_conv=cfg.attention.key_conv,
                indexer_weight=cfg.attention.indexer_weight,
                **common,
            )
        self.feed_forward = build_ffn(cfg, ffn_type)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: int = 0,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(
            self.attention_norm(x), cos, sin, start_pos, mask, positions=positions
        )
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(tokens[B, S], *, attention_mask, position_ids, document_ids, start_pos) ->
    logits[B, S, V]``; ``loss(tokens, targets) -> (loss, parts)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding.from_config(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        grid = cfg.attention.layer_head_patterns(cfg.n_layers, cfg.n_heads)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, i, t, build_attention_pattern(cfg, i, grid))
            for i, t in enumerate(cfg.layer_ffn_types())
        )
        self.has_moe = "moe" in cfg.layer_ffn_types()
        # layers with an aux_loss: MoE and neuron-routed FFNs, block top-k indexers
        self.has_aux = (
            self.has_moe
            or "neuron" in cfg.layer_ffn_types()
            or any(getattr(b.attention, "indexer", None) is not None for b in self.layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # The training loss on the head's logits; the trainer swaps in its torch.compile'd twin
        # (train.compile)
        self.cross_entropy = mean_cross_entropy
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; residual-output projections scaled by 1/sqrt(2 L)
        (GPT-2)."""
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

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        start_pos: int = 0,
        loss_weights: torch.Tensor | None = None,
    ):
        """Logits ``[B, S, V]`` (float32); with ``targets [B, S]``, ``(loss, parts)`` as in
        ``loss``.

        Training calls ``model(tokens, targets)`` so that DDP/FSDP2 forward hooks run on the root
        module; the masks are keywords, so a positional second argument is always ``targets``.

        - ``attention_mask [B, start_pos + S]`` (HF: 1 real, 0 padding; left or right padding): no
          query sees a padding key; padding positions get no loss. In decode pass the mask of the
          whole prefix.
        - ``position_ids [B, S]``: RoPE positions (HF; default ``start_pos + arange(S)``, also under
          padding, as HF's forward does); with ``model.attention.ssmax`` they also set each query's
          scale, so a left-padded row equals the row alone only with position_ids that skip the
          padding.
        - ``document_ids [B, S]`` (training.data.pack_documents): attention stays inside a document,
          and positions restart at each document unless ``position_ids`` are given. Not with a KV
          cache.
        - ``loss_weights [B, S]`` (with ``targets``): each target's weight in the loss that is
          returned, a weighted mean (training.passkey's answer weight); ``parts["ce"]`` stays the
          plain mean.
        """
        from moezoo.layers.attention.masking import AttnMask, check_token_mask, document_positions

        B, S = tokens.shape
        T = start_pos + S
        if document_ids is not None and start_pos:
            raise ValueError(
                "document_ids: packed documents are for training and full passes, not decode"
            )
        check_token_mask("position_ids", position_ids, B, S)
        mask = AttnMask.build(B, S, T, start_pos, attention_mask, document_ids, tokens.device)
        if position_ids is None and document_ids is not None:
            position_ids = document_positions(document_ids)
        h = self.tok_embeddings(tokens)
        positions = (
            torch.arange(start_pos, T, device=tokens.device)
            if position_ids is None
            else position_ids
        )
        cos, sin = self.rope(positions)
        for layer in self.layers:
            h = layer(h, cos, sin, start_pos, mask, positions)
        logits = self.output(self.norm(h))  # the autocast dtype under autocast
        if targets is None:
            return logits.float()
        if attention_mask is not None:  # padding gets no loss (HF: labels -100 there)
            targets = targets.masked_fill(~attention_mask[:, start_pos:].bool(), -100)
        return self._loss(logits, targets, loss_weights)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Cross-entropy plus the weighted auxiliary losses of every MoE and neuron-routed FFN
        layer.

        Returns ``(total, parts)`` with ``parts = {"ce": ..., "aux": ...}`` as detached scalars.
        """
        return self(tokens, targets)

    def _loss(
        self, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict]:
        if weights is None:
            ce = self.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
            total = ce
        else:
            per = F.cross_entropy(
                logits.view(-1, logits.shape[-1]).float(),
                targets.reshape(-1),
                ignore_index=-100,
                reduction="none",
            )
            w = weights.reshape(-1).float() * (targets.reshape(-1) != -100)
            ce = per.sum() / (targets != -100).sum().clamp(min=1)
            total = (per * w).sum() / w.sum().clamp(min=1e-6)
        parts = {"ce": ce.detach()}
        if self.has_aux:
            from moezoo.layers import total_aux_loss

            aux = total_aux_loss(self)
            total = total + aux
            parts["aux"] = aux.detach()
        return total, parts


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (bf16 under autocast), targets [N] (-100: no loss) -> the mean cross-entropy,
    float32.

    The upcast is in here so that a compiled copy (training.loop with train.compile, as torchtitan
    compiles its loss) fuses it into the loss's kernels: eager, the float32 logits are written, read
    by log_softmax, whose output is written and read again, and the backward does the same in
    reverse (~20 GB a step at 16k tokens x 50k vocab, ~6.5 ms of the OLMoE-shaped step:
    BENCHMARKS.md, Against torchtitan)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)


# torch.nn.init's in-place initialisers, which nn.Linear / nn.Embedding call from their
# constructors.
_INITIALISERS = (
    "normal_",
    "uniform_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "trunc_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "zeros_",
    "ones_",
    "constant_",
)


@contextlib.contextmanager
def _skip_constructor_init():
    """No-op torch.nn.init while modules are built on the meta device: there the initialisers
    compute nothing, yet run torch._refs, whose first use imports torch._dynamo (~2 s of a --plan's
    startup)."""
    saved = {n: getattr(nn.init, n) for n in _INITIALISERS}
    for n in saved:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def build_model(cfg: ModelConfig, device=None) -> Transformer:
    """Build and initialise. ``device="meta"`` allocates nothing (for --plan and FSDP2 init)."""
    meta = str(device) == "meta"
    with (
        torch.device(device or "cpu"),
        _skip_constructor_init() if meta else contextlib.nullcontext(),
    ):
        model = Transformer(cfg)
    if not meta:
        model.init_weights()
    return model
