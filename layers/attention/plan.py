"""A layer's pattern resolved for one input (``PatternPlan``: windows, sinks, columns, diagonals,
blocks), the token-level mask it means (``pattern_mask``, ``budget_plan``) and, on request, what its
block top-k heads chose (``BlockSelection``).

Shapes: B batch, H query heads, S queries, T keys, D head dim, nq/nk query/key blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .pattern import DENSE_PATTERN, PatternLike, SparsityPattern, head_patterns, layer_block_size
from .selection import (
    estimate_block_topk,
    estimate_token_topk,
    estimate_vertical_slash,
    index_tensor,
    random_block_rows,
    unpack_blocks,
)


@dataclass
class PatternPlan:
    """What one layer's pattern resolves to for one input: everything a backend needs.

    ``cols/diags [B, H, T]`` (vertical-slash heads, else False), ``blocks [B, H, nq, nk]`` whole key
    blocks allowed for query blocks ``q_block0 ..`` (random or top-k; None when no head uses them),
    ``window[H]`` / ``sinks[H]`` (0 = none; a dense head has ``window = T + 1``), ``q_pos[S]``
    absolute query positions ``q_start ..``. ``col_budget``: the most columns any head chose (known
    from the budgets, so a backend can size per-head column slots without reading ``cols`` back from
    the GPU). ``tok_bits [B, Hs + 1, S, nw]`` int32 (``token_select`` heads, else None): the key
    blocks each query row chose, packed 32 to a word (``selection.pack_blocks``), one slot per
    selection and an empty last slot; ``tok_slot[H]`` int64 maps each head to its slot.
    """

    block_size: int
    q_pos: torch.Tensor
    T: int
    window: torch.Tensor
    sinks: torch.Tensor
    blocks: Optional[torch.Tensor]
    cols: Optional[torch.Tensor]
    diags: Optional[torch.Tensor]
    q_start: int
    col_budget: int = 0
    tok_bits: Optional[torch.Tensor] = None
    tok_slot: Optional[torch.Tensor] = None

    @property
    def q_block0(self) -> int:
        return self.q_start // self.block_size

    @property
    def n_key_blocks(self) -> int:
        return (self.T + self.block_size - 1) // self.block_size

    def token_blocks(self) -> torch.Tensor:
        """bool ``[B, H, S, nk]``: the key blocks each query row of a ``token_select`` head chose
        (False for other heads)."""
        return unpack_blocks(self.tok_bits, self.n_key_blocks)[:, self.tok_slot]

    def token_mask(self) -> torch.Tensor:
        """bool ``[B or 1, H, S, T]``."""
        k_pos = torch.arange(self.T, device=self.q_pos.device)
        d = self.q_pos[:, None] - k_pos[None, :]  # [S, T]
        keep = (d[None] < self.window[:, None, None]) | (
            k_pos[None, None, :] < self.sinks[:, None, None]
        )
        keep = keep[None]  # [1, H, S, T]
        if self.blocks is not None:
            bs = self.block_size
            qb = torch.div(self.q_pos, bs, rounding_mode="floor") - self.q_block0
            kb = torch.div(k_pos, bs, rounding_mode="floor")
            keep = keep | self.blocks[:, :, qb][:, :, :, kb]
        if self.tok_bits is not None:
            kb = torch.div(k_pos, self.block_size, rounding_mode="floor")
            keep = keep | self.token_blocks()[..., kb]
        if self.cols is not None:
            keep = keep | self.cols[:, :, None, :] | self._diag_rows()
        return keep & (d >= 0)

    def diag_reach(self) -> torch.Tensor:
        """bool ``[B, H, T]``: ``reach[x]`` = some chosen diagonal lies in ``x .. x + block_size -
        1``.

        The slash rule in one table: a query q (block start ``qs``) keeps key ``k <= q`` through the
        diagonals iff ``k >= qs`` or ``reach[qs - k]`` (module docstring).
        """
        bs, T = self.block_size, self.T
        cs = torch.nn.functional.pad(self.diags.int().cumsum(-1), (1, 0))  # [B, H, T+1]
        x = torch.arange(T, device=self.diags.device)
        return cs[..., (x + bs).clamp(max=T)] > cs[..., x]

    def _diag_rows(self) -> torch.Tensor:
        """The slash rule as bool ``[B, H, S, T]`` (for vertical-slash heads True on and past each
        query's block start; causality is the caller's): one gathered row per query block, repeated
        over its queries."""
        bs, T = self.block_size, self.T
        qs = torch.div(self.q_pos, bs, rounding_mode="floor") * bs  # [S]
        starts, row_of = torch.unique_consecutive(qs, return_inverse=True)
        x = starts[:, None] - torch.arange(T, device=qs.device)[None, :]  # [nb, T]
        # x <= 0 (the query's own block) reads reach[0]: true exactly for heads with diagonal 0
        # chosen, i.e. the vertical-slash heads; other heads of the plan get nothing from this rule
        rows = self.diag_reach()[..., x.clamp(min=0)]  # [B, H, nb, T]
        return rows[:, :, row_of]

    def block_layout(self, include_cols: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(partial, full)`` bool ``[B or 1, H, nq, nk]`` for a square plan (queries = keys
        0..T-1).

        ``full`` blocks are allowed everywhere (no mask needed); ``partial`` blocks hold at least
        one allowed pair and need the token mask. Derived per component, never from the S x T mask,
        so it costs O(H nq nk) at any length; a union of partial pieces that happens to cover a
        block stays ``partial`` (correct, only slower), except a below-diagonal block whose every
        diagonal is chosen (``full``). ``include_cols=False``: the layout of the rule without the
        vertical columns (the flex backend attends to those through gathered keys,
        layers.sparse_attention).
        """
        bs, T, dev = self.block_size, self.T, self.q_pos.device
        if self.q_pos.numel() != T or self.q_start != 0:
            raise ValueError("block_layout needs queries at positions 0..T-1")
        n = (T + bs - 1) // bs
        off = torch.arange(n, device=dev)[:, None] - torch.arange(n, device=dev)[None, :]  # qb - kb
        causal, below = off >= 0, off > 0
        win, sinks = self.window[:, None, None], self.sinks[:, None, None]
        kb_lo = torch.arange(n, device=dev)[None, :] * bs
        touch = causal & (((off * bs - (bs - 1)) < win) | (kb_lo < sinks))  # [H, n, n]
        full = below & (((off * bs + (bs - 1)) < win) | (kb_lo + bs <= sinks))
        touch, full = touch[None], full[None]
        if self.blocks is not None:
            touch = touch | self.blocks
            full = full | (self.blocks & below)
        if self.tok_bits is not None:
            # a key block is visited by a query block when any of its queries chose it, and needs
            # no mask there when all of them did (and it lies before the query block); per slot,
            # then spread over the heads
            rows = unpack_blocks(self.tok_bits, n)  # [B, Hs + 1, T, nk]
            rows = F.pad(rows, (0, 0, 0, n * bs - T)).unflatten(2, (n, bs))
            touch = touch | rows.any(3)[:, self.tok_slot]
            if T % bs:  # the last query block's padded rows chose nothing: never full
                rows = rows[:, :, :-1]
            every = F.pad(rows.all(3), (0, 0, 0, n - rows.shape[2]))[:, self.tok_slot]
            full = full | (every & below)
        if self.cols is not None:
            # Block offset o >= 1 holds the pairs with qs - k in x = o*bs-(bs-1) .. o*bs, kept where
            # reach[x]: touched when a chosen diagonal lies in o*bs-(bs-1) .. o*bs+(bs-1), full when
            # reach holds on all bs of them. The diagonal block (o = 0) is kept whole (up to
            # causality).
            cs = torch.nn.functional.pad(self.diags.int().cumsum(-1), (1, 0))  # [B, H, T+1]
            cr = torch.nn.functional.pad(self.diag_reach().int().cumsum(-1), (1, 0))
            o = torch.arange(n, device=dev)
            lo, hi = (o * bs - (bs - 1)).clamp(0, T), (o * bs + bs).clamp(0, T)
            n_diag = cs[..., hi] - cs[..., lo]  # [B, H, n] chosen diagonals by offset
            oc = off.clamp(min=0)
            hit = n_diag > 0
            if include_cols:
                pad = n * bs - T
                has_col = (
                    torch.nn.functional.pad(self.cols, (0, pad))
                    .view(*self.cols.shape[:2], n, bs)
                    .any(-1)
                )
                hit = hit[:, :, oc] | has_col[:, :, None, :]
            else:
                hit = hit[:, :, oc]
            touch = touch | (hit & causal)
            xlo, xhi = (o * bs - (bs - 1)).clamp(0, T), (o * bs + 1).clamp(0, T)
            every = (cr[..., xhi] - cr[..., xlo]) == bs
            full = full | (every[:, :, oc] & below)
        # one batch size for both lists: kernels index partial and full lists with the same strides
        touch, full = torch.broadcast_tensors(touch, full)
        return (touch & ~full).contiguous(), full.contiguous()


