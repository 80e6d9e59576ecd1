"""Padding and packed-document masks: which (query, key) pairs attention may use besides causality.

``attention_mask [B, T]`` follows HF: 1 (or True) for a real token, 0 for padding, over every key the
attention sees (the cached prefix + the new tokens in decode). ``document_ids [B, T]``: an integer id per
token (layers.attention never lets a query see a key of another document; training.data.pack_documents
makes them). ``allowed_mask`` folds both into one bool ``[B, 1, S, T]`` that every attention path ANDs
with its causal (and sparse) rule.

Every query may always see itself: a padding query would otherwise see no key at all, its softmax would
be NaN, and a NaN value row poisons every later layer even under a zero weight. Real queries see
themselves anyway (causal), so their outputs are unchanged; padding outputs are finite garbage, ignored
by the loss (zoo.model) and by HF alike.

Shapes: B batch, S queries (absolute positions ``q_offset .. q_offset + S - 1``), T keys.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def check_token_mask(name: str, m: Optional[torch.Tensor], B: int, T: int) -> None:
    """ValueError naming ``name`` unless ``m`` is None or a [B, T] bool/integer tensor."""
    if m is None:
        return
    if not isinstance(m, torch.Tensor) or m.dtype.is_floating_point or m.dtype.is_complex:
        got = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
        raise ValueError(f"{name}: expected a bool or integer tensor, got {got}")
    if tuple(m.shape) != (B, T):
        raise ValueError(f"{name}: expected shape [batch, keys] = {[B, T]}, got {list(m.shape)}")


def allowed_mask(B: int, S: int, T: int, q_offset: int, attention_mask: Optional[torch.Tensor] = None,
                 document_ids: Optional[torch.Tensor] = None, device=None) -> Optional[torch.Tensor]:
    """bool [B, 1, S, T]: key is real (attention_mask) and in the query's document, or is the query itself;
    None when neither mask is given (plain causal attention needs no mask)."""
    if attention_mask is None and document_ids is None:
        return None
    check_token_mask("attention_mask", attention_mask, B, T)
    check_token_mask("document_ids", document_ids, B, T)
    allowed = torch.ones(B, S, T, dtype=torch.bool, device=device)
    if attention_mask is not None:
        allowed = allowed & attention_mask.to(device=device, dtype=torch.bool)[:, None, :]
    if document_ids is not None:
        d = document_ids.to(device)
        allowed = allowed & (d[:, q_offset:q_offset + S, None] == d[:, None, :])
    rows = torch.arange(S, device=device)
    allowed[:, rows, q_offset + rows] = True
    return allowed[:, None]


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids [B, S] -> int64 [B, S]: each token's position inside its document (RoPE restarts)."""
    B, S = document_ids.shape
    idx = torch.arange(S, device=document_ids.device).expand(B, S)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def causal_mask(S: int, T: int, q_offset: int, device=None) -> torch.Tensor:
    """bool [S, T]: key j <= query position ``q_offset + i``."""
    return torch.arange(T, device=device)[None, :] <= (q_offset + torch.arange(S, device=device))[:, None]


def masked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            q_offset: int = 0, scale: Optional[float] = None) -> torch.Tensor:
    """Dense causal SDPA restricted by ``mask [B, 1, S, T]``: q [B, Hq, S, Dh], k [B, Hk, T, Dh],
    v [B, Hk, T, Dv] -> [B, Hq, S, Dv]."""
    S, T = q.shape[2], k.shape[2]
    allowed = mask & causal_mask(S, T, q_offset, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=q.shape[1] != k.shape[1],
                                          scale=scale)
