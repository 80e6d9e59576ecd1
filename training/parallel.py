"""Multi-process layout: torchrun environment -> DeviceMesh -> FSDP2 (+ HSDP) and expert
parallelism.

    state = setup_parallel(cfg)  # validates degrees, then init_process_group + meshes
    # same seed on every rank, or "meta"
    model = build_model(cfg.model, model_init_device(cfg, state))
    model = parallelize(model, cfg, state)
    ... model.loss(x, y).backward()
    clip_grad_norm_(model.parameters(), max_norm, state); opt.step()
    dist.destroy_process_group()  # training.run does this when the run ends

Layout (configs/parallel.py): ranks are numbered ``r = (replica * efsdp + i) * ep + j``, so the
``ep`` ranks of an expert group are consecutive (one node when ep <= GPUs per node). Meshes:
- ``dense_mesh``  ("dp_replicate", "dp_shard"): FSDP2 (HSDP when dp_replicate > 1) for everything
  but routed experts: each transformer block is one FSDP unit, the root holds embeddings, norm and
  output.
- ``mesh``        ("dp_replicate", "efsdp", "ep"): ``ep`` splits the experts of every MoE layer
  (each rank keeps ``E / ep``) and carries the token all-to-all; the experts are FSDP-sharded over
  ("dp_replicate", "efsdp"), i.e. the ``dp_shard / ep`` ranks holding the same experts.

Every rank is a data-parallel rank: it reads its own batch and the loss is averaged over all ranks.
Expert gradients arrive summed over the ``ep`` ranks whose tokens used them (the all-to-all
backward), so their FSDP reduction divides by the whole world size, like the dense gradients' does.

Mixed precision on CUDA in bf16: fp32 sharded master weights, bf16 all-gathered compute weights,
fp32 gradient reduction. ``parallel.fsdp: false`` is DDP semantics (every rank holds every weight,
gradients all-reduced) through the same FSDP2 hooks on a shard degree of 1: unlike a DDP wrapper,
it keeps ``model.loss(...)`` synchronising gradients, and parameter names unchanged.
"""

from __future__ import annotations

import datetime
import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from moezoo.configs import Config, ConfigError
from moezoo.layers.attention.replay import SelectionReplay
from moezoo.layers.moe import MoE, moe_modules

from .plan import device_memory_bytes, moe_num_experts


@dataclass
class ParallelState:
    world_size: int
    rank: int
    local_rank: int
    device: torch.device
    dp_replicate: int
    dp_shard: int
    ep: int
    # DeviceMesh ("dp_replicate", "efsdp", "ep"); None when world == 1
    mesh: Optional[object] = None
    dense_mesh: Optional[object] = None  # DeviceMesh ("dp_replicate", "dp_shard")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads (every rank is a data-parallel rank)."""
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def ep_group(self):
        """All-to-all group of this rank's expert-parallel peers; None when ep == 1."""
        return self.mesh["ep"].get_group() if self.mesh is not None and self.ep > 1 else None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def resolve_device(cfg: Config, local_rank: int = 0) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", "cuda requested but no CUDA device is available")
    if want == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    # One GPU per local rank: two ranks sharing a GPU fail later inside NCCL ("Duplicate GPU
    # detected").
    local_world, gpus = _env_int("LOCAL_WORLD_SIZE", 1), torch.cuda.device_count()
    if local_world > gpus:
        raise ConfigError(
            "train.device",
            f"{local_world} ranks on this node (torchrun --nproc_per_node) but "
            f"{gpus} CUDA device(s); start at most {gpus} per node, or train.device=cpu (gloo)",
        )
    return torch.device("cuda", local_rank)


