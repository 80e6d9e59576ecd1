"""Per-token block top-k from per-block scores in one pass over each query's row: the ranking,
``min_share``, the query blocks' tile shares, the packed bits and the entropy / mass statistics of
``layers.attention.selection.estimate_token_topk`` with single-key scores (kernels.key_block_max),
which otherwise take a chain of torch ops over ``[B, Hs, S, nk]`` (a radix top-k among them) that
costs several times the scores.

Shapes: s float32 [B, Hs, R, nk] (row i at position ``q_start + i``, own block ``own = pos // bs``;
-inf for blocks after it, the own block scored over all its keys), ks int64 [Hs] the slots' budgets
-> bits int32 [B, Hs, R, ceil(nk / 32)] (``selection.pack_blocks``), and optionally own_causal
float32 [B, Hs, R] (the own block's score over the keys up to the query) for the log shares,
tile_share float32 [B, Hs, nq, nk] (amax into query block ``own - tile0``), stats float32 [2]
(entropy and top-k mass summed over the rows, added to).

Ranking as selection._rank_keys, bit for bit: the own block first, then by score, an equal score
ranking the later block first (the float's order as an integer, then the block index). Layers:
``@triton.jit`` kernel + launcher ``token_block_topk`` (CUDA, or CPU under TRITON_INTERPRET=1);
the torch oracle is ``selection._token_topk_reference``, on the same scores.
"""

from __future__ import annotations

import math

import torch

from .launch import jit, tl, triton


