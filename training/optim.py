"""AdamW with decoupled weight decay on matrices only, and the lr schedule (warm-up, then cosine
or warmup-stable-decay; re-planned when a resumed run is extended); ``CompactAdamW``: the same
AdamW keeping DST-masked weights' moments for their active entries only; ``MasterAdamW``: the
same AdamW for a model whose matmul weights are held in bfloat16, with their float32 master copies
in the optimizer (``train.param_dtype: bfloat16``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from moezoo.configs import ConfigError, OptimConfig
from moezoo.kernels.adamw import adamw_
from moezoo.layers.dst.bits import unpack_bits
from moezoo.layers.moe.experts import GroupedExperts
from moezoo.layers.sharding import DTensor, local_tensor


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    device_type: str = "cpu",
    compact: bool = False,
    param_dtype: str = "float32",
    grad_accum: int = 1,
) -> torch.optim.Optimizer:
    """Weight decay on >= 2-D parameters (linears, embeddings, stacked experts); none on norms and
    biases. ``compact``: a ``CompactAdamW`` (for ``dst.compact_state``). ``param_dtype="bfloat16"``:
    a ``MasterAdamW``, which turns the model's ``autocast_weights`` into bfloat16 (in place) and
    keeps their float32 masters (and sums their gradients in float32 when ``grad_accum > 1``). Else
    torch's AdamW, fused or foreach as ``cfg.implementation`` says (auto: fused on CUDA, where it is
    one launch for all parameters; foreach on CPU, the faster one there)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if param_dtype == "bfloat16":
        return MasterAdamW(
            groups,
            autocast_weights(model),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            accumulate_float32=grad_accum > 1,
        )
    fused = device_type == "cuda" if cfg.implementation == "auto" else cfg.implementation == "fused"
    cls = CompactAdamW if compact else torch.optim.AdamW
    return cls(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


# ---- learning-rate schedule ----------------------------------------------------------------------
# A schedule is a list of pieces {"start", "end", "from", "to", "shape"}: the lr goes from "from" at
# step "start" to "to" at step "end" (shape linear or cosine) and holds "to" after it; at a step the
# last piece starting at or before it gives the lr. Pieces are JSON, so a checkpoint holds the
# schedule itself and a resumed run follows it bit for bit, and an extended run keeps the pieces it
# has trained through and plans only the steps ahead (extend_schedule).


def schedule_targets(cfg: OptimConfig, total_steps: int, init_from: bool = False) -> dict:
    """What a schedule is planned from: shape, peak lr, floor, warm-up steps, wsd's decay fraction
    and the run's length. A resumed run whose targets differ from its checkpoint's re-plans the
    steps ahead (``optim.extend``). ``init_from``: a run starting from pretrained weights, which is
    continued training: ``optim.init_from_lr`` (default ``lr * min_lr_ratio``, where a run of this
    config ends) and ``optim.init_from_warmup_steps`` (default ``warmup_steps // 10``)."""
    lr, warmup = cfg.lr, cfg.warmup_steps
    if init_from:
        lr = cfg.lr * cfg.min_lr_ratio if cfg.init_from_lr is None else cfg.init_from_lr
        warmup = cfg.init_from_warmup_steps
        warmup = cfg.warmup_steps // 10 if warmup is None else warmup
    return {
        "schedule": cfg.schedule,
        "lr": lr,
        "floor": lr * cfg.min_lr_ratio,
        "warmup": warmup,
        "decay_fraction": cfg.decay_fraction if cfg.schedule == "wsd" else None,
        "steps": total_steps,
    }


def _piece(start: int, end: int, lr0: float, lr1: float, shape: str = "linear") -> dict:
    return {"start": start, "end": end, "from": lr0, "to": lr1, "shape": shape}


def _decay(t: dict, start: int, lr: float) -> list[dict]:
    """From ``lr`` at step ``start`` to the floor at ``t["steps"]``: a cosine, or for wsd flat at
    ``lr`` until the last ``decay_fraction`` of the steps, then linear (at once when ``start`` is
    already inside them). Never above ``lr``."""
    end, floor = t["steps"], min(t["floor"], lr)
    if floor == lr:
        return [_piece(start, max(end, start + 1), lr, lr)]
    if t["schedule"] == "cosine":
        return [_piece(start, max(end, start + 1), lr, floor, "cosine")]
    decay_start = max(start, end - max(1, round(t["decay_fraction"] * end)))
    flat = [_piece(start, decay_start, lr, lr)] if decay_start > start else []
    return flat + [_piece(decay_start, max(end, decay_start + 1), lr, floor)]


def plan_schedule(t: dict) -> list[dict]:
    """A fresh run's pieces: linear warm-up from ``lr / warmup`` to ``lr`` over ``warmup`` steps
    (at most all but the last step), then ``_decay`` from ``lr`` to the floor."""
    warmup = min(t["warmup"], max(t["steps"] - 1, 0))
    ramp = [_piece(0, warmup, t["lr"] / warmup, t["lr"])] if warmup else []
    return ramp + _decay(t, warmup, t["lr"])


def extend_schedule(pieces: list[dict], step: int, lr_now: float, t: dict, mode: str) -> list[dict]:
    """Re-plan the steps from ``step`` on for targets ``t`` (a resumed run whose length or schedule
    keys changed), keeping the pieces it has trained through. ``lr_now``: the lr the checkpoint
    reached (its next step's).

    ``continue``: never above ``lr_now`` (only a warm-up still under way goes on rising: the fresh
    plan for ``t`` then). A cosine decays from ``lr_now`` to the floor over the remaining steps,
    so a finished run holds the floor; wsd holds ``lr_now`` and decays over the last
    ``decay_fraction`` of the new length, so a run extended while stable keeps training at its lr
    and its decay moves to the new end. ``rewarm``: linear from ``lr_now`` to the peak over
    ``warmup`` steps, then the shape's decay from the peak."""
    if mode == "continue" and _warming(pieces, step) and step < min(t["warmup"], t["steps"] - 1):
        return plan_schedule(t)
    kept = [p for p in pieces if p["start"] < step]
    if mode == "rewarm":
        warmup = min(t["warmup"], max(t["steps"] - step - 1, 0))
        ramp = [_piece(step, step + warmup, lr_now, t["lr"])] if warmup else []
        return kept + ramp + _decay(t, step + warmup, t["lr"])
    return kept + _decay(t, step, lr_now)


def _active(pieces: list[dict], step: int) -> dict:
    return next((p for p in reversed(pieces) if p["start"] <= step), pieces[0])


def _warming(pieces: list[dict], step: int) -> bool:
    """Whether ``step`` is inside the schedule's first warm-up (not one a short run cut off)."""
    p = _active(pieces, step)
    return p["start"] == 0 and p["to"] > p["from"] and step < p["end"]


def lr_at(pieces: list[dict], step: int) -> float:
    p = _active(pieces, step)
    frac = min(max((step - p["start"]) / (p["end"] - p["start"]), 0.0), 1.0)
    if p["shape"] == "cosine":
        return p["to"] + (p["from"] - p["to"]) * (1 + math.cos(math.pi * frac)) / 2
    return p["from"] + (p["to"] - p["from"]) * frac


def describe_schedule(pieces: list[dict], step: int) -> str:
    """The lr from ``step`` on, in words: ``3.00e-04 at step 600, cosine to 3.00e-05 at 1200``."""
    out = [f"{lr_at(pieces, step):.2e} at step {step}"]
    ahead = [p for p in pieces if p["end"] > step]
    for i, p in enumerate(ahead):
        if i + 1 < len(ahead) and ahead[i + 1]["start"] <= step:
            continue  # shadowed by a later piece
        if p["from"] == p["to"]:
            out.append(f"flat to {p['end']}")
        else:
            out.append(f"{p['shape']} to {p['to']:.2e} at {p['end']}")
    return ", ".join(out)


class Schedule:
    """The lr of every param group as a function of the step (pieces, above): ``step()`` after
    each optimizer step sets the next step's lr, as torch's schedulers do (and, as they do, each
    group's ``initial_lr`` keeps the lr it was built with). ``state_dict()`` is JSON: the pieces,
    the targets they were planned from and the step."""

    def __init__(self, optimizer, pieces: list[dict], targets: dict, step: int = 0):
        self.optimizer, self.pieces, self.targets, self.last_step = optimizer, pieces, targets, step
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self._apply()

    def _apply(self) -> None:
        lr = lr_at(self.pieces, self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"pieces": self.pieces, "targets": self.targets, "step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.pieces, self.targets = state["pieces"], state["targets"]
        self.last_step = state["step"]
        self._apply()


def build_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, init_from: bool = False
) -> Schedule:
    """A fresh run's schedule (``optim.schedule``): cosine = linear warm-up from lr/warmup to lr
    over ``warmup_steps``, then cosine to ``lr * min_lr_ratio``; wsd = the same warm-up, flat at
    lr, linear to the floor over the last ``decay_fraction`` of the steps."""
    targets = schedule_targets(cfg, total_steps, init_from)
    return Schedule(opt, plan_schedule(targets), targets)


def autocast_weights(model: nn.Module) -> list[nn.Parameter]:
    """The parameters bf16 autocast casts at every use: the weights (and biases) of ``nn.Linear``
    modules and the grouped experts' weights. Not the embedding (a lookup: autocast leaves it, and
    the residual stream, in float32), nor the norms, nor a layer's ``float32_children`` (children it
    reads with autocast off: the MoE router and its noise, the neuron router), nor a weight tied to
    any of those."""
    keep: set[int] = set()
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            keep.update(id(p) for p in m.parameters())
        for name in getattr(m, "float32_children", ()):
            child = getattr(m, name, None)
            if child is not None:
                keep.update(id(p) for p in child.parameters())
    out, seen = [], set()
    for m in model.modules():
        if isinstance(m, (nn.Linear, GroupedExperts)):
            for p in m.parameters(recurse=False):
                if p.requires_grad and id(p) not in keep and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's update and state) for a model whose ``low_precision`` parameters
    are held in bfloat16, with their float32 master weights in the optimizer state, as Megatron-LM
    and FSDP2's mixed precision keep them (``train.param_dtype: bfloat16`` on one process).

    Construction turns each ``low_precision`` parameter (float32) into bfloat16 in place: its
    float32 data becomes ``state[p]["master"]`` and ``p.data`` its rounded copy. Then forward and
    backward run on the bf16 weights and leave bf16 gradients, where bf16 autocast on float32
    parameters would cast each weight to bf16 at every use and each bf16 weight gradient back to
    float32: the same numbers reach the GEMMs and the update (over micro-batches too, with
    ``accumulate_float32``), without those casts. ``step()`` updates the masters (float32 moments,
    as torch's AdamW) and writes the bf16 copies in the same pass (``kernels.adamw``);
    ``step(grad_scale=c)`` multiplies every gradient by ``c`` on the fly (gradient clipping without
    a pass of its own). Other parameters (embedding, norms, routers) stay float32 and take the same
    update.

    State per parameter: ``step`` (a CPU float32 scalar), ``exp_avg``, ``exp_avg_sq`` and, for bf16
    parameters, ``master`` (all float32, made at construction so that DCP loads a checkpoint's state
    into them). Every state tensor of a parameter's shape is elementwise, so code that permutes or
    zeroes a weight's optimizer state with the weight (``layers.neuron`` re-clustering) keeps the
    master in step. A checkpoint's model entries hold the bf16 weights; its optimizer entries the
    float32 masters.

    ``accumulate_float32``: for several backward passes a step (gradient accumulation), each bf16
    gradient is added into a float32 sum as soon as autograd has written it (a post-accumulate-grad
    hook), and ``p.grad`` is left None: the sum autocast over float32 parameters would have made.
    ``gradient(p)`` is the gradient the step will use (that sum, else ``.grad``), for the norm;
    ``zero_grad()`` drops the sums.
    """

    scales_gradients = True  # step(grad_scale=) takes the clipping factor
    # A step skipped without the host reading its flag: ``found_inf`` (a scalar tensor, as
    # torch.amp.GradScaler sets it on torch's fused AdamW) makes the kernel write nothing; the step
    # counts, on the host, go back when the trainer reads the flag (``uncount_last_step``) before
    # the next step (training.loop.skips_on_device).
    skips_on_device = True
    found_inf: Optional[torch.Tensor] = None

    def __init__(
        self,
        params,
        low_precision,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        dtype: torch.dtype = torch.bfloat16,
        accumulate_float32: bool = False,
    ):
        self._low_ids = {id(p) for p in low_precision}
        self._dtype = dtype
        self._accumulate = accumulate_float32
        # bf16 parameter -> float32 gradient summed over this step's backwards
        self._sums: dict = {}
        # the states whose step counts the last step() with found_inf advanced
        self._counted: list = []
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.dtype != torch.float32:
                raise TypeError(f"MasterAdamW: parameters must start in float32, got {p.dtype}")
            if id(p) in self._low_ids:
                self.state[p]["master"] = p.data
                p.data = p.data.to(self._dtype)
                if self._accumulate:
                    p.register_post_accumulate_grad_hook(self._add_to_sum)
            self._init_state(p)

    def _add_to_sum(self, p: torch.Tensor) -> None:
        total = self._sums.get(p)
        if total is None:
            self._sums[p] = p.grad.float()
        else:
            total.add_(p.grad)
        p.grad = None

    def gradient(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient ``step()`` uses for ``p`` (None: no gradient this step)."""
        return self._sums.get(p, p.grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._sums.clear()

    def _init_state(self, p: torch.Tensor) -> None:
        """Fresh moments (at construction, or after a caller dropped ``state[p]``, as the neuron
        layers do for their router: a bf16 parameter's master then restarts from its bf16 value)."""
        state = self.state[p]
        if id(p) in self._low_ids and "master" not in state:
            state["master"] = p.detach().float()
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None, grad_scale: Optional[torch.Tensor] = None):
        """One AdamW step for every parameter with a gradient; ``grad_scale``: a float32 scalar
        tensor multiplying every gradient (the clipping factor)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf, self._counted = self.found_inf, []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            launches: dict = {}  # one kernels.adamw call per (step count, dtypes, device)
            for p in group["params"]:
                grad = self.gradient(p)
                if grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    self._init_state(p)
                state["step"] += 1  # a CPU scalar: no device sync
                if found_inf is not None:
                    self._counted.append(state)
                key = (int(state["step"].item()), grad.dtype, "master" in state, p.dtype, p.device)
                launches.setdefault(key, []).append((p, grad, state))
            for (step, _, low, _, _), items in launches.items():
                ps, grads, st = zip(*items)
                adamw_(
                    [s["master"] if low else p for s, p in zip(st, ps)],
                    list(grads),
                    [s["exp_avg"] for s in st],
                    [s["exp_avg_sq"] for s in st],
                    list(ps) if low else None,
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=step,
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                )
        return loss

    def uncount_last_step(self) -> None:
        """The last ``step()`` ran with a nonzero ``found_inf``: it wrote nothing, and its step
        counts go back."""
        for state in self._counted:
            state["step"] -= 1
        self._counted = []

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Make every bf16 parameter float32 again, with its master's values (for inference or
        export of a trained model; the optimizer is not usable for training afterwards)."""
        for p in self.state:
            if "master" in self.state[p]:
                p.data = self.state[p]["master"]

    def load_state_dict(self, state_dict) -> None:
        # torch casts loaded state to each parameter's dtype: with the masters standing in for the
        # bf16 parameters, everything loads as float32. Then the bf16 copies are rounded from the
        # loaded masters.
        low = [(p, p.data) for p in self.state if "master" in self.state[p]]
        for p, _ in low:
            p.data = self.state[p]["master"]
        try:
            super().load_state_dict(state_dict)
        finally:
            for p, data in low:
                master = self.state[p].get("master", p.data)
                self.state[p]["master"] = master
                p.data = data
                data.copy_(master)


class CompactAdamW(torch.optim.AdamW):
    """AdamW whose moments for DST-masked weights are held for the active entries only.

        ``layers.dst.DynamicSparsity(..., compact_state=True)`` registers each masked weight ``p``
        with ``set_compact(p, mask, capacity)``: ``mask()`` returns this rank's bit-packed mask
        (``layers.dst.bits``) and ``capacity`` the most entries ``p`` (this rank's shard) can have
        active. Then per step, for ``p``:

            # flat indices of the active entries (int32, rebuilt only when the mask buffer changes)
            idx = ...
            w_A = p[idx]; g_A = grad[idx]  # gathered into [capacity] leaves
            # the same fused/foreach kernel, with compact exp_avg / exp_avg_sq [capacity]
            AdamW on (w_A, g_A)
            p[idx] = w_A

    Persistent per active entry: the two fp32 moments and the int32 index (12 B). The leaves
    ``w_A``, ``g_A`` (8 B per active entry) exist only inside ``step()``: their storage is freed
    after it (as FSDP2 frees unsharded parameters), when the step's activations are gone already.

        Inactive weights are never touched, so they stay exactly zero and DST need not re-mask each
        step; ``p.grad`` stays dense (RigL grows by it, clipping sees it). Unmasked parameters take
        the plain AdamW path, bit for bit. At a mask update DST calls ``compact_remap(p)``: kept
        entries keep their moments, grown ones start at zero, pruned ones are dropped. State is
        plain tensors (DTensors ``[ranks x capacity]`` under FSDP2, one ``[capacity]`` block per
        rank) + the AdamW step, with fixed shapes, so DCP saves and restores it bit-exactly at the
        same world size.
    """

    @property
    def skips_on_device(self) -> bool:
        """Fused: ``found_inf`` (a scalar tensor) skips the step on the device for the dense and the
        compact parameters alike (training.loop.skips_on_device); the compact weights are written
        back unchanged."""
        return bool(self.defaults.get("fused"))

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self._compact: dict = {}  # param -> _Compact
        self._inner: Optional[torch.optim.AdamW] = None
        self._inner_group: dict = {}  # outer group index -> inner group index

    # ---- registration ---------------------------------------------------------------------------
    def set_compact(self, p: torch.Tensor, mask: Callable[[], torch.Tensor], capacity: int) -> None:
        if self.defaults.get("amsgrad"):
            raise ConfigError(
                "dst.compact_state",
                "CompactAdamW keeps no compact max_exp_avg_sq: needs amsgrad=False",
            )
        gi = next(i for i, g in enumerate(self.param_groups) if any(q is p for q in g["params"]))
        local = local_tensor(p)
        capacity = min(capacity, local.numel())
        if local.numel() >= 2**31:
            raise ConfigError(
                "dst.compact_state",
                f"int32 indices: a weight shard of {local.numel()} entries is too big",
            )
        leaf = _like_shards(torch.zeros(capacity, dtype=p.dtype, device=local.device), p)
        leaf.grad = _like_shards(torch.zeros(capacity, dtype=p.dtype, device=local.device), p)
        _free(leaf), _free(leaf.grad)
        c = _Compact(leaf, mask, p.shape[-1])
        self._compact[p] = c
        if self._inner is None:
            # hyperparameters are copied from the outer groups at every step (schedulers change lr
            # there)
            self._inner = torch.optim.AdamW(
                [leaf], fused=self.defaults.get("fused"), foreach=self.defaults.get("foreach")
            )
            self._inner_group[gi] = 0
        elif gi in self._inner_group:
            self._inner.param_groups[self._inner_group[gi]]["params"].append(leaf)
        else:
            self._inner.add_param_group({"params": [leaf]})
            self._inner_group[gi] = len(self._inner.param_groups) - 1
        self._index(c)
        old = self.state.pop(p, None)
        if old:  # dense moments from earlier steps: keep the active ones
            new = {"step": old["step"]}
            for name in ("exp_avg", "exp_avg_sq"):
                s = torch.zeros(capacity, dtype=old[name].dtype, device=local.device)
                s[: c.k] = local_tensor(old[name]).reshape(-1)[c.idx]
                new[name] = _like_shards(s, p)
            self._inner.state[leaf] = new
            self.state[p] = new

    def _index(self, c: _Compact) -> None:
        """Active indices from the mask buffer (a host sync: only after an update or a load)."""
        packed = c.mask()
        idx = unpack_bits(packed, c.cols).reshape(-1).nonzero().squeeze(1).to(torch.int32)
        cap = local_tensor(c.leaf).numel()
        if idx.numel() > cap:
            raise RuntimeError(
                f"compact DST state: {idx.numel()} active entries on this rank "
                f"exceed the capacity {cap} "
                "(a sharded weight's rows drew more active weights than the margin allows)"
            )
        c.idx, c.k, c.key = idx, idx.numel(), (id(packed), packed._version)

    def compact_remap(self, p: torch.Tensor) -> None:
        """After DST wrote ``p``'s new mask: move the moments to the new active set."""
        c = self._compact[p]
        old_idx, old_k = c.idx, c.k
        self._index(c)
        n = local_tensor(p).numel()
        for name in ("exp_avg", "exp_avg_sq"):
            s = self.state.get(p, {}).get(name)
            if s is None:
                continue
            s = local_tensor(s)
            dense = torch.zeros(n, dtype=s.dtype, device=s.device)  # one weight's worth, transient
            dense[old_idx] = s[:old_k]
            s.zero_()
            s[: c.k] = dense[c.idx]

    # ---- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden = {}
        for p, c in self._compact.items():
            if p.grad is None:
                c.leaf_grad, c.leaf.grad = c.leaf.grad, None
                continue
            if c.key != (id(packed := c.mask()), packed._version):
                self._index(c)  # the mask buffer was reloaded (checkpoint)
            lw, lg = _alloc(c.leaf), _alloc(c.leaf.grad)
            torch.index_select(local_tensor(p).reshape(-1), 0, c.idx, out=lw[: c.k])
            torch.index_select(local_tensor(p.grad).reshape(-1), 0, c.idx, out=lg[: c.k])
            lw[c.k :].zero_()  # padding: zero weight, grad, moments: stays zero
            lg[c.k :].zero_()
            hidden[p] = p.grad
            p.grad = None  # the dense AdamW below skips it
        try:
            super().step()
        finally:
            for p, g in hidden.items():
                p.grad = g
        if self._inner is not None and hidden:
            for gi, ii in self._inner_group.items():
                self._inner.param_groups[ii].update(
                    {k: v for k, v in self.param_groups[gi].items() if k != "params"}
                )
            self._inner.found_inf = getattr(self, "found_inf", None)
            self._inner.step()
        for p, c in self._compact.items():
            if p in hidden:
                local_tensor(p).view(-1).index_put_((c.idx,), local_tensor(c.leaf)[: c.k])
                _free(c.leaf), _free(c.leaf.grad)
                if self.state.get(p) is not self._inner.state.get(c.leaf):
                    # one dict: saved with the outer state
                    self.state[p] = self._inner.state[c.leaf]
            elif c.leaf_grad is not None:
                c.leaf.grad, c.leaf_grad = c.leaf_grad, None
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for p, c in self._compact.items():
            if p in self.state:
                self._inner.state[c.leaf] = self.state[p]
            c.key = None  # indices re-derived from the reloaded mask


@dataclass
class _Compact:
    # [capacity] gathered active weights (a DTensor [ranks x capacity] under FSDP2)
    leaf: torch.Tensor
    mask: Callable  # -> this rank's packed mask buffer
    cols: int  # the weight's last dim (packed along it)
    idx: Optional[torch.Tensor] = None
    k: int = 0
    key: Optional[tuple] = None
    leaf_grad: Optional[torch.Tensor] = None  # parked while the weight has no grad this step


def _alloc(t: torch.Tensor) -> torch.Tensor:
    """Give ``t`` (a leaf whose storage was freed) its storage back; returns its local tensor."""
    local = local_tensor(t)
    nbytes = local.numel() * local.element_size()
    if local.untyped_storage().size() != nbytes:
        local.untyped_storage().resize_(nbytes)
    return local


def _free(t: torch.Tensor) -> None:
    local_tensor(t).untyped_storage().resize_(0)


def _like_shards(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A 1-D per-rank block as a DTensor sharded over the mesh dims ``p`` is sharded on (one block
    per rank, so DCP keeps every rank's), or ``local`` itself for a plain ``p``."""
    if not isinstance(p, DTensor):
        return local
    from torch.distributed.tensor import Replicate, Shard

    mesh = p.device_mesh
    placements = [Shard(0) if pl.is_shard() else Replicate() for pl in p.placements]
    n = math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_shard())
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=(n * local.numel(),), stride=(1,)
    )
