"""Top-k token-choice routing for layers.MoE: expert selection, combine weights and balancing
losses.

Pure functions of the router logits, so the MoE module, expert-parallel dispatch and tests share one
definition. Legend: T tokens, E experts, K experts per token.

Routers (``router=``):
- ``softmax`` (Mixtral, default): top-k over the logits, weights = softmax over the k chosen. With
  ``softmax_before_topk`` the softmax is taken over all E first and the k chosen probabilities are
  renormalised (same weights in exact arithmetic; it is what HF computes). ``norm_topk=False`` keeps
  the chosen experts' full-softmax probabilities unnormalised (Qwen2-MoE / DeepSeekMoE
  ``norm_topk_prob=False``); a top-k-then-softmax is normalised by construction, so
  ``norm_topk=False`` implies softmax first.
- ``noisy_topk`` (Shazeer et al. 2017): the same on ``x W_g^T + eps * softplus(x W_n^T)``, eps ~
  N(0, 1) in training only (the noise is added by the module; this file sees the noisy logits).
- ``sigmoid`` (DeepSeek-V3): scores = sigmoid(logits); weights = the chosen scores, divided by their
  sum when ``norm_topk``. Balance-loss probabilities are the scores normalised over E.
- ``switch`` (Fedus et al. 2021): top-1, weight = the chosen expert's softmax probability, never
  renormalised (renormalising would make it 1 and cut the router off from the task gradient).

The DeepSeek-V3 ``bias`` [E] is added to the ranking quantity for selection only; weights never see
it. Group-limited selection (DeepSeek-V2/V3, ``n_group > 1``): the E experts form ``n_group`` groups
of consecutive experts, each token first keeps its ``topk_group`` best groups (V3, sigmoid: a group
scores the sum of its two best biased scores; V2, softmax: its best probability) and picks its top-k
inside them. ``routed_scaling_factor`` multiplies the final weights (DeepSeek-V3: 2.5), after any
renormalisation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def group_limited(sel: torch.Tensor, n_group: int, topk_group: int, pair_sum: bool) -> torch.Tensor:
    """sel [T, E] -> sel with every expert outside the token's ``topk_group`` best groups set to
    -inf."""
    T, E = sel.shape
    grouped = sel.view(T, n_group, E // n_group)
    score = grouped.topk(2, dim=-1).values.sum(-1) if pair_sum else grouped.amax(-1)  # [T, n_group]
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(
        1, score.topk(topk_group, dim=-1).indices, True
    )
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)


def route(
    logits: torch.Tensor,
    router: str,
    top_k: int,
    softmax_before_topk: bool = False,
    norm_topk: bool = True,
    bias: Optional[torch.Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
):
    """logits [T, E] float32 -> (indices [T, K] int64, weights [T, K] float32, probs [T, E]
    float32).

    ``probs`` are the per-token expert probabilities the balance loss and entropy use.
    """
    topk_then_softmax = (
        router in ("softmax", "noisy_topk") and norm_topk and not softmax_before_topk
    )
    if router == "sigmoid":
        rank = torch.sigmoid(logits)  # the scores
        probs = rank / rank.sum(-1, keepdim=True)
    else:
        probs = torch.softmax(logits, dim=-1)
        rank = logits if topk_then_softmax else probs
    sel = rank if bias is None else rank + bias
    if n_group > 1:
        sel = group_limited(sel, n_group, topk_group, pair_sum=router == "sigmoid")
    indices = top_k_indices(sel, top_k)
    if topk_then_softmax:
        weights = torch.softmax(logits.gather(-1, indices), dim=-1)
    else:  # the chosen sigmoid scores or softmax probabilities
        weights = rank.gather(-1, indices)
        if norm_topk and router != "switch":
            weights = weights / weights.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return indices, weights, probs


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, E] -> int64 [T, k], the k largest per row, largest first:
    ``scores.topk(k).indices``.

    Compiled, k <= 2 is k argmax passes (the second over the scores with the first choice masked),
    which inductor fuses with the softmax around them; torch.topk is an ATen fallback there (CUDA's
    gatherTopK, ~47 us a layer at the D 512 MoE's 32k tokens x 8 experts: BENCHMARKS.md, MoE and
    dense in the trainer).
    Same indices unless two scores tie (argmax takes the lower expert id; topk's tie order is
    unspecified)."""
    if k > 2 or not torch.compiler.is_compiling():
        return scores.topk(k, dim=-1).indices
    first = scores.argmax(-1, keepdim=True)
    if k == 1:
        return first
    rest = scores.scatter(-1, first, float("-inf"))
    return torch.cat([first, rest.argmax(-1, keepdim=True)], dim=-1)


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """indices [T, K] -> int64 [E] assignment counts (no host sync, unlike bincount on CUDA).

    Eager: a scatter_add of ones. Under torch.compile: a compare-and-sum over the [T*K, E] one-hot,
    which inductor generates as one reduction kernel without materialising it. A compiled
    scatter_add is an atomic add of T*K ones into E counters, contended at few experts: ~3x the
    reduction's time at E = 8, T*K = 65536 (the dim-512 MoE's profile; BENCHMARKS.md, MoE and dense
    in the trainer), for a result of 8 integers. The reduction compares each id E times (from
    cache): at hundreds of experts, where the scatter's atomics contend less, which is faster is not
    measured. Same integers.
    """
    flat = indices.reshape(-1)
    if torch.compiler.is_compiling():
        return (
            flat[:, None] == torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
        ).sum(0)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def sort_key_dtype(num_ids: int) -> torch.dtype:
    """The narrowest integer dtype holding ids ``0 .. num_ids - 1`` (expert ids as sort keys)."""
    return torch.uint8 if num_ids <= 256 else torch.int16 if num_ids <= 2**15 else torch.int32


