"""The trainer end to end, MoE and neuron-routed FFN against the dense FFN on one backbone:
equal-time quality and tokens/s, on one GPU.

    # tokens, on any machine (CPU):
    python bench/train_moe.py --prepare DIR [--max-files N] [--cache-dir C]
    python bench/train_moe.py --tokens DIR [--suite equal_time,speed_2k] [--seconds 15]
        [--seeds 0,1] [--fixed-steps]
    # bf16 vs FP8 experts:
    python bench/train_moe.py --tokens DIR --suite speed_fp8 --speed-steps 300

``--prepare`` builds the corpus (``data.source=python_packages`` by default: this interpreter's
installed packages, one document per package, validation packages held out), trains the tokenizer
and writes ``tokens_{train,val}.bin`` and ``tokenizer.model`` into DIR, so every run of a suite, and
the GPU machine, trains on exactly the same tokens (the GPU machine has other packages installed).

Suites (each run is ``training.loop.Trainer`` from a ``load_config`` of a preset plus overrides,
bf16 autocast, fused AdamW, compiled with ``--compile`` (eager by default: a compile per run costs
more device time than a short equal-time run trains); the script drives ``train_step`` itself and
times each step):
- ``equal_time``: dense, MoE (8 experts top-2, expert hidden FFN/2: the dense FFN's active FLOPs)
  and neuron-routed (tiny_neuron's schedule: dense warm-up, 3 sparse : 1 dense, dense finish)
  versions of one backbone (D 512, 8 layers, FFN 1408, seq 1024, batch 32), every model the same GPU
  seconds. A probe run per model (``--probe-steps``, seed 0) measures its settled step time. Each
  seed then trains until its steady training seconds reach ``--seconds``, the LR on
  ``TimeSchedule``: warm-up over ``optim.warmup_steps`` steps as the trainer's, then the cosine as a
  function of the steady seconds, at its floor when the budget is spent; ``train.steps`` is only a
  bound (3x the probe's estimate). The neuron-routed model keeps a step count (``--seconds`` / the
  probe's step time): its schedule's phases (dense warm-up and finish, re-grouping) are fractions of
  a step total, as are DST's. ``--fixed-steps``: every model that way (a probe under-rates
  CUDA-graphed runs, which then train short of the budget; the clock does not). Printed: val loss,
  steps taken, tokens seen, epochs of the token folder's training tokens (a note past 1: val loss
  then pays for repetition), steady training seconds, tokens/s. Every suite not named ``speed_*``
  runs this way.
- ``speed_2k``: tokens/s of a D 2048 backbone (4 layers, FFN 5632, 16k tokens a step) with the dense
  FFN and with the neuron-routed FFN at 4 of 16 groups in every step (sparse steps only: the
  schedule's dense steps run the dense FFN plus the router, timed by bench/neuron_ffn.py).
- ``speed_4k``: the same at LLaMA-7B's width (D 4096, FFN 11008, 32 heads / 8 KV; 4 layers, 16k
  tokens a step).
- ``speed_512``: equal_time's dense and MoE models, ``--speed-steps`` steps each: the MoE step
  against the dense step (issue 16's small-model overhead); with ``--profile-at N`` each run also
  profiles three steps (``logging.profile_at``) and prints where the device time went.
- ``speed_512_graphs``: ``speed_512`` with the compiled blocks captured as CUDA graphs
  (``train.compile_mode=reduce-overhead``; with ``--compile``): the host's launch cost taken out.
- ``speed_2k_graphs``: ``speed_2k`` with the compiled blocks captured as CUDA graphs (with
  ``--compile``): the neuron-routed sparse step is launch-bound at D 2048 when eager
  (BENCHMARKS.md, Neuron-routed FFN).
- ``speed_2k_fp32router``: ``speed_2k``'s neuron-routed FFN with
  ``model.neuron.low_precision_router=false`` (its router reading the float32 residual instead of
  the bf16 one), to run beside ``speed_2k``.
- ``speed_512_graphs_fp32router``: ``speed_512_graphs``' MoE with
  ``model.moe.low_precision_router=false`` (the router reading the float32 residual instead of the
  bf16 one), to run beside ``speed_512_graphs``.
- ``equal_time_graphs``: ``equal_time``'s dense and MoE runs the same way (with ``--compile``).
- ``equal_time_moe_shapes``: dense and three other MoE layouts of the same active FFN FLOPs at equal
  time, as CUDA graphs (with ``--compile``): 1 shared expert + top-1 of 8 (hidden 704 each), top-1
  of 8 at 1408 (both top-1 layouts with the Switch router), top-4 of 16 at 352.
- ``equal_time_moe_experts``: dense against top-2 of 16 and of 32 experts at 704 (the same active
  FLOPs as top-2 of 8), as CUDA graphs (with ``--compile``).
- ``equal_time_moe_interleaved``: dense against MoE in every other layer (layers 1, 3, 5, 7; dense
  FFNs in 0, 2, 4, 6, GShard / Switch's layout), top-2 of 8 and of 16 at 704, as CUDA graphs (with
  ``--compile``).
- ``speed_fp8``: equal_time's MoE with bf16 and with FP8 expert GEMMs (``model.moe.precision=fp8``),
  the same seed and ``--speed-steps`` steps each: val loss (the FP8 run should land within 0.5% of
  bf16's), last training loss, tokens/s. Steady seconds leave out steps over twice the median step
  (the first compile, CUDA-graph capture, recompiles at phase changes, the re-clustering step,
  profiled steps): the run's own median, or in a time-budgeted run the probe's settled step, since
  that run's clock must count as it goes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import StepTimes  # noqa: E402
from moezoo.configs import ConfigError, exit_code, load_config  # noqa: E402
from moezoo.configs.errors import check  # noqa: E402
from moezoo.kernels import grouped_wgrad  # noqa: E402
from moezoo.training.profile import format_summary  # noqa: E402

BACKBONE = [
    "model.dim=512",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.ffn_hidden=1408",
    "model.max_seq_len=1024",
    "train.seq_len=1024",
    "train.batch_size=32",
    "optim.lr=2e-3",
    "optim.warmup_steps=50",
]
BACKBONE_2K = [
    "model.dim=2048",
    "model.n_layers=4",
    "model.n_heads=16",
    "model.n_kv_heads=8",
    "model.ffn_hidden=5632",
    "model.max_seq_len=2048",
    "train.seq_len=2048",
    "train.batch_size=8",
]
BACKBONE_4K = [
    "model.dim=4096",
    "model.n_layers=4",
    "model.n_heads=32",
    "model.n_kv_heads=8",
    "model.ffn_hidden=11008",
    "model.max_seq_len=2048",
    "train.seq_len=2048",
    "train.batch_size=8",
]
# the neuron-routed FFN at 4 of 16 groups in every step (no dense warm-up, finish or re-grouping
# steps)
NEURON_SPARSE = [
    "model.neuron.num_groups=16",
    "model.neuron.top_k_groups=4",
    "model.neuron.warmup_fraction=0",
    "model.neuron.finish_fraction=0",
    "model.neuron.sparse_ratio=1.0",
    "model.neuron.recluster=false",
]
# a few-step warm-up: a run of a few seconds reaches its cosine (the presets warm up over 30 steps)
SMOKE = ["model.n_layers=2", "train.batch_size=2", "train.seq_len=64", "optim.warmup_steps=5"]
SUITES = {  # name -> {run: (preset, overrides)}
    "equal_time": {
        "dense": ("zoo/tiny_dense.yaml", BACKBONE),
        "moe": ("zoo/tiny_moe.yaml", BACKBONE + ["model.moe.hidden_dim=704"]),
        "neuron": ("zoo/tiny_neuron.yaml", BACKBONE),
    },
    "speed_2k": {
        "dense_2k": ("zoo/tiny_dense.yaml", BACKBONE_2K),
        "neuron_2k": ("zoo/tiny_neuron.yaml", BACKBONE_2K + NEURON_SPARSE),
    },
    # a 7B-wide layer (LLaMA-7B's D and FFN), 4 of them: where the layer gains most over dense
    # (BENCHMARKS.md, Neuron-routed FFN)
    "speed_4k": {
        "dense_4k": ("zoo/tiny_dense.yaml", BACKBONE_4K),
        "neuron_4k": ("zoo/tiny_neuron.yaml", BACKBONE_4K + NEURON_SPARSE),
    },
    # issue 16's small-model overhead: the MoE step against the dense step, same backbone
    "speed_512": {
        "dense": ("zoo/tiny_dense.yaml", BACKBONE),
        "moe": ("zoo/tiny_moe.yaml", BACKBONE + ["model.moe.hidden_dim=704"]),
    },
    "speed_fp8": {
        "moe_bf16": ("zoo/tiny_moe.yaml", BACKBONE + ["model.moe.hidden_dim=704"]),
        "moe_fp8": (
            "zoo/tiny_moe.yaml",
            BACKBONE + ["model.moe.hidden_dim=704", "model.moe.precision=fp8"],
        ),
    },
    "smoke": {  # this script on CPU in seconds
        "dense": ("zoo/tiny_dense.yaml", SMOKE),
        "moe": ("zoo/tiny_moe.yaml", SMOKE),
        "neuron": ("zoo/tiny_neuron.yaml", SMOKE),
    },
}


def with_overrides(suite: str, suffix: str, extra: list, runs=None) -> dict:
    """``suite``'s runs (those named in ``runs``, else all) with ``extra`` overrides, each renamed
    ``<run>_<suffix>``."""
    return {
        f"{name}_{suffix}": (preset, ov + extra)
        for name, (preset, ov) in SUITES[suite].items()
        if runs is None or name in runs
    }


def with_graphs(suite: str, runs=None) -> dict:
    """``suite``'s runs with --compile's blocks replayed as CUDA graphs
    (train.compile_mode=reduce-overhead)."""
    return with_overrides(suite, "graphs", ["train.compile_mode=reduce-overhead"], runs)


SUITES["speed_512_graphs"] = with_graphs("speed_512")
# the same with train.param_dtype=bfloat16 (bf16 matmul weights, float32 masters in
# training.optim.MasterAdamW)
SUITES["speed_512_graphs_bf16w"] = with_overrides(
    "speed_512_graphs", "bf16w", ["train.param_dtype=bfloat16"]
)
# the MoE with its router reading the float32 residual (a float32 FFMA GEMM; the default router
# reads the bf16 one)
SUITES["speed_512_graphs_fp32router"] = with_overrides(
    "speed_512_graphs", "fp32router", ["model.moe.low_precision_router=false"], ("moe_graphs",)
)
SUITES["speed_2k_graphs"] = with_graphs("speed_2k")
# the neuron-routed FFN with its router reading the float32 residual
SUITES["speed_2k_fp32router"] = with_overrides(
    "speed_2k", "fp32router", ["model.neuron.low_precision_router=false"], ("neuron_2k",)
)
# dense against MoE at equal time, each at its fastest step (CUDA graphs take the launch cost off
# the MoE step, little off dense's: BENCHMARKS.md, MoE and dense in the trainer)
SUITES["equal_time_graphs"] = with_graphs("equal_time", ("dense", "moe"))
# MoE layouts of the same active FFN FLOPs (hidden 1408 a token) against dense, CUDA graphs: a
# shared expert carries half the FLOPs in one dense GEMM (DeepSeekMoE, Qwen-MoE) with top-1 of 8
# routed, top-1 of 8 at 1408 routes each row once (Switch), top-4 of 16 at 352 is DeepSeekMoE's
# finer segmentation. The top-1 layouts use the Switch router: a renormalised top-1 weight is always
# 1.0, so a softmax router would learn from the balance loss only (the config refuses it). Results:
# BENCHMARKS.md, MoE and dense in the trainer.
_TOP1 = ["model.moe.top_k=1", "model.moe.router=switch"]
_MOE_SHAPES = {
    "moe_shared": ["model.moe.shared_experts=1", *_TOP1, "model.moe.hidden_dim=704"],
    "moe_top1": [*_TOP1, "model.moe.hidden_dim=1408"],
    "moe_fine": ["model.moe.num_experts=16", "model.moe.top_k=4", "model.moe.hidden_dim=352"],
}
SUITES["moe_shapes"] = {
    "dense": SUITES["equal_time"]["dense"],
    **{n: ("zoo/tiny_moe.yaml", BACKBONE + ov) for n, ov in _MOE_SHAPES.items()},
}
SUITES["equal_time_moe_shapes"] = with_graphs("moe_shapes")
# More experts at the same active FLOPs (top-2 at 704): expert parameters 2x and 4x the 8-expert
# MoE's, the per-token gain of routing growing with the expert count (Switch, DeepSeekMoE), against
# smaller groups per GEMM and a larger optimizer step (BENCHMARKS.md, MoE and dense in the
# trainer).
SUITES["moe_experts"] = {
    "dense": SUITES["equal_time"]["dense"],
    **{
        f"moe_e{e}": (
            "zoo/tiny_moe.yaml",
            BACKBONE + [f"model.moe.num_experts={e}", "model.moe.hidden_dim=704"],
        )
        for e in (16, 32)
    },
}
SUITES["equal_time_moe_experts"] = with_graphs("moe_experts")
# MoE in every other layer (GShard, Switch): half the layers pay the routing overhead, half keep the
# dense FFN's step. MoE in all 8 layers costs more than the dense step and ends above dense's val
# loss at equal time (BENCHMARKS.md, MoE and dense in the trainer): this asks whether half the
# overhead buys more than half the per-token gain.
_INTERLEAVED = ['model.ffn_layers={"0,2,4,6": dense}', "model.moe.hidden_dim=704"]
SUITES["moe_interleaved"] = {
    "dense": SUITES["equal_time"]["dense"],
    **{
        f"moe_alt_e{e}": (
            "zoo/tiny_moe.yaml",
            BACKBONE + _INTERLEAVED + [f"model.moe.num_experts={e}"],
        )
        for e in (8, 16)
    },
}
SUITES["equal_time_moe_interleaved"] = with_graphs("moe_interleaved")


# A time-budgeted run's train.steps: this times the probe's estimate, a bound meant never to be
# reached (the clock ends the run). Generous, since a probe slowed by process start-up or by
# neighbours (CPU tests under xdist, other processes on a loaded 2-core machine) can estimate steps
# up to ~5x slower than the run then takes, and a tighter bound would stop the run short of its
# budget.
STEP_BOUND = 8.0


class TimeSchedule:
    """training.optim.build_scheduler's LR shape on a clock instead of a step count: the linear
    warm-up over ``optim.warmup_steps`` steps (from lr / warmup_steps), then the cosine from lr to
    ``lr * min_lr_ratio`` over the steady seconds from the warm-up's end to ``seconds``; at the
    floor once ``seconds`` are spent.

    Stands in for a Trainer's ``scheduler`` (the trainer is unchanged): its ``step()``, which
    train_step calls after the optimizer step, counts the step; ``advance(steady_s)``, which the
    bench calls once it has timed a step (in order; train_run: a step late, so the host need not
    wait for each step), adds the step's steady seconds (0 for a step left out) and sets the next
    step's LR in every param group: the warm-up's by the step count, the cosine's by the seconds
    timed so far. Not checkpointable: the bench saves no checkpoints."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg, seconds: float):
        self.optimizer, self.seconds = optimizer, seconds
        self.warmup, self.floor = cfg.warmup_steps, cfg.min_lr_ratio
        # each group's base LR, stored by the schedulers build_scheduler made before they changed
        # "lr"
        self.base = [g["initial_lr"] for g in optimizer.param_groups]
        self.steps, self.timed, self.elapsed, self.warm_s = 0, 0, 0.0, 0.0
        self._set_lr()

    def factor(self) -> float:
        """The next step's LR over the base LR."""
        if self.elapsed >= self.seconds:
            return self.floor
        if self.steps < self.warmup:  # LinearLR's ramp: 1 / warmup at step 0, 1 at step warmup
            return (1 + (self.warmup - 1) * self.steps / self.warmup) / self.warmup
        done = (self.elapsed - self.warm_s) / (self.seconds - self.warm_s)
        return self.floor + (1 - self.floor) * (1 + math.cos(math.pi * done)) / 2

    def step(self) -> None:
        self.steps += 1

    def advance(self, steady_s: float) -> None:
        self.elapsed += steady_s
        self.timed += 1
        # the cosine starts where the warm-up ends, as build_scheduler's
        if self.timed <= self.warmup:
            self.warm_s = self.elapsed
        self._set_lr()

    def _set_lr(self) -> None:
        f = self.factor()
        for g, base in zip(self.optimizer.param_groups, self.base):
            g["lr"] = base * f


