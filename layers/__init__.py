"""Reusable sparse-LLM layers. Plain nn.Modules; import any of them into your own model."""
from .attention import Attention, KVCache, dense_causal_attention
from .mlp import SwiGLU
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rotary

__all__ = ["Attention", "KVCache", "RMSNorm", "RotaryEmbedding", "SwiGLU", "apply_rotary", "dense_causal_attention"]
