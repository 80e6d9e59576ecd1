"""Routed mixture-of-experts FFN: ``MoE(dim, hidden_dim, num_experts, top_k, *, cfg=None,
**MoEConfig fields)``, ``forward(x[..., D]) -> [..., D]``.

Follows Mixtral (softmax top-k, renormalised; the default), Shazeer et al. 2017 (noisy top-k
gating), DeepSeek-V3 (sigmoid scores, aux-loss-free bias balancing), Switch (top-1, capacity
factor), and DeepSeekMoE / Qwen2-MoE (always-on shared experts, optional sigmoid shared gate).
Semantics of each router are in layers.moe.router; docs/moe.md has the contract.

Forward, in three separable stages (expert parallelism replaces only the middle one):
1. route: router logits in float32 -> ``indices [T, K]``, ``weights [T, K]``; losses and stats
   recorded, dispatch plan built (``make_plan``: assignments sorted by expert). Everything after the
   router GEMM is one pure function, ``layers.moe.routing_stage.routing_stage``, torch.compile'd on
   CUDA with the grouped backend (``cfg.compile_routing``): eager it is ~90 launch-bound small
   kernels forward + backward.
2. dispatch: ``_dispatch_local`` (or ``layers.moe.expert_parallel.ep_dispatch`` with an
   ``ep_group``) permutes tokens, runs ``self.experts(xs[N, D], counts[E])`` and combines with the
   weights -> ``y [T, D]``. Grouped backend without EP: the weights are folded into the experts'
   SwiGLU per sorted row (``cfg.fold_weights``) and the combine is an unweighted sum.
3. shared experts are added (gated by ``sigmoid(shared_gate(x))`` when ``shared_gate``).

Parameters (HF layout, names fixed for zoo.hf): ``gate.weight [E, D]``; ``noise.weight [E, D]``
(noisy_topk only); ``experts.w1/w3 [E, H, D]``, ``experts.w2 [E, D, H]``; ``shared.{w1,w2,w3}`` and
``shared_gate.weight [1, D]``; buffer ``expert_bias [E]`` (sigmoid router or bias_update_rate > 0).

After each forward: ``aux_loss`` (scalar with grad: aux_loss_coef * balance + z_loss_coef * z),
``aux_parts`` (detached, unweighted), ``stats`` (tokens_per_expert [E] float, dropped_frac,
router_entropy; all device tensors, no host sync).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from moezoo.configs import ConfigError, MoEConfig
from moezoo.kernels.router_matmul import router_matmul

from ..aux_loss import AuxLossModule, sum_aux_losses
from ..mlp import SwiGLU
from ..shapes import check_width
from .experts import (
    DispatchPlan,
    GroupedExperts,
    local_expert_count,
    make_plan,
    plan_layout,
    routing_inputs,
    run_plan,
)
from .router import balance_loss_of_mean, noisy_logits, route
from .routing_stage import RoutingSpec, routing_fn


def layer_config(cls, cfg, positional: dict, overrides: dict, owner: str):
    """A layer's own config: a copy of ``cfg`` (default ``cls()``) with the non-None ``positional``
    arguments and the keyword ``overrides`` applied; TypeError naming an unknown keyword, as a
    signature would. Shared by MoE and NeuronRoutedFFN."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r} "
            f"(its options are {cls.__name__}'s fields)"
        )
    given = {k: v for k, v in positional.items() if v is not None}
    return dataclasses.replace(cfg if cfg is not None else cls(), **given, **overrides)


def resolve_backend(name: str, device_type: str) -> str:
    """``auto`` -> ``grouped`` on CUDA, ``reference`` elsewhere (modules call it once and keep the
    answer)."""
    if name == "auto":
        return "grouped" if device_type == "cuda" else "reference"
    if name in ("grouped", "megablocks") and device_type != "cuda" or name == "torch":
        # the CPU path of every backend is the reference; "torch" is its alias
        return "reference"
    return name


class ExpertsModule(AuxLossModule):
    """Base of the layers that run a ``GroupedExperts`` (MoE, NeuronRoutedFFN): their backend
    follows the device of their weights. It is resolved at the end of ``__init__`` and again
    whenever the weights move (``_apply``: ``.to``, ``.cuda``, ``to_empty``); weights on the meta
    device leave it to the first forward. Weights elsewhere never do: set in a forward, it is a
    module mutation that a compiled block's guards read (``self._backend is None``), so the first
    MoE block of every MoE model would be traced twice."""

    _backend: Optional[str] = None

    def backend(self, device: torch.device) -> str:
        """``self.cfg.backend`` resolved for ``device`` and kept, ``self.experts`` pointed at its
        path."""
        if self._backend is None:
            self._backend = resolve_backend(self.cfg.backend, device.type)
            self.experts.backend = "grouped" if self._backend == "grouped" else "loop"
        return self._backend

    def _resolve_backend(self) -> None:
        self._backend = None
        p = next(self.parameters(), None)
        if p is not None and not p.is_meta:
            self.backend(p.device)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._resolve_backend()
        return out