def step_scheduled(cfg) -> bool:
    """Whether a sparsity method of ``cfg``'s trainer is scheduled on ``train.steps``: the
    neuron-routed FFN (dense warm-up and finish phases, re-grouping) and DST (its update period and
    end)."""
    return "neuron" in cfg.model.layer_ffn_types() or cfg.dst.enabled


def make_config(preset, overrides, seed, steps, device, tokens_dir, out_dir, compile_=False):
    common = [
        "logging.wandb=disabled",
        "logging.progress=false",
        "checkpoint.every=0",
        f"train.device={device}",
        f"train.compile={str(compile_).lower()}",
        f"train.seed={seed}",
        f"train.steps={steps}",
        "train.eval_batches=16",
        f"train.out_dir={out_dir}",
        f"train.eval_every={max(steps, 1)}",
        f"data.tokenizer={os.path.join(tokens_dir, 'tokenizer.model')}",
    ]
    return load_config(preset, overrides + common)


def use_tokens(tokens_dir) -> int:
    """Make the trainer read DIR's token files instead of building the corpus (same tokens
    everywhere). Returns the number of training tokens (an equal-time run's epochs are its tokens
    seen over this)."""
    import moezoo.training.loop
    from moezoo.training.data import TokenData
    from moezoo.training.tokenizer import Tokenizer

    with open(os.path.join(tokens_dir, "meta.json")) as f:
        dtype = np.dtype(json.load(f)["dtype"])
    tok = Tokenizer(os.path.join(tokens_dir, "tokenizer.model"))
    arrays = {
        s: np.memmap(os.path.join(tokens_dir, f"tokens_{s}.bin"), dtype=dtype, mode="r")
        for s in ("train", "val")
    }
    moezoo.training.loop.prepare_data = lambda cfg, *a, **k: TokenData(
        tok, arrays["train"], arrays["val"]
    )
    return len(arrays["train"])


