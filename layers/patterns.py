"""Sparse attention patterns: the causal token-level mask ``allowed(q, k)`` of each (layer, head), defined once.

Every backend (layers.sparse_attention) must compute attention under exactly this mask. Conventions
(DESIGN.md), for a query at absolute position q and a key at position k, always with ``k <= q``:

- ``local``:  ``q - k < window`` (window W covers keys q-W+1 .. q), optionally plus ``sinks``.
- ``a_shape``: ``k < sinks`` or ``q - k < window`` (StreamingLLM / MInference A-shape).
- ``bigbird``: A-shape plus ``random_blocks`` whole key blocks per query block, drawn from the strictly
  earlier blocks ``0 .. qb-1`` by a counter-based hash of (seed, layer, head, query block, key block):
  identical in every process and on every device, and independent of the sequence length (so decode
  sees the blocks prefill saw).
- ``vertical_slash``: ``k`` in the top-``n_vertical`` key columns or ``q - k`` in the top-``n_slash``
  diagonals, ranked by the softmax mass the last ``last_q`` queries of the input put on them
  (MInference, Jiang et al. 2024, sec. 3.2): columns first, then diagonals by the mass outside the
  chosen columns (MInference ranks diagonals by all their mass, so a heavy column's "shadow"
  diagonals take slash budget that covers nothing new). Diagonal 0 is always chosen. Columns are exact;
  diagonals are dilated to the query block as in MInference's kernel: a query block starting at ``qs``
  takes, for each chosen diagonal d, the ``block_size`` keys ``qs - d .. qs - d + block_size - 1`` (the keys
  its queries meet on d, as one range), i.e. query q keeps key k iff ``qs - k <= d <= qs - k + block_size - 1``
  for some chosen d (so every key of its own block, up to causality). A diagonal chosen from noise among
  its neighbours then costs whole blocks, not blocks the kernel must mask element by element.
- ``block_topk``: the ``top_k`` key blocks (of ``block_size``) with the highest mean-pooled
  ``q_block . k_block`` score per query block, among blocks ``<= qb``; the diagonal block is always one
  of them. Pooling a query block uses all its queries present in the input, so within one block the
  choice can depend on later queries of that block (as in MInference and MoBA).
- ``dense``: causal.

Every type also takes ``dense_below`` (tokens, 0 = never): over ``T`` keys, a head with
``T < dense_below`` attends every causal pair, i.e. is exactly dense causal attention (MInference applies
its estimated patterns to long inputs only; below its crossover a sparse kernel is slower than SDPA).
``T`` is the number of keys of the call, so a decode step at total length T (T keys, new one
included) follows the same rule as prefill over T keys, and all rows of one call share it.
``SparsityPattern.is_dense_at`` is the one place that decides; every consumer asks it.

The input-dependent patterns (vertical_slash, block_topk) estimate from the queries of the *input*;
decode reproduces prefill's estimate from a short history of queries (layers.Attention keeps it), so
each decode step re-estimates: ``last_q x T`` scores, ``last_q`` times a dense decode step's QK^T.

Shapes: B batch, H query heads, S queries, T keys, D head dim, nq/nk query/key blocks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from configs.attention import COMMON_PARAMS, DEFAULT_BLOCK_SIZE, PATTERN_TYPES, validate_pattern
from configs.errors import ConfigError, check_choice

DYNAMIC_TYPES = ("vertical_slash", "block_topk")
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SparsityPattern:
    """One head's pattern. Params are named as in DESIGN.md; 0 means "not used" for optional counts."""

    type: str = "dense"
    window: int = 0
    sinks: int = 0
    random_blocks: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = 0
    n_vertical: int = 0
    n_slash: int = 0
    last_q: int = 64
    top_k: int = 0
    dense_below: int = 0

    def __post_init__(self):
        validate_pattern(self.to_dict(), "pattern")

    @classmethod
    def from_dict(cls, d: dict, key: str = "pattern") -> "SparsityPattern":
        """``{type: a_shape, sinks: 64, window: 1024}`` -> pattern; bad dicts raise ConfigError naming ``key``."""
        validate_pattern(d, key)
        return cls(**dict(d))

    def to_dict(self) -> dict:
        """The YAML form: type, its required params, and optional ones that differ from the default."""
        check_choice(self.type, tuple(PATTERN_TYPES), "pattern.type")
        required, optional = PATTERN_TYPES[self.type]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        out = {"type": self.type}
        for name in required:
            out[name] = getattr(self, name)
        for name in optional + COMMON_PARAMS:
            if getattr(self, name) != defaults[name]:
                out[name] = getattr(self, name)
        return out

    @property
    def dynamic(self) -> bool:
        """True when the mask depends on the input (needs q, k)."""
        return self.type in DYNAMIC_TYPES

    def is_dense_at(self, T: int) -> bool:
        """True when, over ``T`` keys, the pattern allows every causal pair (so dense attention is exact):
        fewer keys than ``dense_below``, or a window / budget that covers all ``T`` keys."""
        if self.type == "dense" or T < self.dense_below:
            return True
        if self.type == "vertical_slash":
            return max(self.n_vertical, self.n_slash) >= T
        if self.type == "block_topk":
            return self.top_k >= (T + self.block_size - 1) // self.block_size
        return self.window >= T