def stable_order(ids: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``torch.argsort(ids, stable=True)`` for integer ``ids`` in ``0 .. num_ids - 1`` (the same
    permutation).

    The keys are sorted in the narrowest dtype that holds them: CUDA's radix sort makes one pass per
    key byte, so int64 expert ids cost a histogram + 8 passes (9 kernels) where uint8 ones cost 2; a
    stable sort's result depends only on the keys' order, which the cast keeps.
    """
    return torch.argsort(ids.to(sort_key_dtype(num_ids)), stable=True)


def balance_loss_of_mean(
    p: torch.Tensor, counts: torch.Tensor, num_tokens: int, top_k: int, group=None
) -> torch.Tensor:
    """Switch balance loss ``E * sum_e f_e * P_e`` with f_e = counts_e / (T * K) and P = ``p`` [E],
    the mean routing probabilities ``probs.mean(0)`` over the T = ``num_tokens`` tokens.

    Normalised as in megablocks / Megatron (1.0 when perfectly balanced); HF's value is K times
    this. ``group``: a data-parallel process group over which f and P are taken on the *global*
    batch (Megatron's "global" aux loss), so the loss and its gradient equal one process seeing
    every rank's tokens. P is all-reduced with autograd (its backward sums the ranks' gradients),
    which together with the data-parallel gradient average gives exactly the single-process router
    gradient.
    """
    E, T = p.shape[0], num_tokens
    if group is not None and torch.distributed.get_world_size(group) > 1:
        from torch.distributed.nn.functional import all_reduce

        world = torch.distributed.get_world_size(group)
        counts = counts.clone()
        torch.distributed.all_reduce(counts, group=group)
        p = all_reduce(p, group=group) / world
        T = T * world
    f = counts.to(p.dtype) / max(T * top_k, 1)
    return E * (f * p).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``mean_t logsumexp(logits[t])^2``."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean per-token entropy (nats) of the routing distribution."""
    return -(probs * torch.log(probs.clamp_min(1e-20))).sum(-1).mean()


def noisy_logits(clean: torch.Tensor, noise_logits: torch.Tensor) -> torch.Tensor:
    """``clean + eps * softplus(noise_logits)``, eps ~ N(0, 1) (Shazeer et al. 2017, eq. 4)."""
    return clean + torch.randn_like(clean) * F.softplus(noise_logits)
