"""Weight-level dynamic sparse training: ``DynamicSparsity`` (RigL, SET, magnitude) on any
nn.Module.

Papers: RigL (Evci et al. 2020, google-research/rigl), SET (Mocanu et al. 2018), ERK densities
(RigL), cosine drop fraction (RigL), transposable 2:4 (Hu et al. ICML'24). Mask selection lives in
``masks``, the schedule in ``schedule``, targets in ``targets``, 1-bit packing in ``bits``, the
optional 2:4 kernel path in ``semi_structured``, the bytes each option costs in ``costs``.

Usage (the training loop in training/loop.py does exactly this)::

    dst = DynamicSparsity(model, optimizer, sparsity=0.8, method="rigl", total_steps=10_000)
    # or DynamicSparsity(model, optimizer, cfg=cfg.dst, total_steps=cfg.train.steps,
    #                    update_every=50)
    for step in range(total_steps):
        loss.backward(); optimizer.step()
        dst.step(step)          # re-apply masks, update them on schedule, clean optimizer moments
        optimizer.zero_grad()
        log(dst.stats())

Targets (``layers.dst.targets``): by default every nn.Linear weight and stacked-expert weight except
embeddings, the output head and routers, on any model; or the parameters named by ``include``
patterns. A weight ``[out, in]`` is one slice; stacked MoE experts ``[E, out, in]`` are E slices,
each with its own top-k at the layer's density.

Masks are bool buffers registered beside their parameter (``<param>_mask``; ``<param>_ever`` marks
weights ever active; ``<param>_score`` holds the EMA grow score when ``grad_ema`` is set), so they
are in ``model.state_dict()`` and travel with checkpoints: create DynamicSparsity before loading a
checkpoint into the model, and a resumed run continues bit-exactly.

``compact_state``: mask and ever-active are uint8 buffers packed 8 per byte along the weight's last
dim, the EMA score is bf16, and the optimizer (``training.optim.CompactAdamW``, reached by duck
typing: ``set_compact`` / ``compact_remap``) keeps AdamW moments for the active entries only and
never moves inactive weights, so ``step()`` skips the per-step re-mask; at an update DST zeroes
pruned weights and the optimizer moves kept moments to their new slots (grown start at 0, pruned are
dropped).

Dense gradients for RigL: masks are applied to the weights (stored dense, inactive entries exactly
zero), never to the gradients, so after backward ``p.grad`` holds dL/dW at every position, active or
not, and the grow score is available with no extra pass or hook. During ``optimizer.step()``
inactive weights therefore move; ``step()`` zeroes them right after (one pass over the masked
weights: 9 bytes per fp32 weight), so inactive weights are exactly zero between steps. At an update,
weights newly grown or pruned get value 0 and every optimizer state of parameter shape (AdamW
``exp_avg``, ``exp_avg_sq``, SGD ``momentum_buffer``) is zeroed there; a weight dropped and regrown
in the same update keeps its value and moments (RigL). Between updates the states of inactive
weights are not maintained (an elementwise optimizer never lets them reach an active weight: they
are zeroed on growth), which keeps the per-step cost to the weight pass. Gradient clipping sees the
dense gradient. AdamW's per-tensor step count is not reset, so a grown weight's first update uses
the tensor's bias correction.

Distributed: all ranks must derive identical masks. |W| is replicated under data parallelism; the
grow score (|grad| or its EMA) is all-reduced over ``process_group`` (default: the world, when
initialised) for plain tensors; SET draws come from a generator seeded by (seed, step, layer).
DTensor parameters (FSDP2 ``fully_shard``, sharded on dim 0) are gathered with ``full_tensor()`` one
layer at a time at update steps, so the per-layer / per-expert top-k is exact; each rank keeps its
shard of the new mask, and mask buffers are DTensors with the parameter's placements (sharded like
it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from moezoo.configs import ConfigError, DSTConfig

from ..sharding import DTensor, full_tensor, local_tensor, shard_like
from .bits import pack_bits, unpack_bits
from .masks import (
    block_expand,
    block_of,
    block_pool,
    erk_densities,
    nm_select,
    nm_update,
    rigl_update,
    topk_mask,
    transposable_nm_select,
)
from .schedule import DSTSchedule
from .targets import Target, dst_parameters


def resolve_config(cfg: Optional[DSTConfig], overrides: dict) -> DSTConfig:
    """``cfg`` (default ``DSTConfig()``) with keyword ``overrides`` of its fields, enabled and
    validated."""
    names = {f.name for f in dataclasses.fields(DSTConfig)} - {"enabled"}
    for k in overrides:
        if k not in names:
            raise ConfigError(f"dst.{k}", f"unknown option; options are {', '.join(sorted(names))}")
    cfg = dataclasses.replace(cfg if cfg is not None else DSTConfig(), enabled=True, **overrides)
    cfg.validate("dst")
    return cfg


class DynamicSparsity:
    """Masks chosen weights of ``model`` and evolves the masks during training.

    ``cfg``: a ``configs.DSTConfig`` (default: its defaults); keyword ``overrides`` replace any of
    its fields (``DynamicSparsity(model, opt, sparsity=0.9, method="set")``), so each option and its
    default is declared once, in ``DSTConfig``. ``total_steps``: the run's length, needed only by
    schedules written in fractions of it (``stop_fraction < 1``, cosine drop / sparsity schedules,
    ``dense_finish``; a ``ConfigError`` on ``dst.total_steps`` says so). ``process_group``: for the
    score all-reduce (default the world group when initialised). A bad value raises ``ConfigError``
    naming ``dst.<key>`` before any mask is computed.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        cfg: Optional[DSTConfig] = None,
        total_steps: Optional[int] = None,
        process_group=None,
        **overrides,
    ):
        cfg = resolve_config(cfg, overrides)
        if cfg.compact_state and not callable(getattr(optimizer, "set_compact", None)):
            raise ConfigError(
                "dst.compact_state",
                f"needs an optimizer that keeps state for active weights only "
                f"(training.optim.CompactAdamW), got {type(optimizer).__name__}",
            )
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module  # parameter names without "module."
        model = getattr(model, "_orig_mod", model)  # torch.compile wrapper: no "_orig_mod."
        self.cfg, self.model, self.optimizer, self.group = cfg, model, optimizer, process_group
        self.schedule = DSTSchedule.from_config(cfg, total_steps)
        self.targets = self._find_targets()
        if cfg.semi_structured:
            from .semi_structured import check_semi_structured_device

            check_semi_structured_device(self.targets[0].param().device)
        for s in {self.schedule.sparsity_at(0), cfg.sparsity}:
            self._counts(s)  # infeasible densities fail here, before work
        self.last_flip_rate = 0.0
        self._dense = False
        self._last_step = 0
        self._init_masks()
        if cfg.semi_structured:
            from .semi_structured import enable_semi_structured

            self.semi_structured = enable_semi_structured(self.targets, cfg.transposable)
        else:
            self.semi_structured = []

    @classmethod
    def from_config(
        cls,
        model: nn.Module,
        cfg: DSTConfig,
        optimizer=None,
        total_steps: Optional[int] = None,
        process_group=None,
    ) -> DynamicSparsity:
        return cls(model, optimizer, cfg=cfg, total_steps=total_steps, process_group=process_group)

    # ---- setup ----------------------------------------------------------------------------------

    def _find_targets(self) -> list[Target]:
        cfg = self.cfg
        out = [
            Target.of(self.model, name, p)
            for name, p in dst_parameters(self.model, cfg.include, cfg.exclude)
        ]
        if not out:
            what = (
                "the default (nn.Linear weights, expert stacks)"
                if cfg.include is None
                else f"patterns {list(cfg.include)}"
            )
            raise ConfigError(
                "dst.include",
                f"{what} minus exclude {list(cfg.exclude)} match no parameter of 2 or more dims",
            )
        for t in out:
            _, R, C = t.shape
            if cfg.granularity == "block" and (R % cfg.block[0] or C % cfg.block[1]):
                raise ConfigError(
                    "dst.block", f"block {list(cfg.block)} does not divide {t.name} ({R} x {C})"
                )
            if cfg.granularity == "nm" and (C % cfg.m or (cfg.transposable and R % cfg.m)):
                raise ConfigError("dst.m", f"m={cfg.m} does not divide {t.name} ({R} x {C})")
        return out

    def _units(self, t: Target) -> int:
        """Maskable units per slice: elements, or blocks for granularity=block."""
        _, R, C = t.shape
        if self.cfg.granularity == "block":
            return (R // self.cfg.block[0]) * (C // self.cfg.block[1])
        return R * C

    def densities(self, sparsity: float) -> list[float]:
        """Per-target density for a global sparsity (uniform, or ERK solved to hit it exactly)."""
        if self.cfg.granularity == "nm":
            return [self.cfg.n / self.cfg.m] * len(self.targets)
        if self.cfg.distribution == "uniform":
            return [1.0 - sparsity] * len(self.targets)
        return erk_densities([t.shape for t in self.targets], 1.0 - sparsity, self.cfg.erk_power)

    def _counts(self, sparsity: float) -> list[int]:
        """Active units per slice of each target; raises ConfigError if a layer would have none."""
        ks = [round(d * self._units(t)) for d, t in zip(self.densities(sparsity), self.targets)]
        for k, t in zip(ks, self.targets):
            if k < 1:
                raise ConfigError(
                    "dst.sparsity",
                    f"sparsity {sparsity:g} ({self.cfg.distribution}) leaves "
                    f"{t.name} with no active weights",
                )
        return ks

    @torch.no_grad()
    def _init_masks(self) -> None:
        """Initial masks: the largest |W| at the step-0 density (random-like at a random init, and
        the magnitude-pruned network when starting from trained weights). Registered as buffers."""
        cfg, ks = self.cfg, self._counts(self.schedule.sparsity_at(0))
        for t, k in zip(self.targets, ks):
            p = t.param()
            for kind in ("mask", "ever", "score"):
                if hasattr(t.module, f"{t.attr}_{kind}"):
                    raise ValueError(
                        f"{t.name}_{kind} already exists: DynamicSparsity was applied twice"
                    )
            W = full_tensor(p.detach()).reshape(t.shape).abs()
            if cfg.granularity == "nm":
                mask = (transposable_nm_select if cfg.transposable else nm_select)(W, cfg.n, cfg.m)
            elif cfg.granularity == "block":
                mask = block_expand(topk_mask(block_pool(W, cfg.block), k), t.shape, cfg.block)
            else:
                mask = topk_mask(W.reshape(t.shape[0], -1), k)
            mask = mask.reshape(p.shape)
            t.module.register_buffer(f"{t.attr}_mask", shard_like(self._stored(mask), p))
            t.module.register_buffer(f"{t.attr}_ever", shard_like(self._stored(mask), p))
            if cfg.grad_ema is not None:
                dtype = torch.bfloat16 if cfg.compact_state else torch.float32
                t.module.register_buffer(
                    f"{t.attr}_score",
                    shard_like(torch.zeros(p.shape, dtype=dtype, device=mask.device), p),
                )
        self._apply_masks(states=True)
        if cfg.compact_state:
            for t, cap in zip(self.targets, self._capacities()):
                self.optimizer.set_compact(t.param(), lambda t=t: local_tensor(t.buf("mask")), cap)

    # ---- mask storage: bool buffers, or bit-packed along the last dim (compact_state) ------------

    def _stored(self, mask: torch.Tensor) -> torch.Tensor:
        return (pack_bits(mask) if self.cfg.compact_state else mask.clone()).contiguous()

    def _mask(self, t: Target, kind: str = "mask", full: bool = False) -> torch.Tensor:
        """The ``mask`` / ``ever`` buffer as bool of the parameter's (local, or ``full``) shape."""
        b = full_tensor(t.buf(kind)) if full else local_tensor(t.buf(kind))
        return unpack_bits(b, t.param().shape[-1]) if self.cfg.compact_state else b

    def _write(self, t: Target, kind: str, local_mask: torch.Tensor) -> None:
        local_tensor(t.buf(kind)).copy_(
            pack_bits(local_mask) if self.cfg.compact_state else local_mask
        )

    def _capacities(self) -> list[int]:
        """Most active entries each target's compact optimizer state must hold on this rank: the
        exact count at the schedule's densest point, plus a margin for a sharded weight (its rows'
        share varies)."""
        area = self.cfg.block[0] * self.cfg.block[1] if self.cfg.granularity == "block" else 1
        ks = [
            max(a, b)
            for a, b in zip(
                self._counts(self.schedule.sparsity_at(0)), self._counts(self.cfg.sparsity)
            )
        ]
        out = []
        for t, k in zip(self.targets, ks):
            p, active = t.param(), t.shape[0] * k * area
            if isinstance(p, DTensor):
                n = math.prod(
                    p.device_mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard()
                )
                rows = p.shape[0]
                local = math.ceil(rows / n) * (t.numel // rows)
                active = min(local, math.ceil(1.1 * active / t.numel * local) + 64)
            out.append(active)
        return out

    def _follow_layout(self, t: Target) -> None:
        """If the parameter became a DTensor after DST was set up (fully_shard applied later), shard
        the buffers the same way."""
        p = t.param()
        if isinstance(p, DTensor):
            for kind in ("mask", "ever", "score"):
                b = t.buf(kind)
                if b is not None and not isinstance(b, DTensor):
                    t.module.register_buffer(f"{t.attr}_{kind}", shard_like(b.to(p.device), p))

    # ---- per step -------------------------------------------------------------------------------

    def _states(self, p: torch.Tensor) -> list[torch.Tensor]:
        """Optimizer state tensors of parameter shape (exp_avg, exp_avg_sq, momentum_buffer,
        ...)."""
        if self.optimizer is None:
            return []
        return [
            v
            for v in self.optimizer.state.get(p, {}).values()
            if torch.is_tensor(v) and v.shape == p.shape
        ]

    @torch.no_grad()
    def _apply_masks(self, states: bool = False) -> None:
        """Zero the inactive weights (and, with ``states``, their optimizer states)."""
        for t in self.targets:
            self._follow_layout(t)
            p, off = t.param(), self._mask(t).logical_not()
            for x in [p.detach(), *(self._states(p) if states else [])]:
                local_tensor(x).masked_fill_(off, 0)  # 12% faster than mul_ by a bool mask on H200

    @torch.no_grad()
    def step(self, step: int, applied: Optional[torch.Tensor] = None) -> None:
        """Call right after ``optimizer.step()`` of training step ``step`` (grads still present).
        ``applied``: a 0-dim float tensor, 1 if the step's update was applied, 0 if it was skipped
        on the device (see ``decides_on_host``: never at a mask update or the dense finish's first
        step)."""
        if step < self._last_step:  # a rollback reloaded earlier masks
            self._dense = False
        self._last_step = step
        if self.schedule.is_dense(step):
            if not self._dense:  # dense finish: masks become all ones
                for t in self.targets:
                    local_tensor(t.buf("mask")).fill_(True)
                    local_tensor(t.buf("ever")).fill_(True)
                if self.semi_structured:
                    from .semi_structured import disable_semi_structured

                    disable_semi_structured(self.targets)
                    self.semi_structured = []
                self._dense = True
            return
        if self.cfg.grad_ema is not None:  # S = a |g| + (1 - a) S = lerp(S, |g|, a)
            for t in self.targets:
                g = t.param().grad
                if g is not None:  # one layer's |g| temporary at a time
                    score = local_tensor(t.buf("score"))
                    g_abs = local_tensor(g).abs().to(score.dtype)
                    if applied is None:
                        score.lerp_(g_abs, self.cfg.grad_ema)
                    else:  # a skipped step's gradient (maybe NaN) leaves S as it is
                        score.copy_(
                            torch.where(
                                applied > 0, torch.lerp(score, g_abs, self.cfg.grad_ema), score
                            )
                        )
        if self.schedule.is_update(step):
            self._update(step)
        if not self.cfg.compact_state:  # CompactAdamW never moves inactive weights
            self._apply_masks()

    def _grow_score(self, t: Target, i: int, step: int, like: torch.Tensor) -> torch.Tensor:
        """Full-size grow score: |grad| or its EMA (RigL, all-reduced so ranks agree), or uniform
        random (SET, and magnitude when the density rises) from a generator seeded by (seed, step,
        layer)."""
        if self.cfg.method == "rigl":
            p = t.param()
            if self.cfg.grad_ema is not None:
                src = t.buf("score")
            elif p.grad is not None:
                src = p.grad
            else:
                raise RuntimeError(
                    f"DST RigL update at step {step}: {t.name} has no .grad; call dst.step(step) "
                    "after optimizer.step() and before optimizer.zero_grad()"
                )
            score = full_tensor(src).float()
            if (
                not isinstance(src, DTensor)
                and dist.is_available()
                and dist.is_initialized()
                and dist.get_world_size(self.group) > 1
            ):
                # the gradient is summed before |.| (a sum ranks like the DDP mean); EMA scores are
                # summed as they are: sum_r EMA(|g_r|) = EMA(sum_r |g_r|)
                score = score.clone() if score is src else score.contiguous()
                dist.all_reduce(score, group=self.group)
            score = score.abs()
            return score
        gen = torch.Generator(device=like.device)
        gen.manual_seed(((self.cfg.seed * 1_000_003 + step) * 1_009 + i) % (2**63))
        return torch.rand(like.shape, generator=gen, device=like.device)

    @torch.no_grad()
    def _update(self, step: int) -> None:
        cfg = self.cfg
        frac = 0.0 if cfg.method == "magnitude" else self.schedule.drop_fraction_at(step)
        ks = self._counts(self.schedule.sparsity_at(step))
        changed, total = [], 0
        for i, (t, k) in enumerate(zip(self.targets, ks)):
            p = t.param()
            W = full_tensor(p.detach()).reshape(t.shape).abs()
            old = self._mask(t, full=True).reshape(t.shape)
            grow = self._grow_score(t, i, step, W).reshape(t.shape)
            if cfg.granularity == "nm":
                new = nm_update(old, W, grow, cfg.n, cfg.m, frac, cfg.transposable)
            elif cfg.granularity == "block":
                new_b = rigl_update(
                    block_of(old, cfg.block),
                    block_pool(W, cfg.block),
                    block_pool(grow, cfg.block),
                    k,
                    frac,
                )
                new = block_expand(new_b, t.shape, cfg.block)
            else:
                S = t.shape[0]
                new = rigl_update(
                    old.reshape(S, -1), W.reshape(S, -1), grow.reshape(S, -1), k, frac
                )
            new = new.reshape(p.shape)
            changed.append((old.reshape(p.shape) != new).sum())  # summed on device, read once below
            total += t.numel
            new_local = local_tensor(shard_like(new, p))
            stay = self._mask(t) & new_local  # grown and pruned: value 0, moments 0
            off = stay.logical_not()
            for x in [p.detach(), *self._states(p)]:
                local_tensor(x).masked_fill_(off, 0)
            self._write(t, "ever", self._mask(t, "ever") | new_local)
            self._write(t, "mask", new_local)
            if self.cfg.compact_state:  # kept moments move, grown start at 0, pruned go
                self.optimizer.compact_remap(p)
        self.last_flip_rate = int(torch.stack(changed).sum()) / total

    # ---- the trainer's sparsity-method protocol (layers.sparsity_method) -------------------------
    skips_on_device = True  # but for the steps decides_on_host names

    def decides_on_host(self, step: int) -> bool:
        """The steps whose work depends on whether the step was applied, decided on the host: a mask
        update (RigL grows by this step's gradients) and the first step of the dense finish."""
        return self.schedule.is_update(step) or (self.schedule.is_dense(step) and not self._dense)

    def before_step(self, step: int) -> None:
        pass

    def after_optimizer_step(self, step: int, applied: Optional[torch.Tensor] = None) -> None:
        self.step(step, applied)

    def skipped_step(self) -> None:
        pass

    def metrics(self) -> dict:
        return {f"dst/{k}": v for k, v in self.stats().items()}

    # ---- logging --------------------------------------------------------------------------------

    @torch.no_grad()
    def stats(self) -> dict:
        """Scalars for logging (the trainer prefixes ``dst/``): ``density`` (global),
        ``density/<param>`` per layer, ``flip_rate`` (share of mask entries changed by the last
        update), ``ever_active`` (share of maskable weights active at some point: the in-time
        over-parameterisation rate) and ``target_sparsity``. One host sync."""
        count = (
            (lambda t, k: self._mask(t, k, full=True).sum())
            if self.cfg.compact_state
            else (lambda t, k: full_tensor(t.buf(k).sum()))
        )
        counts = torch.stack([count(t, k) for t in self.targets for k in ("mask", "ever")]).tolist()
        active, ever = counts[0::2], counts[1::2]
        total = sum(t.numel for t in self.targets)
        out = {
            "density": sum(active) / total,
            "ever_active": sum(ever) / total,
            "flip_rate": self.last_flip_rate,
            "target_sparsity": self.target_sparsity(),
        }
        for t, c in zip(self.targets, active):
            out[f"density/{t.name}"] = c / t.numel
        return out

    def target_sparsity(self) -> float:
        """The scheduled global sparsity in force after the last ``step()`` (it changes at updates
        only)."""
        if self._dense:
            return 0.0
        s = self.schedule
        last = (min(self._last_step, s.stop_step) // s.update_every) * s.update_every
        return s.sparsity_at(max(last, 0))
