"""Neuron-level expert routing of a dense FFN:
``NeuronRoutedFFN(dim, hidden_dim, num_groups, top_k_groups, *, cfg=None, **NeuronConfig fields)``,
``forward(x[..., D]) -> [..., D]``.

Follows MoEfication (Zhang et al. 2022: balanced k-means on W1 rows splits a dense FFN into expert
groups, a router predicts which groups fire), Deja Vu (Liu et al. 2023: a cheap predictor of
contextual sparsity, judged by recall) and the neuron-router layer of arXiv 2602.06183 (sparse steps
during pre-training, dense at the end). Legend: T tokens, D model dim, H hidden units, G groups, Hg
= H / G units per group, K groups per token.

The H hidden units are stored grouped: group g is a small expert with rows ``g*Hg .. (g+1)*Hg - 1``
of the dense FFN after a permutation, held in the MoE layout so the MoE machinery runs it unchanged:
``experts.w1 [G, Hg, D]`` (gate), ``experts.w3 [G, Hg, D]`` (up; SwiGLU only), ``experts.w2 [G, D,
Hg]`` (down); ``router.weight [G, D]``; buffer ``neuron_index [H]``, the dense index of each grouped
unit.

Two modes, switched by ``sparse`` (the training schedule sets it through ``set_step``):
- dense: the whole FFN, ``w2 act(w1 x, w3 x)``, plus the router loss: the router's softmax over G is
  fitted to each token's normalised per-group activation mass ``m_g = sum_{i in g} |h_i|`` (``ce``:
  KL to the soft target; ``mse``: squared error of the shares). The router reads ``x`` detached: it
  is a predictor of the FFN, and its loss must not reshape the residual stream.
- sparse: every token computes only the K groups the router ranks highest, through the MoE dispatch
  (``make_plan`` sort, ``moe_permute``, grouped GEMM, ``moe_combine`` with unit weights; the outputs
  of the groups add up, exactly as in the dense FFN). With K == G this is the dense FFN.

``recluster(optimizer)`` re-forms the groups by balanced k-means on the current weights (after a
dense warm-up; ``recluster: true`` makes ``set_step`` do it when the warm-up ends), permuting the
optimizer state along.

After each forward: ``aux_loss`` (scalar with grad; ``router_loss_coef * router loss`` in dense
mode, zero in sparse mode), ``stats`` (detached device tensors): ``active_frac`` (share of groups a
token computes), ``tokens_per_group [G]`` (sparse), ``router_loss``, ``recall`` (share of each
token's true top-K groups by mass that the router also ranks top-K) and ``mass_captured`` (share of
the activation mass in the router's top-K groups) in dense mode, where the true masses are known;
the last dense forward's router numbers stay in ``router_stats`` through the sparse steps that
follow.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moezoo.configs import ConfigError
from moezoo.configs.neuron import NeuronConfig
from moezoo.kernels.router_matmul import router_matmul

from ..moe.experts import GroupedExperts, expert_hidden, make_plan, routing_inputs, run_plan
from ..moe.layer import ExpertsModule, layer_config
from ..shapes import check_width
from ..sharding import full_tensor, local_tensor, shard_like
from .cluster import cluster_neurons
from .schedule import neuron_phase, phase_bounds


def _assign(t: torch.Tensor, value: torch.Tensor) -> None:
    """``t[...] = value`` for a plain tensor or a DTensor (each rank keeps its shard of the same
    ``value``)."""
    local_tensor(t).copy_(local_tensor(shard_like(value, t)))


class NeuronRoutedFFN(ExpertsModule):
    """A dense FFN whose hidden units form ``num_groups`` routed groups. Options are NeuronConfig's
    fields (declared there only): ``NeuronRoutedFFN(dim, hidden_dim, num_groups, top_k_groups,
    **fields)`` or ``NeuronRoutedFFN(dim, hidden_dim, cfg=NeuronConfig(...), **fields)``; arguments
    override ``cfg``."""

    # read with autocast off (as MoE's router; training.optim.autocast_weights)
    float32_children = ("router",)

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_groups: Optional[int] = None,
        top_k_groups: Optional[int] = None,
        *,
        cfg: Optional[NeuronConfig] = None,
        key: str = "neuron",
        **overrides,
    ):
        super().__init__()
        if not (isinstance(dim, int) and dim > 0):
            raise ConfigError(f"{key}.dim", f"must be > 0, got {dim}")
        if not (isinstance(hidden_dim, int) and hidden_dim > 0):
            raise ConfigError(f"{key}.hidden_dim", f"must be > 0, got {hidden_dim}")
        cfg = layer_config(
            NeuronConfig,
            cfg,
            dict(num_groups=num_groups, top_k_groups=top_k_groups),
            overrides,
            "NeuronRoutedFFN",
        )
        cfg.validate(key, hidden_dim)
        self.cfg = cfg
        num_groups, top_k_groups, activation = cfg.num_groups, cfg.top_k_groups, cfg.activation
        self.dim, self.hidden_dim = dim, hidden_dim
        self.num_groups, self.top_k_groups = num_groups, top_k_groups
        self.group_dim = hidden_dim // num_groups
        self.activation = activation
        self.experts = GroupedExperts(num_groups, dim, self.group_dim, activation)
        self.router = nn.Linear(dim, num_groups, bias=False)
        self.register_buffer("neuron_index", torch.arange(hidden_dim))
        self.sparse = True  # the schedule (set_step) switches it per training step
        self.aux_loss = torch.zeros(())
        self.stats: dict = {}
        self.router_stats: dict = {}  # router_loss, recall, mass_captured of the last dense forward
        self.init_weights()
        self._resolve_backend()

    # -- construction ------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, std: float = 0.02, out_std: float = 0.02) -> None:
        self.experts.init_weights(std, out_std)
        nn.init.normal_(self.router.weight, std=std)
        # Fresh groups are contiguous unit ranges (from_dense re-clusters); also repairs a
        # meta-device build.
        self.neuron_index.copy_(
            torch.arange(self.neuron_index.numel(), device=self.neuron_index.device)
        )

    @classmethod
    def from_dense(
        cls, ffn: nn.Module, num_groups: int, top_k_groups: int, **kwargs
    ) -> NeuronRoutedFFN:
        """Cluster a dense FFN (``w1``, ``w2`` and, for SwiGLU, ``w3`` linears, LLaMA naming) into
        routed groups.

        ``activation`` defaults to swiglu when ``ffn`` has ``w3``, else relu2; other keywords as the
        constructor. The result is in sparse mode; with ``top_k_groups == num_groups`` it computes
        ``ffn``.
        """
        w1 = ffn.w1.weight
        kwargs.setdefault("activation", "swiglu" if hasattr(ffn, "w3") else "relu2")
        m = cls(w1.shape[1], w1.shape[0], num_groups, top_k_groups, **kwargs).to(
            w1.device, w1.dtype
        )
        w3 = getattr(ffn, "w3", None)
        m.load_dense(w1, ffn.w2.weight, None if w3 is None else w3.weight)
        return m

    @torch.no_grad()
    def load_dense(
        self, w1: torch.Tensor, w2: torch.Tensor, w3: Optional[torch.Tensor] = None, seed: int = 0
    ) -> None:
        """Group dense weights w1/w3 [H, D], w2 [D, H] by balanced k-means on the W1 (and W3) rows.

        The router starts at each group's mean gate row, a linear predictor of the group's mean
        pre-activation (MoEfication's similarity routing), so routing is sensible before any
        training.
        """
        if (w3 is None) != (self.activation == "relu2"):
            raise ConfigError(
                "neuron.activation",
                f"{self.activation} {'needs a' if w3 is None else 'has no'} w3 (up projection)",
            )
        order = cluster_neurons(w1, w3, self.num_groups, self.cfg.kmeans_iters, seed)
        G, Hg, D = self.num_groups, self.group_dim, self.dim
        self.experts.w1.copy_(w1[order].view(G, Hg, D))
        if w3 is not None:
            self.experts.w3.copy_(w3[order].view(G, Hg, D))
        self.experts.w2.copy_(w2[:, order].reshape(D, G, Hg).permute(1, 0, 2))
        self.neuron_index.copy_(order)
        self.router.weight.copy_(self.experts.w1.float().mean(1))

    @torch.no_grad()
    def recluster(self, optimizer: Optional[torch.optim.Optimizer] = None, seed: int = 0) -> None:
        """Re-form the groups by balanced k-means on the current W1 (and W3) rows (SSD-style
        re-clustering).

        The dense function is unchanged: the units are only permuted. Every tensor of
        ``optimizer``'s state shaped like an expert weight is permuted alike (AdamW is elementwise,
        so its trajectory is unchanged); the router restarts at the new groups' mean gate rows with
        fresh optimizer state. FSDP2-sharded (DTensor) weights are gathered, and every rank computes
        the same clustering from the same values.
        """
        H, D, G, Hg = self.hidden_dim, self.dim, self.num_groups, self.group_dim
        gated = self.activation == "swiglu"
        # The float32 values: an optimizer keeping float32 masters of bf16 weights
        # (training.optim.MasterAdamW) holds them in its state, and the clustering and the router
        # must not see the rounding.
        states = {
            p: optimizer.state.get(p, {}) if optimizer is not None else {}
            for p in self.experts.parameters()
        }
        value = lambda p: full_tensor(states[p].get("master", p))  # noqa: E731
        w1 = value(self.experts.w1).reshape(H, D)
        order = cluster_neurons(
            w1,
            value(self.experts.w3).reshape(H, D) if gated else None,
            G,
            self.cfg.kmeans_iters,
            seed,
        )

        def rows(t):  # [G, Hg, D] grouped rows -> regrouped
            return t.reshape(H, D)[order].view(G, Hg, D)

        def cols(t):  # [G, D, Hg] grouped columns -> regrouped
            return t.permute(1, 0, 2).reshape(D, H)[:, order].reshape(D, G, Hg).permute(1, 0, 2)

        weights = [(self.experts.w1, rows), (self.experts.w2, cols)] + (
            [(self.experts.w3, rows)] if gated else []
        )
        for p, regroup in weights:
            for t in [p] + [
                v for v in states[p].values() if torch.is_tensor(v) and v.shape == p.shape
            ]:
                _assign(t, regroup(full_tensor(t)))
        self.neuron_index.copy_(self.neuron_index[order])
        _assign(
            self.router.weight, value(self.experts.w1).float().mean(1).to(self.router.weight.dtype)
        )
        if optimizer is not None:
            # moments of the old groups mean nothing now
            optimizer.state.pop(self.router.weight, None)

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(w1 [H, D], w2 [D, H], w3 [H, D] or None) in the dense FFN's original unit order
        (differentiable)."""
        H, D = self.hidden_dim, self.dim
        inv = torch.argsort(self.neuron_index)
        w1 = self.experts.w1.reshape(H, D)[inv]
        w2 = self.experts.w2.permute(1, 0, 2).reshape(D, H)[:, inv]
        w3 = self.experts.w3.reshape(H, D)[inv] if self.activation == "swiglu" else None
        return w1, w2, w3

    # -- schedule ----------------------------------------------------------------------------------
    def set_step(
        self, step: int, total_steps: int, optimizer: Optional[torch.optim.Optimizer] = None
    ) -> str:
        """Set the mode for training step ``step`` of ``total_steps``; returns the phase
        (neuron_schedule).

        With ``recluster``, the first step after a non-empty warm-up re-clusters first
        (``optimizer``'s state is permuted with the weights: pass it whenever there is one).
        """
        c = self.cfg
        phase = neuron_phase(
            step, total_steps, c.warmup_fraction, c.sparse_ratio, c.finish_fraction
        )
        self.sparse = phase == "sparse"
        warm = phase_bounds(total_steps, c.warmup_fraction, c.finish_fraction)[0]
        if c.recluster and warm > 0 and step == warm:
            self.recluster(optimizer)
        return phase

    # -- forward -----------------------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> float32 logits [T, G]; input detached (see module docstring), autocast off;
        bf16 / fp16 CUDA inputs take the GEMM with bf16 products and float32 accumulation
        (kernels.router_matmul)."""
        with torch.autocast(x.device.type, enabled=False):
            return router_matmul(x.detach(), self.router.weight, self.cfg.low_precision_router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_width("NeuronRoutedFFN", x, self.dim)
        shape = x.shape
        x2 = x.reshape(-1, self.dim)
        # the groups read the autocast copy
        xr, x2 = routing_inputs(x2, self.cfg.low_precision_router)
        logits = self.router_logits(xr)
        if self.sparse:
            y = self._sparse(x2, logits)
        else:
            y = self._dense(x2, logits)
        return y.reshape(shape)

    def _dense(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        G, Hg, H, D = self.num_groups, self.group_dim, self.hidden_dim, self.dim
        w3 = self.experts.w3.reshape(H, D) if self.activation == "swiglu" else None
        h = expert_hidden(x, self.experts.w1.reshape(H, D), w3, self.activation)  # [T, H]
        y = torch.einsum("tgh,gdh->td", h.view(-1, G, Hg), self.experts.w2.to(h.dtype))
        # per-group L1 mass [T, G] in float32 from one read of h (on CUDA the reduction takes bf16
        # in, float32 out: no float32 copy of the [T, H] hidden state, as .float().abs().sum() made)
        mass = torch.linalg.vector_norm(
            h.detach().view(-1, G, Hg), ord=1, dim=-1, dtype=torch.float32
        )
        self._record_dense(mass, logits)
        return y

    def _sparse(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        indices = logits.topk(self.top_k_groups, dim=-1).indices  # [T, K]
        plan = make_plan(indices, self.num_groups)
        y = run_plan(x, plan, None, self.experts, self.backend(x.device) == "grouped")
        # Zero, but through the router: its weight then gets a (zero) gradient every step, as
        # data-parallel wrappers that expect every parameter to take part in the backward require.
        self.aux_loss = logits.sum() * 0.0
        # torch.full is a fill kernel; torch.tensor(float, device=cuda) would be a host copy that
        # syncs
        self.stats = {
            "active_frac": torch.full((), self.top_k_groups / self.num_groups, device=x.device),
            "tokens_per_group": plan.counts.float(),
        }
        return y

    def _record_dense(self, mass: torch.Tensor, logits: torch.Tensor) -> None:
        """mass [T, G] (per-group |activation| sums, detached), logits [T, G] -> aux_loss and
        stats."""
        target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-12)
        logp = F.log_softmax(logits, dim=-1)
        if self.cfg.router_loss == "ce":
            loss = F.kl_div(logp, target, reduction="batchmean")
        else:
            loss = (logp.exp() - target).square().sum(-1).mean()
        self.aux_loss = self.cfg.router_loss_coef * loss
        K = self.top_k_groups
        pred = logits.detach().topk(K, dim=-1).indices
        hit = torch.zeros_like(target, dtype=torch.bool).scatter_(
            1, target.topk(K, dim=-1).indices, True
        )
        self.router_stats = {
            "router_loss": loss.detach(),
            "recall": hit.gather(1, pred).float().mean(),
            "mass_captured": target.gather(1, pred).sum(-1).mean(),
        }
        self.stats = {"active_frac": torch.ones((), device=mass.device), **self.router_stats}


def neuron_modules(model: nn.Module) -> list[NeuronRoutedFFN]:
    return [m for m in model.modules() if isinstance(m, NeuronRoutedFFN)]


def neuron_schedule_step(
    model: nn.Module, step: int, total_steps: int, optimizer: Optional[torch.optim.Optimizer] = None
) -> Optional[str]:
    """Set the mode of every NeuronRoutedFFN of ``model`` for training step ``step`` (0-based) of
    ``total_steps``; call once per step before the forward. Returns the phase of the first such
    layer ("warmup", "sparse", "dense" or "finish"; see layers.neuron.schedule), None when there is
    none. Pass the ``optimizer``: layers with ``recluster`` permute its state when they re-cluster.
    """
    phases = [m.set_step(step, total_steps, optimizer) for m in neuron_modules(model)]
    return phases[0] if phases else None


def neuron_stats(model: nn.Module) -> dict:
    """Scalars averaged over the NeuronRoutedFFN layers, as ``neuron/<name>`` (for logging):
    ``active_frac`` of the last forward; ``router_loss``, ``recall``, ``mass_captured`` of the last
    dense forward.
    """
    out: dict = {}
    for name in ("active_frac", "router_loss", "recall", "mass_captured"):
        src = "stats" if name == "active_frac" else "router_stats"
        vals = [
            getattr(m, src)[name].float() for m in neuron_modules(model) if name in getattr(m, src)
        ]
        if vals:
            out[f"neuron/{name}"] = (
                torch.stack([v.to(vals[0].device) for v in vals]).mean().detach()
            )
    return out


class NeuronSchedule:
    """The NeuronRoutedFFN layers of a model as one sparsity method (layers.sparsity_method): each
    step's phase before its forward (``neuron_schedule_step``), their stats and phase as metrics."""

    PHASES = ("warmup", "sparse", "dense", "finish")

    skips_on_device = True  # nothing to do after a step (layers.sparsity_method)

    def __init__(
        self, model: nn.Module, total_steps: int, optimizer: Optional[torch.optim.Optimizer] = None
    ):
        self.model, self.total_steps, self.optimizer = model, total_steps, optimizer
        self.phase: Optional[str] = None

    def before_step(self, step: int) -> None:
        self.phase = neuron_schedule_step(self.model, step, self.total_steps, self.optimizer)

    def after_optimizer_step(self, step: int, applied: Optional[torch.Tensor] = None) -> None:
        pass

    def skipped_step(self) -> None:
        pass

    def metrics(self) -> dict:
        return neuron_stats(self.model) if self.phase is not None else {}
