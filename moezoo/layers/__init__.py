"""Reusable sparse-LLM layers. Plain nn.Modules; import any of them into your own model.

One subpackage per concept: ``attention/`` (dense + sparse), ``moe/``, ``neuron/``, ``dst/``; the
small shared blocks (``norm``, ``rope``, ``mlp``, ``aux_loss``, ``sharding``) sit beside them.
"""

from moezoo import _checkout_path

__path__ = _checkout_path(__path__, "layers")
from .attention import (
    Attention,
    AttentionStats,
    KVCache,
    SparsityPattern,
    attention_density,
    dense_causal_attention,
    pattern_mask,
    sparse_attention,
)
from .aux_loss import total_aux_loss
from .dst import DynamicSparsity
from .mlp import SwiGLU
from .moe import ExpertBalancing, MoE, moe_aux_loss, moe_reset_load, moe_update_bias
from .neuron import NeuronRoutedFFN, NeuronSchedule, neuron_schedule_step, neuron_stats
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rotary
from .sparsity_method import SparsityMethod

__all__ = [
    "Attention",
    "DynamicSparsity",
    "KVCache",
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "apply_rotary",
    "dense_causal_attention",
    "moe_aux_loss",
    "moe_reset_load",
    "moe_update_bias",
    "SparsityPattern",
    "sparse_attention",
    "pattern_mask",
    "attention_density",
    "NeuronRoutedFFN",
    "neuron_schedule_step",
    "neuron_stats",
    "total_aux_loss",
    "AttentionStats",
    "ExpertBalancing",
    "NeuronSchedule",
    "SparsityMethod",
]
