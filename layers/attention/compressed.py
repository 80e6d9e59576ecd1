"""NSA's compressed-attention branch for block top-k heads (``compress: 1``; Yuan et al. 2025, sec.
3.3.1).

Every query attends, with its own softmax, to one mean-pooled key and value per *complete* key
block: query position p sees block j (keys ``j*bs .. j*bs+bs-1``) iff the block ends at or before
it, ``(j + 1) * bs <= p + 1``; a query before the first block's end sees none and this branch gives
it 0. Pooling is a plain mean (NSA learns an MLP over the block; MoBA's and our selection score the
same mean-pooled keys), so the compressed branch's logits ``q . mean(k_block) / sqrt(D)`` are the
per-query scores block top-k selects by (``query_max``): a gradient through this branch is what
teaches q and k which far blocks matter, which the hard top-k selection alone never receives (a
block outside the top-k gets no gradient). The layer mixes the branches with learned per-head gates
(``layers.Attention``): ``out = sigmoid(g_fine) * fine + sigmoid(g_cmp) * compressed``.

``compressed_attention(q [B, H, S, D], k, v [B, Hk, T, D], block_size, q_offset) -> [B, H, S, D]``;
query i at absolute position ``q_offset + i`` (decode: the last rows of a prefill, exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F


def compressed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    q_offset: int = 0,
    kv_heads: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Softmax attention of each query over the mean-pooled complete key blocks before it (module
    docstring).

    ``kv_heads`` (int64 ``[H]``): the KV head of each query head; default GQA's ``h // (H / Hk)``.
    Keys are pooled before they are picked per query head (``T / block_size`` rows, so the copy is
    small). Differentiable in q, k and v.
    """
    B, H, S, D = q.shape
    T, bs = k.shape[2], block_size
    nb = T // bs  # complete blocks only
    first = max(bs - 1 - q_offset, 0)  # the first row that sees a block
    if nb == 0 or first >= S:
        return q.new_zeros(B, H, S, v.shape[-1])
    kc = k[:, :, : nb * bs].unflatten(2, (nb, bs)).mean(3)  # [B, Hk, nb, D]
    vc = v[:, :, : nb * bs].unflatten(2, (nb, bs)).mean(3)
    if kv_heads is not None:
        kc, vc = kc[:, kv_heads], vc[:, kv_heads]
    elif H != k.shape[1]:
        kc, vc = (t.repeat_interleave(H // k.shape[1], dim=1) for t in (kc, vc))
    pos = torch.arange(q_offset + first, q_offset + S, device=q.device)
    seen = (
        torch.arange(nb, device=q.device)[None, :]
        < torch.div(pos + 1, bs, rounding_mode="floor")[:, None]
    )
    rows = F.scaled_dot_product_attention(
        q[:, :, first:], kc.to(q.dtype), vc.to(q.dtype), attn_mask=seen
    )
    return F.pad(rows, (0, 0, first, 0)) if first else rows  # rows before the first block end: 0


def compressed_density(pats: Sequence, T: int, causal_pairs: float) -> list[float]:
    """Per head, the (query, pooled key) pairs a square call's compressed branch computes over
    ``causal_pairs``: every row that sees a block times all ``T // block_size`` pooled keys (the
    masked SDPA computes the whole rectangle); 0 for heads without the branch. What honest FLOPs add
    for it (layers.attention.density)."""
    out = []
    for p in pats:
        cb = compress_block(p)
        pairs = max(T - (cb - 1), 0) * (T // cb) if p.type == "block_topk" and p.compress else 0
        out.append(pairs / causal_pairs)
    return out


def compress_block(p) -> int:
    """The keys a pattern's compressed branch pools per block (``compress_block``, else
    ``block_size``)."""
    return p.compress_block or p.block_size


def compress_heads(pats: Sequence) -> list[int]:
    """The heads of a per-head pattern list that carry the compressed branch (block top-k with
    ``compress: 1``)."""
    return [h for h, p in enumerate(pats) if p.type == "block_topk" and p.compress]
