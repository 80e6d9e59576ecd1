"""``--plan``: params, FLOPs per token, memory per GPU and a dp/ep layout, without allocating
weights.

    p = plan(load_config("zoo/moe_65b.yaml"), n_gpus=256, device_bytes=gpu_memory("h200")[0])
    print(format_plan(p))
    check_fits(cfg, world_size, device)   # raises PlanDoesNotFit (a ConfigError) with the plan text

The model is built on the meta device, so a 1.4T-parameter preset plans in seconds on a laptop.

The GPU (``--gpu``): ``h100`` (80 GB), ``h200`` (141 GB), ``b200`` (180 GB) or a size in GB; by
default this machine's GPU, else an H100. The GPU count (``--gpus N``): without it, the smallest
count that fits (1 to 8, then whole 8-GPU nodes); with it, every GPU when a layout fits on all N,
else the largest count up to N that fits (a layout needs ``ep`` to divide both the GPUs and the
experts, so 300 GPUs hold no layout of a 256-expert model that 256 of them do). ``train.py --plan``
exits 0 when the plan fits and ``EXIT_DOES_NOT_FIT`` (3) when it does not.

Memory model per GPU (bytes), for FSDP2 with mixed precision as training.parallel sets it up:
- weights: fp32 master copy, sharded: dense over ``dp_shard``, experts over ``ep x dp_shard/ep``
  (also ``dp_shard``). Without FSDP (DDP) everything is replicated.
- grads: fp32, sharded like the weights. optimizer: AdamW exp_avg + exp_avg_sq, fp32, sharded.
- fsdp buffers: the unsharded compute-dtype weights of two blocks (current + prefetched) and one
  block's unsharded grads before reduce-scatter; an EP rank gathers only its ``E/ep`` experts.
- activations: tensors autograd keeps per token (see ``activation_bytes_per_token``) times the
  micro-batch tokens ``batch_size x seq_len``; with activation checkpointing only each block's input
  is kept plus one block recomputed at a time. A run "fits" when the total is at most ``HEADROOM``
  of the device memory (CUDA context, allocator fragmentation and NCCL buffers take the rest).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional

from moezoo.configs import Config, ConfigError

if TYPE_CHECKING:
    from moezoo.zoo.flops import ParamCounts

HEADROOM = 0.9
FP32, ADAM_STATES = 4, 2
GB = 1e9
# Memory of one GPU as sold, in GB (1e9 bytes): H100 SXM, H200, B200 (HGX B200's per-GPU figure).
# torch reports a little more usable memory on each, so a plan errs on the safe side.
GPU_GB = {"h100": 80, "h200": 141, "b200": 180}
DEFAULT_GPU = "h100"  # the plan's GPU on a machine without one: the most common training GPU
EXIT_DOES_NOT_FIT = 3  # train.py --plan's exit status when the plan does not fit
NODE = 8  # GPUs per node: counts past one node are searched in whole nodes
MAX_GPUS = 2**16


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    ep: int
    fsdp: bool = True
    activation_checkpointing: bool = False

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard

    def __str__(self) -> str:
        s = f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} ep={self.ep}"
        s += "" if self.fsdp else " (DDP)"
        return s + (" +activation_checkpointing" if self.activation_checkpointing else "")


@dataclass
class Memory:
    """Bytes per GPU."""

    weights: float
    grads: float
    optimizer: float
    fsdp_buffers: float
    activations: float
    dst_masks: float = 0.0  # DST mask / ever-active / EMA-score buffers, sharded like the weights
    # compact DST state: gathered active weights + grads inside optimizer.step()
    dst_step: float = 0.0

    @property
    def total(self) -> float:
        # the compact store's gather lives only inside the optimizer step, after backward freed the
        # activations
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.fsdp_buffers
            + self.dst_masks
            + max(self.activations, self.dst_step)
        )


class ShortPhase(NamedTuple):
    """The short-context phase (``train.short_seq_len``, ``train.short_steps``): its steps, window
    length, windows per micro-batch and training FLOPs per token at that length. Its micro-batch
    holds as many tokens as a full one, so the memory at ``seq_len`` stays the peak."""

    steps: int
    seq_len: int
    windows: int
    flops_per_token: float


@dataclass
class Plan:
    name: str
    counts: ParamCounts
    flops_per_token: float
    seq_len: int
    batch_size: int  # sequences per micro-batch per GPU
    compute_bytes: int  # 2 (bf16) or 4 (fp32) for activations and gathered weights
    n_gpus: int
    layout: Layout
    layout_source: str  # "config" or "recommended"
    memory: Memory
    device_bytes: float
    notes: list = field(default_factory=list)
    device: str = "GPU"  # what the report calls one device: "GPU" on CUDA, else "device"
    gpu: str = ""  # the GPU planned for, as the report names it ("" for a CPU run's check)
    available_gpus: Optional[int] = None  # --gpus when the plan uses fewer of them
    # sparse attention: (budget density over all heads, FLOPs/token with it, dense layers, layers)
    attention: Optional[tuple] = None
    short_phase: Optional[ShortPhase] = None
    # sparse attention's dense phases (model.attention.dense_warmup / dense_finish): (first step
    # after the warm-up, first step of the finish, train.steps, dense_phase_heads), as the trainer
    # runs them
    dense_phases: Optional[tuple] = None

    @property
    def fits(self) -> bool:
        return self.memory.total <= HEADROOM * self.device_bytes


@dataclass(frozen=True)
class _Shape:
    """What the memory model needs from the built (meta) model."""

    dense_params: int  # everything but routed experts
    expert_params: int  # routed experts, all layers
    max_block_dense: int  # largest transformer block, dense part
    max_block_expert: int  # largest transformer block, routed experts (all E)
    num_experts: Optional[int]  # routed experts per MoE layer (None: no MoE layer)
    dst_dense: int = 0  # DST-masked weights outside routed experts
    dst_expert: int = 0  # DST-masked routed-expert weights


def _shape(model, cfg: Optional[Config] = None) -> _Shape:
    from moezoo.zoo.flops import count_params, is_routed_moe

    counts = count_params(model)
    blocks_dense, blocks_expert, experts = [0], [0], None
    for block in getattr(model, "layers", []):
        e = sum(
            p.numel() for m in block.modules() if is_routed_moe(m) for p in m.experts.parameters()
        )
        experts = next((m.num_experts for m in block.modules() if is_routed_moe(m)), experts)
        blocks_dense.append(sum(p.numel() for p in block.parameters()) - e)
        blocks_expert.append(e)
    dst_dense = dst_expert = 0
    if cfg is not None and cfg.dst.enabled:
        from moezoo.layers.dst.targets import dst_parameters

        expert_ids = {
            id(p) for m in model.modules() if is_routed_moe(m) for p in m.experts.parameters()
        }
        for _, p in dst_parameters(model, cfg.dst.include, cfg.dst.exclude):
            if id(p) in expert_ids:
                dst_expert += p.numel()
            else:
                dst_dense += p.numel()
    return _Shape(
        counts.total - counts.expert,
        counts.expert,
        max(blocks_dense),
        max(blocks_expert),
        experts,
        dst_dense,
        dst_expert,
    )


def activation_bytes_per_token(cfg: Config, compute_bytes: int, checkpointing: bool) -> float:
    """Bytes autograd holds per token for one forward (all layers + logits).

    Per block, in units of compute-dtype elements: attention keeps its input, the normed input, q,
    k, v and the attention output (4D + 2 Dkv); a dense SwiGLU keeps its input, the normed input and
    w1x, w3x, silu(w1x), their product (2D + 4H); a routed MoE keeps its input, the normed input,
    fp32 router logits (2E units), and per chosen expert the dispatched token, its output and 4 H_e
    hidden tensors; shared experts add 4 H_s. The head keeps compute-dtype and fp32 logits and the
    cross-entropy grad (2 + 4 + 4 bytes per vocab entry).
    """
    m = cfg.model
    d, dkv = m.dim, m.kv_heads * m.head_dim
    attn = 4 * d + 2 * dkv
    per_block = []
    for t in m.layer_ffn_types():
        if t == "moe":
            moe = m.moe
            ffn = (
                2 * d
                + 2 * moe.num_experts
                + moe.top_k * (2 * d + 4 * m.expert_hidden_dim)
                + 4 * m.shared_expert_hidden_dim
            )
        else:
            ffn = 2 * d + 4 * m.hidden_dim
        per_block.append((attn + ffn) * compute_bytes)
    head = m.vocab_size * (compute_bytes + 4 + 4)
    if checkpointing:
        # each block's input is kept; one block's full set lives during its recompute + backward
        return m.n_layers * d * compute_bytes + max(per_block) + head
    return sum(per_block) + head


def memory_per_gpu(cfg: Config, shape: _Shape, layout: Layout, compute_bytes: int) -> Memory:
    shard = layout.dp_shard if layout.fsdp else 1
    # ranks one expert weight spans
    expert_shard = layout.ep * (shard // layout.ep if layout.fsdp else 1)
    held = shape.dense_params / shard + shape.expert_params / expert_shard
    gathered_block = shape.max_block_dense + shape.max_block_expert / layout.ep
    buffers = (
        (2 * gathered_block * compute_bytes + gathered_block * compute_bytes)
        if layout.fsdp and shard > 1
        else 0
    )
    tokens = cfg.train.batch_size * cfg.train.seq_len
    acts = tokens * activation_bytes_per_token(cfg, compute_bytes, layout.activation_checkpointing)
    dst_held = shape.dst_dense / shard + shape.dst_expert / expert_shard
    cost = dst_cost(cfg, layout)
    weight_b, grad_b = FP32, FP32
    # bf16 weights + float32 masters; bf16 grads (+ float32 sums)
    if cfg.train.param_dtype == "bfloat16":
        weight_b, grad_b = 2 + FP32, 2 + (FP32 if cfg.train.grad_accum > 1 else 0)
    return Memory(
        weights=held * weight_b,
        grads=held * grad_b,
        optimizer=(held - dst_held) * FP32 * ADAM_STATES + dst_held * cost.optimizer,
        fsdp_buffers=buffers,
        activations=acts,
        dst_masks=dst_held * cost.buffers,
        dst_step=dst_held * cost.step_only,
    )


def dst_cost(cfg: Config, layout: Layout):
    """Bytes per masked weight of the DST options (layers.dst.costs); the compact store keeps a 10%
    margin for weights sharded over ranks."""
    from moezoo.layers.dst.costs import dst_state_bytes

    return dst_state_bytes(cfg.dst, margin=1.1 if layout.fsdp and layout.dp_shard > 1 else 1.0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recommend_layout(
    cfg: Config, shape: _Shape, n_gpus: int, compute_bytes: int, device_bytes: float
) -> Layout:
    """FSDP over every GPU; EP as wide as divides both the experts and the GPUs (expert weights then
    stay put and only tokens move, which is far less data per step than gathering experts);
    activation checkpointing only when the plan would not fit without it."""
    ep = (
        max(d for d in _divisors(n_gpus) if shape.num_experts and shape.num_experts % d == 0)
        if shape.num_experts
        else 1
    )
    layout = Layout(1, n_gpus, ep, True, cfg.parallel.activation_checkpointing)
    if memory_per_gpu(cfg, shape, layout, compute_bytes).total > HEADROOM * device_bytes:
        layout = dataclasses.replace(layout, activation_checkpointing=True)
    return layout


def _fits(cfg: Config, shape: _Shape, n: int, compute_bytes: int, device_bytes: float) -> bool:
    lay = recommend_layout(cfg, shape, n, compute_bytes, device_bytes)
    return memory_per_gpu(cfg, shape, lay, compute_bytes).total <= HEADROOM * device_bytes


def _fewest_possible_gpus(
    cfg: Config, shape: _Shape, compute_bytes: int, device_bytes: float
) -> int:
    """A count below which no layout fits: every term but the FSDP buffers at ``ep=1`` with
    activation checkpointing, a bound that only falls as GPUs are added (bisection)."""

    def bound(n: int) -> float:
        m = memory_per_gpu(cfg, shape, Layout(1, n, 1, True, True), compute_bytes)
        return m.total - m.fsdp_buffers

    lo, hi = 1, MAX_GPUS
    if bound(hi) > HEADROOM * device_bytes:
        return hi + 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if bound(mid) > HEADROOM * device_bytes else (lo, mid)
    return lo


def smallest_fitting_gpus(
    cfg: Config, shape: _Shape, compute_bytes: int, device_bytes: float
) -> Optional[int]:
    """The smallest count whose recommended layout fits: 1 to 8 GPUs, then whole 8-GPU nodes (up to
    2^16); None when none does."""
    n = _fewest_possible_gpus(cfg, shape, compute_bytes, device_bytes)
    if n > NODE:
        n = math.ceil(n / NODE) * NODE
    while n <= MAX_GPUS:
        if _fits(cfg, shape, n, compute_bytes, device_bytes):
            return n
        n += 1 if n < NODE else NODE
    return None


def largest_fitting_gpus(
    cfg: Config, shape: _Shape, n_gpus: int, compute_bytes: int, device_bytes: float
) -> Optional[int]:
    """The largest count up to ``n_gpus`` whose recommended layout fits (None when none does)."""
    lo = _fewest_possible_gpus(cfg, shape, compute_bytes, device_bytes)
    return next(
        (n for n in range(n_gpus, lo - 1, -1) if _fits(cfg, shape, n, compute_bytes, device_bytes)),
        None,
    )


def _counts_that_fit(
    cfg: Config, shape: _Shape, n_gpus: int, compute_bytes: int, device_bytes: float
) -> str:
    """The note of a plan that does not fit on ``n_gpus``: which counts do."""
    below = largest_fitting_gpus(cfg, shape, n_gpus, compute_bytes, device_bytes)
    smallest = smallest_fitting_gpus(cfg, shape, compute_bytes, device_bytes)
    gpu = f"{device_bytes / GB:.0f} GB GPUs"
    if smallest is None:
        return f"no count of {gpu} up to {MAX_GPUS} fits with the recommended layout"
    if below is None:
        return f"the recommended layout fits from {smallest} {gpu} ({_node_count(smallest)})"
    if below == n_gpus:
        return f"the recommended layout fits on all {n_gpus} GPUs"
    return (
        f"the recommended layout fits on {below} of the {n_gpus} GPUs "
        f"(the largest count up to {n_gpus}) and from {smallest} {gpu} ({_node_count(smallest)})"
    )


def _subset_note(
    cfg: Config, shape: _Shape, layout: Layout, n_gpus: int, below: int, compute_bytes: int
) -> str:
    """Why a plan for ``n_gpus`` uses ``below`` of them."""
    need = memory_per_gpu(cfg, shape, layout, compute_bytes).total
    why = f"the best layout on all of them needs {need / GB:.1f} GB per GPU"
    if shape.num_experts and layout.ep < shape.num_experts:
        why += (
            f" (ep={layout.ep}: the largest count dividing both {n_gpus} GPUs and "
            f"{shape.num_experts} experts, so every rank gathers experts)"
        )
    return f"{n_gpus} GPUs: {why}; this plan uses {below} of them (launch {below} ranks)"


def _node_count(n: int) -> str:
    return "one node" if n <= NODE else f"{n // NODE} nodes of {NODE}"


def _compute_bytes(cfg: Config, device_type: str) -> int:
    dtype = cfg.train.dtype
    if dtype == "auto":
        return 2 if device_type == "cuda" else 4
    return 2 if dtype == "bfloat16" else 4


def plan(
    cfg: Config,
    n_gpus: Optional[int] = None,
    device_bytes: float = GPU_GB[DEFAULT_GPU] * GB,
    device_type: str = "cuda",
    layout: Optional[Layout] = None,
    model=None,
    gpu: str = "",
) -> Plan:
    """Plan ``cfg`` on ``n_gpus`` devices of ``device_bytes`` each (default: an H100's 80 GB).

    ``n_gpus=None``: the smallest count that fits with the recommended layout (1 to 8 GPUs, then
    whole 8-GPU nodes). The layout is the config's ``parallel`` section when its degrees resolve
    for ``n_gpus`` and were set explicitly (``ep > 1`` or ``dp_shard != -1``), else the recommended
    one; when the recommended one does not fit on all ``n_gpus``, the plan uses the largest count
    below that fits and says so (``available_gpus``). ``model``: an already built model to count
    instead of building one on the meta device. ``gpu``: the GPU's name in the report.
    """
    from moezoo.zoo.flops import count_params, flops_per_token

    if model is None:
        from moezoo.zoo import build_model

        model = build_model(cfg.model, "meta")
    counts, shape = count_params(model), _shape(model, cfg)
    cb = _compute_bytes(cfg, device_type)
    notes = []
    available = None
    if n_gpus is None:
        n_gpus = smallest_fitting_gpus(cfg, shape, cb, device_bytes) or MAX_GPUS
        notes.append(
            f"n_gpus: the smallest count that fits (1 to {NODE} GPUs, then whole {NODE}-GPU "
            "nodes; --gpus N to plan another)"
        )
    source = "config"
    if layout is None:
        p = cfg.parallel
        explicit = p.ep > 1 or p.dp_shard != -1 or p.dp_replicate > 1 or not p.fsdp
        try:
            rep, shard, ep = p.resolve(n_gpus, shape.num_experts)
            layout = (
                Layout(rep, shard, ep, p.fsdp, p.activation_checkpointing) if explicit else None
            )
        except ConfigError as e:
            notes.append(
                f"config layout does not apply to {n_gpus} GPUs ({e}); showing the recommended one"
            )
        if layout is None:
            layout, source = recommend_layout(cfg, shape, n_gpus, cb, device_bytes), "recommended"
            if not _fits(cfg, shape, n_gpus, cb, device_bytes):
                below = largest_fitting_gpus(cfg, shape, n_gpus - 1, cb, device_bytes)
                if below is not None:
                    notes.append(_subset_note(cfg, shape, layout, n_gpus, below, cb))
                    available, n_gpus = n_gpus, below
                    layout = recommend_layout(cfg, shape, n_gpus, cb, device_bytes)
    mem = memory_per_gpu(cfg, shape, layout, cb)
    t, short = cfg.train, None
    if t.short_seq_len:
        S, windows = t.windows(0)
        short = ShortPhase(t.short_steps, S, windows, flops_per_token(cfg.model, S, counts))
    if cfg.dst.enabled and shape.dst_dense + shape.dst_expert:
        parts = dst_cost(cfg, layout).parts
        notes.append(
            "dst state per masked weight: " + ", ".join(f"{k} {v:.2f} B" for k, v in parts.items())
        )
    attention = _attention_work(cfg, model, counts)
    a, dense_phases = cfg.model.attention, None
    if attention and (a.dense_warmup or a.dense_finish):
        from moezoo.layers.neuron.schedule import phase_bounds

        bounds = phase_bounds(t.steps, a.dense_warmup, a.dense_finish)
        dense_phases = (*bounds, t.steps, a.dense_phase_heads)
    out = Plan(
        attention=attention,
        dense_phases=dense_phases,
        name=cfg.name,
        counts=counts,
        flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len, counts),
        seq_len=cfg.train.seq_len,
        batch_size=cfg.train.batch_size,
        compute_bytes=cb,
        n_gpus=n_gpus,
        layout=layout,
        layout_source=source,
        memory=mem,
        device_bytes=device_bytes,
        notes=notes,
        device="GPU" if device_type == "cuda" else "device",
        gpu=gpu,
        available_gpus=available,
        short_phase=short,
    )
    if not out.fits:
        if source == "recommended":  # the best layout tried, but one to change, not to follow
            out.layout_source = "best found, does not fit"
        notes.append(_counts_that_fit(cfg, shape, n_gpus, cb, device_bytes))
        need = mem.total / (HEADROOM * device_bytes)
        fixes = "more GPUs, a smaller train.batch_size"
        fixes += (
            "" if layout.activation_checkpointing else " or parallel.activation_checkpointing=true"
        )
        if mem.dst_masks and not cfg.dst.compact_state:
            fixes += ", dst.compact_state=true (optimizer and DST state for active weights only)"
        elif mem.dst_masks and cfg.dst.grad_ema is not None:
            fixes += ", dst.grad_ema=null (2 B less per masked weight)"
        notes.append(
            f"does not fit: needs {need:.2f}x the usable {HEADROOM:.0%} of device memory; "
            f"try {fixes}"
        )
    return out


def _attention_work(cfg: Config, model, counts) -> Optional[tuple]:
    """For a model with sparse attention layers: the mean budget density over every head of every
    layer at ``train.seq_len`` (layers.attention.density.budget_density, plus block top-k
    selection's scores, selection_work; dense layers 1), the training FLOPs per token that density
    does, and how many of the layers are dense."""
    from moezoo.layers import Attention
    from moezoo.layers.attention.density import budget_density, selection_work
    from moezoo.zoo.flops import flops_per_token

    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if not any(a.pattern is not None for a in attns):
        return None
    T = cfg.train.seq_len
    dens = [
        1.0
        if a.pattern is None
        else float(
            (
                budget_density(a.pattern, a.n_heads, T)
                + selection_work(a.pattern, a.n_heads, T, a.n_kv_heads, a.head_dim)
            ).mean()
        )
        for a in attns
    ]
    d = sum(dens) / len(dens)
    n_dense = sum(a.pattern is None for a in attns)
    return d, flops_per_token(cfg.model, T, counts, attn_density=d), n_dense, len(attns)


# FLOP counts as the report writes them ("563.16 MFLOP")
FLOP_UNITS = ((1e12, " T"), (1e9, " G"), (1e6, " M"), (1, " "))


def _fmt(n: float, units=((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))) -> str:
    for unit, s in units:
        if n >= unit:
            return f"{n / unit:.2f}{s}"
    return str(int(n))


def _attention_line(a: tuple) -> list[str]:
    d, flops, n_dense, n = a
    done = _fmt(flops, FLOP_UNITS)
    return [
        f"  attention     sparse in {n - n_dense} of {n} layers: {d:.1%} of the causal pairs "
        f"(budget, selection scores included) -> {done}FLOP/token done"
    ]


def _dense_phase_line(bounds: tuple) -> list[str]:
    warm, finish, steps, heads = bounds
    parts = ([f"steps 0-{warm - 1}"] if warm else []) + (
        [f"steps {finish}-{steps - 1}"] if finish < steps else []
    )
    who = "the selecting heads" if heads == "selecting" else "every head of the sparse layers"
    return [f"  dense phases  {' and '.join(parts)}: {who} dense causal attention"]


def _short_phase_line(s: ShortPhase) -> list[str]:
    flops = _fmt(s.flops_per_token, FLOP_UNITS)
    return [
        f"  short phase   steps 0-{s.steps - 1}: windows of {s.seq_len} tokens, {s.windows} a "
        f"micro-batch (the same tokens), {flops}FLOP/token"
    ]


def format_plan(p: Plan) -> str:
    """Human-readable report (what ``train.py --plan`` prints)."""
    c, m, cap = p.counts, p.memory, p.device_bytes
    dtype = "bf16" if p.compute_bytes == 2 else "fp32"
    of = f" of {p.available_gpus}" if p.available_gpus else ""
    lines = [
        f"plan: {p.name}",
        f"  params        total {_fmt(c.total)} ({c.total:,})   "
        f"active {_fmt(c.active)} ({c.active:,})",
        f"                routed experts {_fmt(c.expert)}   embedding {_fmt(c.embedding)}",
        f"  FLOPs/token   "
        f"{_fmt(p.flops_per_token, FLOP_UNITS)}FLOP "
        f"(training fwd+bwd, active params, seq_len {p.seq_len})",
        *(_attention_line(p.attention) if p.attention else []),
        *(_dense_phase_line(p.dense_phases) if p.dense_phases else []),
        *(_short_phase_line(p.short_phase) if p.short_phase else []),
        *([f"  gpu           {p.gpu}"] if p.gpu else []),
        f"  layout        {p.n_gpus}{of} {p.device}(s): {p.layout}   [{p.layout_source}]",
        f"  {'memory/' + p.device:<14}(micro-batch {p.batch_size} x {p.seq_len} tokens, "
        f"{dtype} compute, fp32 master + AdamW)",
        f"    weights       {m.weights / GB:9.1f} GB",
        f"    grads         {m.grads / GB:9.1f} GB",
        f"    optimizer     {m.optimizer / GB:9.1f} GB",
        f"    fsdp buffers  {m.fsdp_buffers / GB:9.1f} GB",
        f"    activations   {m.activations / GB:9.1f} GB",
        *([f"    dst masks     {m.dst_masks / GB:9.1f} GB"] if m.dst_masks else []),
        *(
            [
                f"    dst step      {m.dst_step / GB:9.1f} GB   "
                "(compact store's gather, optimizer step only: "
                "counted as max(activations, dst step))"
            ]
            if m.dst_step
            else []
        ),
        f"    total         {m.total / GB:9.1f} GB of {cap / GB:.0f} GB "
        f"({100 * m.total / cap:.0f}%) -> " + ("fits" if p.fits else "DOES NOT FIT"),
    ]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


# The keys that make each part of the memory big: the error names the one behind the largest part.
# Model-sized parts shrink per device with more GPUs / sharding (parallel.*).
_PART_KEYS = {
    "activations": "train.batch_size",
    "weights": "parallel",
    "grads": "parallel",
    "optimizer": "parallel",
    "fsdp_buffers": "parallel",
    "dst_masks": "dst.grad_ema",
}


class PlanDoesNotFit(ConfigError):
    """Raised by ``check_fits``: first line names the problem, the rest is the plan."""

    def __init__(self, p: Plan, where: str):
        self.plan = p
        part, size = max(((k, getattr(p.memory, k)) for k in _PART_KEYS), key=lambda kv: kv[1])
        why = (
            f" (train.batch_size={p.batch_size} x train.seq_len={p.seq_len})"
            if part == "activations"
            else ""
        )
        super().__init__(
            _PART_KEYS[part],
            f"{p.name} needs {p.memory.total / GB:.1f} GB per device on {where} "
            f"({p.layout}) but has {p.device_bytes / GB:.1f} GB; the largest part is "
            f"{part.replace('_', ' ')} {size / GB:.1f} GB{why}",
        )
        self.report = format_plan(p)

    def __str__(self) -> str:
        return super().__str__() + "\n" + self.report


def gpu_memory(spec: Optional[str]) -> tuple[float, str]:
    """``--gpu``: ``(bytes per GPU, the GPU as the report names it)`` for ``h100``, ``h200``,
    ``b200`` or a size in GB (``96``, ``96GB``); None: this machine's first GPU, else an H100.
    ConfigError on ``--gpu`` for anything else (without importing torch)."""
    if spec is None:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            size = float(props.total_memory)
            return size, f"{props.name} {size / GB:.0f} GB (this machine's; --gpu to plan another)"
        gb = GPU_GB[DEFAULT_GPU]
        return gb * GB, (
            f"{DEFAULT_GPU.upper()} {gb} GB (no GPU here: the default; "
            f"--gpu {'|'.join(GPU_GB)}|<GB> to choose)"
        )
    name = spec.strip().lower()
    if name in GPU_GB:
        return GPU_GB[name] * GB, f"{name.upper()} {GPU_GB[name]} GB"
    try:
        gb = float(name.removesuffix("gb"))
    except ValueError:
        gb = math.nan
    if not (math.isfinite(gb) and gb > 0):
        raise ConfigError(
            "--gpu", f"expected {', '.join(GPU_GB)} or a memory size in GB (e.g. 96), got {spec!r}"
        )
    return gb * GB, f"{gb:g} GB GPU"


def plan_command(cfg: Config, n_gpus: Optional[int], gpu: Optional[str]) -> int:
    """``train.py --plan [--gpus N] [--gpu G]``: print the plan; its exit status is 0 when it fits,
    ``EXIT_DOES_NOT_FIT`` when it does not. Bad flags raise ConfigError before any model is
    built."""
    if n_gpus is not None and n_gpus < 1:
        raise ConfigError("--gpus", f"must be >= 1, got {n_gpus}")
    if n_gpus is not None and n_gpus > MAX_GPUS:
        raise ConfigError("--gpus", f"must be at most {MAX_GPUS}, got {n_gpus}")
    device_bytes, name = gpu_memory(gpu)
    p = plan(cfg, n_gpus, device_bytes, gpu=name)
    print(format_plan(p))
    return 0 if p.fits else EXIT_DOES_NOT_FIT


def moe_num_experts(cfg: Config) -> Optional[int]:
    """Routed experts per MoE layer (what ``parallel.ep`` must divide), None for a model without
    MoE."""
    return cfg.model.moe.num_experts if "moe" in cfg.model.layer_ffn_types() else None


def device_memory_bytes(device) -> float:
    """Total memory of one device: the GPU's, or this host's RAM split over its local ranks on
    CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_fits(cfg: Config, world_size: int, device, model=None) -> Plan:
    """Plan ``cfg`` on ``world_size`` ranks of ``device``'s kind with the config's layout; raise
    ``PlanDoesNotFit`` (a ConfigError) before anything is allocated when it cannot fit."""
    import torch

    device = torch.device(device)
    p = cfg.parallel
    rep, shard, ep = p.resolve(world_size, moe_num_experts(cfg))
    layout = Layout(rep, shard, ep, p.fsdp and world_size > 1, p.activation_checkpointing)
    out = plan(cfg, world_size, device_memory_bytes(device), device.type, layout, model)
    if not out.fits:
        raise PlanDoesNotFit(out, f"{world_size} x {device.type}")
    return out