def setup_parallel(cfg: Config) -> ParallelState:
    """Read the torchrun environment, validate ``cfg.parallel`` against it (ConfigError before any
    process-group work), then initialise the process group and the meshes. Works without torchrun
    (world size 1: no process group)."""
    world, rank, local_rank = (
        _env_int("WORLD_SIZE", 1),
        _env_int("RANK", 0),
        _env_int("LOCAL_RANK", 0),
    )
    rep, shard, ep = cfg.parallel.resolve(world, moe_num_experts(cfg))
    if ep > 1 and cfg.model.moe.backend == "megablocks":
        raise ConfigError(
            "model.moe.backend",
            "megablocks cannot run under parallel.ep > 1 here (it has its own "
            "expert-parallel setup); use auto, grouped or torch",
        )
    device = resolve_device(cfg, local_rank)
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend", "nccl needs CUDA devices; use gloo (or auto) on CPU")
    state = ParallelState(world, rank, local_rank, device, rep, shard, ep)
    if world == 1:
        return state
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
        )
    state.mesh, state.dense_mesh = build_meshes(device.type, rep, shard, ep)
    return state


def build_meshes(device_type: str, rep: int, shard: int, ep: int):
    """The ("dp_replicate", "efsdp", "ep") and ("dp_replicate", "dp_shard") meshes over the same
    ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(rep * shard)
    mesh = DeviceMesh(
        device_type,
        ranks.view(rep, shard // ep, ep),
        mesh_dim_names=("dp_replicate", "efsdp", "ep"),
    )
    dense = DeviceMesh(
        device_type, ranks.view(rep, shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    return mesh, dense


def _fsdp_mesh(mesh, rep: int, shard_dim: str):
    """2-D (HSDP) mesh when replicating, else the 1-D shard mesh."""
    return mesh["dp_replicate", shard_dim] if rep > 1 else mesh[shard_dim]


def _mp_policy(cfg: Config, device: torch.device):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = device.type == "cuda" and cfg.train.dtype in ("auto", "bfloat16")
    return (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )


def _checkpointed(forward, *args, **kwargs):
    """``forward`` under non-reentrant activation checkpointing; eager, its recompute replays the
    sparse-attention selections of the forward (layers.attention.replay) instead of estimating them
    again."""
    from torch.utils.checkpoint import checkpoint

    if not torch.compiler.is_compiling():
        forward = functools.partial(SelectionReplay().run, forward)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward; parameter names are unchanged (no wrapper
    module)."""
    for block in model.layers:
        block.forward = functools.partial(_checkpointed, block.forward)


def parallelize(model: nn.Module, cfg: Config, state: ParallelState) -> nn.Module:
    """Shard ``model`` for ``state``'s layout and put it on ``state.device``.

    ``model`` is built identically on every rank (same seed), on CPU or on the meta device; a meta
    model is materialised on the device after sharding and initialised with ``init_weights()``
    (each rank initialises its own shards). Returns the same object, so ``model.loss(...)`` (which
    calls the root module) triggers the parameter gathering and gradient reduction hooks.
    """
    on_meta = any(p.is_meta for p in model.parameters())
    if cfg.parallel.activation_checkpointing:
        apply_activation_checkpointing(model)
    seed = cfg.train.seed
    if not state.distributed:
        return _materialize(model, state, on_meta, seed)
    for moe in moe_modules(model):
        # Every rank is a data-parallel rank: the global balance loss spans the world.
        moe.balance_group = dist.group.WORLD
    if state.ep > 1:
        from moezoo.layers.moe.expert_parallel import shard_experts

        for moe in moe_modules(model):
            shard_experts(moe, state.ep_group, state.ep_rank)
    _fully_shard(model, cfg, state)
    if state.ep > 1:
        ckpt_mesh = _expert_checkpoint_mesh(state)
        for moe in moe_modules(model):
            moe.ep_checkpoint_mesh = ckpt_mesh
    return _materialize(model, state, on_meta, seed)


