"""Padding and packed-document masks: which (query, key) pairs attention may use besides causality.

``attention_mask [B, T]`` follows HF: 1 (or True) for a real token, 0 for padding, over every key
the attention sees (the cached prefix + the new tokens in decode). ``document_ids [B, T]``: an
integer id per token (layers.attention never lets a query see a key of another document;
training.data.pack_documents makes them). ``AttnMask`` carries both through the layers; every
attention path ANDs it with its causal (and sparse) rule: materialised ``[B, 1, S, T]`` for SDPA and
the sparse reference, a FlexAttention BlockMask for long square dense calls on CUDA (blocks across
documents skipped).

Every query may always see itself: a padding query would otherwise see no key at all, its softmax
would be NaN, and a NaN value row poisons every later layer even under a zero weight. Real queries
see themselves anyway (causal), so their outputs are unchanged; padding outputs are finite garbage,
ignored by the loss (zoo.model) and by HF alike.

Shapes: B batch, S queries (absolute positions ``q_offset .. q_offset + S - 1``), T keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class AttnMask:
    """The padding / document restriction of one forward, shared by every layer.

    ``key_valid [B, T]`` bool and ``doc [B, T]`` (ids of the keys; queries are ``doc[:,
    q_offset:]``), either None. Nothing ``[S, T]``-sized is held until a path asks: ``dense()`` for
    SDPA / the sparse reference, ``block_mask()`` for FlexAttention (which skips whole blocks across
    documents), each built once.
    """

    key_valid: Optional[torch.Tensor]
    doc: Optional[torch.Tensor]
    q_offset: int = 0
    _dense: Optional[torch.Tensor] = field(default=None, repr=False)
    _block: Optional[object] = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        B: int,
        S: int,
        T: int,
        q_offset: int,
        attention_mask: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
        device=None,
    ) -> Optional[AttnMask]:
        """None when neither mask is given (plain causal attention needs none); ValueError naming a
        bad one."""
        if attention_mask is None and document_ids is None:
            return None
        check_token_mask("attention_mask", attention_mask, B, T)
        check_token_mask("document_ids", document_ids, B, T)
        valid = (
            None if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
        )
        doc = None if document_ids is None else document_ids.to(device)
        return cls(valid, doc, q_offset)

    def dense(self, S: int, T: int) -> torch.Tensor:
        """bool [B, 1, S, T]: key is real and in the query's document, or is the query itself."""
        if self._dense is None:
            t = self.key_valid if self.key_valid is not None else self.doc
            B, dev, off = t.shape[0], t.device, self.q_offset
            allowed = torch.ones(B, S, T, dtype=torch.bool, device=dev)
            if self.key_valid is not None:
                allowed = allowed & self.key_valid[:, None, :]
            if self.doc is not None:
                allowed = allowed & (self.doc[:, off : off + S, None] == self.doc[:, None, :])
            rows = torch.arange(S, device=dev)
            allowed[:, rows, off + rows] = True
            self._dense = allowed[:, None]
        return self._dense

    def block_mask(self, T: int, device):
        """FlexAttention BlockMask of causality AND this mask, for square (training / prefill)
        calls."""
        if self._block is None:
            from torch.nn.attention.flex_attention import create_block_mask

            valid, doc = self.key_valid, self.doc

            def mask_mod(b, h, q, k):
                keep = k <= q
                if valid is not None:
                    keep = keep & (valid[b, k] | (q == k))
                if doc is not None:
                    keep = keep & (doc[b, q] == doc[b, k])
                return keep

            B = (valid if valid is not None else doc).shape[0]
            self._block = create_block_mask(
                mask_mod, B, None, T, T, device=device, _compile=device.type == "cuda"
            )
        return self._block


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids [B, S] -> int64 [B, S]: each token's position inside its document (RoPE
    restarts)."""
    B, S = document_ids.shape
    idx = torch.arange(S, device=document_ids.device).expand(B, S)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def causal_mask(S: int, T: int, q_offset: int, device=None) -> torch.Tensor:
    """bool [S, T]: key j <= query position ``q_offset + i``."""
    return (
        torch.arange(T, device=device)[None, :]
        <= (q_offset + torch.arange(S, device=device))[:, None]
    )


def masked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask, q_offset: int = 0
) -> torch.Tensor:
    """Dense causal attention restricted by ``mask``: q [B, Hq, S, Dh], k [B, Hk, T, Dh], v [B, Hk,
    T, Dv] -> [B, Hq, S, Dv]. FlexAttention for square CUDA calls of at least DENSE_CROSSOVER tokens
    (head dims ``flex_fits``), else SDPA."""
    from .dense import DENSE_CROSSOVER, flex_fits
    from .flex import flex_attention_call

    S, T = q.shape[2], k.shape[2]
    if flex_fits(q, v) and S == T and q_offset == 0 and T >= DENSE_CROSSOVER:
        return flex_attention_call(q, k, v, mask.block_mask(T, q.device))
    allowed = mask.dense(S, T) & causal_mask(S, T, q_offset, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, enable_gqa=q.shape[1] != k.shape[1]
    )
