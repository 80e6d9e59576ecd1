"""Attention: one module for dense and sparse heads (training, prefill, decode with a KV cache).

- ``module``: ``Attention``, ``KVCache``; ``mla``: ``MLA`` (DeepSeek-V2/V3 latent attention, same
  interface).
- ``masking``: ``AttnMask`` (padding / packed-document restriction shared by every layer of a
  forward).
- ``functional``: ``sparse_attention`` (the backend dispatch); ``dense``:
  ``dense_causal_attention``.
- ``pattern``: ``SparsityPattern``, the per-head pattern type and its YAML form.
- ``selection``: seeded random blocks, vertical-slash and block top-k estimation.
- ``plan``: ``PatternPlan`` (a pattern resolved for one input), ``pattern_mask``, ``budget_plan``,
  ``BlockSelection`` (what block top-k heads chose, kept on request for diagnostics).
- ``flex``: FlexAttention BlockMask / mask_mod glue; ``flash``: flash-attn for sliding windows.
- ``density``: ``attention_density`` / ``pattern_density`` for logging.
"""

from .density import AttentionStats, attention_density, attention_metrics, pattern_density
from .functional import dense_causal_attention, sparse_attention
from .module import Attention, KVCache
from .pattern import SparsityPattern
from .plan import pattern_mask

__all__ = [
    "AttentionStats",
    "Attention",
    "KVCache",
    "SparsityPattern",
    "attention_density",
    "attention_metrics",
    "dense_causal_attention",
    "pattern_density",
    "pattern_mask",
    "sparse_attention",
]
