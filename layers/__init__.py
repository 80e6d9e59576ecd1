"""Reusable sparse-LLM layers. Plain nn.Modules; import any of them into your own model."""
from .attention import Attention, KVCache, dense_causal_attention
from .aux_loss import total_aux_loss
from .dst import DynamicSparsity
from .mlp import SwiGLU
from .moe import MoE, moe_aux_loss, moe_reset_load, moe_update_bias
from .neuron_ffn import NeuronRoutedFFN, neuron_schedule_step, neuron_stats
from .norm import RMSNorm
from .patterns import SparsityPattern, pattern_mask
from .rope import RotaryEmbedding, apply_rotary
from .sparse_attention import attention_density, sparse_attention

__all__ = ["Attention", "DynamicSparsity", "KVCache", "MoE", "RMSNorm", "RotaryEmbedding", "SwiGLU", "apply_rotary", "dense_causal_attention", "moe_aux_loss",
           "moe_reset_load", "moe_update_bias", "SparsityPattern", "sparse_attention", "pattern_mask", "attention_density",
           "NeuronRoutedFFN", "neuron_schedule_step", "neuron_stats", "total_aux_loss"]
