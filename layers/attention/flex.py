"""FlexAttention glue for sparse patterns: a BlockMask built from a PatternPlan's block indices, the
mask_mod that evaluates the same token rule on partial blocks, and the vertical-slash column gather.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .plan import PatternPlan

_compiled_flex = None

# FlexAttention's FLASH backend (flash-attn-4's CuTe kernels, ``kernel_options={"BACKEND":
# "FLASH"}``, torch >= 2.10, Hopper/Blackwell) against its Triton backend, per pattern type: the
# lengths from which FLASH is faster both forward and forward+backward (32/8 heads, d 128, bf16,
# 128-token blocks; ~1.2-1.5x at 64k: BENCHMARKS.md, Sparse attention layer). ``flex_kernel: auto``
# runs FLASH for a layer only when every sparse head's type is listed here at this length;
# unmeasured types run Triton. A-shape is measured from 16k (also in the
# ../shared/peers/stage_flash_attn4.sh header), block top-k at 64k only.
FLASH_FASTER_FROM = {"a_shape": 16384, "local": 16384, "block_topk": 65536}


# A pattern's block size is its selection unit; the flex kernel's tile is another thing.
# FlexAttention's Triton templates on CUDA take one tile config by default, and a BlockMask's block
# size must be a multiple of it: forward (128, 128) / (128, 64) at bf16 head dims 64 / 128 on sm90,
# backward (64, 128, 128, 64) on sm90 and sm100 (torch's template_heuristics; sm8x's d < 64 backward
# also has 128s). Smaller blocks fail there ("Q and KV block size must be divisible by BLOCK_M and
# BLOCK_N" forward, no backward config at all), so on CUDA a layer of smaller blocks is laid out on
# 128-token tiles (``flex_block_mask``'s ``tile``): exact, since the mask_mod evaluates the token
# rule in every tile that is not full.
FLEX_TILE_CUDA = 128


def flex_tile(block_size: int, device: torch.device) -> int:
    """The BlockMask block size for a layer of ``block_size``-token blocks on ``device``: the block
    size itself on CPU or when CUDA's 128-token tiles divide it, else the least common multiple with
    128."""
    if device.type != "cuda" or block_size % FLEX_TILE_CUDA == 0:
        return block_size
    return math.lcm(block_size, FLEX_TILE_CUDA)


def _flex_fn(device: torch.device):
    """Compiled flex on CUDA (the fused kernel); eager elsewhere (unfused, forward-only on CPU)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        # Each pattern structure (which tables the mask_mod reads) and kernel option set is one
        # compiled entry; past dynamo's default limit of 8 it would silently fall back to eager flex
        # (O(S^2) memory).
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


# flash-attn-4 4.0.0b5 to 4.0.0b25 start the Hopper backward before its bwd_preprocess kernel ends
# (programmatic dependent launch), and the block-sparse path, which every flex call with a
# BlockMask takes, loaded LSE / dPsum and reduce-added into dQaccum before the preprocess had
# written / zeroed them: wrong or NaN gradients in 0.1-1% of backward launches
# (Dao-AILab/flash-attention PR #2756, released in 4.0.0b26). ``auto`` runs FLASH only from there;
# tests/layers/attention/test_sparse_backward_gpu.py checks the gradients and 200 repeated launches.
FLASH_BACKWARD_FIXED_IN = "4.0.0b26"


def flash_release_known_good(version: Optional[str]) -> bool:
    """True for a flash-attn-4 release at or past ``FLASH_BACKWARD_FIXED_IN``; False for None (no
    such distribution) or a version string that does not parse."""
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(version) >= Version(FLASH_BACKWARD_FIXED_IN)
    except InvalidVersion:
        return False


@functools.cache
def flash_kernel_available() -> bool:
    """flash-attn-4 importable, a Hopper/Blackwell GPU and a flash-attn-4 release whose block-sparse
    backward is known good (probed once per process)."""
    from importlib.metadata import PackageNotFoundError, version

    from moezoo.configs.attention import fast_path_missing

    if fast_path_missing("cuda") is not None:
        return False
    try:
        return flash_release_known_good(version("flash-attn-4"))
    except PackageNotFoundError:
        return False