@dataclass(frozen=True)
class BlockSelection:
    """The key blocks one forward's block top-k heads chose, recorded for diagnostics (the passkey
    eval's needle recall): ``plan_pattern`` fills ``stats["selection"]`` when the caller puts that
    key in ``stats``.

    ``blocks bool [B, H, nq, nk]``: the plan's blocks (every head; for block top-k heads the chosen
    blocks, own block included, plus any random blocks) for query blocks ``q_block0 ..``; ``heads``:
    the block top-k heads, in order.
    """

    blocks: torch.Tensor
    heads: tuple[int, ...]
    block_size: int
    q_block0: int
    plan: Optional[PatternPlan] = None

    def covers(self, q_pos: int, k_pos: Sequence[int]) -> torch.Tensor:
        """bool ``[B, len(heads)]``: each block top-k head's blocks for the query at ``q_pos`` hold
        one of the keys ``k_pos`` (windows and sinks aside: what the selection itself found); a
        ``token_select`` head's blocks are those of that query itself."""
        bs = self.block_size
        kb = index_tensor(sorted({int(k) // bs for k in k_pos}), self.blocks.device)
        heads = index_tensor(self.heads, self.blocks.device)
        # [B, h, nk]
        row = self.blocks[:, heads, q_pos // bs - self.q_block0]
        if self.plan is not None and self.plan.tok_bits is not None:
            i = q_pos - self.plan.q_start
            tok = unpack_blocks(self.plan.tok_bits[:, :, i], self.plan.n_key_blocks)
            row = row | tok[:, self.plan.tok_slot[heads]]
        return row[..., kb].any(-1)


def plan_pattern(
    pattern: PatternLike,
    n_heads: int,
    q_start: int,
    S: int,
    T: int,
    layer: int = 0,
    q: Optional[torch.Tensor] = None,
    k: Optional[torch.Tensor] = None,
    q_history: Optional[torch.Tensor] = None,
    device=None,
    stats: Optional[dict] = None,
    score_qk: Optional[tuple] = None,
) -> PatternPlan:
    """Resolve a (per-head) pattern for queries at positions ``q_start .. q_start+S-1`` over keys
    ``0..T-1``.

    Input-dependent heads need ``q[B, H, S, D]`` and ``k[B, Hk, T, D]``; ``q_history[B, H, P, D]``
    holds the queries at positions just before ``q_start`` (decode), used for estimation only.
    ``stats``: a dict to receive the block top-k selection's entropy and top-k mass
    (estimate_block_topk), and a ``BlockSelection`` under ``"selection"`` when that key is already
    in it (a request: the blocks stay alive as long as the dict). ``score_qk``: ``(q, k,
    q_history)`` shaped as ``q, k, q_history`` (their head dim may differ), which block top-k heads
    with ``score_nope`` (q, k before RoPE) or ``indexer`` (the layer's indexer) score instead.
    Positions are Python ints, so planning never waits on the GPU.
    """
    pats = head_patterns(pattern, n_heads)
    bs = layer_block_size(pats)
    # a head that allows every causal pair over T keys is planned as a dense head: window T + 1, no
    # sinks, random blocks or estimation (the same mask; decode at T keys follows prefill of T keys)
    pats = [DENSE_PATTERN if p.is_dense_at(T) else p for p in pats]
    dev = device if device is not None else (q.device if q is not None else None)
    q_pos = torch.arange(q_start, q_start + S, device=dev)
    win = index_tensor([T + 1 if p.type == "dense" else p.window for p in pats], dev)
    sinks = index_tensor([p.sinks for p in pats], dev)
    qb0 = q_start // bs
    q_blocks = torch.arange(qb0, (q_start + S - 1) // bs + 1 if S else qb0, device=dev)
    nk = (T + bs - 1) // bs
    blocks = cols = diags = None
    if any(p.random_blocks for p in pats):
        blocks = random_block_rows(pats, layer, q_blocks, nk)[None]
    dyn = [h for h, p in enumerate(pats) if p.dynamic]
    if dyn:
        if q is None or k is None:
            raise ValueError("input-dependent patterns (vertical_slash, block_topk) need q and k")
        src = _with_history(q, q_history)
        src_start = q_start - (src.shape[2] - S)
        B = q.shape[0]
        if any(pats[h].scores_apart for h in dyn):
            if score_qk is None:
                raise ValueError(
                    "block top-k heads with score_nope or indexer need score_qk (the q, k they "
                    "score)"
                )
            nq_, nk_, nh_ = score_qk
            # (queries, keys, queries with history) each head's selection scores
            scoring = {0: (q, k, src), 1: (nq_, nk_, _with_history(nq_, nh_))}
        else:
            scoring = {0: (q, k, src)}
        vs = [h for h in dyn if pats[h].type == "vertical_slash"]
        if vs:
            L = min(max(pats[h].last_q for h in vs), src.shape[2])
            src_end = src_start + src.shape[2]
            # index tensors, not lists: a list index is a blocking host-to-GPU copy
            heads = index_tensor(vs, dev)
            c, dg = estimate_vertical_slash(
                src[:, heads, -L:],
                _kv_for_heads(k, vs, n_heads),
                range(src_end - L, src_end),
                [pats[h].n_vertical for h in vs],
                [pats[h].n_slash for h in vs],
                [pats[h].keep_columns for h in vs],
                [pats[h].keep_diagonals for h in vs],
            )
            cols = torch.zeros(B, n_heads, T, dtype=torch.bool, device=dev)
            diags = torch.zeros_like(cols)
            cols[:, heads], diags[:, heads] = c, dg
        bt = [h for h in dyn if pats[h].type == "block_topk"]
        tb = [h for h in bt if pats[h].token_select == 1]
        union = [h for h in bt if pats[h].token_select == 2]
        bt_block = [h for h in bt if not pats[h].token_select]
        if tb:
            tok = _token_selection(pats, tb, n_heads, scoring, q_start, bs, stats)[:2]
        if union:
            nq = q_blocks.numel()
            bits, slot, cap, share = _token_selection(
                pats, union, n_heads, scoring, q_start, bs, stats, nq
            )
            chosen = _union_per_query_block(bits, q_start, bs, nq, nk, cap, share)[:, slot]
            if blocks is None:
                blocks = torch.zeros(B, n_heads, q_blocks.numel(), nk, dtype=torch.bool, device=dev)
            blocks = blocks | chosen  # the empty slot adds nothing to the other heads
        if bt_block:
            first = max(qb0 * bs - src_start, 0)  # pool from the first query block's start on
            g = n_heads // k.shape[1]
            full = torch.zeros(B, n_heads, q_blocks.numel(), nk, dtype=torch.bool, device=dev)
            if blocks is not None:
                full |= blocks
            # one estimate per scoring rule (query_max, score_block's sub-blocks; a layer mixing
            # rules logs the stats of the last one)
            rule = {
                h: (pats[h].query_max, _sub_blocks(pats[h], bs), int(pats[h].scores_apart))
                for h in bt_block
            }
            for qmax, sub, nope in sorted(set(rule.values())):
                hs = [h for h in bt_block if rule[h] == (qmax, sub, nope)]
                _, k_s, src_s = scoring[nope]
                heads = index_tensor(hs, dev)
                # share_group heads of one KV group with one budget share a slot (one selection);
                # others their own
                slot_key = [
                    (h // g, pats[h].top_k) if pats[h].share_group else ("head", h) for h in hs
                ]
                slot = [sorted(set(slot_key), key=str).index(x) for x in slot_key]
                full[:, heads] |= estimate_block_topk(
                    src_s[:, heads, first:],
                    src_start + first,
                    _kv_for_heads(k_s, hs, n_heads),
                    q_blocks,
                    qb0,
                    bs,
                    [pats[h].top_k for h in hs],
                    slot,
                    stats,
                    int(qmax),
                    sub,
                )
            blocks = full
    plan = PatternPlan(bs, q_pos, T, win, sinks, blocks, cols, diags, q_start, _col_budget(pats, T))
    if dyn and tb:
        plan.tok_bits, plan.tok_slot = tok
    if dyn and bt and stats is not None and "selection" in stats:
        chosen = plan.blocks
        if chosen is None:
            chosen = torch.zeros(B, n_heads, q_blocks.numel(), nk, dtype=torch.bool, device=dev)
        stats["selection"] = BlockSelection(chosen, tuple(bt), bs, qb0, plan)
    return plan


def _union_per_query_block(
    bits: torch.Tensor,
    q_start: int,
    bs: int,
    n_q_blocks: int,
    nk: int,
    cap: Sequence[int] = (),
    share: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``bits [B, Hs, S, nw]`` (rows at positions ``q_start ..``) -> bool ``[B, Hs, nq, nk]``: the
    key blocks any query row of each query block chose (``token_select: 2``). ``share [B, Hs, nq,
    nk]``: the highest log share a query of the block gives each chosen block (+inf for its own,
    -inf where none chose it), so where it is given the union is read from it and ``bits`` are not
    unpacked (``[B, Hs, S, nk]`` booleans: half a gigabyte a layer of the 1B presets' model at
    128k). ``cap`` (per slot, 0 = none; ``union_blocks``): a query block keeps the ``cap`` blocks
    with the highest share, ties to the later block, so its own block always stays."""
    if share is not None:
        union = share > float("-inf")
    else:
        rows = unpack_blocks(bits, nk)
        head = q_start % bs
        tail = n_q_blocks * bs - head - rows.shape[2]
        rows = F.pad(rows, (0, 0, head, tail))
        union = rows.unflatten(2, (n_q_blocks, bs)).any(3)
    if not any(cap):
        return union
    # a stable sort of the reversed blocks puts the later of equal shares first
    order = nk - 1 - share.flip(-1).sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(nk, device=order.device).expand_as(order).contiguous()
    )
    limit = index_tensor([c or nk for c in cap], order.device)[None, :, None, None]
    return union & (rank < limit)


def _with_history(q: torch.Tensor, q_history: Optional[torch.Tensor]) -> torch.Tensor:
    """The queries an estimate pools: ``cat(q_history, q)`` along the rows (decode), else q."""
    return q if q_history is None else torch.cat([q_history.to(q.dtype), q], dim=2)


def _token_selection(pats, heads, n_heads, scoring, q_start, bs, stats, nq=0):
    """``(tok_bits [B, Hs + 1, S, nw], tok_slot [H], union_blocks per slot, tile shares)`` for the
    ``token_select`` heads ``heads``: one estimate per scoring rule (score_block's sub-blocks;
    ``scoring[scores_apart]``: the q, k it scores; ``min_share``), a KV group's ``share_group``
    heads with one budget sharing a slot, and an empty last slot for every other head. Tile shares
    (float32 ``[B, Hs + 1, nq, nk]``, ``estimate_token_topk``'s ``tile_share``, which the slots
    without ``union_blocks`` read for their union only): None when no slot has one."""
    g = n_heads // scoring[0][1].shape[1]
    parts, shares, slot_of = [], [], {}
    ranked = any(pats[h].union_blocks for h in heads)  # tile shares wanted
    rules = {
        h: (_sub_blocks(pats[h], bs), int(pats[h].scores_apart), pats[h].min_share) for h in heads
    }
    for sub, nope, min_share in sorted(set(rules.values())):
        hs = [h for h in heads if rules[h] == (sub, nope, min_share)]
        q, k, _ = scoring[nope]
        keys = [
            (h // g, pats[h].top_k, pats[h].union_blocks) if pats[h].share_group else ("head", h)
            for h in hs
        ]
        order = list(dict.fromkeys(keys))  # first-seen order: unshared heads keep head order
        slot = [order.index(x) for x in keys]
        nk = (k.shape[2] + bs - 1) // bs
        share = None
        if ranked:
            share = torch.full((q.shape[0], len(order), nq, nk), float("-inf"), device=q.device)
            shares.append(share)
        bits, _ = estimate_token_topk(
            q[:, index_tensor(hs, q.device)],
            q_start,
            _kv_for_heads(k, hs, n_heads),
            bs,
            [pats[h].top_k for h in hs],
            slot,
            stats,
            sub,
            min_share,
            share,
        )
        base = sum(p.shape[1] for p in parts)
        slot_of.update({h: base + s for h, s in zip(hs, slot)})
        parts.append(bits)
    empty = sum(p.shape[1] for p in parts)
    parts.append(torch.zeros_like(parts[0][:, :1]))
    tok_slot = index_tensor([slot_of.get(h, empty) for h in range(n_heads)], q.device)
    cap = [0] * (empty + 1)
    for h, sl in slot_of.items():
        cap[sl] = pats[h].union_blocks
    # the empty slot chose nothing: -inf shares, an empty union
    tile = (
        torch.cat(shares + [torch.full_like(shares[0][:, :1], float("-inf"))], dim=1)
        if ranked
        else None
    )
    return torch.cat(parts, dim=1), tok_slot, cap, tile


def _sub_blocks(p: SparsityPattern, bs: int) -> int:
    """Sub-blocks a block top-k head scores each key block by (``bs / score_block``; 1 = the whole
    block)."""
    return bs // p.score_block if 0 < p.score_block < bs else 1


def _col_budget(pats: Sequence[SparsityPattern], T: int) -> int:
    """The most key columns a vertical-slash head of ``pats`` chooses over ``T`` keys (top-k picks
    exactly this many)."""
    return max([min(p.n_vertical, T) for p in pats if p.type == "vertical_slash"], default=0)


def _kv_for_heads(k: torch.Tensor, heads: Sequence[int], n_heads: int) -> torch.Tensor:
    """KV heads serving query heads ``heads`` (one per query head, so the GQA group is 1)."""
    g = n_heads // k.shape[1]
    return k[:, index_tensor([h // g for h in heads], k.device)]


def pattern_mask(
    pattern: PatternLike,
    q_len: int,
    kv_len: int,
    n_heads: int,
    layer: int = 0,
    q: Optional[torch.Tensor] = None,
    k: Optional[torch.Tensor] = None,
    device=None,
) -> torch.Tensor:
    """The token-level mask a pattern means: bool ``[n_heads, q_len, kv_len]`` (``[B, ...]`` with
    ``q, k``).

    Queries are the last ``q_len`` positions of the ``kv_len`` keys (decode: ``q_len = 1``).
    Input-dependent patterns need ``q[B, n_heads, q_len, D]`` and ``k[B, Hk, kv_len, D]``.
    """
    dev = device or (q.device if q is not None else None)
    plan = plan_pattern(pattern, n_heads, kv_len - q_len, q_len, kv_len, layer, q, k, device=dev)
    m = plan.token_mask()
    return m if q is not None else m[0]


def budget_plan(
    pattern: PatternLike,
    n_heads: int,
    T: int,
    layer: int = 0,
    rows: Optional[range] = None,
    device=None,
) -> PatternPlan:
    """A plan that needs no input: input-dependent heads get the places their budgets allow.

    Vertical-slash heads take columns ``0 .. n_vertical-1`` and diagonals ``0 .. n_slash-1``; block
    top-k heads take the diagonal block and the ``top_k - 1`` (``union_blocks - 1``) blocks before
    it. Used for density logs and pictures; the density it gives is what the budgets buy when the
    picks do not overlap.
    """
    pats = head_patterns(pattern, n_heads)
    rows = range(T) if rows is None else rows
    # heads dense at T: plan_pattern
    dyn = [h for h, p in enumerate(pats) if p.dynamic and not p.is_dense_at(T)]
    # stand-ins that keep the layer's block size; their window is cleared below
    static = [
        SparsityPattern(type="local", window=1, block_size=p.block_size) if h in dyn else p
        for h, p in enumerate(pats)
    ]
    plan = plan_pattern(static, n_heads, rows.start, len(rows), T, layer, device=device)
    if not dyn:
        return plan
    idx = torch.arange(T, device=device)
    plan.window, plan.sinks = plan.window.clone(), plan.sinks.clone()
    for h in dyn:  # block top-k heads keep their own sinks / window on top of the blocks
        plan.window[h], plan.sinks[h] = (
            (pats[h].window, pats[h].sinks) if pats[h].type == "block_topk" else (0, 0)
        )
    cols = torch.zeros(1, n_heads, T, dtype=torch.bool, device=device)
    diags = torch.zeros_like(cols)
    nq = (rows.stop - 1) // plan.block_size - plan.q_block0 + 1 if len(rows) else 0
    nk = (T + plan.block_size - 1) // plan.block_size
    qb = torch.arange(plan.q_block0, plan.q_block0 + nq, device=device)[:, None]
    blocks = (
        torch.zeros(1, n_heads, nq, nk, dtype=torch.bool, device=device)
        if plan.blocks is None
        else plan.blocks.clone()
    )
    for h in dyn:
        p = pats[h]
        if p.type == "vertical_slash":
            cols[0, h], diags[0, h] = idx < p.n_vertical, idx < p.n_slash
        else:
            off = qb - torch.arange(nk, device=device)[None, :]
            budget = p.union_blocks or p.top_k  # a capped union's bound
            blocks[0, h] = (off >= 0) & (off < budget)
    plan.cols, plan.diags, plan.blocks = cols, diags, blocks
    plan.col_budget = _col_budget([pats[h] for h in dyn], T)
    return plan
