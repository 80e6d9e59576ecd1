"""Sparse causal attention: ``sparse_attention(q, k, v, pattern) -> out``, one mask, several backends.

``q [B, Hq, S, D]``, ``k, v [B, Hk, T, D]`` (RoPE already applied; GQA when Hk divides Hq), query i at
absolute position ``q_offset + i``; returns ``[B, Hq, S, D]``. The mask is the token-level
``allowed(q, k)`` of layers.patterns (DESIGN.md conventions); every backend computes exactly it:

- ``reference``: SDPA with the materialised bool mask. The oracle and the CPU path (fwd + bwd).
- ``flex``: FlexAttention with a BlockMask built straight from block indices (``from_kv_blocks``)
  for square inputs (training, prefill; decode and chunked-prefill rows use the reference):
  blocks wholly inside the pattern are "full" (no per-element mask), the rest carry a ``mask_mod``
  that evaluates the same token rule. Compiled on GPU (fwd + bwd); eager on CPU (forward only is
  supported there by PyTorch). Masks of static patterns are cached per (pattern, layer, length).
  Vertical-slash columns are gathered (``column_slots``, ``gather_columns``): each query head's chosen
  keys and values are copied in front of the keys, ``K' = cat(K[cols], K)`` with ``Hq`` heads, so the
  columns cost a few dense key blocks instead of touching every key block; ``gathered_mask_mod``
  allows a gathered column only where the rest of the rule does not, so each pair counts once.
- ``flash_attn``: flash-attn's ``window_size`` for pure sliding-window layers, when installed.
- ``auto``: flex on CUDA for square inputs at or above ``DENSE_CROSSOVER`` tokens; otherwise the
  reference, which below the crossover is the faster way to compute the same masked result.

Whatever the backend, a pattern that allows every causal pair at this length (a window >= T, budgets
>= T, fewer than its ``dense_below`` keys: ``SparsityPattern.is_dense_at``) runs dense causal SDPA: the
same result, faster; in a mixed layer such heads are planned as dense heads (no estimation). There is
no ``triton`` backend: FlexAttention's generated Triton kernel already reaches the density limit forward on the H200 for static patterns, so
an own block-sparse kernel had nothing to win there (BENCHMARKS.md "Sparse attention").
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F

from configs.attention import ATTN_BACKENDS

from .attention import Attention, dense_causal_attention
from .patterns import PatternLike, PatternPlan, budget_plan, head_patterns, plan_pattern

# Tokens; below this, ``auto`` runs the reference (SDPA + materialised mask). Measured on the H200 by
# bench/attention.py --crossover (BENCHMARKS.md "Sparse attention"): at 2048 tokens flex is already 3.3x
# faster than masked SDPA (0.56 vs 1.83 ms, A-shape); shorter lengths were not measured.
DENSE_CROSSOVER = 2048
# Flex kernel tiling; None = PyTorch's per-GPU defaults. bench/attention.py sweeps alternatives.
FLEX_KERNEL_OPTIONS: Optional[dict] = None
_MASK_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
_MASK_CACHE_SIZE = 32
_compiled_flex = None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: PatternLike,
                     backend: str = "auto", layer: int = 0, q_offset: int = 0,
                     q_history: Optional[torch.Tensor] = None, reference_below: int = -1) -> torch.Tensor:
    """Causal attention under ``pattern`` (a SparsityPattern or one per query head).

    ``q_history [B, Hq, P, D]``: queries just before this chunk (decode); input-dependent patterns
    estimate from ``cat(q_history, q)`` so a decode step sees the indices prefill would have.
    ``reference_below``: backend ``auto`` runs the reference below this many keys (-1 = ``DENSE_CROSSOVER``);
    unlike the pattern parameter ``SparsityPattern.dense_below`` (a head dense below it), same result either way.
    """
    B, Hq, S, D = q.shape
    T = k.shape[2]
    if Hq % k.shape[1]:
        raise ValueError(f"{Hq} query heads are not a multiple of {k.shape[1]} KV heads")
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown sparse attention backend {backend!r}; expected one of {', '.join(ATTN_BACKENDS)}")
    pats = head_patterns(pattern, Hq)
    if all(p.is_dense_at(T) for p in pats):       # e.g. a window longer than the input: exactly causal
        return dense_causal_attention(q, k, v, q_offset)
    square = S == T and q_offset == 0
    if backend == "auto":
        crossover = DENSE_CROSSOVER if reference_below < 0 else reference_below
        backend = "flex" if (q.is_cuda and square and T >= crossover) else "reference"
    if backend == "flash_attn":
        return _flash_attn(q, k, v, pats, square)
    if backend == "flex" and square:   # decode / chunked prefill rows go to the reference: O(S T) mask
        if any(p.dynamic and not p.is_dense_at(T) for p in pats):   # estimated from this input: a new mask every call
            plan = plan_pattern(pats, Hq, 0, S, T, layer, q, k, q_history)
            # a mask built for this call only: its backward lists are needed only if a backward can follow
            bwd = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            slots = column_slots(plan) if plan.cols is not None else None
            if slots is not None:          # vertical-slash columns ride in front of the keys (see column_slots)
                k, v = gather_columns(k, v, slots)
            bm = flex_block_mask(plan, slots, backward=bwd)
        else:
            bm = _static_block_mask(pats, Hq, T, layer, q.device)
        return flex_attention_call(q, k, v, bm)
    return reference_sparse_attention(q, k, v, plan_pattern(pats, Hq, q_offset, S, T, layer, q, k, q_history))


def _static_block_mask(pats: list, n_heads: int, T: int, layer: int, device: torch.device):
    """A static pattern's BlockMask, cached per (pattern, layer, length, device); least recently used dropped first."""
    key = (tuple(pats), layer, T, device)
    bm = _MASK_CACHE.get(key)
    if bm is None:
        bm = _MASK_CACHE[key] = flex_block_mask(plan_pattern(pats, n_heads, 0, T, T, layer, device=device))
    _MASK_CACHE.move_to_end(key)
    while len(_MASK_CACHE) > _MASK_CACHE_SIZE:
        _MASK_CACHE.popitem(last=False)
    return bm