def pick_flex_kernel(kernel: str, pats, T: int, block_size: int) -> str:
    """``triton`` or ``flash`` for one layer's flex call (``kernel``: auto | triton | flash)."""
    if kernel != "auto":
        return kernel
    types = {p.type for p in pats if not p.is_dense_at(T)}
    # per-token selection's bit-table mask_mod (token_select 1) does not compile on FLASH: the CuTe
    # code generation stores its int64 table index into an int32 (the class of pytorch #188871).
    # The tile union (token_select 2) visits whole blocks, block lists as block top-k's.
    token = any(p.token_select == 1 for p in pats if not p.is_dense_at(T))
    if (
        token
        or not types
        or block_size % 128
        or any(T < FLASH_FASTER_FROM.get(t, float("inf")) for t in types)
    ):
        return "triton"
    return "flash" if flash_kernel_available() else "triton"


def kernel_options_for(kernel: str, options: Optional[dict]) -> Optional[dict]:
    """The ``kernel_options`` of one flex call: the layer's Triton options, FLASH's backend
    switch."""
    opts = dict(options or {})
    if kernel == "flash":
        opts["BACKEND"] = "FLASH"
    return opts or None


def _kv_blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[B, H, nq, nk]`` -> (counts int32 ``[B, H, nq]``, indices int32 ``[B, H, nq, nk]``:
    each row's chosen blocks ascending, then zeros that FlexAttention never reads, as it reads
    ``counts`` entries).

    A compaction (cumsum + scatter) rather than a sort: at 128k tokens, 32 heads a stable argsort of
    the [32, 1024, 1024] layout takes ~0.6 ms per list, and vertical-slash builds lists every call.
    """
    nk = m.shape[-1]
    num = m.sum(-1, dtype=torch.int32)
    dest = torch.where(m, torch.cumsum(m, -1) - 1, nk)  # rank among the chosen; others -> slot nk
    idx = torch.zeros(*m.shape[:-1], nk + 1, dtype=torch.int32, device=m.device)
    idx.scatter_(-1, dest, torch.arange(nk, dtype=torch.int32, device=m.device).expand(m.shape))
    return num, idx[..., :nk].contiguous()


def _keep_rule(plan: PatternPlan, with_cols: bool = True, tile: int = 0):
    """The plan's token rule without causality as ``keep(b, h, q_idx, k) -> bool`` on FlexAttention
    index tensors (square plans); ``with_cols=False`` leaves out the vertical columns (and only
    them). ``tile``: the BlockMask's block size (a multiple of the plan's; default the plan's
    own)."""
    bs, T = plan.block_size, plan.T
    tile = tile or bs
    # Tables padded so any index inside the last (padded) tile is in bounds: kernels evaluate the
    # mask_mod over whole tiles and mask the positions past T afterwards.
    Tp = (T + tile - 1) // tile * tile
    win, sinks = plan.window.to(torch.int32), plan.sinks.to(torch.int32)
    blocks, cols, diags = plan.blocks, None, None
    if blocks is not None and blocks.shape[-1] * bs < Tp:
        nb = Tp // bs
        blocks = F.pad(blocks, (0, nb - blocks.shape[-1], 0, nb - blocks.shape[-2]))
    if plan.cols is not None:
        # the slash rule's table (PatternPlan.diag_reach)
        diags = F.pad(plan.diag_reach(), (0, Tp - T))
        cols = F.pad(plan.cols, (0, Tp - T)) if with_cols else None
    tok, tok_slot = None, plan.tok_slot
    if plan.tok_bits is not None:
        # rows padded to whole tiles, words to the padded tiles' key blocks: all reads in bounds
        tok = plan.tok_bits
        nw = (Tp // bs + 31) // 32
        tok = F.pad(tok, (0, nw - tok.shape[-1], 0, Tp - tok.shape[2]))
    blocks, diags, cols, tok = (_per_batch(t) for t in (blocks, diags, cols, tok))

    def keep(b, h, q_idx, k):
        d = q_idx - k
        out = (d < win[h]) | (k < sinks[h])
        if blocks is not None:
            out = out | blocks(b, h, q_idx // bs, k // bs)
        if tok is not None:
            kb = k // bs
            word = tok(b, tok_slot[h], q_idx, kb // 32)
            out = out | (((word >> (kb % 32)) & 1) == 1)
        if diags is not None:
            x = (q_idx // bs) * bs - k  # query block start - key; own block: reach[0]
            out = out | diags(b, h, torch.where(x > 0, x, 0))
            if cols is not None:
                out = out | cols(b, h, k)
        return out

    return keep


def _per_batch(table: Optional[torch.Tensor]):
    """``table [B or 1, ...]`` -> ``read(b, *idx)``: per-batch tables read at ``b``; a table shared
    by the batch (static parts, or batch 1) is sliced here once, so the mask_mod indexes it without
    a constant batch index (FLASH's CuTe code generation takes only tensor expressions as indices:
    ``t[0, h, ...]`` failed there with "Expected TensorSSA, but got <class 'int'>")."""
    if table is None:
        return None
    if table.shape[0] > 1:
        return lambda b, *idx: table[(b, *idx)]
    shared = table[0]
    return lambda b, *idx: shared[idx]


def plan_mask_mod(plan: PatternPlan, tile: int = 0):
    """The plan's token rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (square
    plans); ``tile``: the BlockMask's block size, which its tables are padded to."""
    keep = _keep_rule(plan, tile=tile)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & keep(b, h, q_idx, kv_idx)

    return mask_mod