def _fully_shard(model: nn.Module, cfg: Config, state: ParallelState) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mp = _mp_policy(cfg, state.device)
    dense = _fsdp_mesh(state.dense_mesh, state.dp_replicate, "dp_shard")
    expert_mesh = _fsdp_mesh(state.mesh, state.dp_replicate, "efsdp")
    efsdp = state.dp_shard // state.ep
    # Fewer local experts than shard ranks would leave ranks with empty shards: shard the hidden dim
    # then.
    expert_placement = lambda p: Shard(0) if p.shape[0] % efsdp == 0 else Shard(1)  # noqa: E731
    moes = set(moe_modules(model))
    for block in model.layers:
        for m in block.modules():
            if m in moes:
                # Own FSDP unit so the block's unit (dense mesh) does not take the experts, which
                # differ across ep ranks. Divide by the world: the all-to-all backward already
                # summed over ep.
                fully_shard(
                    m.experts, mesh=expert_mesh, mp_policy=mp, shard_placement_fn=expert_placement
                )
                m.experts.set_gradient_divide_factor(float(state.world_size))
                if dist.get_backend() == "gloo" and efsdp > 1:
                    # gloo has no PREMUL_SUM: reduce with SUM and scale after. (Not with one shard
                    # rank: torch then divides both in its no-communication copy and after it.)
                    m.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dense, mp_policy=mp)
    fully_shard(model, mesh=dense, mp_policy=mp)


def _expert_checkpoint_mesh(state: ParallelState):
    """The same ranks as ("dp_replicate", "ep", "efsdp"): ep outer, so [Shard(0) on ep, Shard(d) on
    efsdp] describes where each rank's expert shard sits in the global ``[E, ...]`` tensor."""
    from torch.distributed.device_mesh import DeviceMesh

    rep, efsdp, ep = state.dp_replicate, state.dp_shard // state.ep, state.ep
    ranks = torch.arange(state.world_size).view(rep, efsdp, ep).transpose(1, 2)
    return DeviceMesh(state.device.type, ranks, mesh_dim_names=("dp_replicate", "ep", "efsdp"))