def reference_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PatternPlan) -> torch.Tensor:
    """SDPA with the materialised ``[B or 1, Hq, S, T]`` mask; differentiable, any device."""
    mask = plan.token_mask()
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":
        # CPU's fused SDPA sums GQA groups' dk/dv in low precision (bf16 error ~2.5x plain torch);
        # the math kernel accumulates in float32 and meets the FlashAttention criterion.
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


# ---------------------------------------------------------------------------------------------------
# FlexAttention


def _flex_fn(device: torch.device):
    """Compiled flex on CUDA (the fused kernel); eager elsewhere (unfused, forward-only on CPU)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        # Each pattern structure (which tables the mask_mod reads) and kernel option set is one compiled
        # entry; past dynamo's default limit of 8 it would silently fall back to eager flex (O(S^2) memory).
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _kv_blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[B, H, nq, nk]`` -> (counts int32 ``[B, H, nq]``, indices int32 ``[B, H, nq, nk]``: each row's
    chosen blocks ascending, then zeros that FlexAttention never reads, as it reads ``counts`` entries).

    A compaction (cumsum + scatter) rather than a sort: at 128k tokens, 32 heads a stable argsort of the
    [32, 1024, 1024] layout took 0.6 ms per list on the H200, and vertical-slash builds lists every call.
    """
    nk = m.shape[-1]
    num = m.sum(-1, dtype=torch.int32)
    dest = torch.where(m, torch.cumsum(m, -1) - 1, nk)                  # rank among the chosen; others -> slot nk
    idx = torch.zeros(*m.shape[:-1], nk + 1, dtype=torch.int32, device=m.device)
    idx.scatter_(-1, dest, torch.arange(nk, dtype=torch.int32, device=m.device).expand(m.shape))
    return num, idx[..., :nk].contiguous()


