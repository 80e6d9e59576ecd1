"""Balanced k-means over FFN neurons (MoEfication, Zhang et al. 2022, "parameter clustering split").

Legend: N points (FFN hidden units), F features per point, G clusters of exactly N / G points each.

- ``balanced_assign(dist[N, G], capacity) -> labels[N]``: every point to a cluster, at most
  ``capacity`` points per cluster, preferring small distances (greedy rounds of proposals).
- ``balanced_kmeans(points[N, F], G, iters, seed) -> labels[N]``: spherical k-means (cosine
  distance, unit centroids) whose assignment step is ``balanced_assign``, so every cluster has N / G
  points.
- ``cluster_neurons(w1[H, D], w3[H, D] | None, G, iters, seed) -> order[H]``: neurons sorted by
  cluster, so that group g is ``order[g*H/G : (g+1)*H/G]``. A neuron's feature is its gate row and,
  for SwiGLU, its up row concatenated: two neurons whose rows point the same way fire on the same
  tokens.

Deterministic for a given seed and device (the seeded generator runs on the CPU), so data-parallel
ranks that cluster the same weights agree without communication.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def balanced_assign(dist: torch.Tensor, capacity: int) -> torch.Tensor:
    """dist [N, G] -> labels [N] int64 with at most ``capacity`` points per cluster (needs N <= G *
    capacity).

    Each round every unassigned point proposes to its nearest cluster that still has room; each
    cluster keeps its nearest proposers up to its room. A round either places every proposer or
    fills a cluster, so there are at most G + 1 rounds, each a few vectorised sorts.
    """
    N, G = dist.shape
    if N > G * capacity:
        raise ValueError(f"{N} points do not fit in {G} clusters of {capacity}")
    labels = torch.full((N,), -1, dtype=torch.long, device=dist.device)
    room = torch.full((G,), capacity, dtype=torch.long, device=dist.device)
    while True:
        free = (labels < 0).nonzero().squeeze(1)
        if free.numel() == 0:
            return labels
        d = dist[free].masked_fill(room == 0, float("inf"))
        choice = d.argmin(1)
        cost = d.gather(1, choice[:, None]).squeeze(1)
        # sort proposers by (cluster, distance): stable sort by distance, then stable sort by
        # cluster
        order = torch.argsort(cost, stable=True)
        order = order[torch.argsort(choice[order], stable=True)]
        c = choice[order]
        counts = torch.bincount(c, minlength=G)
        rank = torch.arange(c.numel(), device=dist.device) - (torch.cumsum(counts, 0) - counts)[c]
        keep = rank < room[c]
        labels[free[order[keep]]] = c[keep]
        room -= torch.bincount(c[keep], minlength=G)


def balanced_kmeans(
    points: torch.Tensor, num_clusters: int, iters: int = 20, seed: int = 0
) -> torch.Tensor:
    """points [N, F] -> labels [N] int64: ``num_clusters`` clusters of exactly N / num_clusters
    points."""
    N = points.shape[0]
    if N % num_clusters:
        raise ValueError(f"{N} points do not split into {num_clusters} equal clusters")
    cap = N // num_clusters
    x = F.normalize(points.detach().float(), dim=1)
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(N, generator=gen)[:num_clusters].to(x.device)]
    labels = None
    for _ in range(max(iters, 1)):
        new = balanced_assign(1.0 - x @ centroids.T, cap)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        sums = torch.zeros_like(centroids).index_add_(0, labels, x)
        centroids = F.normalize(sums, dim=1)
    return labels


def cluster_neurons(
    w1: torch.Tensor, w3: Optional[torch.Tensor], num_groups: int, iters: int = 20, seed: int = 0
) -> torch.Tensor:
    """w1 (gate) [H, D], w3 (up) [H, D] or None -> order [H] int64: neuron indices grouped by
    cluster."""
    feats = w1 if w3 is None else torch.cat([w1, w3], dim=1)
    labels = balanced_kmeans(feats, num_groups, iters, seed)
    return torch.argsort(labels, stable=True)