# Builtins only (tl.full, tl.reduce, tl.exp, tl.log), as kernels.moe_combine: the interpreter
# refuses triton's jitted standard library (tl.max, tl.sum) where triton was imported before
# TRITON_INTERPRET was set.
def _token_block_topk_kernel(
    s_ptr,
    own_ptr,
    ks_ptr,
    bits_ptr,
    tile_ptr,
    stats_ptr,
    R,
    NK,
    NW,
    HS,
    q_start,
    tile0,
    log_min,
    bits_sb,
    bits_sh,
    bits_sr,
    tile_sb,
    tile_sh,
    tile_sq,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    NKP: tl.constexpr,
    SHARES: tl.constexpr,
    MIN_SHARE: tl.constexpr,
    TILE: tl.constexpr,
    STATS: tl.constexpr,
):
    # grid (cdiv(R, ROWS), B * HS): ROWS whole rows of one slot, each row in registers throughout
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // HS, bh % HS
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    rows = tl.minimum(rows, R - 1)  # rows past R repeat the last (no all -inf row), never stored
    j = tl.arange(0, NKP)
    jmask = j < NK
    own = (q_start + rows) // BS
    s = tl.load(
        s_ptr + bh * R * NK + rows[:, None] * NK + j[None, :],
        mask=jmask[None, :],
        other=float("-inf"),
    )
    future = j[None, :] > own[:, None]
    is_own = j[None, :] == own[:, None]
    s = tl.where(future, float("-inf"), s)

    # the ranking of selection._rank_keys (the float's order as an integer, then the later block)
    # as two int32 maxima a step, the order's then the block's among its equals: half the
    # registers and a third fewer instructions than one int64 key
    i = tl.where(is_own, float("inf"), s).to(tl.int32, bitcast=True)
    ordered = tl.where(i >= 0, i, i ^ 0x7FFFFFFF)  # negative floats: the order reversed
    gone = -2147483648  # below every float's order: taken blocks and the padding past nk
    key = tl.where(jmask[None, :], ordered, gone)
    jj = j[None, :] + tl.full([ROWS, NKP], 0, tl.int32)
    pick = tl.full([ROWS, NKP], 0, tl.int32)
    for _ in range(tl.minimum(tl.load(ks_ptr + h), NK)):
        top = tl.reduce(key, 1, tl.standard._elementwise_max)
        last = tl.reduce(tl.where(key == top[:, None], jj, -1), 1, tl.standard._elementwise_max)
        hit = jj == last[:, None]
        pick = tl.where(hit, 1, pick)
        key = tl.where(hit, gone, key)
    pick = tl.where(future | ~jmask[None, :], 0, pick)

    if SHARES:
        # log softmax over the causal blocks, the own block over the keys up to the query
        oc = tl.load(own_ptr + bh * R + rows)
        c = tl.where(is_own, oc[:, None], s)
        c = c - tl.reduce(c, 1, tl.standard._elementwise_max)[:, None]
        share = c - tl.log(tl.reduce(tl.exp(c), 1, tl.standard._sum_combine))[:, None]
        if MIN_SHARE:
            pick = tl.where((share >= log_min) | is_own, pick, 0)
        if TILE:
            kept = tl.where(is_own, float("inf"), share)
            kept = tl.where((pick != 0) & rmask[:, None], kept, float("-inf"))
            # one atomic per query block and key block: the program's rows of a query block are
            # reduced first (a query block holds bs rows, mostly all in one program)
            first = (q_start + pid * ROWS) // BS
            last = (q_start + tl.minimum(pid * ROWS + ROWS, R) - 1) // BS
            for t in range(first, last + 1):
                v = tl.where(own[:, None] == t, kept, float("-inf"))
                v = tl.reduce(v, 0, tl.standard._elementwise_max)
                tl.atomic_max(
                    tile_ptr + b * tile_sb + h * tile_sh + (t - tile0) * tile_sq + j,
                    v,
                    mask=jmask & (v > float("-inf")),
                )

    # distinct bits: their sum is their OR (bit 31 wraps to the sign)
    words = tl.reshape(pick << (j % 32)[None, :], [ROWS, NKP // 32, 32])
    words = tl.reduce(words, 2, tl.standard._sum_combine)
    w = tl.arange(0, NKP // 32)
    tl.store(
        bits_ptr + b * bits_sb + h * bits_sh + rows[:, None] * bits_sr + w[None, :],
        words,
        mask=rmask[:, None] & (w[None, :] < NW),
    )

    if STATS:
        # softmax over the causal blocks' scores (the own block over all its keys)
        e = tl.exp(s - tl.reduce(s, 1, tl.standard._elementwise_max)[:, None])
        p = e / tl.reduce(e, 1, tl.standard._sum_combine)[:, None]
        ent = -tl.reduce(p * tl.log(tl.maximum(p, 1e-30)), 1, tl.standard._sum_combine)
        ent = ent / tl.log(tl.maximum(own + 1, 2).to(tl.float32))
        mass = tl.reduce(tl.where(pick != 0, p, 0.0), 1, tl.standard._sum_combine)
        out = stats_ptr + (bh * tl.num_programs(0) + pid) * 2
        tl.store(out, tl.reduce(tl.where(rmask, ent, 0.0), 0, tl.standard._sum_combine))
        tl.store(out + 1, tl.reduce(tl.where(rmask, mass, 0.0), 0, tl.standard._sum_combine))


def token_block_topk(
    s: torch.Tensor,
    q_start: int,
    bs: int,
    ks: torch.Tensor,
    bits_out: torch.Tensor,
    own_causal: torch.Tensor | None = None,
    min_share: int = 0,
    tile_share: torch.Tensor | None = None,
    tile0: int = 0,
    stats: torch.Tensor | None = None,
    rows: int = 0,
    num_warps: int = 0,
) -> None:
    """Writes ``bits_out`` (int32 ``[B, Hs, R, nw]``, any strides, the last 1) with each row's
    blocks (module docstring): its top ``ks[h]`` by score, its own block first, then those of the
    future dropped and, with ``min_share`` (percent), those other than its own whose log share
    (``own_causal`` required) is below ``log(min_share / 100)``. ``tile_share`` (last stride 1):
    amax of each kept block's log share (+inf for the own block) into row ``own - tile0`` of the
    query blocks; ``stats``: the rows' summed normalised entropy and top-k mass added to ``[0]``,
    ``[1]``. ``rows`` / ``num_warps``: query rows a program holds and its warps (0: a 4096-element
    tile, 8 warps from there; a row split over several warps reduces through shared memory, one
    warp a row reduces by shuffles alone). No host sync. Launches where ``use_triton(s)``;
    elsewhere the caller runs the torch oracle."""
    B, Hs, R, nk = s.shape
    if R == 0 or B * Hs == 0:
        return
    shares = bool(min_share) or tile_share is not None
    if shares and own_causal is None:
        raise ValueError("min_share and tile_share need own_causal")
    nkp = max(32, triton.next_power_of_2(nk))  # at least one whole packed word
    rows = rows or min(16, max(1, 4096 // nkp))  # a 4096-element tile per program
    num_warps = num_warps or (8 if rows * nkp >= 4096 else 4)
    grid = (triton.cdiv(R, rows), B * Hs)
    s = s.contiguous()
    own_causal = s if own_causal is None else own_causal.float().contiguous()
    tile = s if tile_share is None else tile_share
    partial = s if stats is None else torch.empty(B * Hs, grid[0], 2, device=s.device)
    jit(_token_block_topk_kernel)[grid](
        s,
        own_causal,
        ks,
        bits_out,
        tile,
        partial,
        R,
        nk,
        bits_out.shape[-1],
        Hs,
        q_start,
        tile0,
        math.log(min_share / 100) if min_share else 0.0,
        bits_out.stride(0),
        bits_out.stride(1),
        bits_out.stride(2),
        tile.stride(0),
        tile.stride(1),
        tile.stride(2),
        BS=bs,
        ROWS=rows,
        NKP=nkp,
        SHARES=shares,
        MIN_SHARE=bool(min_share),
        TILE=tile_share is not None,
        STATS=stats is not None,
        num_warps=num_warps,
    )
    if stats is not None:
        stats += partial.sum((0, 1))
