"""Which keys an input-dependent or random head keeps: seeded random blocks (BigBird),
vertical-slash estimation (MInference), block top-k estimation per query block (MoBA-style pooled
scores) and per query token (NSA / MoBA gating: each query its own blocks).

Semantics in layers.attention.pattern. Shapes: B batch, H query heads, S queries, T keys, D head
dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from moezoo.kernels.key_block_max import key_block_max
from moezoo.kernels.launch import to_device, use_triton
from moezoo.kernels.token_block_topk import token_block_topk

from .pattern import SparsityPattern

_MASK32 = 0xFFFFFFFF


def _fmix32(x):
    """Murmur3 finaliser on Python ints or int64 tensors holding 32-bit values (wrapping multiply,
    low 32 bits kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def index_tensor(values: Sequence[int], device=None) -> torch.Tensor:
    """int64 ``[len(values)]`` on ``device``, without waiting for the GPU (``torch.tensor(values,
    device="cuda")`` would wait for everything queued: kernels.launch.to_device). Under
    torch.compile the values are constants of the graph, so the plain copy is traced instead."""
    t = torch.tensor(values, dtype=torch.long)
    if device is None or torch.compiler.is_compiling():
        return t if device is None else t.to(device)
    return to_device(t, device)


def random_block_rows(
    pats: Sequence[SparsityPattern], layer: int, q_blocks: torch.Tensor, n_k_blocks: int
) -> torch.Tensor:
    """``bool[H, len(q_blocks), n_k_blocks]``: the ``random_blocks`` key blocks each head's query
    blocks draw.

    Block ``qb`` of head h picks the ``r`` blocks of ``0 .. qb-1`` with the largest 32-bit hash of
    (seed, layer, h, qb, kb) (all of them when ``qb <= r``); integer ops only, so equal on every
    device, and the hash of a (qb, kb) pair never depends on the sequence length.
    """
    dev = q_blocks.device
    kb = torch.arange(n_k_blocks, device=dev)
    # [H]
    base = index_tensor(
        [
            _fmix32((p.seed * 0x9E3779B1 + layer * 0x85EBCA77 + h * 0xC2B2AE3D) & _MASK32)
            for h, p in enumerate(pats)
        ],
        dev,
    )
    hq = _fmix32(base[:, None] ^ ((q_blocks.long() * 0x27D4EB2F) & _MASK32)[None, :])  # [H, nq]
    h = _fmix32(hq[:, :, None] ^ ((kb * 0x165667B1) & _MASK32))  # [H, nq, nk]
    earlier = kb[None, :] < q_blocks[:, None]  # [nq, nk]
    # distinct scores: ties never depend on topk order
    score = torch.where(earlier, (h << 20) | kb, -1)
    return _topk_per_head(score[None], [p.random_blocks for p in pats])[0] & earlier


# --------------------------------------------------------------------------------------------------
# Input-dependent estimation (vertical-slash, block top-k)


def _group_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q[B, H, L, D]``, ``k[B, Hk, T, D]`` -> float32 ``q k^T / sqrt(D)`` of shape ``[B, H, L,
    T]`` (GQA without repeat)."""
    B, H, L, D = q.shape
    Hk = k.shape[1]
    # index choice in float32 even under bf16 autocast
    with torch.autocast(q.device.type, enabled=False):
        if q.is_cuda and q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16):
            # Tensor cores with float32 accumulation and output: 16-bit products are exact in
            # float32, so this is the float32 GEMM below up to summation order, ~10x faster (CUDA
            # has no TF32 default).
            s = torch.bmm(
                q.reshape(B * Hk, H // Hk * L, D),
                k.reshape(B * Hk, -1, D).transpose(1, 2),
                out_dtype=torch.float32,
            ).mul_(D**-0.5)
        else:
            qg = q.float().view(B, Hk, H // Hk, L, D)
            s = torch.einsum("bkgld,bktd->bkglt", qg, k.float()) * D**-0.5
    return s.reshape(B, H, L, -1)


def _topk_per_head(score: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """``score[B, H, ..., N]``, per-head budgets ``ks[H]`` -> bool, same shape, marking each row's
    top-k."""
    H, N = score.shape[1], score.shape[-1]
    kmax = min(max(ks), N)
    idx = score.topk(kmax, dim=-1).indices
    rank_ok = (
        torch.arange(kmax, device=score.device)[None, :] < index_tensor(ks, score.device)[:, None]
    )
    rank_ok = rank_ok.view(H, *([1] * (score.dim() - 3)), kmax)
    out = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    return out.scatter_(-1, idx, rank_ok.expand_as(idx))


def _rank_keys(score: torch.Tensor) -> torch.Tensor:
    """float ``[..., nk]`` block scores -> int64 keys of the same order, equal scores ranked by
    block index (the later block first): a top-k over them never depends on how ties fall in one
    call's shapes, so a decode step picks the blocks prefill picked. Ties are common where a score
    is a function of the token alone (``score_nope`` keys of a repeated token)."""
    i = score.float().contiguous().view(torch.int32).long()
    ordered = torch.where(i >= 0, i, -(2**31) - 1 - i)  # the float order as integers
    return ordered * (1 << 20) + torch.arange(score.shape[-1], device=score.device)


@torch.no_grad()  # indices only: nothing differentiable leaves, so record no graph
def estimate_vertical_slash(
    q_est: torch.Tensor,
    k: torch.Tensor,
    est_pos: range,
    n_vertical: Sequence[int],
    n_slash: Sequence[int],
    keep_columns: Sequence[int] = (),
    keep_diagonals: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """MInference's online index estimation.

    ``q_est[B, H, L, D]`` are the last queries (absolute positions ``est_pos``, a range), ``k[B, Hk,
    T, D]``. Returns ``cols, diags`` bool ``[B, H, T]``: the chosen key columns and diagonals ``d =
    q - k``. ``keep_columns[h]`` / ``keep_diagonals[h]``: the first columns / nearest diagonals
    forced into head h's top-k (MInference's kernel sets their scores to +inf), earliest / nearest
    first.
    """
    T, L, p0 = k.shape[2], q_est.shape[2], est_pos.start
    s = _group_scores(q_est, k)  # [B, H, L, T]
    # only keys after the first estimating query can lie in a row's future: mask that tail in place
    future = (
        torch.arange(p0 + 1, T, device=k.device)[None, :]
        > torch.arange(p0, p0 + L, device=k.device)[:, None]
    )
    s[..., p0 + 1 :].masked_fill_(future, float("-inf"))
    prob = s.softmax(-1)
    cols = _topk_per_head(_force_first(prob.sum(-2), keep_columns, L), n_vertical)
    # Diagonals are ranked by the mass the chosen columns leave: a heavy column key otherwise puts
    # one row's mass on each of L diagonals ("shadows" of the column) that buy nothing the column
    # does not already cover, and scatter over the key blocks (BENCHMARKS.md, Sparse attention
    # layer). MInference ranks both from the same scores; this is the greedy cover: the union holds
    # at least as much of the estimating rows' mass for the same budgets.
    prob.masked_fill_(cols[:, :, None, :], 0.0)
    diags = _topk_per_head(_force_first(_diagonal_sums(prob, p0), keep_diagonals, L), n_slash)
    diags[..., 0] = True
    return cols, diags


def _force_first(score: torch.Tensor, keep: Sequence[int], L: int) -> torch.Tensor:
    """``score[B, H, T]`` (masses, each <= L) with entries ``0 .. keep[h]-1`` raised above every
    mass, decreasing with the index (so a budget below ``keep`` takes the first ones)."""
    if not any(keep):
        return score
    T = score.shape[-1]
    idx = torch.arange(T, device=score.device, dtype=score.dtype)
    forced = idx[None, :] < index_tensor(list(keep), score.device)[:, None]  # [H, T]
    return torch.where(forced, L + 2 - idx / T, score)


def _diagonal_sums(prob: torch.Tensor, p0: int) -> torch.Tensor:
    """``prob[B, H, L, T]`` with row i at position ``p_i = p0 + i < T`` (zero where k > q) -> ``[B,
    H, T]``: the mass on each diagonal ``d = q - k``, all rows at once (no loop over rows, no copy
    of prob).

    Diagonals ``0 .. p0`` cross every row: element ``(i, e)`` at flat offset ``i * (T + 1) + e`` of
    a row-major ``[L, T]`` slab is row i, key ``i + e``, diagonal ``p0 - e``, so a strided view
    summed over i gives them all. Diagonals ``p0 + m`` (``m = 1 .. L-1``) exist only in rows ``i >=
    m`` (key ``i - m``): a gather from the first L keys.
    """
    B, H, L, T = prob.shape
    prob = prob.contiguous()
    out = prob.new_zeros(B, H, T)
    main = prob.as_strided((B, H, L, p0 + 1), (H * L * T, L * T, T + 1, 1), prob.storage_offset())
    out[..., : p0 + 1] = main.sum(-2).flip(-1)
    if L > 1:
        # [L, L-1]
        key = (
            torch.arange(L, device=prob.device)[:, None]
            - torch.arange(1, L, device=prob.device)[None, :]
        )
        vals = prob[..., :L].gather(-1, key.clamp(min=0).expand(B, H, L, L - 1)) * (key >= 0)
        out[..., p0 + 1 : p0 + L] = vals.sum(-2)
    return out


def _whole_blocks(x: torch.Tensor, start: int, bs: int) -> tuple[torch.Tensor, int, int]:
    """``x[B, H, N, D]`` with row 0 at position ``start`` -> ``(x zero-padded to whole blocks of bs,
    head, tail)``: the ``head`` rows before it and ``tail`` after it that the padding added (no copy
    when both are 0)."""
    head, tail = start % bs, -(start + x.shape[2]) % bs
    if head or tail:
        x = torch.nn.functional.pad(x, (0, 0, head, tail))
    return x, head, tail


def _block_mean(x: torch.Tensor, start: int, bs: int, n_blocks: int) -> torch.Tensor:
    """float32 ``[B, H, n_blocks, D]``: the mean of ``x[B, H, N, D]`` over blocks of ``bs``
    positions, row 0 at position ``start`` (block 0 = the one holding it); blocks the rows do not
    reach are 0.

    One float32-accumulating reduction over a ``[.., blocks, bs, D]`` view (zero-padded to whole
    blocks only when the rows do not start and end on block edges, as in decode): no float32 copy of
    ``x`` and no atomics, so the sums come out the same on every call, and an
    activation-checkpointing recompute chooses the blocks the forward chose.
    """
    B, H, N, D = x.shape
    x, head, tail = _whole_blocks(x, start, bs)
    nb = x.shape[2] // bs
    sums = x.unflatten(2, (nb, bs)).sum(3, dtype=torch.float32)
    cnt = torch.full((nb,), float(bs), device=x.device)
    cnt[0] -= head
    cnt[-1] -= tail
    out = torch.zeros(B, H, n_blocks, D, device=x.device, dtype=torch.float32)
    m = min(nb, n_blocks)
    out[:, :, :m] = sums[:, :, :m] / cnt[:m, None]
    return out


def _slot_mean(x: torch.Tensor, slot: Sequence[int]) -> torch.Tensor:
    """``x[B, H, N, D]`` -> float32 ``[B, Hs, N, D]``: the mean over the heads of each slot (slots 0
    .. Hs-1)."""
    sl = index_tensor(list(slot), x.device)
    # heads per slot from the host list (a graph constant under compile; inductor's CPU code for an
    # index_add_ into a one-element tensor fails to build, e.g. one KV group of shared heads)
    cnt = index_tensor([list(slot).count(v) for v in sorted(set(slot))], x.device).float()
    out = torch.zeros(x.shape[0], len(cnt), *x.shape[2:], device=x.device).index_add_(
        1, sl, x.float()
    )
    return out / cnt[None, :, None, None]


# Elements of one chunk of per-query scores (float32, 256 MiB): bounds the query_max estimate's
# memory at 64k+.
_QUERY_MAX_CHUNK = 1 << 26


def _block_max_scores(
    q: torch.Tensor,
    start: int,
    bs: int,
    n_blocks: int,
    kp: torch.Tensor,
    share_from: int | None = None,
    sub: int = 1,
) -> torch.Tensor:
    """float32 ``[B, H, n_blocks, nk]``: for each query block, the max over its queries of ``q . kp
    / sqrt(D)``.

    ``q[B, H, N, D]`` rows from position ``start`` (block 0 = the one holding it), ``kp[B, H, nk,
    D]`` pooled keys. Rows a block does not have (partial first / last block) take no part; a block
    without rows scores -inf. Chunked over query blocks so at most ``_QUERY_MAX_CHUNK`` scores live
    at once. ``share_from`` (``query_max: 2``; the absolute position of block 0's first row): each
    row's scores become its log shares (``_log_share``) over the ``nk / sub`` key blocks of ``sub``
    pooled keys each before the max, and the result has ``nk / sub`` columns; a pooled key counts
    for a row from its first key on.
    """
    B, H, N, D = q.shape
    nk = kp.shape[2]
    q, head, tail = _whole_blocks(q, start, bs)
    nb = q.shape[2] // bs
    n_out = nk if share_from is None else nk // sub
    out = torch.full((B, H, n_blocks, n_out), float("-inf"), device=q.device)
    step = max(1, _QUERY_MAX_CHUNK // max(B * H * bs * nk, 1))
    unit_start = torch.arange(nk, device=q.device) * (bs // sub)  # first key of each pooled key
    for b0 in range(0, min(nb, n_blocks), step):
        b1 = min(b0 + step, nb, n_blocks)
        s = _group_scores(q[:, :, b0 * bs : b1 * bs], kp)  # [B, H, rows, nk]
        if share_from is not None:
            pos = share_from + torch.arange(b0 * bs, b1 * bs, device=q.device)
            s = s.masked_fill(unit_start[None, :] > pos[:, None], float("-inf"))
            s = _log_share(s.unflatten(-1, (n_out, sub)).amax(-1))  # [B, H, rows, n_out]
        if b0 == 0 and head:  # padding rows take no part (only the first and last block have any)
            s[:, :, :head] = float("-inf")
        if b1 == nb and tail:
            s[:, :, s.shape[2] - tail :] = float("-inf")
        out[:, :, b0:b1] = s.unflatten(2, (b1 - b0, bs)).amax(3)
    return out


def _log_share(s: torch.Tensor) -> torch.Tensor:
    """``s[.., rows, nk]`` one query's causal block scores (-inf where not causal) -> its log
    softmax over them: ``query_max: 2`` compares the tile's queries by how much of its own
    attention each gives a block, so a query whose scores run high everywhere outranks none."""
    return s.log_softmax(-1)


def _own_block_max(
    q: torch.Tensor, k: torch.Tensor, start: int, bs: int, scale: float
) -> torch.Tensor:
    """float32 ``[B, H, N]``: each query's max of ``q . k * scale`` over the keys of its own block
    up to itself. ``q[B, H, N, D]`` rows from absolute position ``start``, ``k[B, H, T, D]``."""
    qw, head, _ = _whole_blocks(q, start, bs)
    first, nb = start // bs, qw.shape[2] // bs
    kw = k[:, :, first * bs : (first + nb) * bs]
    kw = torch.nn.functional.pad(kw, (0, 0, 0, nb * bs - kw.shape[2]))
    # float32 products, as the kernel's accumulator (autocast off: it would round them to bf16):
    # a bs-wide diagonal per query costs little
    with torch.autocast(q.device.type, enabled=False):
        d = torch.einsum(
            "bhnid,bhnjd->bhnij",
            qw.unflatten(2, (nb, bs)).float(),
            kw.unflatten(2, (nb, bs)).float(),
        )
    later = torch.ones(bs, bs, dtype=torch.bool, device=q.device).triu(1)
    d = d.masked_fill(later, float("-inf")).amax(-1) * scale  # [B, H, nb, bs]
    return d.flatten(2)[:, :, head : head + q.shape[2]]


def _causal_own_block(
    s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, start: int, bs: int, scale: float
) -> torch.Tensor:
    """``s[B, H, N, nk]`` per-query block maxima of ``q . k * scale`` (kernels.key_block_max, which
    scores a query's own block over all its keys) with the own block's entry rescored over the keys
    up to the query alone (``_own_block_max``)."""
    own = torch.div(
        torch.arange(start, start + q.shape[2], device=q.device), bs, rounding_mode="floor"
    )
    own_max = _own_block_max(q, k, start, bs, scale)
    return s.scatter(3, own.expand(*s.shape[:2], -1)[..., None], own_max[..., None])


def _fused_key_max(sb: int, q: torch.Tensor) -> bool:
    """Whether single-key scores (``score_block: 1``) go through the fused per-block max
    (kernels.key_block_max): where Triton runs, outside a torch.compile trace."""
    return sb == 1 and use_triton(q) and not torch.compiler.is_compiling()


def _query_block_key_max(
    q: torch.Tensor,
    src_start: int,
    off: int,
    bs: int,
    n_blocks: int,
    k: torch.Tensor,
    dt: torch.dtype,
    share: bool = False,
) -> torch.Tensor:
    """float32 ``[B, H, n_blocks, nk]``: for each query block, the max over its queries and a key
    block's keys of ``q . k / sqrt(D)`` (``query_max`` with ``score_block: 1``), as
    ``_block_max_scores`` over single keys. ``q[B, H, N, D]`` rows from position ``src_start``,
    row 0 at ``off`` within block 0; ``k[B, H, T, D]``; ``dt``: the operands' dtype; ``share``
    (``query_max: 2``): each query's log shares instead of its scores."""
    scale = q.shape[-1] ** -0.5
    tok = key_block_max(q.to(dt), k.to(dt), src_start, bs, scale)
    if share:  # the own block over the keys up to each query, then its log shares
        tok = _log_share(_causal_own_block(tok, q.to(dt), k.to(dt), src_start, bs, scale))
    head, tail = off % bs, -(off + q.shape[2]) % bs
    tok = torch.nn.functional.pad(tok, (0, 0, head, tail), value=float("-inf"))
    s = tok.unflatten(2, (tok.shape[2] // bs, bs)).amax(3)[:, :, :n_blocks]
    if s.shape[2] < n_blocks:  # query blocks without rows score -inf
        s = torch.nn.functional.pad(s, (0, 0, 0, n_blocks - s.shape[2]), value=float("-inf"))
    return s


def wants_sharpness(stats: dict | None) -> bool:
    """Whether a selection fills ``stats`` with its ``entropy`` / ``topk_mass``: a stats dict
    asks for them unless it holds ``sharpness: False`` (training steps that log nothing)."""
    return stats is not None and stats.get("sharpness", True)


@torch.no_grad()
def estimate_block_topk(
    q_pool_src: torch.Tensor,
    src_start: int,
    k: torch.Tensor,
    q_blocks: torch.Tensor,
    first: int,
    bs: int,
    top_k: Sequence[int],
    slot: Sequence[int] | None = None,
    stats: dict | None = None,
    query_max: int = 0,
    sub_blocks: int = 1,
) -> torch.Tensor:
    """Block top-k by pooled scores.

    ``q_pool_src[B, H, N, D]`` holds queries at positions ``src_start ..`` covering every query
    block in ``q_blocks[nq] = first, first+1, ..``; ``k[B, H, T, D]`` (the KV head of each query
    head). Returns bool ``[B, H, nq, nk]``. ``slot[h]``: heads with the same slot share one
    selection (a KV group's ``share_group`` heads, same ``top_k``): scored by their mean query,
    top-k taken once per slot. A key block's score for a query block is mean-pooled query .
    mean-pooled key (MInference's block_sparse); with ``query_max`` the max over the block's queries
    of query . mean-pooled key (the per-query affinity of MoBA and NSA, reduced to the query block
    by its best query, so one query's strong preference, e.g. a question's answer position, is not
    averaged away by its block); ``query_max: 2`` takes the max of each query's log share instead
    (its log softmax over its causal key blocks, the own block scored over the keys up to the
    query), so the tile's queries compete by how much of their own attention a block would get,
    not by the scale of their scores. ``sub_blocks`` (a power of two dividing ``bs``; the pattern's
    ``score_block``): keys are pooled over ``bs / sub_blocks``-key sub-blocks and a key block scores
    its best sub-block, so a short needle is averaged with ``bs / sub_blocks`` keys instead of
    ``bs`` (NSA derives its selection from the compression scores of finer blocks, summing their
    probabilities; the max is that sum's dominant term when one sub-block holds what the query looks
    for). ``stats``: filled with the selection's mean normalised entropy (of the softmax over each
    query block's causal scores; 1 = uniform, 0 = one block) and the softmax mass the chosen blocks
    hold.
    """
    T, H = k.shape[2], k.shape[1]
    nk = (T + bs - 1) // bs
    off = src_start - first * bs
    # the queries that score: every query (query_max) or each block's mean query [B, H, nq, D]
    q = q_pool_src if query_max else _block_mean(q_pool_src, off, bs, q_blocks.numel())
    reps = list(range(H))
    if slot is not None and len(set(slot)) < H:
        reps = [list(slot).index(x) for x in sorted(set(slot))]  # first head of each slot
        # the group's mean query: its score is the mean of the group's heads' scores (linear in q)
        q = _slot_mean(q, slot)
        k = k[:, index_tensor(reps, k.device)]
        top_k = [top_k[r] for r in reps]
    sb = bs // sub_blocks
    # 16-bit operands on CUDA for the tensor-core GEMM (float32 accumulation, _group_scores and
    # kernels.key_block_max), also for a group's float32 mean query; float32 elsewhere
    half = q_pool_src.is_cuda and q_pool_src.dtype in (torch.bfloat16, torch.float16)
    dt = q_pool_src.dtype if half else torch.float32
    share = query_max == 2
    fused = query_max and _fused_key_max(sb, q)
    if fused:
        # [B, Hs, nq, nk]
        s = _query_block_key_max(q, src_start, off, bs, q_blocks.numel(), k, dt, share)
    elif query_max:
        kp = _block_mean(k, 0, sb, nk * sub_blocks)  # [B, Hs, nk * sub, D]
        # [B, Hs, nq, nk * sub], or [B, Hs, nq, nk] of log shares
        s = _block_max_scores(
            q.to(dt),
            off,
            bs,
            q_blocks.numel(),
            kp.to(dt),
            first * bs if share else None,
            sub_blocks,
        )
    else:
        kp = _block_mean(k, 0, sb, nk * sub_blocks)  # [B, Hs, nk * sub, D]
        s = _group_scores(q, kp)  # [B, Hs, nq, nk * sub]
    if sub_blocks > 1 and not fused and not share:
        # sub-blocks past the last key hold no keys (their pooled key is 0): they never win their
        # block
        s = s.masked_fill(
            torch.arange(nk * sub_blocks, device=k.device) >= (T + sb - 1) // sb, float("-inf")
        )
        s = s.unflatten(-1, (nk, sub_blocks)).amax(-1)  # [B, Hs, nq, nk]
    kb = torch.arange(nk, device=k.device)
    s = s.masked_fill(kb[None, :] > q_blocks[:, None], float("-inf"))
    pick = _topk_per_head(
        _rank_keys(torch.where(kb[None, :] == q_blocks[:, None], float("inf"), s)), top_k
    )
    pick &= kb[None, :] <= q_blocks[:, None]
    if wants_sharpness(stats):
        p = s.softmax(-1)
        n = (q_blocks + 1).clamp(min=2).log()[:, None]  # log of causal blocks per row
        stats["entropy"] = (-(p * p.clamp_min(1e-30).log()).sum(-1) / n[:, 0]).mean()
        stats["topk_mass"] = (p * pick).sum(-1).mean()
    if len(reps) < H:
        pick = pick[:, index_tensor(list(slot), pick.device)]
    return pick


@functools.lru_cache(maxsize=256)
def selection_density(
    pats: tuple[SparsityPattern, ...],
    T: int,
    n_kv_heads: int = 0,
    training: bool = True,
    head_dim: int = 0,
) -> tuple[float, ...]:
    """Per head, the work of its block top-k selection's scores in a square call over ``T`` keys,
    in the units of the attention density (attended pairs over the ``T (T + 1) / 2`` causal ones):
    a scored (query, key) pair is one ``q . k`` in the forward only, once a step (the
    activation-checkpointing recompute replays it, layers.attention.replay). An attended pair is
    ``q . k`` and ``p v`` forward and twice that backward (zoo.flops), so in ``training`` a scored
    pair is a sixth of an attended pair's work, in a forward-only call half. The heads sharing one
    selection (``share_group`` heads of a KV group with one budget
    and scoring rule; ``n_kv_heads`` groups, 0 = no sharing) share its scores. Single-key scores
    (``score_block: 1`` per token or with ``query_max``, kernels.key_block_max) cover each query's
    causal key blocks; pooled ones each query's row of all ``T / score_block`` pooled keys (per
    token, ``query_max``), or each query block's (mean-pooled queries). Heads with ``indexer: Di``
    score at width Di: their pairs count ``Di / head_dim`` (the attention's head dim) of one. 0 for
    other heads."""
    H = len(pats)
    g = H // n_kv_heads if n_kv_heads else 1
    causal = T * (T + 1) / 2

    def rule(h: int, p: SparsityPattern):
        sb = p.score_block if 0 < p.score_block < p.block_size else p.block_size
        per_query = bool(p.token_select or p.query_max)
        share = (h // g, p.top_k) if p.share_group else ("head", h)
        # one estimate per rule and slot, as plan_pattern makes them
        return share, p.block_size, sb, per_query, p.token_select, p.query_max

    rules = {
        h: rule(h, p) for h, p in enumerate(pats) if p.type == "block_topk" and not p.is_dense_at(T)
    }
    out = []
    for h in range(H):
        if h not in rules:
            out.append(0.0)
            continue
        _, bs, sb, per_query, _, _ = rules[h]
        nb = -(-T // bs)
        if sb == 1 and per_query:
            pairs = sum(min(bs, T - i * bs) * min((i + 1) * bs, T) for i in range(nb))
        elif per_query:
            pairs = T * -(-T // sb)
        else:
            pairs = nb * -(-T // sb)
        sharing = sum(1 for r in rules.values() if r == rules[h])
        if pats[h].indexer:
            if not head_dim:
                raise ValueError("selection_density: heads with indexer need the head_dim")
            pairs *= pats[h].indexer / head_dim
        out.append((1 / 6 if training else 0.5) * pairs / causal / sharing)
    return tuple(out)


# Per-token selections are packed 32 key blocks to an int32 word: at 128k tokens and 1024 blocks a
# row is 128 bytes, and FlexAttention's mask_mod reads one word per element.
TOKEN_BITS = 32


def pack_blocks(pick: torch.Tensor) -> torch.Tensor:
    """bool ``[..., nk]`` -> int32 ``[..., ceil(nk / 32)]``: bit ``j % 32`` of word ``j // 32`` is
    block j."""
    nk = pick.shape[-1]
    nw = (nk + TOKEN_BITS - 1) // TOKEN_BITS
    pick = torch.nn.functional.pad(pick, (0, nw * TOKEN_BITS - nk)).unflatten(-1, (nw, TOKEN_BITS))
    weights = torch.ones(TOKEN_BITS, dtype=torch.int64, device=pick.device) << torch.arange(
        TOKEN_BITS, device=pick.device
    )
    # int64 sums up to 2^32 - 1 wrap to int32's two's complement: bit 31 is the sign bit
    return (pick.long() * weights).sum(-1).to(torch.int32)


def unpack_blocks(bits: torch.Tensor, nk: int) -> torch.Tensor:
    """The inverse of ``pack_blocks``: int32 ``[..., nw]`` -> bool ``[..., nk]``."""
    shift = torch.arange(TOKEN_BITS, device=bits.device, dtype=torch.int32)
    out = (bits[..., None] >> shift) & 1
    return out.flatten(-2)[..., :nk].bool()


def _token_topk_reference(
    s: torch.Tensor,
    causal: torch.Tensor | None,
    start: int,
    bs: int,
    top_k: Sequence[int],
    min_share: int = 0,
    tile_share: torch.Tensor | None = None,
    tile0: int = 0,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows' choice from their block scores, in torch (kernels.token_block_topk fuses it):
    ``s[B, Hs, R, nk]`` float32, row i at position ``start + i``; ``causal`` (``min_share`` or
    ``tile_share``) the same scores with each block over the keys up to the query (-inf after it).
    Returns int32 ``[B, Hs, R, ceil(nk / 32)]`` (``pack_blocks``); amaxes into ``tile_share``
    (query blocks from ``tile0``) and adds the rows' summed normalised entropy and top-k mass to
    ``stats[0]``, ``stats[1]`` (``estimate_token_topk``)."""
    nk = s.shape[-1]
    kb = torch.arange(nk, device=s.device)
    pos = torch.arange(start, start + s.shape[2], device=s.device)
    own = torch.div(pos, bs, rounding_mode="floor")[:, None]  # [rows, 1]
    s = s.masked_fill(kb[None, :] > own, float("-inf"))
    pick = _topk_per_head(_rank_keys(torch.where(kb[None, :] == own, float("inf"), s)), top_k)
    pick &= kb[None, :] <= own
    if min_share or tile_share is not None:
        share = _log_share(causal)
    if min_share:
        pick &= (share >= math.log(min_share / 100)) | (kb[None, :] == own)
    if tile_share is not None:
        kept = torch.where(kb[None, :] == own, float("inf"), share).masked_fill(
            ~pick, float("-inf")
        )
        tile = (own - tile0).expand(-1, nk).expand_as(kept)
        tile_share.scatter_reduce_(2, tile, kept.float(), "amax")
    if stats is not None:
        p = s.softmax(-1)
        n = (own[:, 0] + 1).clamp(min=2).log()
        ent = (-(p * p.clamp_min(1e-30).log()).sum(-1) / n).sum()
        stats += torch.stack([ent, (p * pick).sum()])
    return pack_blocks(pick)


@torch.no_grad()
def estimate_token_topk(
    q: torch.Tensor,
    q_start: int,
    k: torch.Tensor,
    bs: int,
    top_k: Sequence[int],
    slot: Sequence[int] | None = None,
    stats: dict | None = None,
    sub_blocks: int = 1,
    min_share: int = 0,
    tile_share: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Per-token block top-k (``token_select: 1``; NSA Eq. 9-11, MoBA's gate).

    ``q[B, H, S, D]`` queries at positions ``q_start ..``, ``k[B, H, T, D]`` (the KV head of each
    query head). Each query scores every key block by ``q . mean-pooled k`` (with ``sub_blocks``: by
    its best ``bs / sub_blocks``-key sub-block) and keeps the ``top_k`` best among the blocks that
    start at or before it, its own block always one of them. Heads of one ``slot`` (a KV group's
    ``share_group`` heads) share one choice, by the group's mean query (NSA sums the group's
    importance scores, Eq. 10; the mean ranks the same). Returns ``(bits, reps)``: int32 ``[B, Hs,
    S, ceil(nk / 32)]`` (``pack_blocks``) per slot, and the first head of each slot. ``stats``:
    filled with the mean normalised entropy of each query's softmax over its causal block scores and
    the mass its chosen blocks hold (as ``estimate_block_topk``). ``min_share`` (percent): a query
    keeps a chosen block other than its own only if the block holds at least that share of its
    softmax over its causal blocks' scores (a pooled key counts from its first key on, so the own
    block is scored over the keys up to the query with single keys): a query whose scores are
    spread keeps its own block, one that points at a far block keeps it. ``tile_share`` (float32
    ``[B, Hs, nq, nk]``, -inf, query blocks from ``q_start``'s): filled with the highest log share
    any query of each query block gives each block it keeps (+inf for its own block), how
    ``union_blocks`` ranks a tile's union. On CUDA, single-key scores (``sub_blocks == bs``) take
    two fused kernels: kernels.key_block_max for the scores, kernels.token_block_topk for the rest.
    """
    B, H, S, D = q.shape
    T = k.shape[2]
    nk = (T + bs - 1) // bs
    reps = list(range(H))
    if slot is not None and len(set(slot)) < H:
        reps = [list(slot).index(x) for x in sorted(set(slot))]
        q = _slot_mean(q, slot)
        k = k[:, index_tensor(reps, k.device)]
        top_k = [top_k[r] for r in reps]
    sb = bs // sub_blocks
    # 16-bit operands on CUDA (float32 accumulation), also for a group's float32 mean query
    half = k.is_cuda and k.dtype in (torch.bfloat16, torch.float16)
    dt = k.dtype if half else torch.float32
    # single-key scores (score_block 1) where Triton runs: the fused per-block max, no [S, T] scores
    fused = _fused_key_max(sb, q)
    if fused:
        q, kp = q.to(dt), k.to(dt)
    else:
        kp = _block_mean(k, 0, sb, nk * sub_blocks)  # [B, Hs, nk * sub, D]
        q, kp = q.to(dt), kp.to(dt)
    Hs = kp.shape[1]
    empty_sub = torch.arange(nk * sub_blocks, device=k.device) >= (T + sb - 1) // sb
    nw = (nk + TOKEN_BITS - 1) // TOKEN_BITS
    bits = torch.empty(B, Hs, S, nw, dtype=torch.int32, device=k.device)
    acc = torch.zeros(2, device=k.device) if wants_sharpness(stats) else None  # entropy, mass
    ks = index_tensor(top_k, k.device) if fused else None
    step = max(1, _QUERY_MAX_CHUNK // max(B * Hs * nk * (1 if fused else sub_blocks), 1))
    shares = bool(min_share) or tile_share is not None  # each query's log share of its blocks
    tile0 = q_start // bs  # tile_share's first query block
    for r0 in range(0, S, step):
        r1 = min(r0 + step, S)
        if fused:
            s = key_block_max(q[:, :, r0:r1], kp, q_start + r0, bs, D**-0.5)  # [B, Hs, rows, nk]
            own_max = None
            if shares:
                own_max = _own_block_max(q[:, :, r0:r1], kp, q_start + r0, bs, D**-0.5)
            rows = bits[:, :, r0:r1]
            token_block_topk(
                s, q_start + r0, bs, ks, rows, own_max, min_share, tile_share, tile0, acc
            )
            continue
        s = _group_scores(q[:, :, r0:r1], kp)  # [B, Hs, rows, nk * sub]
        causal = None  # [B, Hs, rows, nk]: scores over the keys up to each query (shares)
        if shares:
            pos = torch.arange(q_start + r0, q_start + r1, device=k.device)
            unit_start = torch.arange(nk * sub_blocks, device=k.device) * sb
            causal = s.masked_fill(unit_start[None, :] > pos[:, None], float("-inf"))
            causal = causal.unflatten(-1, (nk, sub_blocks)).amax(-1)
        if sub_blocks > 1:
            s = s.masked_fill(empty_sub, float("-inf")).unflatten(-1, (nk, sub_blocks)).amax(-1)
        bits[:, :, r0:r1] = _token_topk_reference(
            s, causal, q_start + r0, bs, top_k, min_share, tile_share, tile0, acc
        )
    if acc is not None:
        stats["entropy"] = acc[0] / (B * Hs * S)
        stats["topk_mass"] = acc[1] / (B * Hs * S)
    return bits, reps