def _keep_rule(plan: PatternPlan, with_cols: bool = True):
    """The plan's token rule without causality as ``keep(b, h, q_idx, k) -> bool`` on FlexAttention index
    tensors (square plans); ``with_cols=False`` leaves out the vertical columns (and only them)."""
    bs, T = plan.block_size, plan.T
    Tp = (T + bs - 1) // bs * bs      # tables padded so any index inside a padded block is in bounds
    win, sinks = plan.window.to(torch.int32), plan.sinks.to(torch.int32)
    blocks, cols, diags = plan.blocks, None, None
    if plan.cols is not None:
        diags = F.pad(plan.diag_reach(), (0, Tp - T))      # the slash rule's table (PatternPlan.diag_reach)
        cols = F.pad(plan.cols, (0, Tp - T)) if with_cols else None
    # Tables without a batch dimension of their own (static parts) are read at batch 0.
    blocks_b = blocks is not None and blocks.shape[0] > 1
    diags_b = diags is not None and diags.shape[0] > 1

    def keep(b, h, q_idx, k):
        d = q_idx - k
        out = (d < win[h]) | (k < sinks[h])
        if blocks is not None:
            out = out | blocks[b if blocks_b else 0, h, q_idx // bs, k // bs]
        if diags is not None:
            bb = b if diags_b else 0
            x = (q_idx // bs) * bs - k                    # query block start - key; own block: reach[0]
            out = out | diags[bb, h, torch.where(x > 0, x, 0)]
            if cols is not None:
                out = out | cols[bb, h, k]
        return out

    return keep


def plan_mask_mod(plan: PatternPlan):
    """The plan's token rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (square plans)."""
    keep = _keep_rule(plan)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & keep(b, h, q_idx, kv_idx)

    return mask_mod


# Vertical-slash columns. A chosen column is one key seen by every later query, so in key blocks it
# marks its whole block "touched" for every query block: ~1000 columns over 128k keys touch nearly all
# blocks and the block mask is dense (BENCHMARKS.md: 0.55x SDPA at 64k). MInference gathers the
# columns instead; here each query head's chosen keys are copied in front of the keys
# (``K' = cat(K[cols], K)``, the same for V) so one flex call sees them as a few dense key blocks, and
# the columns leave the main part's block layout. Exact: prefix slot j (column p) is allowed for query
# q iff p <= q and the rest of the rule does not already allow (q, p), so each pair counts once.
# One call rather than two (columns, rest) merged by their logsumexps: no merge or LSE gradient to
# get right, one launch; the cost is that K', V' carry every query head (GQA expanded), T + NVp rows
# of Hq heads each (at 128k, 32 heads, d 128, bf16: ~1 GiB each, plus their gradients in training).


def column_slots(plan: PatternPlan) -> torch.Tensor:
    """int32 ``[B, H, NVp]``: each head's chosen key columns ascending, then ``T`` (an empty slot).

    ``NVp`` = ``plan.col_budget`` rounded up to the block size (no read-back of ``cols``); heads
    without columns have only empty slots.
    """
    bs, T, cols = plan.block_size, plan.T, plan.cols
    if plan.col_budget < 1:     # plans from plan_pattern / budget_plan always set it with their columns
        raise ValueError("column_slots needs plan.col_budget (the most columns any head chose)")
    nvp = -(-plan.col_budget // bs) * bs
    kk = min(nvp, T)
    pos = torch.arange(T, device=cols.device, dtype=torch.int32)
    # chosen columns score T - p (> 0, larger for earlier p); topk's sorted order is then ascending p
    val, idx = torch.where(cols, T - pos, -1).topk(kk, dim=-1)
    slots = torch.where(val > 0, idx.to(torch.int32), T)
    return F.pad(slots, (0, nvp - kk), value=T)


def gather_columns(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v [B, Hk, T, D]``, ``slots [B or 1, Hq, NVp]`` -> ``k', v' [B, Hq, NVp + T, D]``: per query head
    the keys (values) at its column slots (empty slots read key T-1; the mask never allows them), then
    all keys of its KV head. Differentiable: gradients of both parts flow back to ``k, v``."""
    B, Hk, T, D = k.shape
    Hq, nvp = slots.shape[1], slots.shape[2]
    g = Hq // Hk
    kv_head = torch.arange(Hq, device=k.device) // g
    base = (torch.arange(B, device=k.device)[:, None] * Hk + kv_head[None, :]) * T          # [B, Hq]
    flat = (base[:, :, None] + slots.clamp(max=T - 1).expand(B, Hq, nvp)).view(B, Hk, g, nvp)

    def one(x):
        picked = x.flatten(0, 2)[flat]                                                       # [B, Hk, g, NVp, D]
        return torch.cat([picked, x[:, :, None].expand(B, Hk, g, T, D)], dim=3).view(B, Hq, nvp + T, D)

    return one(k), one(v)


def gathered_mask_mod(plan: PatternPlan, slots: torch.Tensor):
    """``mask_mod`` over ``K' = cat(K[slots], K)``: slot j (key ``slots[b, h, j]``) where the rest of the rule
    does not allow it, key ``kv_idx - NVp`` where it does; together exactly ``plan.token_mask()``, once."""
    keep = _keep_rule(plan, with_cols=False)
    nvp, T = slots.shape[-1], plan.T
    slots_b = slots.shape[0] > 1

    def mask_mod(b, h, q_idx, kv_idx):
        pre = kv_idx < nvp
        k = torch.where(pre, slots[b if slots_b else 0, h, torch.clamp(kv_idx, max=nvp - 1)], kv_idx - nvp)
        rest = keep(b, h, q_idx, torch.clamp(k, max=T - 1))     # empty slots (k = T) fail causality
        return (q_idx >= k) & torch.where(pre, ~rest, rest)

    return mask_mod


def _slot_blocks(slots: torch.Tensor, bs: int, n_q: int, T: int) -> torch.Tensor:
    """bool ``[B, H, nq, NVp / bs]``: slot block j is touched by query block qb when its first (smallest)
    column is <= the block's last query; never full (pairs the rest allows are masked out there)."""
    first = slots[..., ::bs]                                                                 # [B, H, nj]
    q_last = (torch.arange(n_q, device=slots.device) * bs + bs - 1).clamp(max=T - 1)
    return first[:, :, None, :] <= q_last[None, None, :, None]


def flex_block_mask(plan: PatternPlan, slots: Optional[torch.Tensor] = None, backward: bool = True):
    """A FlexAttention BlockMask for a square plan: full/partial blocks from ``plan.block_layout()``
    (built from indices, never by evaluating the mask per block) and ``plan_mask_mod`` on partial blocks.

    With ``slots`` (``column_slots(plan)``) the keys are ``K' = cat(K[slots], K)`` (``gather_columns``):
    ``NVp / bs`` slot blocks, then the layout of the rule without columns shifted past them.
    ``backward=False`` skips the transposed (per key block) lists only the backward pass reads.
    """
    from torch.nn.attention.flex_attention import BlockMask
    bs, T = plan.block_size, plan.T
    if slots is None:
        partial, full = plan.block_layout()
        mask_mod, kv_len = plan_mask_mod(plan), T
    else:
        partial, full = plan.block_layout(include_cols=False)
        pre = _slot_blocks(slots, bs, partial.shape[2], T)
        B = max(pre.shape[0], partial.shape[0])
        pre, partial, full = (x.expand(B, *x.shape[1:]) for x in (pre, partial, full))
        partial = torch.cat([pre, partial], dim=-1)
        full = torch.cat([torch.zeros_like(pre), full], dim=-1)
        mask_mod, kv_len = gathered_mask_mod(plan, slots), slots.shape[-1] + T
    pn, pi = _kv_blocks(partial)
    fn, fi = _kv_blocks(full)
    return BlockMask.from_kv_blocks(pn, pi, fn, fi, BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(T, kv_len),
                                    compute_q_blocks=backward)


def flex_attention_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """FlexAttention (compiled on CUDA) over a BlockMask from ``flex_block_mask``."""
    return _flex_fn(q.device)(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1],
                              kernel_options=FLEX_KERNEL_OPTIONS)


# ---------------------------------------------------------------------------------------------------
# flash-attn (optional): pure causal sliding windows


def _flash_attn(q, k, v, pats, square: bool) -> torch.Tensor:
    """flash-attn's ``window_size=(W-1, 0)`` is exactly our window W (keys q-W+1 .. q); a head dense at
    these T keys is the window T."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        raise ValueError("backend 'flash_attn' needs the flash-attn package") from None
    T = k.shape[2]
    windows = {T if p.is_dense_at(T) else p.window for p in pats}
    if not square or len(windows) != 1 or any(p.type != "local" or p.sinks for p in pats if not p.is_dense_at(T)):
        raise ValueError("backend 'flash_attn' runs one causal window without sinks shared by all heads, square inputs")
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                          window_size=(windows.pop() - 1, 0))
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------------
# Density for logging


def pattern_density(pattern: PatternLike, n_heads: int, seq_len: int, layer: int = 0, max_rows: int = 2048,
                    chunk: int = 256, device=None) -> torch.Tensor:
    """float64 ``[n_heads]``: the fraction of causal (q, k) pairs each head of ``pattern`` attends at ``seq_len``.

    Input-dependent heads count what their budgets allow (``patterns.budget_plan``). Exact when
    ``seq_len <= max_rows``; longer inputs count ``max_rows`` query rows in evenly spaced chunks and
    interpolate the allowed keys per row linearly across the rows in between (exact for windows, sinks
    and dense heads). Masks are built ``chunk`` rows at a time on ``device``.
    """
    if seq_len <= max_rows:
        starts = range(0, seq_len, chunk)
    else:
        n_chunks = max(max_rows // chunk, 2)
        starts = sorted({round(i * (seq_len - chunk) / (n_chunks - 1)) for i in range(n_chunks)})
    rows = [range(s, min(s + chunk, seq_len)) for s in starts]
    per_row = [budget_plan(pattern, n_heads, seq_len, layer, r, device).token_mask()[0].sum(-1).double()
               for r in rows]                                                      # [H, rows] allowed keys
    allowed = sum(c.sum(-1) for c in per_row)
    for a, b, ra, rb in zip(per_row, per_row[1:], rows, rows[1:]):                  # trapezoid over skipped rows
        allowed = allowed + (rb.start - ra.stop) * (a[:, -1] + b[:, 0]) / 2
    return (allowed / (seq_len * (seq_len + 1) / 2)).cpu()                         # one host copy per layer


def attention_density(model_or_attention: torch.nn.Module, seq_len: int, max_rows: int = 2048,
                      chunk: int = 256) -> dict:
    """Fraction of causal (q, k) pairs each head attends at ``seq_len``.

    Returns ``{"layer{L}/head{h}": float, "layer{L}": mean over heads, "mean": over all heads}`` for
    every ``layers.Attention`` inside the module (dense heads are 1.0), each layer by ``pattern_density``
    (exact up to ``max_rows``, sampled beyond). Masks are built on the module's device.
    """
    out, all_heads = {}, []
    for m in model_or_attention.modules():
        if not isinstance(m, Attention):
            continue
        H, L = m.n_heads, m.layer_id
        if m.pattern is None:
            dens = torch.ones(H, dtype=torch.float64)
        else:
            # masks are built where the model lives (a 64k model's rows are slow on CPU, instant on GPU)
            dev = m.wq.weight.device if m.wq.weight.device.type != "meta" else torch.device("cpu")
            dens = pattern_density(m.pattern, H, seq_len, L, max_rows, chunk, dev)
        for h in range(H):
            out[f"layer{L}/head{h}"] = float(dens[h])
        out[f"layer{L}"] = float(dens.mean())
        all_heads.append(dens)
    if all_heads:
        out["mean"] = float(torch.cat(all_heads).mean())
    return out
