"""Stacked experts (SwiGLU or squared ReLU) and the token -> expert-sorted dispatch plan used by
layers.MoE.

Legend: T tokens, K experts per token, E experts (local ones under expert parallelism), D model dim,
H expert hidden dim, N rows of the expert-sorted buffer.

- ``make_plan(indices[T, K], E, capacity, align, routed)`` sorts assignments by expert (stable, so
  earlier tokens win a full expert's slots) and returns ``inv[T, K]`` (row of each assignment in the
  sorted buffer, -1 when dropped) plus per-expert row counts. No host sync.
- ``run_plan(x[T, D], plan, weights[T, K], run_experts, fast, row_weights[N] | None) -> [T, D]``:
  permute, run the experts on the sorted buffer, weighted combine (the dispatch stage of layers.MoE
  on one process); with ``row_weights`` the weights are folded into the experts and the combine is
  unweighted.
- ``GroupedExperts(xs[N, D], counts[E], row_scale[N] | None, plan=None) -> [N, D]``: expert e runs
  on rows ``start_e .. start_e + counts[e]`` where start is the exclusive cumsum of counts (with
  ``plan``, xs is the tokens x [T, D] and the rows are its permute by the plan, ``sorted_rows``).
  Rows past ``counts.sum()`` are not computed (their output is unspecified on the grouped path, zero
  on the loop path): callers must only read rows some assignment maps to. Backends: ``loop``
  (per-expert matmuls; any device and dtype, syncs the counts to the host) and ``grouped``
  (``torch._grouped_mm`` over all experts in one launch per projection; CUDA, bfloat16; SwiGLU:
  grouped GEMMs for w1 and w3 with the permute fused into their backward (kernels.moe_gate_up), the
  fused kernels.moe_swiglu activation, a grouped GEMM for w2). ``precision`` "fp8" (set by the
  owner: ``model.moe.precision``) makes those GEMMs kernels.moe_fp8's rowwise-scaled e4m3 ones,
  forward and backward, on the grouped path only (ValueError where that path cannot run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moezoo.configs.errors import check, check_choice
from moezoo.configs.neuron import NEURON_ACTIVATIONS
from moezoo.kernels.grouped_wgrad import grouped_linear
from moezoo.kernels.moe_combine import moe_combine, moe_combine_reference
from moezoo.kernels.moe_fp8 import fp8_grouped_linear
from moezoo.kernels.moe_gate_up import gate_up
from moezoo.kernels.moe_permute import moe_permute, moe_permute_reference, moe_unpermute
from moezoo.kernels.moe_swiglu import swiglu

from ..mlp import gate_act as _gate_act
from ..mlp import relu2
from ..shapes import check_width
from .router import stable_order, tokens_per_expert


@dataclass
class DispatchPlan:
    inv: torch.Tensor  # [T, K] int32: sorted row of assignment (t, j), -1 when dropped
    counts: torch.Tensor  # [E] int64: rows of each expert's group (after capacity, before padding)
    group_sizes: torch.Tensor  # [E] int64: counts rounded up to the alignment (what the GEMMs see)
    # N, static: T * K (+ E * (align - 1) of padding, rounded up to a multiple of align)
    num_rows: int
    dense: bool  # every row 0..N-1 is some assignment's (no drops, no padding)


def plan_layout(
    num_assignments: int, num_experts: int, capacity: Optional[int], align: int
) -> tuple[int, bool]:
    """The static part of a DispatchPlan: ``(num_rows, dense)`` for T*K = ``num_assignments``."""
    dense = capacity is None and align == 1
    if align == 1:
        return num_assignments, dense
    # a whole number of aligned blocks: FP8 kernels that read the rows as a column-major operand
    # need its row count (the column stride) 16-byte aligned too
    return -(-(num_assignments + num_experts * (align - 1)) // align) * align, dense


def make_plan(
    indices: torch.Tensor,
    num_experts: int,
    capacity: Optional[int] = None,
    align: int = 1,
    routed: Optional[torch.Tensor] = None,
) -> DispatchPlan:
    """indices [T, K] -> DispatchPlan. ``capacity``: max assignments kept per expert (None =
    dropless).

    ``align``: pad every expert's group to a multiple of this many rows (grouped-GEMM kernels that
    need aligned group starts); padding rows are zero-filled inputs whose outputs nobody reads.
    ``routed``: the per-expert assignment counts when the caller already has them.
    """
    T, K = indices.shape
    flat = indices.reshape(-1)
    n = flat.numel()
    order = stable_order(flat, num_experts)  # [T*K] assignment at each sorted position
    if routed is None:
        routed = tokens_per_expert(indices, num_experts)
    arange = torch.arange(n, device=flat.device)
    inv = torch.empty(n, dtype=torch.int32, device=flat.device)
    if capacity is None and align == 1:
        # Dropless, unpadded: the sorted position is the row. Few launches matter here: the routing
        # stage is CPU-launch-bound at the start of a forward (BENCHMARKS.md, MoE layer).
        inv[order] = arange.to(torch.int32)
        return DispatchPlan(inv.view(T, K), routed, routed, n, dense=True)
    sorted_e = flat[order]
    starts = torch.cumsum(routed, 0) - routed
    rank = arange - starts[sorted_e]  # position within its expert
    counts = routed if capacity is None else routed.clamp(max=capacity)
    sizes = counts if align == 1 else (counts + align - 1) // align * align
    new_starts = torch.cumsum(sizes, 0) - sizes
    pos = new_starts[sorted_e] + rank
    if capacity is not None:
        pos = torch.where(rank < capacity, pos, torch.full_like(pos, -1))
    inv[order] = pos.to(torch.int32)
    return DispatchPlan(
        inv.view(T, K), counts, sizes, *plan_layout(n, num_experts, capacity, align)
    )


def run_plan(
    x: torch.Tensor,
    plan: DispatchPlan,
    weights: Optional[torch.Tensor],
    run_experts,
    fast: bool,
    row_weights: Optional[torch.Tensor] = None,
    fuse_permute: bool = True,
) -> torch.Tensor:
    """x [T, D] -> y [T, D] = ``sum_j weights[t, j] * ys[inv[t, j]]`` with ``ys = run_experts(xs[N,
    D], plan.group_sizes)`` on the expert-sorted copy ``xs`` of x (``weights=None``: unit weights).

    ``row_weights`` [N] float32 (instead of ``weights``): the same weights in sorted-row order,
    folded into the experts (``run_experts(xs, sizes, row_weights)`` scales each row's hidden
    state), so the combine is an unweighted sum: its backward is a permute of dy and never reads ys
    again (the weight gradient comes out of the SwiGLU backward, over H instead of D). ``fast``: the
    Triton permute/combine ops (kernels.moe_permute / moe_combine), else their references; a
    GroupedExperts (with ``fuse_permute``) then gets x and the plan and permutes itself (its grouped
    SwiGLU path fuses the permute into the gate/up projection's backward); without, it gets the
    permuted rows, as any other ``run_experts`` does (bench/moe.py's A/B of the fusion).
    """
    extra = () if row_weights is None else (row_weights,)
    if row_weights is not None:
        weights = None
    if fast:
        if fuse_permute and isinstance(run_experts, GroupedExperts):
            ys = run_experts(x, plan.group_sizes, *extra, plan=plan)
        else:
            ys = run_experts(sorted_rows(x, plan), plan.group_sizes, *extra)
        if weights is None:
            return moe_unpermute(ys, plan.inv, not plan.dense)
        return moe_combine(ys, plan.inv, weights, not plan.dense)
    xs = moe_permute_reference(x, plan.inv, plan.num_rows)
    return moe_combine_reference(run_experts(xs, plan.group_sizes, *extra), plan.inv, weights)


def sorted_rows(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """x [T, D] -> xs [N, D], ``xs[inv[t, j]] = x[t]`` (kernels.moe_permute); rows no assignment
    maps to are zero unless the plan is dense (then there are none)."""
    return moe_permute(x, plan.inv, plan.num_rows, not plan.dense)


def sorted_row_weights(weights: torch.Tensor, inv: torch.Tensor, num_rows: int) -> torch.Tensor:
    """weights [T, K], inv [T, K] -> [num_rows] float32 with ``out[inv[t, j]] = weights[t, j]``;
    rows no assignment maps to are 0. Differentiable; no data-dependent shapes (torch.compile
    fullgraph): dropped assignments (-1) all land in one extra slot that is cut off."""
    flat = inv.reshape(-1).long()
    dest = torch.where(flat >= 0, flat, torch.full_like(flat, num_rows))
    out = weights.new_zeros(num_rows + 1, dtype=torch.float32)
    return out.index_put((dest,), weights.reshape(-1).float())[:num_rows]


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype when autocast is on for its device (else unchanged).

    Mixed-precision training keeps the residual stream in float32 and lets autocast cast each
    matmul's inputs; the expert GEMMs are not autocast ops (``torch._grouped_mm`` takes bf16 only)
    and the permute/combine kernels would move float32 rows. Casting once before dispatch gives the
    grouped bf16 path the inputs autocast would have given F.linear, and halves the bytes the
    dispatch moves.
    """
    dev = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


def routing_inputs(
    x: torch.Tensor, low_precision_router: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (what the router reads, what the experts read). The experts read
    ``autocast_input(x)``; with ``low_precision_router`` the router reads that copy too (bf16
    products, float32 accumulation and logits through kernels.router_matmul, as megablocks' and
    torchtitan's routers read bf16 inputs): a float32 input would make it a float32 FFMA GEMM (no
    tensor cores; BENCHMARKS.md, Tried and rejected) plus a float32 copy of the normed rows. Without
    it the router reads x as given. Shared by MoE and NeuronRoutedFFN."""
    xa = autocast_input(x)
    return (xa if low_precision_router else x), xa


def local_expert_count(num_experts: int, ep_size: int, key: str = "moe") -> int:
    """Experts each of ``ep_size`` expert-parallel ranks holds; ConfigError unless they split
    evenly."""
    check(
        num_experts % ep_size == 0,
        f"{key}.num_experts",
        f"{num_experts} experts do not split over {ep_size} EP ranks",
    )
    return num_experts // ep_size


def expert_hidden(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor | None,
    activation: str,
    gate_act: str = "silu",
) -> torch.Tensor:
    """x [n, D], w1/w3 [H, D] -> hidden [n, H]: ``act(x w1^T) * x w3^T`` (swiglu; act =
    ``gate_act``, silu by default) or ``relu(x w1^T)^2`` (relu2)."""
    a = F.linear(x, w1)
    if activation != "swiglu":
        return relu2(a)
    return (F.silu(a) if gate_act == "silu" else _gate_act(gate_act)(a)) * F.linear(x, w3)


def scale_rows(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h [n, H] * scale [n] (float32 product, h's dtype), as kernels.moe_swiglu applies it."""
    return (h.float() * scale.unsqueeze(-1)).to(h.dtype)


class GroupedExperts(nn.Module):
    """E experts stacked HF-style: w1 (gate) [E, H, D], w3 (up) [E, H, D], w2 (down) [E, D, H].

    ``activation`` "swiglu" (default) or "relu2" (squared ReLU, Primer: ``w2 relu(w1 x)^2``, no w3).
    ``forward(xs[N, D], counts[E]) -> [N, D]``; ``backend`` is "loop" or "grouped" (set by the
    owner). ``forward(x[T, D], plan.group_sizes, plan=plan)`` runs the rows ``sorted_rows(x, plan)``
    (run_plan).
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        activation: str = "swiglu",
        gate_act: str = "silu",
    ):
        super().__init__()
        check_choice(activation, NEURON_ACTIVATIONS, "activation")
        _gate_act(gate_act)
        self.num_experts, self.dim, self.hidden_dim, self.activation = (
            num_experts,
            dim,
            hidden_dim,
            activation,
        )
        # the gated (swiglu) layout's gate activation: silu | gelu | gelu_tanh | relu2
        self.gate_act = gate_act
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = (
            nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
            if activation == "swiglu"
            else None
        )
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.backend = "loop"
        # the grouped path's GEMM operands: bf16 | fp8 (set by the owner, as backend)
        self.precision = "bf16"

    def init_weights(self, std: float = 0.02, out_std: float = 0.02) -> None:
        nn.init.normal_(self.w1, std=std)
        if self.w3 is not None:
            nn.init.normal_(self.w3, std=std)
        nn.init.normal_(self.w2, std=out_std)

    def forward(
        self,
        xs: torch.Tensor,
        counts: torch.Tensor,
        row_scale: Optional[torch.Tensor] = None,
        plan: Optional[DispatchPlan] = None,
    ) -> torch.Tensor:
        """``row_scale`` [N] float32: multiplies each row's hidden state (the folded routing
        weight). ``plan``: xs is the tokens x [T, D] and the experts run on ``sorted_rows(x,
        plan)``."""
        check_width("GroupedExperts", xs, self.dim, arg="xs")
        if counts.shape != (self.num_experts,):
            raise ValueError(
                f"GroupedExperts(num_experts={self.num_experts}): expected counts of shape "
                f"[{self.num_experts}], got {list(counts.shape)}"
            )
        # the fused grouped path computes silu gates; other gate activations take the loop
        if (
            self.backend == "grouped"
            and xs.is_cuda
            and xs.dtype == torch.bfloat16
            and self.gate_act == "silu"
        ):
            return self._grouped(xs, counts, row_scale, plan)
        if self.precision == "fp8":
            raise ValueError(
                "precision fp8 runs on the grouped CUDA path with bfloat16 activations "
                "(a bf16 model or autocast) and a silu gate; "
                f"got {xs.dtype} on {xs.device.type}, backend {self.backend}"
            )
        return self._loop(xs, counts, row_scale, plan)

    # Eager inside a compiled block: the loop reads the counts on the host, and traced, dynamo
    # specialises the code after that graph break on each count's value, so every batch with new
    # counts would recompile it until the recompile limit (a CPU trainer with train.compile; float32
    # or non-silu experts on CUDA).
    @torch.compiler.disable
    def _loop(
        self,
        xs: torch.Tensor,
        counts: torch.Tensor,
        row_scale: Optional[torch.Tensor] = None,
        plan: Optional[DispatchPlan] = None,
    ) -> torch.Tensor:
        if plan is not None:
            xs = sorted_rows(xs, plan)
        pieces, start = [], 0
        w1, w2 = self.w1.to(xs.dtype), self.w2.to(xs.dtype)
        w3 = self.w3.to(xs.dtype) if self.w3 is not None else None
        for e, n in enumerate(counts.tolist()):
            if n:
                h = expert_hidden(
                    xs[start : start + n],
                    w1[e],
                    w3[e] if w3 is not None else None,
                    self.activation,
                    self.gate_act,
                )
                if row_scale is not None:
                    h = scale_rows(h, row_scale[start : start + n])
                pieces.append(F.linear(h, w2[e]))
            start += n
        pieces.append(xs.new_zeros(xs.shape[0] - start, self.dim))
        return torch.cat(pieces)

    def _grouped(
        self,
        xs: torch.Tensor,
        counts: torch.Tensor,
        row_scale: Optional[torch.Tensor] = None,
        plan: Optional[DispatchPlan] = None,
    ) -> torch.Tensor:
        # One grouped GEMM per projection over all experts; offs are group ends (int32, on device:
        # no sync).
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        fp8 = self.precision == "fp8"
        if self.activation == "swiglu":
            # Gate and up stay two grouped GEMMs: one GEMM over [w1 | w3] is slower at both
            # benchmark shapes (BENCHMARKS.md, Tried and rejected). With a plan the
            # permute is fused into them, so their backward adds the two input gradients inside the
            # permute's. fp8 reads the weights as they are (its quantizers cast them), so no bf16
            # copy is made.
            perm = () if plan is None else (plan.inv, plan.num_rows, not plan.dense)
            w1, w3 = (self.w1, self.w3) if fp8 else (self.w1.to(xs.dtype), self.w3.to(xs.dtype))
            h = swiglu(*gate_up(xs, w1, w3, offs, *perm, fp8=fp8), row_scale)
        else:
            if plan is not None:
                xs = sorted_rows(xs, plan)
            h = relu2(self._linear(xs, self.w1, offs))
            if row_scale is not None:
                h = scale_rows(h, row_scale)
        return self._linear(h, self.w2, offs)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]: ``x w[e]^T`` on each expert's rows (w [E, out, in]), in
        ``self.precision``."""
        if self.precision == "fp8":
            return fp8_grouped_linear(x, w, offs)
        return grouped_linear(x, w.to(x.dtype), offs)
