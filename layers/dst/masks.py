"""Mask selection for weight-level dynamic sparse training (layers.dst): pure tensor functions.

Every function works on a stack of independent slices ``[S, R, C]`` (S = 1 for a linear weight
``[out, in]``, S = E for stacked MoE experts ``[E, out, in]``), so each expert gets its own top-k
with the same per-expert density. N:M groups run along the last (input, reduction) dim, as
``torch.sparse.to_sparse_semi_structured`` expects for a linear weight; transposable N:M also makes
every group of M along the output dim hold N (so ``W^T`` is N:M too, Hu et al. ICML'24).

The update rule is RigL's (google-research/rigl ``generic_mask_update``), per slice: keep the
``n_keep`` largest-|W| active weights, then grow the ``k - n_keep`` largest grow scores among the
positions not kept (a weight dropped in this update may be regrown). Masks are bool.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import cache

import torch


def topk_mask(score: torch.Tensor, k: int) -> torch.Tensor:
    """``score[S, N] -> bool[S, N]`` with exactly ``k`` True per row (the k largest scores)."""
    mask = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    if k > 0:
        mask.scatter_(1, score.topk(k, dim=1, sorted=False).indices, True)
    return mask


def swap_counts(n_active: int, k: int, drop_fraction: float) -> tuple[int, int]:
    """How many active weights to keep and how many to grow to end with ``k`` active.

    ``n_swap = floor(drop_fraction * min(n_active, k))`` are replaced (RigL's drop count), the rest
    of the change is the density schedule: ``n_keep = min(n_active, k - n_swap)``, ``n_grow = k -
    n_keep``.
    """
    n_swap = int(math.floor(drop_fraction * min(n_active, k)))
    n_keep = min(n_active, k - n_swap)
    return n_keep, k - n_keep


def keep_largest(mask: torch.Tensor, drop_score: torch.Tensor, n_keep: int) -> torch.Tensor:
    """``bool[S, N]``: the ``n_keep`` active positions (of ``mask``) with the largest ``drop_score``
    (|W|)."""
    return topk_mask(drop_score.float().masked_fill(~mask, -math.inf), n_keep)


def rigl_update(
    mask: torch.Tensor,
    drop_score: torch.Tensor,
    grow_score: torch.Tensor,
    k: int,
    drop_fraction: float,
) -> torch.Tensor:
    """Unstructured drop/grow on ``[S, N]`` slices -> new ``bool[S, N]`` with exactly ``k`` True per
    row.

    ``mask`` must hold the same count in every row (true by construction). Grown positions are the
    top ``grow_score`` among positions not kept, so previously inactive weights and weights dropped
    now compete alike, as in RigL.
    """
    n_keep, n_grow = swap_counts(int(mask[0].sum()), k, drop_fraction)
    keep = keep_largest(mask, drop_score, n_keep)
    return keep | topk_mask(grow_score.float().masked_fill(keep, -math.inf), n_grow)


# ---- blocks -------------------------------------------------------------------------------------


def block_pool(x: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """``x[S, R, C] -> [S, R/br * C/bc]``: the sum of each ``br x bc`` block (as float32)."""
    S, R, C = x.shape
    br, bc = block
    return x.float().view(S, R // br, br, C // bc, bc).sum(dim=(2, 4)).view(S, -1)


def block_expand(mask_b: torch.Tensor, shape: Sequence[int], block: Sequence[int]) -> torch.Tensor:
    """``bool[S, nb] -> bool[S, R, C]``: every element takes its block's value."""
    S, R, C = shape
    br, bc = block
    m = mask_b.view(S, R // br, 1, C // bc, 1).expand(S, R // br, br, C // bc, bc)
    return m.reshape(S, R, C)


def block_of(mask: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """``bool[S, R, C] -> bool[S, nb]``: the block-level mask of a block-structured element mask."""
    return mask[:, :: block[0], :: block[1]].reshape(mask.shape[0], -1)


# ---- N:M ----------------------------------------------------------------------------------------


def nm_select(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """``score[S, R, C] -> bool[S, R, C]``: the n largest of every m consecutive entries along C
    (ties: the earlier entry wins).

    Ranks by m*m pairwise comparisons instead of ``topk(n)`` over millions of length-m rows, which
    is several times slower on GPU (bench/dst.py).
    """
    S, R, C = score.shape
    g = score.float().reshape(-1, m)
    gi, gj = g.unsqueeze(2), g.unsqueeze(1)  # [G, m(i), 1], [G, 1, m(j)]
    earlier = torch.ones(m, m, dtype=torch.bool, device=g.device).tril(-1)  # j < i
    beats = (gj > gi) | ((gj == gi) & earlier)  # entry j outranks entry i
    return (beats.sum(-1) < n).view(S, R, C)


@cache
def _tile_patterns(n: int, m: int) -> torch.Tensor:
    """All ``m x m`` 0/1 tiles with n ones in every row and every column, as ``float[P, m*m]`` (90
    for 2:4)."""
    rows = [r for r in itertools.product((0, 1), repeat=m) if sum(r) == n]
    pats = [
        sum(t, ())
        for t in itertools.product(rows, repeat=m)
        if all(sum(t[i][j] for i in range(m)) == n for j in range(m))
    ]
    return torch.tensor(pats, dtype=torch.float32)


def transposable_nm_select(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """``score[S, R, C] -> bool[S, R, C]``: per ``m x m`` tile, the N:M-in-rows-and-columns pattern
    of largest total score (exhaustive over the tile patterns, as 2by4-pretrain's
    TransposableSparse)."""
    S, R, C = score.shape
    tiles = score.float().view(S, R // m, m, C // m, m).permute(0, 1, 3, 2, 4).reshape(-1, m * m)
    pats = _tile_patterns(n, m).to(score.device)
    best = pats[(tiles @ pats.T).argmax(dim=1)].bool()
    return best.view(S, R // m, C // m, m, m).permute(0, 1, 3, 2, 4).reshape(S, R, C)


def nm_update(
    mask: torch.Tensor,
    drop_score: torch.Tensor,
    grow_score: torch.Tensor,
    n: int,
    m: int,
    drop_fraction: float,
    transposable: bool,
) -> torch.Tensor:
    """N:M drop/grow on ``[S, R, C]``: drop the ``floor(drop_fraction * active)`` smallest-|W|
    active weights of each slice, then refill every group (tile) to N from the largest grow scores.

    Kept weights outrank every grow candidate: the selection score is ``BIG`` on kept positions and
    the grow score scaled into [0, 1] elsewhere, with ``BIG = n*m + 1`` larger than any tile's grow
    sum, so a transposable tile pattern also retains all kept weights (the old pattern contained
    them).
    """
    S, R, C = mask.shape
    flat = mask.view(S, -1)
    n_active = int(flat[0].sum())
    keep = keep_largest(
        flat, drop_score.reshape(S, -1), n_active - int(math.floor(drop_fraction * n_active))
    )
    g = grow_score.float().reshape(S, -1)
    g = g / g.amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    sel = torch.where(keep, torch.full_like(g, n * m + 1.0), g).view(S, R, C)
    return transposable_nm_select(sel, n, m) if transposable else nm_select(sel, n, m)


def is_nm(mask: torch.Tensor, n: int, m: int, transposable: bool = False) -> bool:
    """True when every m consecutive entries along the last dim hold exactly n (and along dim -2
    too)."""
    S, R, C = mask.shape
    ok = bool((mask.reshape(S, R, C // m, m).sum(-1) == n).all())
    if transposable:
        ok = ok and bool((mask.transpose(1, 2).reshape(S, C, R // m, m).sum(-1) == n).all())
    return ok


# ---- layer densities ----------------------------------------------------------------------------


def erk_densities(
    shapes: Sequence[Sequence[int]], density: float, power: float = 1.0
) -> list[float]:
    """Erdos-Renyi-Kernel densities: ``d_l = min(1, eps * ((out+in)/(out*in))**power)`` with eps
    solved so that ``sum d_l N_l = density * sum N_l``. ``shapes[l] = (S, out, in)``, ``N_l =
    S*out*in``.

    Iterative as in google-research/rigl ``get_sparsities_erdos_renyi``: a layer whose density would
    exceed 1 is made dense, leaves the budget, and eps is solved again (clipping alone misses the
    target).
    """
    numel = [s * r * c for s, r, c in shapes]
    raw = [((r + c) / (r * c)) ** power for _, r, c in shapes]
    dense: set[int] = set()
    while True:
        budget = density * sum(numel) - sum(numel[i] for i in dense)
        free = [i for i in range(len(shapes)) if i not in dense]
        if not free:
            return [1.0] * len(shapes)
        eps = budget / sum(raw[i] * numel[i] for i in free)
        over = [i for i in free if eps * raw[i] > 1.0]
        if not over:
            return [1.0 if i in dense else eps * raw[i] for i in range(len(shapes))]
        dense.add(max(over, key=lambda i: raw[i]))