PatternLike = Union[SparsityPattern, Sequence[SparsityPattern]]
_DENSE = SparsityPattern()


def head_patterns(pattern: PatternLike, n_heads: int) -> list[SparsityPattern]:
    """One pattern per query head (a single pattern is shared by all heads)."""
    if isinstance(pattern, SparsityPattern):
        return [pattern] * n_heads
    pats = list(pattern)
    if len(pats) != n_heads:
        raise ValueError(f"per-head pattern list has {len(pats)} entries for {n_heads} heads")
    return [p if p is not None else SparsityPattern() for p in pats]


def layer_block_size(pats: Sequence[SparsityPattern]) -> int:
    """The block size shared by a layer's sparse heads (kernels tile one block size per layer)."""
    sizes = {p.block_size for p in pats if p.type != "dense"} or {SparsityPattern().block_size}
    if len(sizes) != 1:
        raise ConfigError("pattern.block_size", f"heads of one layer must share block_size, got {sorted(sizes)}")
    return sizes.pop()


# ---------------------------------------------------------------------------------------------------
# Seeded random blocks


def _fmix32(x):
    """Murmur3 finaliser on Python ints or int64 tensors holding 32-bit values (wrapping multiply, low 32 bits kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _ints(values: Sequence[int], device=None) -> torch.Tensor:
    """int64 ``[len(values)]`` on ``device``, without waiting for the GPU: ``torch.tensor(values, device="cuda")``
    (a copy from pageable memory) first waits for everything queued on the GPU; a pinned source copied
    non-blocking does not (the caching host allocator keeps it alive until the copy has run). Under
    torch.compile the values are constants of the graph, so the plain copy is traced instead."""
    t = torch.tensor(values, dtype=torch.long)
    if device is None or torch.device(device).type != "cuda" or torch.compiler.is_compiling():
        return t if device is None else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def random_block_rows(pats: Sequence[SparsityPattern], layer: int, q_blocks: torch.Tensor, n_k_blocks: int) -> torch.Tensor:
    """``bool[H, len(q_blocks), n_k_blocks]``: the ``random_blocks`` key blocks each head's query blocks draw.

    Block ``qb`` of head h picks the ``r`` blocks of ``0 .. qb-1`` with the largest 32-bit hash of
    (seed, layer, h, qb, kb) (all of them when ``qb <= r``); integer ops only, so equal on every device,
    and the hash of a (qb, kb) pair never depends on the sequence length.
    """
    dev = q_blocks.device
    kb = torch.arange(n_k_blocks, device=dev)
    base = _ints([_fmix32((p.seed * 0x9E3779B1 + layer * 0x85EBCA77 + h * 0xC2B2AE3D) & _MASK32)
                  for h, p in enumerate(pats)], dev)                                     # [H]
    hq = _fmix32(base[:, None] ^ ((q_blocks.long() * 0x27D4EB2F) & _MASK32)[None, :])   # [H, nq]
    h = _fmix32(hq[:, :, None] ^ ((kb * 0x165667B1) & _MASK32))                          # [H, nq, nk]
    earlier = kb[None, :] < q_blocks[:, None]                                             # [nq, nk]
    score = torch.where(earlier, (h << 20) | kb, -1)     # distinct scores: ties never depend on topk order
    return _topk_per_head(score[None], [p.random_blocks for p in pats])[0] & earlier


# ---------------------------------------------------------------------------------------------------
# Input-dependent estimation (vertical-slash, block top-k)


def _group_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q[B, H, L, D]``, ``k[B, Hk, T, D]`` -> float32 ``q k^T / sqrt(D)`` of shape ``[B, H, L, T]`` (GQA without repeat)."""
    B, H, L, D = q.shape
    Hk = k.shape[1]
    with torch.autocast(q.device.type, enabled=False):    # index choice in float32 even under bf16 autocast
        if q.is_cuda and q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16):
            # Tensor cores with float32 accumulation and output: 16-bit products are exact in float32, so
            # this is the float32 GEMM below up to summation order, ~10x faster (CUDA has no TF32 default).
            s = torch.bmm(q.reshape(B * Hk, H // Hk * L, D), k.reshape(B * Hk, -1, D).transpose(1, 2),
                          out_dtype=torch.float32).mul_(D ** -0.5)
        else:
            qg = q.float().view(B, Hk, H // Hk, L, D)
            s = torch.einsum("bkgld,bktd->bkglt", qg, k.float()) * D ** -0.5
    return s.reshape(B, H, L, -1)


def _topk_per_head(score: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """``score[B, H, ..., N]``, per-head budgets ``ks[H]`` -> bool, same shape, marking each row's top-k."""
    H, N = score.shape[1], score.shape[-1]
    kmax = min(max(ks), N)
    idx = score.topk(kmax, dim=-1).indices
    rank_ok = torch.arange(kmax, device=score.device)[None, :] < _ints(ks, score.device)[:, None]
    rank_ok = rank_ok.view(H, *([1] * (score.dim() - 3)), kmax)
    out = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    return out.scatter_(-1, idx, rank_ok.expand_as(idx))


@torch.no_grad()   # indices only: nothing differentiable leaves, so record no graph
def estimate_vertical_slash(q_est: torch.Tensor, k: torch.Tensor, est_pos: range,
                            n_vertical: Sequence[int], n_slash: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """MInference's online index estimation.

    ``q_est[B, H, L, D]`` are the last queries (absolute positions ``est_pos``, a range), ``k[B, Hk, T, D]``.
    Returns ``cols, diags`` bool ``[B, H, T]``: the chosen key columns and diagonals ``d = q - k``.
    """
    T, L, p0 = k.shape[2], q_est.shape[2], est_pos.start
    s = _group_scores(q_est, k)                                             # [B, H, L, T]
    # only keys after the first estimating query can lie in a row's future: mask that tail in place
    future = torch.arange(p0 + 1, T, device=k.device)[None, :] > torch.arange(p0, p0 + L, device=k.device)[:, None]
    s[..., p0 + 1:].masked_fill_(future, float("-inf"))
    prob = s.softmax(-1)
    cols = _topk_per_head(prob.sum(-2), n_vertical)
    # Diagonals are ranked by the mass the chosen columns leave: a heavy column key otherwise puts one
    # row's mass on each of L diagonals ("shadows" of the column) that buy nothing the column does not
    # already cover, and scatter over the key blocks (BENCHMARKS.md, vertical-slash). MInference ranks
    # both from the same scores; this is the greedy cover: the union holds at least as much of the
    # estimating rows' mass for the same budgets.
    prob.masked_fill_(cols[:, :, None, :], 0.0)
    diags = _topk_per_head(_diagonal_sums(prob, p0), n_slash)
    diags[..., 0] = True
    return cols, diags


def _diagonal_sums(prob: torch.Tensor, p0: int) -> torch.Tensor:
    """``prob[B, H, L, T]`` with row i at position ``p_i = p0 + i < T`` (zero where k > q) -> ``[B, H, T]``: the
    mass on each diagonal ``d = q - k``, all rows at once (no loop over rows, no copy of prob).

    Diagonals ``0 .. p0`` cross every row: element ``(i, e)`` at flat offset ``i * (T + 1) + e`` of a row-major
    ``[L, T]`` slab is row i, key ``i + e``, diagonal ``p0 - e``, so a strided view summed over i gives them
    all. Diagonals ``p0 + m`` (``m = 1 .. L-1``) exist only in rows ``i >= m`` (key ``i - m``): a gather from
    the first L keys.
    """
    B, H, L, T = prob.shape
    prob = prob.contiguous()
    out = prob.new_zeros(B, H, T)
    main = prob.as_strided((B, H, L, p0 + 1), (H * L * T, L * T, T + 1, 1), prob.storage_offset())
    out[..., :p0 + 1] = main.sum(-2).flip(-1)
    if L > 1:
        key = torch.arange(L, device=prob.device)[:, None] - torch.arange(1, L, device=prob.device)[None, :]   # [L, L-1]
        vals = prob[..., :L].gather(-1, key.clamp(min=0).expand(B, H, L, L - 1)) * (key >= 0)
        out[..., p0 + 1:p0 + L] = vals.sum(-2)
    return out


def _block_mean(x: torch.Tensor, start: int, bs: int, n_blocks: int) -> torch.Tensor:
    """Mean of ``x[B, H, N, D]`` over blocks ``[start + i*bs, ...)`` that the rows cover; empty blocks are 0."""
    B, H, N, D = x.shape
    blk = torch.div(torch.arange(N, device=x.device) + start, bs, rounding_mode="floor") - start // bs
    s = torch.zeros(B, H, n_blocks, D, device=x.device, dtype=torch.float32)
    s.index_add_(2, blk, x.float())
    cnt = torch.zeros(n_blocks, device=x.device).index_add_(0, blk, torch.ones(N, device=x.device))
    return s / cnt.clamp(min=1)[:, None]


@torch.no_grad()
def estimate_block_topk(q_pool_src: torch.Tensor, src_start: int, k: torch.Tensor, q_blocks: torch.Tensor,
                        first: int, bs: int, top_k: Sequence[int]) -> torch.Tensor:
    """Block top-k by mean-pooled scores.

    ``q_pool_src[B, H, N, D]`` holds queries at positions ``src_start ..`` covering every query block in
    ``q_blocks[nq] = first, first+1, ..``; ``k[B, Hk, T, D]``. Returns bool ``[B, H, nq, nk]``.
    """
    T = k.shape[2]
    nk = (T + bs - 1) // bs
    qp = _block_mean(q_pool_src, src_start - first * bs, bs, q_blocks.numel())   # [B, H, nq, D]
    kp = _block_mean(k, 0, bs, nk)                                                 # [B, Hk, nk, D]
    s = _group_scores(qp, kp)                                                      # [B, H, nq, nk]
    kb = torch.arange(nk, device=k.device)
    s = s.masked_fill(kb[None, :] > q_blocks[:, None], float("-inf"))
    s = torch.where(kb[None, :] == q_blocks[:, None], torch.full_like(s, float("inf")), s)
    return _topk_per_head(s, top_k) & (kb[None, :] <= q_blocks[:, None])


# ---------------------------------------------------------------------------------------------------
# The mask, all heads


@dataclass
class PatternPlan:
    """What one layer's pattern resolves to for one input: everything a backend needs.

    ``cols/diags [B, H, T]`` (vertical-slash heads, else False), ``blocks [B, H, nq, nk]`` whole key
    blocks allowed for query blocks ``q_block0 ..`` (random or top-k; None when no head uses them),
    ``window[H]`` / ``sinks[H]`` (0 = none; a dense head has ``window = T + 1``), ``q_pos[S]`` absolute
    query positions ``q_start ..``. ``col_budget``: the most columns any head chose (known from the budgets,
    so a backend can size per-head column slots without reading ``cols`` back from the GPU).
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

    @property
    def q_block0(self) -> int:
        return self.q_start // self.block_size

    def token_mask(self) -> torch.Tensor:
        """bool ``[B or 1, H, S, T]``."""
        k_pos = torch.arange(self.T, device=self.q_pos.device)
        d = self.q_pos[:, None] - k_pos[None, :]                                            # [S, T]
        keep = (d[None] < self.window[:, None, None]) | (k_pos[None, None, :] < self.sinks[:, None, None])
        keep = keep[None]                                                                   # [1, H, S, T]
        if self.blocks is not None:
            bs = self.block_size
            qb = torch.div(self.q_pos, bs, rounding_mode="floor") - self.q_block0
            kb = torch.div(k_pos, bs, rounding_mode="floor")
            keep = keep | self.blocks[:, :, qb][:, :, :, kb]
        if self.cols is not None:
            keep = keep | self.cols[:, :, None, :] | self._diag_rows()
        return keep & (d >= 0)

    def diag_reach(self) -> torch.Tensor:
        """bool ``[B, H, T]``: ``reach[x]`` = some chosen diagonal lies in ``x .. x + block_size - 1``.

        The slash rule in one table: a query q (block start ``qs``) keeps key ``k <= q`` through the
        diagonals iff ``k >= qs`` or ``reach[qs - k]`` (module docstring).
        """
        bs, T = self.block_size, self.T
        cs = torch.nn.functional.pad(self.diags.int().cumsum(-1), (1, 0))                 # [B, H, T+1]
        x = torch.arange(T, device=self.diags.device)
        return cs[..., (x + bs).clamp(max=T)] > cs[..., x]

    def _diag_rows(self) -> torch.Tensor:
        """The slash rule as bool ``[B, H, S, T]`` (for vertical-slash heads True on and past each query's
        block start; causality is the caller's): one gathered row per query block, repeated over its queries."""
        bs, T = self.block_size, self.T
        qs = torch.div(self.q_pos, bs, rounding_mode="floor") * bs                          # [S]
        starts, row_of = torch.unique_consecutive(qs, return_inverse=True)
        x = starts[:, None] - torch.arange(T, device=qs.device)[None, :]                   # [nb, T]
        # x <= 0 (the query's own block) reads reach[0]: true exactly for heads with diagonal 0 chosen,
        # i.e. the vertical-slash heads; other heads of the plan get nothing from this rule
        rows = self.diag_reach()[..., x.clamp(min=0)]                                       # [B, H, nb, T]
        return rows[:, :, row_of]

    def block_layout(self, include_cols: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(partial, full)`` bool ``[B or 1, H, nq, nk]`` for a square plan (queries = keys 0..T-1).

        ``full`` blocks are allowed everywhere (no mask needed); ``partial`` blocks hold at least one
        allowed pair and need the token mask. Derived per component, never from the S x T mask, so it
        costs O(H nq nk) at any length; a union of partial pieces that happens to cover a block stays
        ``partial`` (correct, only slower), except a below-diagonal block whose every diagonal is chosen
        (``full``). ``include_cols=False``: the layout of the rule without the vertical columns (the
        flex backend attends to those through gathered keys, layers.sparse_attention).
        """
        bs, T, dev = self.block_size, self.T, self.q_pos.device
        if self.q_pos.numel() != T or self.q_start != 0:
            raise ValueError("block_layout needs queries at positions 0..T-1")
        n = (T + bs - 1) // bs
        off = torch.arange(n, device=dev)[:, None] - torch.arange(n, device=dev)[None, :]     # qb - kb
        causal, below = off >= 0, off > 0
        win, sinks = self.window[:, None, None], self.sinks[:, None, None]
        kb_lo = torch.arange(n, device=dev)[None, :] * bs
        touch = causal & (((off * bs - (bs - 1)) < win) | (kb_lo < sinks))                   # [H, n, n]
        full = below & (((off * bs + (bs - 1)) < win) | (kb_lo + bs <= sinks))
        touch, full = touch[None], full[None]
        if self.blocks is not None:
            touch = touch | self.blocks
            full = full | (self.blocks & below)
        if self.cols is not None:
            # Block offset o >= 1 holds the pairs with qs - k in x = o*bs-(bs-1) .. o*bs, kept where
            # reach[x]: touched when a chosen diagonal lies in o*bs-(bs-1) .. o*bs+(bs-1), full when
            # reach holds on all bs of them. The diagonal block (o = 0) is kept whole (up to causality).
            cs = torch.nn.functional.pad(self.diags.int().cumsum(-1), (1, 0))                # [B, H, T+1]
            cr = torch.nn.functional.pad(self.diag_reach().int().cumsum(-1), (1, 0))
            o = torch.arange(n, device=dev)
            lo, hi = (o * bs - (bs - 1)).clamp(0, T), (o * bs + bs).clamp(0, T)
            n_diag = cs[..., hi] - cs[..., lo]                       # [B, H, n] chosen diagonals by offset
            oc = off.clamp(min=0)
            hit = n_diag > 0
            if include_cols:
                pad = n * bs - T
                has_col = torch.nn.functional.pad(self.cols, (0, pad)).view(*self.cols.shape[:2], n, bs).any(-1)
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


def plan_pattern(pattern: PatternLike, n_heads: int, q_start: int, S: int, T: int, layer: int = 0,
                 q: Optional[torch.Tensor] = None, k: Optional[torch.Tensor] = None,
                 q_history: Optional[torch.Tensor] = None, device=None) -> PatternPlan:
    """Resolve a (per-head) pattern for queries at positions ``q_start .. q_start+S-1`` over keys ``0..T-1``.

    Input-dependent heads need ``q[B, H, S, D]`` and ``k[B, Hk, T, D]``; ``q_history[B, H, P, D]``
    holds the queries at positions just before ``q_start`` (decode), used for estimation only.
    Positions are Python ints, so planning never waits on the GPU.
    """
    pats = head_patterns(pattern, n_heads)
    bs = layer_block_size(pats)
    # a head that allows every causal pair over T keys is planned as a dense head: window T + 1, no
    # sinks, random blocks or estimation (the same mask; decode at T keys follows prefill of T keys)
    pats = [_DENSE if p.is_dense_at(T) else p for p in pats]
    dev = device if device is not None else (q.device if q is not None else None)
    q_pos = torch.arange(q_start, q_start + S, device=dev)
    win = _ints([T + 1 if p.type == "dense" else p.window for p in pats], dev)
    sinks = _ints([p.sinks for p in pats], dev)
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
        src = q if q_history is None else torch.cat([q_history.to(q.dtype), q], dim=2)
        src_start = q_start - (src.shape[2] - S)
        B = q.shape[0]
        vs = [h for h in dyn if pats[h].type == "vertical_slash"]
        if vs:
            L = min(max(pats[h].last_q for h in vs), src.shape[2])
            src_end = src_start + src.shape[2]
            heads = _ints(vs, dev)      # index tensors, not lists: a list index is a blocking host-to-GPU copy
            c, dg = estimate_vertical_slash(src[:, heads, -L:], _kv_for_heads(k, vs, n_heads), range(src_end - L, src_end),
                                            [pats[h].n_vertical for h in vs], [pats[h].n_slash for h in vs])
            cols = torch.zeros(B, n_heads, T, dtype=torch.bool, device=dev)
            diags = torch.zeros_like(cols)
            cols[:, heads], diags[:, heads] = c, dg
        bt = [h for h in dyn if pats[h].type == "block_topk"]
        if bt:
            first = max(qb0 * bs - src_start, 0)       # pool from the first query block's start on
            heads = _ints(bt, dev)
            pick = estimate_block_topk(src[:, heads, first:], src_start + first, _kv_for_heads(k, bt, n_heads),
                                       q_blocks, qb0, bs, [pats[h].top_k for h in bt])
            full = torch.zeros(B, n_heads, q_blocks.numel(), nk, dtype=torch.bool, device=dev)
            if blocks is not None:
                full |= blocks
            full[:, heads] |= pick
            blocks = full
    return PatternPlan(bs, q_pos, T, win, sinks, blocks, cols, diags, q_start, _col_budget(pats, T))


def _col_budget(pats: Sequence[SparsityPattern], T: int) -> int:
    """The most key columns a vertical-slash head of ``pats`` chooses over ``T`` keys (top-k picks exactly this many)."""
    return max([min(p.n_vertical, T) for p in pats if p.type == "vertical_slash"], default=0)


def _kv_for_heads(k: torch.Tensor, heads: Sequence[int], n_heads: int) -> torch.Tensor:
    """KV heads serving query heads ``heads`` (one per query head, so the GQA group is 1)."""
    g = n_heads // k.shape[1]
    return k[:, _ints([h // g for h in heads], k.device)]


def pattern_mask(pattern: PatternLike, q_len: int, kv_len: int, n_heads: int, layer: int = 0,
                 q: Optional[torch.Tensor] = None, k: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """The token-level mask a pattern means: bool ``[n_heads, q_len, kv_len]`` (``[B, ...]`` with ``q, k``).

    Queries are the last ``q_len`` positions of the ``kv_len`` keys (decode: ``q_len = 1``).
    Input-dependent patterns need ``q[B, n_heads, q_len, D]`` and ``k[B, Hk, kv_len, D]``.
    """
    dev = device or (q.device if q is not None else None)
    plan = plan_pattern(pattern, n_heads, kv_len - q_len, q_len, kv_len, layer, q, k, device=dev)
    m = plan.token_mask()
    return m if q is not None else m[0]


def budget_plan(pattern: PatternLike, n_heads: int, T: int, layer: int = 0, rows: Optional[range] = None,
                device=None) -> PatternPlan:
    """A plan that needs no input: input-dependent heads get the places their budgets allow.

    Vertical-slash heads take columns ``0 .. n_vertical-1`` and diagonals ``0 .. n_slash-1``; block
    top-k heads take the diagonal block and the ``top_k - 1`` blocks before it. Used for density logs
    and pictures; the density it gives is what the budgets buy when the picks do not overlap.
    """
    pats = head_patterns(pattern, n_heads)
    rows = range(T) if rows is None else rows
    dyn = [h for h, p in enumerate(pats) if p.dynamic and not p.is_dense_at(T)]   # heads dense at T: plan_pattern
    # stand-ins that keep the layer's block size; their window is cleared below
    static = [SparsityPattern(type="local", window=1, block_size=p.block_size) if h in dyn else p
              for h, p in enumerate(pats)]
    plan = plan_pattern(static, n_heads, rows.start, len(rows), T, layer, device=device)
    if not dyn:
        return plan
    idx = torch.arange(T, device=device)
    plan.window, plan.sinks = plan.window.clone(), plan.sinks.clone()
    plan.window[dyn] = 0
    cols = torch.zeros(1, n_heads, T, dtype=torch.bool, device=device)
    diags = torch.zeros_like(cols)
    nq = (rows.stop - 1) // plan.block_size - plan.q_block0 + 1 if len(rows) else 0
    nk = (T + plan.block_size - 1) // plan.block_size
    qb = torch.arange(plan.q_block0, plan.q_block0 + nq, device=device)[:, None]
    blocks = torch.zeros(1, n_heads, nq, nk, dtype=torch.bool, device=device) if plan.blocks is None else plan.blocks.clone()
    for h in dyn:
        p = pats[h]
        if p.type == "vertical_slash":
            cols[0, h], diags[0, h] = idx < p.n_vertical, idx < p.n_slash
        else:
            off = qb - torch.arange(nk, device=device)[None, :]
            blocks[0, h] = (off >= 0) & (off < p.top_k)
    plan.cols, plan.diags, plan.blocks = cols, diags, blocks
    plan.col_budget = _col_budget([pats[h] for h in dyn], T)
    return plan