# Vertical-slash columns. A chosen column is one key seen by every later query, so in key blocks it
# marks its whole block "touched" for every query block: ~1000 columns over 128k keys touch nearly
# all blocks and the block mask is dense (slower than dense SDPA). MInference gathers the
# columns instead; here each query head's chosen keys are copied in front of the keys (``K' =
# cat(K[cols], K)``, the same for V) so one flex call sees them as a few dense key blocks, and the
# columns leave the main part's block layout. Exact: prefix slot j (column p) is allowed for query q
# iff p <= q and the rest of the rule does not already allow (q, p), so each pair counts once. One
# call rather than two (columns, rest) merged by their logsumexps: no merge or LSE gradient to get
# right, one launch; the cost is that K', V' carry every query head (GQA expanded), T + NVp rows of
# Hq heads each (at 128k, 32 heads, d 128, bf16: ~1 GiB each, plus their gradients in training).


def column_slots(plan: PatternPlan) -> torch.Tensor:
    """int32 ``[B, H, NVp]``: each head's chosen key columns ascending, then ``T`` (an empty slot).

    ``NVp`` = ``plan.col_budget`` rounded up to the block size (no read-back of ``cols``); heads
    without columns have only empty slots.
    """
    bs, T, cols = plan.block_size, plan.T, plan.cols
    # plans from plan_pattern / budget_plan always set it with their columns
    if plan.col_budget < 1:
        raise ValueError("column_slots needs plan.col_budget (the most columns any head chose)")
    nvp = -(-plan.col_budget // bs) * bs
    kk = min(nvp, T)
    pos = torch.arange(T, device=cols.device, dtype=torch.int32)
    # chosen columns score T - p (> 0, larger for earlier p); topk's sorted order is then ascending
    # p
    val, idx = torch.where(cols, T - pos, -1).topk(kk, dim=-1)
    slots = torch.where(val > 0, idx.to(torch.int32), T)
    return F.pad(slots, (0, nvp - kk), value=T)


def gather_columns(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v [B, Hk, T, D]``, ``slots [B or 1, Hq, NVp]`` -> ``k', v' [B, Hq, NVp + T, D]``: per
    query head the keys (values) at its column slots (empty slots read key T-1; the mask never
    allows them), then all keys of its KV head. Differentiable: gradients of both parts flow back to
    ``k, v``."""
    B, Hk, T, D = k.shape
    Hq, nvp = slots.shape[1], slots.shape[2]
    g = Hq // Hk
    kv_head = torch.arange(Hq, device=k.device) // g
    base = (torch.arange(B, device=k.device)[:, None] * Hk + kv_head[None, :]) * T  # [B, Hq]
    flat = (base[:, :, None] + slots.clamp(max=T - 1).expand(B, Hq, nvp)).view(B, Hk, g, nvp)

    def one(x):
        picked = x.flatten(0, 2)[flat]  # [B, Hk, g, NVp, D]
        return torch.cat([picked, x[:, :, None].expand(B, Hk, g, T, D)], dim=3).view(
            B, Hq, nvp + T, D
        )

    return one(k), one(v)


def gathered_mask_mod(plan: PatternPlan, slots: torch.Tensor, tile: int = 0):
    """``mask_mod`` over ``K' = cat(K[slots], K)``: slot j (key ``slots[b, h, j]``) where the rest
    of the rule does not allow it, key ``kv_idx - NVp`` where it does; together exactly
    ``plan.token_mask()``, once."""
    keep = _keep_rule(plan, with_cols=False, tile=tile)
    nvp, T = slots.shape[-1], plan.T
    slot = _per_batch(slots)

    def mask_mod(b, h, q_idx, kv_idx):
        pre = kv_idx < nvp
        k = torch.where(pre, slot(b, h, torch.clamp(kv_idx, max=nvp - 1)), kv_idx - nvp)
        rest = keep(b, h, q_idx, torch.clamp(k, max=T - 1))  # empty slots (k = T) fail causality
        return (q_idx >= k) & torch.where(pre, ~rest, rest)

    return mask_mod


def _slot_blocks(slots: torch.Tensor, bs: int, n_q: int, T: int) -> torch.Tensor:
    """bool ``[B, H, nq, NVp / bs]``: slot block j is touched by query block qb when its first
    (smallest) column is <= the block's last query; never full (pairs the rest allows are masked out
    there)."""
    first = slots[..., ::bs]  # [B, H, nj]
    q_last = (torch.arange(n_q, device=slots.device) * bs + bs - 1).clamp(max=T - 1)
    return first[:, :, None, :] <= q_last[None, None, :, None]


def _coarsen(
    partial: torch.Tensor, full: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block layouts ``[B, H, nq, nk]`` -> the layouts of ``m x m``-block tiles ``[B, H, ceil(nq/m),
    ceil(nk/m)]``: a tile is full when its every block is (a ragged edge tile never is), partial
    when any block is listed and the tile is not full."""
    nq, nk = partial.shape[-2:]
    pad = (0, -nk % m, 0, -nq % m)
    touched, full = F.pad(partial | full, pad), F.pad(full, pad)
    shape = (*touched.shape[:2], touched.shape[2] // m, m, touched.shape[3] // m, m)
    touched, full = touched.view(shape).any(5).any(3), full.view(shape).all(5).all(3)
    return (touched & ~full).contiguous(), full.contiguous()


def flex_block_mask(
    plan: PatternPlan, slots: Optional[torch.Tensor] = None, backward: bool = True, tile: int = 0
):
    """A FlexAttention BlockMask for a square plan: full/partial blocks from ``plan.block_layout()``
    (built from indices, never by evaluating the mask per block) and ``plan_mask_mod`` on partial
    blocks.

    With ``slots`` (``column_slots(plan)``) the keys are ``K' = cat(K[slots], K)``
    (``gather_columns``): ``NVp / bs`` slot blocks, then the layout of the rule without columns
    shifted past them. ``backward=False`` skips the transposed (per key block) lists only the
    backward pass reads. ``tile``: the BlockMask's block size, a multiple of the plan's
    (``flex_tile``; default the plan's own): the layout is pooled onto tiles and the mask_mod masks
    inside them.
    """
    from torch.nn.attention.flex_attention import BlockMask

    bs, T = plan.block_size, plan.T
    tile = tile or bs
    if tile % bs:
        raise ValueError(f"flex tile {tile} is not a multiple of the plan's block size {bs}")
    if slots is None:
        partial, full = plan.block_layout()
        mask_mod, kv_len = plan_mask_mod(plan, tile), T
    else:
        partial, full = plan.block_layout(include_cols=False)
        pre = _slot_blocks(slots, bs, partial.shape[2], T)
        B = max(pre.shape[0], partial.shape[0])
        pre, partial, full = (x.expand(B, *x.shape[1:]) for x in (pre, partial, full))
        partial = torch.cat([pre, partial], dim=-1)
        full = torch.cat([torch.zeros_like(pre), full], dim=-1)
        mask_mod, kv_len = gathered_mask_mod(plan, slots, tile), slots.shape[-1] + T
    if tile > bs:
        partial, full = _coarsen(partial, full, tile // bs)
    pn, pi = _kv_blocks(partial)
    fn, fi = _kv_blocks(full)
    return BlockMask.from_kv_blocks(
        pn,
        pi,
        fn,
        fi,
        BLOCK_SIZE=tile,
        mask_mod=mask_mod,
        seq_lengths=(T, kv_len),
        compute_q_blocks=backward,
    )


def flex_attention_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask,
    kernel_options: Optional[dict] = None,
) -> torch.Tensor:
    """FlexAttention (compiled on CUDA) over a BlockMask from ``flex_block_mask``;
    ``kernel_options`` per call (``kernel_options_for``): Triton tiles, or ``{"BACKEND": "FLASH"}``.
    Eager CPU flex takes none."""
    if q.device.type != "cuda":
        kernel_options = None
    return _flex_fn(q.device)(
        q,
        k,
        v,
        block_mask=block_mask,
        enable_gqa=q.shape[1] != k.shape[1],
        kernel_options=kernel_options,
    )
