"""Expert-parallel dispatch for layers.MoE: the expert-sorted rows travel to the ranks owning the
experts.

With an ``ep_group`` of P ranks, rank r holds experts ``r*E/P .. (r+1)*E/P - 1`` (E/P = L local
experts). The MoE layer routes and permutes its own tokens into an expert-sorted buffer as on one
process; this file replaces "run the experts on the buffer" by (Lepikhin et al. 2020 GShard;
megablocks / torchtitan all-to-all dispatchers):

1. exchange per-expert row counts (all_to_all_single of ``sizes[E]``, P chunks of L),
2. all_to_all_single the rows with uneven splits (rows for experts of rank p go to rank p),
3. regroup the received rows from source-major to local-expert-major and run the local experts,
4. undo the regrouping and send the outputs back with the reverse all-to-all.

The MoE layer then unpermutes and combines with its routing weights exactly as on one process, so
the result equals the single-process layer on the union of every rank's tokens. Experts with no rows
and ranks that receive nothing are normal. Autograd: the backward of an all-to-all is the
all-to-all with the splits swapped; the expert weights' gradients sum the contributions of every
rank's tokens (the FSDP reduction in training.parallel divides accordingly).

Legend: N rows of the sorted buffer, D model dim, E experts, L = E/P local experts, R received rows.
The split sizes go to the host (``.tolist()``): all_to_all_single takes Python lists.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .experts import local_expert_count
from .router import stable_order


def all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    """Differentiable ``all_to_all_single``: send ``in_splits[p]`` rows of ``x`` to rank p, receive
    ``out_splits[p]`` rows from rank p, concatenated in rank order (torch's autograd collective: its
    backward is the reverse exchange)."""
    # loads the autograd collectives only under EP
    import torch.distributed.nn.functional as dist_nn

    out = x.new_empty(sum(out_splits), *x.shape[1:])
    return dist_nn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def ep_run_experts(
    xs_ND: torch.Tensor, sizes_E: torch.Tensor, experts: nn.Module, group
) -> torch.Tensor:
    """Run global experts over an expert-sorted buffer with the experts spread over ``group``.

    ``xs_ND``: rows sorted by global expert, expert e owning ``sizes_E[e]`` consecutive rows from
    the exclusive cumsum; rows past ``sizes_E.sum()`` are ignored (their output is zero).
    ``experts(rows[R, D], counts[L]) -> [R, D]`` holds this rank's L = E/P experts. Returns ``[N,
    D]`` like running all E experts locally.
    """
    P = dist.get_world_size(group)
    E = sizes_E.numel()
    L = E // P
    sizes_E = sizes_E.to(torch.int64)
    # 1. counts: recv_PL[p, l] = rows rank p sends to my local expert l
    recv_PL = torch.empty_like(sizes_E)
    dist.all_to_all_single(recv_PL, sizes_E, group=group)
    recv_PL = recv_PL.view(P, L)
    # one host sync
    in_splits, out_splits = torch.stack([sizes_E.view(P, L).sum(1), recv_PL.sum(1)]).tolist()
    n_send = sum(in_splits)
    # 2. rows out, grouped by source rank then by local expert
    x_recv = all_to_all(xs_ND[:n_send], out_splits, in_splits, group)
    # 3. source-major -> expert-major (stable: keeps each source's rows in order) output_size: the
    #    received row count is already on the host, so repeat_interleave need not sync again.
    local_ids = (
        torch.arange(L, device=xs_ND.device)
        .repeat(P)
        .repeat_interleave(recv_PL.flatten(), output_size=x_recv.shape[0])
    )
    order = stable_order(local_ids, L)
    # One zero row appended to the last local expert: SwiGLU(0) = 0 and adds 0 to every gradient,
    # but it keeps the output tied to the input and the weights when this rank receives no rows.
    # Otherwise its backward would skip the reverse all-to-all (and FSDP's gradient reduction) that
    # its peers wait on.
    counts_L = recv_PL.sum(0)
    counts_L[-1] += 1
    y_local = experts(torch.cat([x_recv[order], x_recv.new_zeros(1, x_recv.shape[1])]), counts_L)[
        :-1
    ]
    # y_recv[order[i]] = y_local[i]
    y_recv = torch.empty_like(y_local).index_copy(0, order, y_local)
    # 4. outputs back to the ranks that own the tokens
    y = all_to_all(y_recv, in_splits, out_splits, group)
    if n_send == xs_ND.shape[0]:
        return y
    return torch.cat([y, y.new_zeros(xs_ND.shape[0] - n_send, *y.shape[1:])])


def ep_dispatch(
    moe: nn.Module,
    x_TD: torch.Tensor,
    indices_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    routed_E: Optional[torch.Tensor] = None,
    plan=None,
):
    """``MoE.forward``'s dispatch stage under ``moe.ep_group``. A group of one rank holds every
    expert, so it takes the local path unchanged (EP degree 1 costs nothing); otherwise
    ``all_to_all_dispatch``. ``plan``: the DispatchPlan of ``indices_TK`` if already built (MoE's
    routing stage builds it). Returns ``y [T, D]``."""
    if dist.get_world_size(moe.ep_group) == 1:
        return moe._dispatch_local(x_TD, indices_TK, weights_TK, routed_E, plan=plan)
    return all_to_all_dispatch(moe, x_TD, indices_TK, weights_TK, routed_E, plan)


def all_to_all_dispatch(
    moe: nn.Module,
    x_TD: torch.Tensor,
    indices_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    routed_E: Optional[torch.Tensor] = None,
    plan=None,
):
    """``MoE._dispatch_local`` (same plan over global expert ids, permute and combine of this rank's
    tokens) with the experts run by ``ep_run_experts`` over ``moe.ep_group``."""

    def run(xs_ND, sizes_E):
        return ep_run_experts(xs_ND, sizes_E, moe.experts, moe.ep_group)

    return moe._dispatch_local(x_TD, indices_TK, weights_TK, routed_E, run_experts=run, plan=plan)


@torch.no_grad()
def shard_experts(moe: nn.Module, group, rank: int) -> None:
    """Keep only this rank's ``E / P`` experts of ``moe`` (any device, meta included) and set its
    ``ep_group``: ``experts.w* [E, ...] -> [E/P, ...]`` rows ``rank*E/P .. (rank+1)*E/P - 1``.
    ConfigError (``moe.num_experts``) when P does not divide E."""
    L = local_expert_count(moe.num_experts, dist.get_world_size(group))
    for name, p in list(moe.experts.named_parameters(recurse=False)):
        local = p[rank * L : (rank + 1) * L].clone()
        setattr(moe.experts, name, nn.Parameter(local, requires_grad=p.requires_grad))
    moe.experts.num_experts = L
    moe.num_local_experts = L
    moe.ep_group = group