def prepare(out, source, max_files, vocab, max_tokens=0, cache_dir=None):
    """Corpus -> tokenizer + token files in ``out`` (training.data's own code and cache:
    ``cache_dir``, else data.cache_dir's default). ``max_tokens``: keep only the first N tokens of
    each split (a folder that fits one device transfer of 64 MiB)."""
    from moezoo.training.data import prepare_data

    cache = [f"data.cache_dir={cache_dir}"] if cache_dir else []
    cfg = load_config(
        "zoo/tiny_dense.yaml",
        [
            f"data.source={source}",
            f"data.max_files={max_files}",
            "data.val_fraction=0.1",
            f"model.vocab_size={vocab}",
            "train.seq_len=1024",
            "model.max_seq_len=1024",
            *cache,
        ],
    )
    td = prepare_data(cfg)
    os.makedirs(out, exist_ok=True)
    keep = {
        s: getattr(td, s)[:max_tokens] if max_tokens else getattr(td, s) for s in ("train", "val")
    }
    for split, arr in keep.items():
        arr.tofile(os.path.join(out, f"tokens_{split}.bin"))
    shutil.copy(td.tokenizer.path, os.path.join(out, "tokenizer.model"))
    from moezoo.training.corpus import load_documents, split_documents

    docs = load_documents(cfg.data)
    train, val = split_documents(docs, cfg.data.val_fraction)
    meta = {
        "source": source,
        "max_files": max_files,
        "vocab": vocab,
        "dtype": str(td.train.dtype),
        "tokens": {s: len(a) for s, a in keep.items()},
        "max_tokens": max_tokens,
        "documents": {"train": len(train), "val": len(val)},
        "val_names": sorted(d.name for d in val),
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print({k: v for k, v in meta.items() if k != "val_names"})


def train_run(preset, overrides, seed, steps, args, tag, budget=None) -> dict:
    """One Trainer run, each step timed (bench.timing.StepTimes: on CUDA an event after each step,
    so nothing makes the host wait a step, as in train.py, and a step's time is the device's,
    including any wait for the host); val loss at the end. With a budget, on CUDA, the clock learns
    each step's time a step late.

    ``budget=None``: ``steps`` steps on the trainer's LR schedule; steady steps are those up to
    twice the run's median step. ``budget=(seconds, step_s)``: steps until the steady seconds reach
    ``seconds`` (at most ``steps``, a bound), the LR on TimeSchedule; a step is steady when it takes
    up to twice ``step_s``, the probe's settled step (the clock runs during the run; the run's own
    median is known at its end).
    """
    from moezoo.layers import NeuronSchedule
    from moezoo.training.loop import Trainer

    dev = args.device
    profile = [f"logging.profile_at={args.profile_at}"] if args.profile_at else []
    cfg = make_config(
        preset,
        overrides + profile,
        seed,
        steps,
        dev,
        args.tokens,
        os.path.join(args.runs, tag),
        args.compile,
    )
    # what earlier runs in this process still hold (their CUDA-graph pools live as long as the
    # compiled code that replays them): left out of this run's peak, so seed 1's peak is not seed
    # 0's plus its own
    held = torch.cuda.memory_allocated() if dev == "cuda" else 0
    tr = Trainer(cfg)
    clock = None
    if budget:
        tr.scheduler = clock = TimeSchedule(tr.optimizer, cfg.optim, budget[0])
    neuron = next((s for s in tr.sparsity if isinstance(s, NeuronSchedule)), None)
    times, covered, phases, losses, prof, wall = [], [], [], [], None, 0.0
    clocked = StepTimes(dev == "cuda")

    # the profiled steps carry the profiler's overhead, and the step after them its trace export (it
    # lands in that step's interval, as bench/torchtitan_moe.py leaves out too): inf, never "steady"
    def take(ts):
        nonlocal wall
        for t in ts:
            wall += t
            times.append(float("inf") if covered[len(times)] else t)
            if clock:
                clock.advance(times[-1] if times[-1] <= 2 * budget[1] else 0.0)

    while tr.step < steps and not (clock and clock.elapsed >= clock.seconds):
        tr.profiler.before(tr.step + 1)
        m = tr.train_step()
        clocked.mark()
        covered.append(tr.profiler.covers(tr.step) or tr.profiler.covers(tr.step - 1))
        # on CUDA the clock learns each step's time a step late (the LR it sets too; one step more
        # may run past the budget); on CPU a step has ended when train_step returns
        take(clocked.ready(keep=1 if dev == "cuda" else 0))
        prof = tr.profiler.after(tr.step) or prof
        phases.append(neuron.phase if neuron else "dense")
        losses.append(m["loss/total"].detach().float())  # read once after the run
    take(clocked.ready())
    losses = torch.stack(losses).tolist()
    tr.settle()  # the last step's skip flag (training.loop.skips_on_device)
    med = statistics.median([t for t in times if t < float("inf")] or [0.0])
    # the longest steady step; with a budget the clock's own rule
    limit = 2 * (budget[1] if budget else med)
    steady = [t for t in times if t <= limit] or [float("inf")]
    out = {
        "steps": len(times),
        "tokens_seen": len(times) * tr.tokens_per_step,
        "wall_s": wall,
        "steady_s": sum(steady),
        "steady_steps": len(steady),
        "lr_end": tr.optimizer.param_groups[0]["lr"],
        # the median step of the run's second half: past compilation, CUDA-graph capture and warm-up
        "tail_median_s": statistics.median(
            [t for t in times[len(times) // 2 :] if t < float("inf")] or [med]
        ),
        "tokens_per_s": len(steady) * tr.tokens_per_step / sum(steady),
        "val": tr.evaluate(),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "skipped": tr.bad_total,
        "peak_gb": (torch.cuda.max_memory_allocated() - held) / 1e9 if dev == "cuda" else 0.0,
        "held_before_gb": held / 1e9,
        "mfu_flops_per_token": tr.flops_per_token,
    }
    # short of the budget only when the bound stopped it (steps far slower than the probe's)
    if budget:
        out.update(
            budget_s=budget[0], steps_bound=steps, budget_reached=clock.elapsed >= clock.seconds
        )
    for p in sorted(set(phases)):  # per-phase step time (neuron: sparse vs dense steps)
        ts = [t for t, q in zip(times, phases) if q == p and t <= limit]
        if ts:
            out[f"tokens_per_s_{p}"] = len(ts) * tr.tokens_per_step / sum(ts)
    if tr.peak_flops:
        out["mfu"] = out["tokens_per_s"] * tr.flops_per_token / tr.peak_flops
    if prof:
        # training.profile's summary; trace + op table under --runs/<tag>/profile
        out["profile"] = prof
    del tr
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def equal_time(suite, args) -> dict:
    res = {}
    for name, (preset, ov) in SUITES[suite].items():
        probe = train_run(preset, ov, 0, args.probe_steps, args, f"{name}_probe")
        # the probe's settled step time (the median of its second half: past compilation, graph
        # capture and warm-up) still under-rated the CUDA-graphed MoE runs by 7-11%
        # (moe_shared_switch: 1.097M tok/s against the run's 1.218M), too far off to size a run by:
        # it bounds the steps of a run that trains to the budget on its own clock, and sizes only
        # the step-scheduled runs (and --fixed-steps)
        step_s = probe["tail_median_s"]
        steps = max(args.probe_steps, int(args.seconds / step_s))
        timed = not args.fixed_steps and not step_scheduled(load_config(preset, ov))
        budget = (args.seconds, step_s) if timed else None
        if timed:
            steps, how = int(STEP_BOUND * steps), f"until {args.seconds} steady s (~{steps} steps)"
        else:
            how = f"{steps} steps for {args.seconds} s"
        settled = probe["tokens_seen"] / probe["steps"] / step_s
        print(f"{name}: probe {settled:.0f} tok/s settled -> {how}", flush=True)
        res[name] = {"probe": probe, "seeds": {}}
        for seed in args.seeds:
            r = train_run(preset, ov, seed, steps, args, f"{name}_s{seed}", budget)
            r["epochs"] = r["tokens_seen"] / args.train_tokens
            if budget and not r["budget_reached"]:
                print(
                    f"{name} {seed}: short of the budget, "
                    f"stopped at its bound of {r['steps']} steps "
                    f"after {r['steady_s']:.1f} steady s",
                    flush=True,
                )
            res[name]["seeds"][seed] = r
            print(
                name,
                seed,
                {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()},
                flush=True,
            )
    return res


def speed(suite, args) -> dict:
    res = {}
    for name, (preset, ov) in SUITES[suite].items():
        res[name] = train_run(preset, ov, 0, args.speed_steps, args, name)
        print(
            name,
            {k: round(v, 4) if isinstance(v, float) else v for k, v in res[name].items()},
            flush=True,
        )
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", default=None, help="write the tokens to this folder and exit")
    ap.add_argument("--source", default="python_packages")
    ap.add_argument("--max-files", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="with --prepare: keep the first N tokens of each split (0 = all)",
    )
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="with --prepare: data.cache_dir, where the tokenizer and token cache go (default: the "
        "config's)",
    )
    ap.add_argument("--tokens", default=None, help="folder written by --prepare")
    ap.add_argument("--suite", default="equal_time,speed_2k")
    ap.add_argument(
        "--seconds", type=float, default=15.0, help="steady training seconds per equal-time run"
    )
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--probe-steps", type=int, default=30)
    ap.add_argument(
        "--fixed-steps",
        action="store_true",
        help="equal-time runs: the probe's step count for every model (the LR cosine over steps) "
        "instead of training each to --seconds of steady time",
    )
    ap.add_argument("--speed-steps", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--compile", action="store_true", help="train.compile=true (per-block torch.compile)"
    )
    ap.add_argument(
        "--profile-at",
        type=int,
        default=0,
        help="logging.profile_at: profile 3 steps from this one in every run (0 = off)",
    )
    ap.add_argument("--runs", default="/tmp/train_moe")
    ap.add_argument(
        "--wgrad-splits",
        type=int,
        default=None,
        help="split every bf16 expert weight gradient into this many row parts "
        "(kernels.grouped_wgrad; default: its own choice), e.g. 1 for the unsplit GEMMs",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.wgrad_splits is not None:
        check(args.wgrad_splits >= 1, "--wgrad-splits", f"must be >= 1, got {args.wgrad_splits}")
        grouped_wgrad.SPLITS = args.wgrad_splits  # this benchmark process only
    if args.prepare:
        return prepare(
            args.prepare, args.source, args.max_files, args.vocab, args.max_tokens, args.cache_dir
        )
    for suite in args.suite.split(","):  # before any training: one line, exit 2
        if suite not in SUITES:
            raise ConfigError("--suite", f"unknown suite {suite!r} (one of {', '.join(SUITES)})")
        graphs = any("train.compile_mode=reduce-overhead" in ov for _, ov in SUITES[suite].values())
        if graphs and not args.compile:
            raise ConfigError(
                "--suite", f"{suite} replays the compiled blocks as CUDA graphs: add --compile"
            )
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.train_tokens = use_tokens(args.tokens)
    # a neuron block has a sparse and a dense training graph besides evaluation's: room for all of
    # them
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    out = {
        "env": {
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "torch": torch.__version__,
        },
        "args": {k: v for k, v in vars(args).items()},
    }
    for suite in args.suite.split(","):
        out[suite] = speed(suite, args) if suite.startswith("speed") else equal_time(suite, args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    report(out)


def report(out):
    for suite, res in out.items():
        if suite in ("env", "args"):
            continue
        print(f"\n{suite}")
        if suite.startswith("speed"):
            print(
                f"{'run':12s} {'tok/s':>10s} {'MFU':>6s} {'peak GB':>8s} "
                f"{'loss last':>9s} {'val':>7s}"
            )
            for name, r in res.items():
                print(
                    f"{name:12s} {r['tokens_per_s']:10.0f} {r.get('mfu', 0):6.3f} "
                    f"{r['peak_gb']:8.1f} {r['loss_last']:9.4f} {r['val']:7.4f}"
                )
            for name, r in res.items():
                if "profile" in r:
                    print(f"{name:12s} profile: {format_summary(r['profile'])}")
            continue
        print(
            f"{'run':12s} {'seed':>4s} {'steps':>6s} {'tokens':>10s} {'epochs':>6s} "
            f"{'steady s':>8s} {'tok/s':>10s} {'val':>7s}"
        )
        for name, r in res.items():
            for seed, s in r["seeds"].items():
                print(
                    f"{name:12s} {seed:>4} {s['steps']:6d} {s['tokens_seen']:10d} "
                    f"{s['epochs']:6.2f} {s['steady_s']:8.1f} {s['tokens_per_s']:10.0f} "
                    f"{s['val']:7.4f}"
                )
        most = max(s["epochs"] for r in res.values() for s in r["seeds"].values())
        if most > 1:
            # a faster model repeats more of a small corpus: its val loss then pays for memorising,
            # so the comparison favours the slower one
            print(
                f"note: up to {most:.1f} epochs of the training tokens; "
                "val loss measures repetition as well "
                "(prepare a larger folder: bench/moe_gpu.sh's equal part tokenises on the device)"
            )


if __name__ == "__main__":
    sys.exit(exit_code(main))
