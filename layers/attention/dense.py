"""Dense causal attention (SDPA) and the length below which sparse calls run the reference.

``dense_causal_attention(q[B, Hq, S, Dh], k[B, Hk, T, Dh], v, q_offset) -> [B, Hq, S, Dh]``: the
exact causal result every backend falls back to; query i sits at absolute position ``q_offset + i``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens; below this, ``auto`` runs the reference (SDPA + materialised mask): at 2048 tokens flex is
# already ~3x faster than masked SDPA (bench/attention.py --crossover; BENCHMARKS.md, Sparse
# attention layer), and shorter lengths are not measured.
DENSE_CROSSOVER = 2048
# Inductor lowers flex attention on CUDA only for query/key and value head dims of at least 16 (it
# refuses smaller ones with "embedding dimension ... must be at least 16"), so smaller heads run the
# SDPA reference.
FLEX_MIN_HEAD_DIM = 16


def flex_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``auto`` may send this CUDA call to FlexAttention: head dims ``q[..., Dh]``, ``v[...,
    Dv]``."""
    return q.is_cuda and min(q.shape[-1], v.shape[-1]) >= FLEX_MIN_HEAD_DIM


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0
) -> torch.Tensor:
    """``q [B, Hq, S, Dh]``, ``k, v [B, Hk, T, Dh]`` with query i at absolute position ``q_offset +
    i``."""
    S, T = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if q_offset == 0 and S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if S == 1:  # one decode step sees every cached key
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    allowed = (
        torch.arange(T, device=q.device)[None, :]
        <= (q_offset + torch.arange(S, device=q.device))[:, None]
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
