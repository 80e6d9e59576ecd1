"""AdamW with decoupled weight decay on matrices only, and linear warm-up + cosine decay (torch
schedulers); ``CompactAdamW``: the same AdamW keeping DST-masked weights' moments for their active
entries only; ``MasterAdamW``: the same AdamW for a model whose matmul weights are held in bfloat16,
with their float32 master copies in the optimizer (``train.param_dtype: bfloat16``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

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


def build_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up from lr/warmup to lr over ``warmup_steps``, then cosine to ``lr *
    min_lr_ratio``."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    cosine = CosineAnnealingLR(
        opt, T_max=max(total_steps - warmup, 1), eta_min=cfg.lr * cfg.min_lr_ratio
    )
    if warmup == 0:
        return cosine
    ramp = LinearLR(opt, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
    return SequentialLR(opt, [ramp, cosine], milestones=[warmup])


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
