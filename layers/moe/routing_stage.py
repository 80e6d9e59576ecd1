"""The routing stage of layers.MoE as one pure function, compiled on CUDA to cut its kernel
launches.

``routing_stage(logits[T, E], bias[E] | None, spec)`` runs, after the router GEMM: selection and
combine weights (layers.moe.router.route), the balance and z losses, the logged stats (tokens per
expert, dropped fraction, entropy), the dispatch plan (layers.moe.experts.make_plan) and optionally
the combine weights scattered to the plan's rows (folded into the experts' SwiGLU). Eager, that is
~60 small kernels at the start of every MoE forward (plus their backward), and the CPU launches them
more slowly than the GPU runs them (BENCHMARKS.md, MoE layer: 2.4 ms of GPU idle per Mixtral step).
``routing_fn(device, backend, spec)`` returns ``torch.compile(routing_stage, fullgraph=True)`` for
CUDA (made lazily, once per process, backend and spec), which fuses the elementwise and reduction
chains into a few kernels; elsewhere, or inside an outer ``torch.compile``, the eager function (one
definition).

Everything random (noisy gating) and every collective (the global balance loss over a data-parallel
group) stays outside: the caller computes the logits and, for ``spec.local_balance=False``, finishes
the balance loss from the returned mean probabilities with ``balance_loss_of_mean``.
Legend: T tokens, K experts per token, E experts.
"""

from __future__ import annotations

import functools
import types
from typing import NamedTuple, Optional

import torch

from .experts import make_plan, sorted_row_weights
from .router import balance_loss_of_mean, route, router_entropy, tokens_per_expert, z_loss


class RoutingSpec(NamedTuple):
    """The static arguments (graph constants under torch.compile)."""

    router: str
    top_k: int
    softmax_before_topk: bool
    norm_topk: bool
    num_experts: int
    aux_loss_coef: float
    z_loss_coef: float
    capacity: Optional[int]  # max kept assignments per expert; None = dropless
    align: int  # dispatch-plan group alignment (rows)
    local_balance: bool  # balance loss on this process's tokens only (no collective)
    plan: bool  # also build the dispatch plan
    row_weights: bool = False  # also the combine weights in sorted-row order (needs plan)
    n_group: int = 1  # group-limited selection (DeepSeek-V2/V3; layers.moe.router.route)
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


class Routed(NamedTuple):
    indices: torch.Tensor  # [T, K] int64
    weights: torch.Tensor  # [T, K] float32, with grad
    routed: torch.Tensor  # [E] int64 assignments per expert (before capacity)
    aux_loss: torch.Tensor  # scalar with grad; the z part only when not local_balance
    balance: Optional[torch.Tensor]  # scalar with grad (local_balance) or None
    p_mean: Optional[torch.Tensor]  # [E] mean routing probabilities with grad (not local_balance)
    z: torch.Tensor  # scalar with grad
    stats: dict  # tokens_per_expert [E] float, dropped_frac, router_entropy (detached)
    plan_tensors: Optional[tuple]  # (inv [T, K] int32, counts [E], group_sizes [E]) when spec.plan
    row_weights: Optional[torch.Tensor]  # [num_rows] float32 with grad when spec.row_weights


def routing_stage(logits: torch.Tensor, bias: Optional[torch.Tensor], spec: RoutingSpec) -> Routed:
    """logits [T, E] float32 -> Routed (see the module docstring)."""
    T = logits.shape[0]
    indices, weights, probs = route(
        logits,
        spec.router,
        spec.top_k,
        spec.softmax_before_topk,
        spec.norm_topk,
        bias,
        spec.n_group,
        spec.topk_group,
        spec.routed_scaling_factor,
    )
    routed = tokens_per_expert(indices, spec.num_experts)
    p_mean = probs.mean(0)
    z = z_loss(logits)
    n = T * spec.top_k
    if spec.capacity is None:
        dropped = torch.zeros((), device=logits.device)  # dropless: exactly zero, no reduction
    else:
        dropped = 1.0 - routed.clamp(max=spec.capacity).sum().float() / max(n, 1)
    stats = {
        "tokens_per_expert": routed.float(),
        "router_entropy": router_entropy(probs).detach(),
        "dropped_frac": dropped.detach(),
    }
    balance = None
    aux = spec.z_loss_coef * z
    if spec.local_balance:
        balance = balance_loss_of_mean(p_mean, routed, T, spec.top_k)
        aux = aux + spec.aux_loss_coef * balance
        p_mean = None
    plan_tensors = row_weights = None
    if spec.plan:
        p = make_plan(indices, spec.num_experts, spec.capacity, spec.align, routed)
        plan_tensors = (p.inv, p.counts, p.group_sizes)
        if spec.row_weights:
            row_weights = sorted_row_weights(weights, p.inv, p.num_rows)
    return Routed(
        indices, weights, routed, aux, balance, p_mean, z, stats, plan_tensors, row_weights
    )


@functools.cache
def compiled_routing_stage(backend: str, spec: RoutingSpec):
    """``routing_stage`` compiled for one spec. Each spec gets its own copy of the code object:
    dynamo counts recompilations per code object (8, then a hard error under fullgraph), and every
    MoE configuration is a different graph. dynamic=None: static shapes first, one dynamic recompile
    if the token count changes."""
    fn = types.FunctionType(
        routing_stage.__code__.replace(), routing_stage.__globals__, "routing_stage"
    )
    return torch.compile(fn, fullgraph=True, dynamic=None, backend=backend)


def routing_fn(device: torch.device, backend: Optional[str], spec: RoutingSpec):
    """The routing stage to call for ``spec``: compiled with ``backend`` ("inductor") on CUDA, else
    eager.

    ``backend=None`` turns compilation off (``MoEConfig.compile_routing``). Inside an outer
    torch.compile the eager function is returned so the outer graph traces it.
    """
    if backend is None or device.type != "cuda" or torch.compiler.is_compiling():
        return routing_stage
    return compiled_routing_stage(backend, spec)