class MoE(ExpertsModule):
    """Top-k routed SwiGLU experts. Options are MoEConfig's fields, declared (with their defaults)
    there only: ``MoE(dim, hidden_dim, num_experts, top_k, **fields)`` or ``MoE(dim,
    cfg=MoEConfig(...), **fields)``; positional arguments and keywords override ``cfg``. The layer
    keeps its own copy (``self.cfg``), so the speed switches (``compile_routing``, ``fold_weights``,
    ``group_align``, ``low_precision_router``, ``fuse_permute``) and ``precision`` can be flipped on
    one instance: they are read at each forward. ``precision="fp8"`` raises ConfigError (a
    ValueError) when built off the meta device on a machine without a Hopper / Blackwell GPU, and
    ValueError when run on CPU tensors.
    """

    # children read with autocast off (routing in float32): their weights stay float32 when a
    # trainer holds the other matmul weights in bf16 (training.optim.autocast_weights)
    float32_children = ("gate", "noise")

    def __init__(
        self,
        dim: int,
        hidden_dim: Optional[int] = None,
        num_experts: Optional[int] = None,
        top_k: Optional[int] = None,
        *,
        cfg: Optional[MoEConfig] = None,
        act: str = "silu",
        ep_group=None,
        key: str = "moe",
        **overrides,
    ):
        """``cfg`` (a MoEConfig) plus keyword overrides of its fields; ``act``: the experts' gate
        activation (the model's ``ffn_act``: silu, gelu, gelu_tanh, relu2)."""
        super().__init__()
        if not (isinstance(dim, int) and dim > 0):
            raise ConfigError(f"{key}.dim", f"must be > 0, got {dim}")
        cfg = layer_config(
            MoEConfig,
            cfg,
            dict(hidden_dim=hidden_dim, num_experts=num_experts, top_k=top_k),
            overrides,
            "MoE",
        )
        if cfg.hidden_dim is None:
            raise ConfigError(f"{key}.hidden_dim", "the layer needs the expert hidden size")
        cfg.validate(key)
        if cfg.backend == "megablocks":
            if act != "silu" or cfg.n_group > 1 or cfg.routed_scaling_factor != 1.0:
                raise ConfigError(
                    f"{key}.backend",
                    "megablocks runs SwiGLU experts behind its own Mixtral router: "
                    "no other activation, group-limited routing or routed_scaling_factor",
                )
            from .megablocks import check_megablocks_config

            check_megablocks_config(cfg, key)
        self.cfg = cfg
        hidden_dim, num_experts, top_k, router = (
            cfg.hidden_dim,
            cfg.num_experts,
            cfg.top_k,
            cfg.router,
        )
        bias_update_rate, shared_experts = cfg.bias_update_rate, cfg.shared_experts
        self.dim, self.hidden_dim, self.num_experts, self.top_k = (
            dim,
            hidden_dim,
            num_experts,
            top_k,
        )
        self.ep_group = ep_group
        # Data-parallel group for the global balance loss; set by training.parallel (None = this
        # rank only).
        self.balance_group = None
        # The mesh (ep ranks x expert-FSDP ranks) the checkpoint's global [E, ...] expert views live
        # on; set by training.parallel under expert parallelism (None: the experts are stored as
        # they are).
        self.ep_checkpoint_mesh = None
        self.num_local_experts = local_expert_count(
            num_experts, 1 if ep_group is None else ep_group.size(), key
        )

        self.gate = nn.Linear(dim, num_experts, bias=False)
        if router == "noisy_topk":
            self.noise = nn.Linear(dim, num_experts, bias=False)
        if router == "sigmoid" or bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        if bias_update_rate > 0:
            # int64: model-wide dtype casts (.to(bfloat16)) leave it alone and counts stay exact.
            self.register_buffer(
                "load_accum", torch.zeros(num_experts, dtype=torch.int64), persistent=False
            )
        self.experts = GroupedExperts(self.num_local_experts, dim, hidden_dim, gate_act=act)
        cfg.check_precision_shapes(dim, hidden_dim, act, key)
        if not self.experts.w1.is_meta:
            # fp8 on a machine that cannot run it; a meta build (a plan) may
            cfg.check_runtime("cuda", key)
        if shared_experts > 0:
            self.shared = SwiGLU(dim, cfg.shared_hidden_dim or hidden_dim * shared_experts, act)
            if cfg.shared_gate:
                self.shared_gate = nn.Linear(dim, 1, bias=False)
        self.aux_loss = torch.zeros(())
        self.aux_parts: dict = {}
        self.stats: dict = {}
        self.init_weights()
        self._resolve_backend()

    # -- init --------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float = 0.02, out_std: float = 0.02) -> None:
        """Normal(std) for router and input projections, Normal(out_std) for the down projections.

        The noise projection starts at zero (Shazeer et al.: noise std softplus(0) ~ 0.69 at start).
        """
        nn.init.normal_(self.gate.weight, std=std)
        if hasattr(self, "noise"):
            nn.init.zeros_(self.noise.weight)
        if hasattr(self, "expert_bias"):
            self.expert_bias.zero_()
        if hasattr(self, "load_accum"):
            self.load_accum.zero_()  # integer buffer: a meta-device build leaves it uninitialised
        self.experts.init_weights(std, out_std)
        if hasattr(self, "shared"):
            self.shared.init_weights(std, out_std)
            if hasattr(self, "shared_gate"):
                nn.init.normal_(self.shared_gate.weight, std=std)

    def _apply(self, fn, recurse=True):
        # The balancing bias stays float32 under model-wide casts: updates of ~1e-3 on values ~1
        # vanish in bfloat16 (8 bits of mantissa).
        super()._apply(fn, recurse)
        b = self._buffers.get("expert_bias")
        if b is not None and b.is_floating_point() and b.dtype != torch.float32:
            self._buffers["expert_bias"] = b.float()
        return self

    # -- routing -----------------------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> float32 logits [T, E] (noisy in training for noisy_topk). Autocast off:
        routing in fp32."""
        with torch.autocast(x.device.type, enabled=False):
            logits = router_matmul(x, self.gate.weight, self.cfg.low_precision_router)
            if hasattr(self, "noise") and self.training:
                logits = noisy_logits(
                    logits, router_matmul(x, self.noise.weight, self.cfg.low_precision_router)
                )
        return logits

    def route(self, x: torch.Tensor):
        """x [T, D] -> (indices [T, K], weights [T, K] float32, logits [T, E], probs [T, E])."""
        logits = self.router_logits(x)
        bias = getattr(self, "expert_bias", None)
        c = self.cfg
        indices, weights, probs = route(
            logits,
            c.router,
            c.top_k,
            c.softmax_before_topk,
            c.norm_topk,
            bias,
            c.n_group,
            c.topk_group,
            c.routed_scaling_factor,
        )
        return indices, weights, logits, probs

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Max assignments per expert: ceil(capacity_factor * T * K / E); None when dropless."""
        cf = self.cfg.capacity_factor
        return None if cf is None else math.ceil(cf * num_tokens * self.top_k / self.num_experts)

    # -- dispatch ----------------------------------------------------------------------------------
    def _align(self, x: torch.Tensor) -> int:
        return self.cfg.group_align if self.backend(x.device) == "grouped" and x.is_cuda else 1

    def _dispatch_local(
        self,
        x: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        routed: Optional[torch.Tensor] = None,
        run_experts=None,
        plan: Optional[DispatchPlan] = None,
        row_weights: Optional[torch.Tensor] = None,
    ):
        """All experts on this rank: x [T, D] -> y [T, D].

        ``run_experts(xs[N, D], group_sizes[E]) -> [N, D]`` replaces ``self.experts`` on the sorted
        buffer (expert parallelism: layers.moe.expert_parallel sends the rows to the ranks owning
        the experts). ``plan``: the dispatch plan of ``indices`` when the routing stage already
        built it. ``row_weights``: ``weights`` in the plan's row order, folded into the experts
        (run_plan).
        """
        fast = self.backend(x.device) == "grouped"
        if plan is None:
            plan = make_plan(
                indices, self.num_experts, self.capacity(x.shape[0]), self._align(x), routed
            )
        return run_plan(
            x, plan, weights, run_experts or self.experts, fast, row_weights, self.cfg.fuse_permute
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.precision != self.cfg.precision:  # read each forward, as the speed switches
            self.experts.precision = self.cfg.precision
        check_width("MoE", x, self.dim)
        shape = x.shape
        x2 = x.reshape(-1, self.dim)
        # the router's input, the experts' (autocast copy)
        xr, x2 = routing_inputs(x2, self.cfg.low_precision_router)
        r, plan = self._route_and_record(xr)
        if self.ep_group is not None:
            from .expert_parallel import ep_dispatch

            y = ep_dispatch(self, x2, r.indices, r.weights, r.routed, plan)
        elif self.backend(x.device) == "megablocks":
            from .megablocks import megablocks_forward

            y = megablocks_forward(self, x2)
        else:
            y = self._dispatch_local(
                x2, r.indices, r.weights, r.routed, plan=plan, row_weights=r.row_weights
            )
        if hasattr(self, "shared"):
            s = self.shared(x2)
            if hasattr(self, "shared_gate"):
                s = torch.sigmoid(self.shared_gate(x2)) * s
            y = y + s
        return y.reshape(shape)

    # -- losses, stats, bias balancing -------------------------------------------------------------
    def _route_and_record(self, x: torch.Tensor):
        """x [T, D] -> (Routed, DispatchPlan or None): the routing stage (layers.moe.routing_stage;
        compiled on CUDA for the grouped backend) with losses and stats recorded on the module."""
        c = self.cfg
        T = x.shape[0]
        group = self.balance_group if c.global_balance else None
        local = group is None or torch.distributed.get_world_size(group) == 1
        backend = self.backend(x.device)
        align = self._align(x)
        capacity = self.capacity(T)
        spec = RoutingSpec(
            c.router,
            c.top_k,
            c.softmax_before_topk,
            c.norm_topk,
            self.num_experts,
            float(c.aux_loss_coef),
            float(c.z_loss_coef),
            capacity,
            align,
            local,
            plan=backend != "megablocks",
            row_weights=c.fold_weights and backend == "grouped" and self.ep_group is None,
            n_group=c.n_group,
            topk_group=c.topk_group,
            routed_scaling_factor=float(c.routed_scaling_factor),
        )
        fn = routing_fn(x.device, c.compile_routing if backend == "grouped" else None, spec)
        r = fn(self.router_logits(x), getattr(self, "expert_bias", None), spec)
        bal, aux = r.balance, r.aux_loss
        if not local:
            bal = balance_loss_of_mean(r.p_mean, r.routed, T, c.top_k, group)
            aux = aux + c.aux_loss_coef * bal
        self.aux_loss = aux
        self.aux_parts = {"balance": bal.detach(), "z": r.z.detach()}
        self.stats = dict(r.stats)
        if c.bias_update_rate > 0 and self.training:
            self.load_accum += r.routed
        plan = None
        if r.plan_tensors is not None:
            plan = DispatchPlan(
                *r.plan_tensors, *plan_layout(r.indices.numel(), self.num_experts, capacity, align)
            )
        return r, plan

    @torch.no_grad()
    def update_bias(self, group=None, applied: Optional[torch.Tensor] = None) -> None:
        """DeepSeek-V3 aux-loss-free balancing: ``bias += rate * sign(mean_load - load)`` over the
        load accumulated since the last call, then reset. Call after ``optimizer.step()``
        (``moe_update_bias``); pass the data/expert-parallel group so every rank applies the same
        update. ``applied``: a 0-dim float tensor, 1 or 0, multiplying the update (0: a skipped
        step, whose load is only dropped).
        """
        if self.cfg.bias_update_rate <= 0:
            return
        load = self.load_accum
        if group is not None:
            torch.distributed.all_reduce(load, group=group)
        load_f = load.float()
        step = self.cfg.bias_update_rate * torch.sign(load_f.mean() - load_f)
        self.expert_bias += step if applied is None else step * applied
        load.zero_()


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of ``aux_loss`` over every MoE module of ``model`` from its last forward (0 when
    none)."""
    return sum_aux_losses(moe_modules(model))


def moe_update_bias(model: nn.Module, group=None, applied: Optional[torch.Tensor] = None) -> None:
    """Apply the aux-loss-free bias update of every MoE module (after ``optimizer.step()``;
    ``applied``: ``MoE.update_bias``)."""
    for m in moe_modules(model):
        m.update_bias(group, applied)


def moe_reset_load(model: nn.Module) -> None:
    """Forget the load routed since the last bias update (a skipped or rolled-back step's)."""
    for m in moe_modules(model):
        if hasattr(m, "load_accum"):
            m.load_accum.zero_()
