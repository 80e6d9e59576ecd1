"""Sparse causal attention: ``sparse_attention(q, k, v, pattern) -> out``, one mask, several
backends.

``q [B, Hq, S, D]``, ``k, v [B, Hk, T, D]`` (RoPE already applied; GQA when Hk divides Hq), query i
at absolute position ``q_offset + i``; returns ``[B, Hq, S, D]``. The mask is the token-level
``allowed(q, k)`` of layers.attention.pattern (docs/sparse_attention.md); every backend computes
exactly it:

- ``reference``: SDPA with the materialised bool mask. The oracle and the CPU path (fwd + bwd).
- ``flex``: FlexAttention with a BlockMask built straight from block indices (``from_kv_blocks``)
  for square inputs (training, prefill; decode and chunked-prefill rows use the reference): blocks
  wholly inside the pattern are "full" (no per-element mask), the rest carry a ``mask_mod`` that
  evaluates the same token rule. Compiled on GPU (fwd + bwd); eager on CPU (forward only is
  supported there by PyTorch). Masks of static patterns are cached per (pattern, layer, length).
  Vertical-slash columns are gathered (``column_slots``, ``gather_columns``): each query head's
  chosen keys and values are copied in front of the keys, ``K' = cat(K[cols], K)`` with ``Hq``
  heads, so the columns cost a few dense key blocks instead of touching every key block;
  ``gathered_mask_mod`` allows a gathered column only where the rest of the rule does not, so each
  pair counts once.
- ``flash_attn``: flash-attn's ``window_size`` for pure sliding-window layers, when installed.
- ``auto``: flex on CUDA for square inputs at or above ``DENSE_CROSSOVER`` tokens with head dims of
  at least ``FLEX_MIN_HEAD_DIM`` (16, what inductor lowers); otherwise the reference, which below
  the crossover is the faster way to compute the same masked result.

Whatever the backend, a pattern that allows every causal pair at this length (a window >= T, budgets
>= T, fewer than its ``dense_below`` keys: ``SparsityPattern.is_dense_at``) runs dense causal SDPA:
the same result, faster; in a mixed layer such heads are planned as dense heads (no estimation).
There is no ``triton`` backend: FlexAttention's generated Triton kernel already reaches the density
limit forward for static patterns, so an own block-sparse kernel has nothing to win there
(BENCHMARKS.md, Sparse attention layer).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F

from moezoo.configs.attention import ATTN_BACKENDS
from moezoo.kernels.launch import to_device

from .dense import DENSE_CROSSOVER, dense_causal_attention, flex_fits
from .flash import flash_attn_window
from .flex import (
    column_slots,
    flex_attention_call,
    flex_block_mask,
    flex_tile,
    gather_columns,
    kernel_options_for,
    pick_flex_kernel,
)
from .masking import masked_causal_attention
from .pattern import PatternLike, head_patterns
from .pattern import layer_block_size as plan_block_size
from .plan import PatternPlan, plan_pattern
from .replay import replayed
from .selection import selection_density

_MASK_CACHE: OrderedDict[tuple, object] = OrderedDict()
_MASK_CACHE_SIZE = 32


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: PatternLike,
    backend: str = "auto",
    layer: int = 0,
    q_offset: int = 0,
    q_history: Optional[torch.Tensor] = None,
    reference_below: int = -1,
    mask: Optional[torch.Tensor] = None,
    kernel: str = "auto",
    kernel_options: Optional[dict] = None,
    stats: Optional[dict] = None,
    score_qk: Optional[tuple] = None,
) -> torch.Tensor:
    """Causal attention under ``pattern`` (a SparsityPattern or one per query head).

    ``q_history [B, Hq, P, D]``: queries just before this chunk (decode); input-dependent patterns
    estimate from ``cat(q_history, q)`` so a decode step sees the indices prefill would have.
    ``reference_below``: backend ``auto`` runs the reference below this many keys (-1 =
    ``DENSE_CROSSOVER``); unlike the pattern parameter ``SparsityPattern.dense_below`` (a head dense
    below it), same result either way. ``mask`` (a layers.attention.masking.AttnMask: padding /
    packed documents): ANDed with the pattern's mask; such calls run the reference (or dense masked
    attention when the pattern is dense here). ``kernel`` (auto | triton | flash) and
    ``kernel_options``: the flex kernel of this call (``flex.pick_flex_kernel``,
    ``flex.kernel_options_for``). ``stats``: a dict that receives, for square inputs, ``density``
    float32 ``[Hq]`` (a block-sparse kernel's visited blocks / the causal blocks) and, for
    input-dependent patterns, ``score_work`` (what block top-k selection's scores add, in the same
    units) and for block top-k heads ``entropy`` / ``topk_mass`` of the selection (tensors on q's
    device; not where it holds ``sharpness: False``, which spares per-token selection a softmax
    over every query's blocks). ``score_qk``: ``(q, k, q_history)`` before RoPE, which block top-k
    heads with ``score_nope: 1`` select by (plan.plan_pattern).
    """
    B, Hq, S, D = q.shape
    T = k.shape[2]
    if Hq % k.shape[1]:
        raise ValueError(f"{Hq} query heads are not a multiple of {k.shape[1]} KV heads")
    if backend not in ATTN_BACKENDS:
        raise ValueError(
            f"unknown sparse attention backend {backend!r}; "
            f"expected one of {', '.join(ATTN_BACKENDS)}"
        )
    pats = head_patterns(pattern, Hq)
    if all(p.is_dense_at(T) for p in pats):  # e.g. a window longer than the input: exactly causal
        if stats is not None:
            stats["density"] = torch.ones(Hq, device=q.device)
        if mask is not None:
            return masked_causal_attention(q, k, v, mask, q_offset)
        return dense_causal_attention(q, k, v, q_offset)
    if mask is not None:
        return reference_sparse_attention(
            q,
            k,
            v,
            plan_pattern(pats, Hq, q_offset, S, T, layer, q, k, q_history, score_qk=score_qk),
            mask.dense(S, T),
        )
    square = S == T and q_offset == 0
    if backend == "auto":
        crossover = DENSE_CROSSOVER if reference_below < 0 else reference_below
        backend = "flex" if (flex_fits(q, v) and square and T >= crossover) else "reference"
    if backend == "flash_attn":
        return flash_attn_window(q, k, v, pats, square)
    # decode / chunked prefill rows go to the reference: O(S T) mask
    if backend == "flex" and square:
        return _flex_sparse(
            q, k, v, pats, layer, q_history, stats, kernel, kernel_options, score_qk
        )
    plan = replayed(
        ("reference", layer, tuple(pats), q.shape, k.shape, q_offset),
        lambda: plan_pattern(
            pats, Hq, q_offset, S, T, layer, q, k, q_history, stats=stats, score_qk=score_qk
        ),
        stats,
    )
    if stats is not None and square:
        partial, full = plan.block_layout()
        stats["density"] = _density_of(partial | full, plan.block_size, T)
        stats["score_work"] = _selection_work(pats, T, k.shape[1], q)
    return reference_sparse_attention(q, k, v, plan)


# Eager even inside a torch.compile'd block (a graph break): traced into the trainer's compiled
# blocks, the per-call block mask and flex call give gradients ~11% off eager's (grad norm at step
# 0, same weights; tests/e2e/test_training_gpu.py), while this eager path meets the float32
# reference. The flex kernel itself is compiled either way (``_flex_fn``), so what the break
# costs is only the fusion of the few elementwise ops around it.
@torch.compiler.disable
def _flex_sparse(q, k, v, pats, layer, q_history, stats, kernel, kernel_options, score_qk):
    """The flex backend for a square call: q [B, Hq, T, Dh], k, v [B, Hk, T, Dh] -> [B, Hq, T,
    Dh]."""
    Hq, S, T = q.shape[1], q.shape[2], k.shape[2]
    # estimated from this input: a new mask every call (the checkpoint recompute replays it)
    if any(p.dynamic and not p.is_dense_at(T) for p in pats):
        # a mask built for this call only: its backward lists are needed only if a backward can
        # follow
        bwd = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))

        def build():
            plan = plan_pattern(
                pats, Hq, 0, S, T, layer, q, k, q_history, stats=stats, score_qk=score_qk
            )
            slots = column_slots(plan) if plan.cols is not None else None
            tile = flex_tile(plan.block_size, q.device)
            return slots, flex_block_mask(plan, slots, backward=bwd, tile=tile)

        key = ("flex", layer, tuple(pats), q.shape, k.shape, bwd)
        slots, bm = replayed(key, build, stats)
        if slots is not None:  # vertical-slash columns ride in front of the keys (see column_slots)
            k, v = gather_columns(k, v, slots)
        if stats is not None:
            stats["density"] = _visited_density(bm, T)
            stats["score_work"] = _selection_work(pats, T, k.shape[1], q)
    else:
        bm, dens = _static_block_mask(pats, Hq, T, layer, q.device)
        if stats is not None:
            stats["density"] = dens
    kern = pick_flex_kernel(kernel, pats, T, plan_block_size(pats))
    return flex_attention_call(q, k, v, bm, kernel_options_for(kern, kernel_options))


def _selection_work(pats: list, T: int, n_kv_heads: int, q: torch.Tensor) -> torch.Tensor:
    """float32 ``[H]`` on q's device (or a 0-d zero): the work of the block top-k heads' selection
    scores in density units (selection.selection_density), the ``score_work`` stat that
    attention_metrics adds to the visited density. Read only, so one tensor per (pattern, length,
    device) serves every call."""
    return _selection_work_on(tuple(pats), T, n_kv_heads, q.shape[-1], q.device)


@functools.lru_cache(maxsize=64)
def _selection_work_on(
    pats: tuple, T: int, n_kv_heads: int, head_dim: int, device: torch.device
) -> torch.Tensor:
    work = selection_density(pats, T, n_kv_heads, head_dim=head_dim)
    if not any(work):
        return torch.zeros((), device=device)
    return to_device(torch.tensor(work, dtype=torch.float32), device)


def _causal_blocks(bs: int, T: int) -> float:
    n = (T + bs - 1) // bs
    return n * (n + 1) / 2


def _density_of(blocks: torch.Tensor, bs: int, T: int) -> torch.Tensor:
    """float32 ``[H]``: visited blocks (bool ``[B, H, nq, nk]``) over the causal blocks (a dense
    causal kernel's work, diagonal blocks whole; so dense heads are 1 and a block-sparse layout at
    most ~1)."""
    return blocks.sum((-1, -2)).float().mean(0) / _causal_blocks(bs, T)


def _visited_density(bm, T: int) -> torch.Tensor:
    """``_density_of`` a BlockMask's lists (partial + full blocks per query block; gathered columns
    included), in the BlockMask's own blocks: the tiles a kernel visits (``flex.flex_tile``)."""
    n = bm.kv_num_blocks.sum(-1) + bm.full_kv_num_blocks.sum(-1)  # [B, H]
    return n.float().mean(0) / _causal_blocks(bm.BLOCK_SIZE[1], T)


def _static_block_mask(pats: list, n_heads: int, T: int, layer: int, device: torch.device):
    """A static pattern's (BlockMask, density ``[H]``), cached per (pattern, layer, length, device);
    least recently used dropped first."""
    key = (tuple(pats), layer, T, device)
    hit = _MASK_CACHE.get(key)
    if hit is None:
        bm = flex_block_mask(
            plan_pattern(pats, n_heads, 0, T, T, layer, device=device),
            tile=flex_tile(plan_block_size(pats), device),
        )
        hit = _MASK_CACHE[key] = (bm, _visited_density(bm, T))
    _MASK_CACHE.move_to_end(key)
    while len(_MASK_CACHE) > _MASK_CACHE_SIZE:
        _MASK_CACHE.popitem(last=False)
    return hit


def reference_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: PatternPlan,
    extra: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """SDPA with the materialised ``[B or 1, Hq, S, T]`` mask (ANDed with ``extra [B, 1, S, T]``);
    differentiable."""
    mask = plan.token_mask()
    if extra is not None:
        mask = mask & extra
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":
        # CPU's fused SDPA sums GQA groups' dk/dv in low precision (bf16 error ~2.5x plain torch);
        # the math kernel accumulates in float32 and meets the FlashAttention criterion.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