def checkpoint_views(sd: dict, model: nn.Module) -> dict:
    """``{"model": model_sd, "optim": optim_sd}`` (from ``get_state_dict``) with every
    expert-parallel tensor replaced by a view of the *global* ``[E, ...]`` tensor it is a shard of.

    Under EP the FSDP DTensor of ``experts.w1`` on each ep rank is ``[E/ep, ...]`` under one name,
    so DCP would see ep different tensors as one (and keep one rank's). The views share storage with
    ``sd``: ``dcp.save`` writes, and ``dcp.load`` fills, the same memory; checkpoints then hold
    ``[E, ...]`` tensors that load at any ep degree or on one process. Identity without EP.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    fqns = {}
    for name, m in model.named_modules():
        mesh = m.ep_checkpoint_mesh if isinstance(m, MoE) else None
        if mesh is not None:
            for pname, _ in m.experts.named_parameters():
                fqns[f"{name}.experts.{pname}"] = mesh

    def view(t, mesh):
        if not isinstance(t, DTensor) or t.dim() == 0:
            return t
        ep = mesh["ep"].size()
        d = next(p.dim for p in t.placements if isinstance(p, Shard))
        shape = (t.shape[0] * ep, *t.shape[1:])
        return DTensor.from_local(
            t.to_local(),
            mesh,
            [Replicate(), Shard(0), Shard(d)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    out = dict(sd)
    if "model" in sd:
        out["model"] = {k: view(v, fqns[k]) if k in fqns else v for k, v in sd["model"].items()}
    if "optim" in sd and "state" in sd["optim"]:
        st = {
            k: ({n: view(t, fqns[k]) for n, t in v.items()} if k in fqns else v)
            for k, v in sd["optim"]["state"].items()
        }
        out["optim"] = {**sd["optim"], "state": st}
    return out


def _materialize(model: nn.Module, state: ParallelState, on_meta: bool, seed: int) -> nn.Module:
    if on_meta:
        model.to_empty(device=state.device)
        init_local_shards(model, seed + 1_000_003 * (state.rank % state.dp_shard))
        return model
    return model.to(state.device)


@torch.no_grad()
def init_local_shards(model: nn.Module, seed: int) -> None:
    """``model.init_weights()`` applied to each rank's local shards, from ``seed``.

    The seed is keyed on the rank's ``dp_shard`` coordinate, so shards of one tensor (and experts on
    different ep ranks, which share their FSDP shard position) differ while HSDP replicas agree. The
    local tensors are swapped in for the DTensor parameters during the call (same storage), so this
    does not depend on DTensor's RNG tracker; it needs an elementwise init (normal/zeros/ones),
    which is what the zoo's ``init_weights`` methods do. Buffers left garbage by ``to_empty`` are
    zeroed first (the derived ones, like RoPE frequencies, are recomputed by ``init_weights``).
    """
    from torch.distributed.tensor import DTensor

    swapped = []
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                swapped.append((mod, name, p))
                mod._parameters[name] = nn.Parameter(p.to_local(), requires_grad=False)
        for b in mod._buffers.values():
            if b is not None and b.is_floating_point():
                b.zero_()
    try:
        with torch.random.fork_rng(
            devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []
        ):
            torch.manual_seed(seed)
            model.init_weights()
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


def model_init_device(cfg: Config, state: ParallelState, max_fraction: float = 0.25):
    """Where to build the model before ``parallelize``: ``state.device`` (every rank builds the full
    model from the same seed, so a run on N ranks starts from the weights of a 1-rank run), or
    "meta" when the unsharded fp32 weights would take more than ``max_fraction`` of one device's
    memory (then each rank initialises only its shards, see ``init_local_shards``)."""
    if not state.distributed:
        return state.device
    from moezoo.zoo.flops import param_counts

    full = 4 * param_counts(cfg.model).total
    return "meta" if full > max_fraction * device_memory_bytes(state.device) else state.device


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor clipping multiplies the gradients by: ``min(1, max_norm / (norm + 1e-6))``
    (float32)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm_(
    parameters,
    max_norm: float,
    state: ParallelState,
    apply: bool = True,
    grads: Optional[list] = None,
) -> torch.Tensor:
    """Total gradient norm over the whole (sharded) model, same on every rank; scales the gradients
    down to ``max_norm`` when it is exceeded (``max_norm <= 0`` or ``apply=False``: measure only).
    ``grads``: the gradients, where an optimizer keeps them outside ``.grad``
    (``MasterAdamW.gradient(p)``).

    ``torch.nn.utils.clip_grad_norm_`` cannot mix the dense and the expert meshes' DTensors, so this
    sums squares of the local shards and all-reduces once: every parameter element lives on exactly
    ``dp_replicate`` ranks (one per replica group), hence the division.
    """
    from torch.distributed.tensor import DTensor

    if grads is None:
        grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else state.device
    # Float32 norms of bf16 gradients too (a bf16 norm would round the clipping factor), one foreach
    # launch per dtype (bf16 weights; float32 embeddings and norms), summed in parameter order
    # whatever the dtypes.
    by_dtype: dict = {}
    for i, g in enumerate(local):
        by_dtype.setdefault(g.dtype, []).append(i)
    norms: list = [None] * len(local)
    for idx in by_dtype.values():
        for i, n in zip(idx, torch._foreach_norm([local[i] for i in idx], 2, dtype=torch.float32)):
            norms[i] = n
    sq = torch.stack(norms).square().sum() if local else torch.zeros((), device=device)
    if state.distributed and any(isinstance(g, DTensor) for g in grads):
        dist.all_reduce(sq)
        sq = sq / state.dp_replicate
    norm = sq.sqrt()
    if apply and max_norm > 0 and local:
        torch._foreach_mul_(local, clip_coef(norm, max_norm).to(local[0].dtype))
    return norm


def all_reduce_mean(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Average a tensor (loss, metric) over the data-parallel ranks; identity on one process."""
    if not state.distributed:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)  # every rank is a data-parallel rank
    return x / state.dp_size
