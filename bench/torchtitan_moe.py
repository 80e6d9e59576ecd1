"""Our MoE decoder vs torchtitan's on the same fine-grained model, one GPU: tokens/s, MFU, peak
memory and the loss of both over the same steps.

    python bench/torchtitan_moe.py [--layers 8] [--steps 30] [--batch 4] [--tokens DIR]
        [--out f.json]
        [--profile-at 10]            # also: where each model's device time goes (3 profiled steps)
    python bench/torchtitan_moe.py --smoke --device cpu      # this script on CPU, tiny shapes

Model (OLMoE-1B-7B's layer shape): D 2048, 16 heads of 128 (no GQA), 64 experts top-8, expert hidden
1024, vocab 50304, seq 4096, untied embeddings, RMSNorm, RoPE, no qk-norm. Ours:
``zoo.model.build_model`` with ``model.ffn=moe`` (softmax top-k renormalised, aux-loss-free bias
balancing at rate 1e-3, no aux loss). torchtitan 0.3.0: its Qwen3 MoE block built from its own
config helpers with the same router (softmax, ``route_norm``, ``load_balance_coeff`` 1e-3) and
qk-norm off; its attention is FlexAttention (0.3.0 has no SDPA path for language models), ours SDPA.
Init: Normal(0.02), output projections 0.02 / sqrt(2 L) in ours, torchtitan's Megatron-style
residual init in theirs.

``ours_bf16`` is ours with ``train.param_dtype: bfloat16`` (matmul weights held in bf16, their
float32 masters in ``training.optim.MasterAdamW``, whose one fused pass applies the clipping factor,
updates and writes the bf16 copy): the same numbers as ours, the trainer's faster precision layout.

All run the same loop: fp32 master weights, fused AdamW (lr 3e-4, wd 0.1), bf16 autocast, every
block ``torch.compile``'d and the loss compiled (ours: as train.compile; theirs: likewise per block,
and the loss as its trainer's compile.components "loss"), the same batches (``--tokens``: a
bench/train_moe.py --prepare folder, else seeded random ids), so the difference is the model code
and how each trainer copies a batch to the GPU: ours as train.py does (a pinned copy, queued without
waiting: kernels.launch.to_device), torchtitan's as its trainer does (``.to(device)``, which waits
for the last step); ``--feed pinned`` / ``--feed blocking`` feed both alike. torchtitan's aux-free
bias update runs through its optimizer hook (``register_moe_load_balancing_hook``) when available;
ours after each step (layers.moe_update_bias). MFU counts active FLOPs (zoo.flops: 6 N_active +
attention) against the GPU's dense bf16 peak. Before any work, the plan's memory estimate must fit
the GPU (one-line error naming ``--layers``/``--batch`` otherwise). Needs torchtitan 0.3.0 and what
it imports that the H200 image lacks, as wheels (device README recipe): torchtitan==0.3.0
spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 shtab==1.13.0 (checked on
CPU, torch 2.13: both models build with the same parameter count, 197,952 at the smoke shapes, and
start at the same loss; torchtitan's FlexAttention has no CPU backward, so the smoke test runs its
forward only). Results: BENCHMARKS.md, Against torchtitan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import StepTimes  # noqa: E402
from moezoo.kernels.launch import to_device  # noqa: E402

SHAPE = dict(
    dim=2048,
    n_heads=16,
    head_dim=128,
    experts=64,
    top_k=8,
    expert_hidden=1024,
    vocab=50304,
    seq=4096,
)
SMOKE = dict(
    dim=64, n_heads=4, head_dim=16, experts=8, top_k=2, expert_hidden=32, vocab=512, seq=64
)


def our_config(s, n_layers):
    from moezoo.configs import ModelConfig, MoEConfig

    moe = MoEConfig(
        num_experts=s["experts"],
        top_k=s["top_k"],
        hidden_dim=s["expert_hidden"],
        router="softmax",
        norm_topk=True,
        aux_loss_coef=0.0,
        bias_update_rate=1e-3,
    )
    return ModelConfig(
        vocab_size=s["vocab"],
        dim=s["dim"],
        n_layers=n_layers,
        n_heads=s["n_heads"],
        ffn="moe",
        moe=moe,
        max_seq_len=s["seq"],
        tie_embeddings=False,
    )


def build_ours(s, n_layers, device, compile_loss=False):
    from moezoo.zoo.model import build_model, mean_cross_entropy

    model = build_model(our_config(s, n_layers), device)
    if compile_loss:  # as training.loop does with train.compile
        model.cross_entropy = torch.compile(mean_cross_entropy, dynamic=False)

    def loss_fn(x, y):
        return model(x, y)[0]

    def after_step():
        from moezoo.layers import moe_update_bias

        moe_update_bias(model)

    return model, list(model.layers), loss_fn, after_step


def _torch_211_stand_in():
    """torchtitan 0.3.0 imports FSDP2's ``DataParallelMeshDims`` (torch >= 2.12) at module level for
    its multi-GPU wrapping; the one-GPU model here never builds one. On an older torch (the GPU
    images have 2.11) a stand-in dataclass lets its model code import; only this bench process sees
    it."""
    import dataclasses

    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims


def _titan_cross_entropy(logits, y):
    """torchtitan's cross_entropy_loss (its components/loss.py): float32 logits, mean over the
    tokens."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def build_titan(s, n_layers, device, compile_loss=False):
    _torch_211_stand_in()
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import (
        get_attention_config,
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        Qwen3TransformerBlock,
        _moe_experts_init,
        _qwen3_norm,
        _residual_output_init,
    )

    D, hd = s["dim"], s["head_dim"]
    rope = CosSinRoPE.Config(dim=hd, max_seq_len=s["seq"], theta=10000.0)
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=_qwen3_norm(D),
            ffn_norm=_qwen3_norm(D),
            attention=make_gqa_config(
                dim=D,
                n_heads=s["n_heads"],
                n_kv_heads=s["n_heads"],
                head_dim=hd,
                wqkv_param_init=_LINEAR_INIT,
                wo_param_init=_residual_output_init(n_layers),
                inner_attention=get_attention_config("flex"),
                fuse_qkv=True,
                rope=rope,
                qk_norm=None,
            ),
            moe=make_moe_config(
                num_experts=s["experts"],
                load_balance_coeff=1e-3,
                router=make_router_config(
                    dim=D,
                    num_experts=s["experts"],
                    gate_param_init=_LINEAR_INIT,
                    top_k=s["top_k"],
                    score_func="softmax",
                    route_norm=True,
                ),
                routed_experts=make_routed_experts_config(
                    dim=D,
                    hidden_dim=s["expert_hidden"],
                    num_experts=s["experts"],
                    top_k=s["top_k"],
                    param_init=_moe_experts_init(n_layers),
                    comm_backend="standard",
                ),
            ),
        )
        for _ in range(n_layers)
    ]
    V = s["vocab"]
    cfg = Qwen3Model.Config(
        vocab_size=V,
        dim=D,
        norm=_qwen3_norm(D),
        layers=layers,
        tok_embeddings=Embedding.Config(
            num_embeddings=V, embedding_dim=D, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=D, out_features=V, param_init=_LINEAR_INIT),
    )
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    masks = {}

    def loss_fn(x, y):
        if "m" not in masks:  # the causal BlockMask for this sequence length, shared by the batch
            # built with torch's own create_block_mask: torchtitan 0.3.0's helper passes a keyword
            # (separate_full_blocks) that torch 2.11 does not take; the mask is the same causal one
            from torch.nn.attention.flex_attention import create_block_mask

            S = x.shape[1]
            masks["m"] = create_block_mask(
                lambda b, h, q, k: q >= k, None, None, S, S, device=x.device
            )
        return ce(model(x, positions=None, attention_masks=masks["m"]), y)

    # torchtitan's trainer compiles its loss when compiling the model (compile.components: model,
    # loss)
    ce = (
        torch.compile(_titan_cross_entropy, dynamic=False) if compile_loss else _titan_cross_entropy
    )
    return model, list(model.layers.values()), loss_fn, None


def fit_check(s, n_layers, batch, device) -> dict:
    """Memory plan (bytes): fp32 weights + grads + 2 Adam moments (16 B/param) plus activations
    (measured order: ~1.9 GB per layer per 16k tokens at this shape, kept generous at 3 GB)."""
    from moezoo.zoo.flops import count_params, flops_per_token
    from moezoo.zoo.model import build_model

    cfg = our_config(s, n_layers)
    counts = count_params(build_model(cfg, "meta"))
    tokens = batch * s["seq"]
    need = 16 * counts.total + n_layers * 3e9 * tokens / 16384 + 4 * tokens * s["vocab"] * 3
    plan = {
        "params": counts.total,
        "active": counts.active,
        "need_gb": need / 1e9,
        "flops_per_token": flops_per_token(cfg, s["seq"], counts),
    }
    if device == "cuda":
        have = torch.cuda.get_device_properties(0).total_memory
        plan["have_gb"] = have / 1e9
        if need > 0.92 * have:
            print(
                f"--layers {n_layers} --batch {batch}: needs ~{need / 1e9:.0f} GB, the GPU has "
                f"{have / 1e9:.0f} GB; lower --layers or --batch",
                file=sys.stderr,
            )
            sys.exit(2)
    return plan


def batches(args, s, steps):
    if args.tokens:
        with open(os.path.join(args.tokens, "meta.json")) as f:
            dtype = np.dtype(json.load(f)["dtype"])
        data = np.memmap(os.path.join(args.tokens, "tokens_train.bin"), dtype=dtype, mode="r")
    else:
        data = np.random.default_rng(0).integers(0, s["vocab"], 1 << 22).astype(np.int64)
    g = np.random.default_rng(1)
    for _ in range(steps):
        starts = g.integers(0, len(data) - s["seq"] - 1, args.batch)
        w = torch.from_numpy(
            np.stack([np.asarray(data[i : i + s["seq"] + 1], dtype=np.int64) for i in starts])
        )
        w = w % s["vocab"]  # a smaller vocabulary than the tokenizer's (the smoke shapes)
        yield w[:, :-1], w[:, 1:]


def train(name, build, s, args, plan) -> dict:
    dev = args.device
    torch.manual_seed(0)
    model, blocks, loss_fn, after_step = build(s, args.layers, dev, compile_loss=args.compile)
    master = None
    if name == "ours_bf16":
        # train.param_dtype=bfloat16: the matmul weights in bf16, their float32 masters in the
        # optimizer, the clipping factor applied inside its fused update (the same AdamW
        # hyper-parameters as the others)
        from moezoo.training.optim import MasterAdamW, autocast_weights
        from moezoo.training.parallel import ParallelState, clip_coef, clip_grad_norm_

        opt = master = MasterAdamW(
            model.parameters(), autocast_weights(model), lr=3e-4, weight_decay=0.1
        )
        one = ParallelState(1, 0, 0, torch.device(dev), 1, 1, 1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=dev == "cuda")
    if args.compile:
        for b in blocks:
            b.compile(dynamic=False)
    if after_step is None:  # torchtitan's aux-free bias update, through its optimizer hook
        try:
            import types

            from torchtitan.components.optimizer import register_moe_load_balancing_hook

            one_gpu = types.SimpleNamespace(
                get_optional_mesh=lambda name: None, ep_enabled=False, tp=1
            )
            register_moe_load_balancing_hook(opt, [model], one_gpu)
        except Exception as e:  # noqa: BLE001 - report, keep the speed numbers
            print(name, "no load-balancing hook:", type(e).__name__, e, flush=True)
    # bf16 autocast on CUDA; on CPU (the smoke test) float32, but for bf16 weights, which need
    # autocast
    amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda" or master is not None)
    # FlexAttention has no CPU backward: on CPU (the smoke test) torchtitan's model runs forward
    # only
    forward_only = dev == "cpu" and name == "torchtitan"
    from moezoo.training.profile import StepProfiler

    prof = StepProfiler(
        args.profile_at, 3, os.path.join(args.profile_dir, name), 0, torch.device(dev)
    )
    # No host sync a step, as neither trainer has one (torchtitan's reads the loss at its log steps
    # only; train.py's non-finite check stays on the device): each step's time is the device's, from
    # an event after it (bench.timing.StepTimes), and the losses are read after the run.
    clocked, losses, summary = StepTimes(dev == "cuda"), [], None
    # Each model is fed as its trainer feeds it: train.py queues a pinned copy
    # (kernels.launch.to_device); torchtitan's trainer copies the batch with a plain `.to(device)`,
    # which waits for the previous step (--feed pinned / blocking: both models the same way, to
    # separate the model code from the feeding)
    pinned = args.feed == "pinned" or (args.feed == "own" and name.startswith("ours"))
    to_dev = to_device if pinned else torch.Tensor.to
    for step, (x, y) in enumerate(batches(args, s, args.steps), start=1):
        x, y = to_dev(x, dev), to_dev(y, dev)
        prof.before(step)
        with amp, torch.set_grad_enabled(not forward_only):
            loss = loss_fn(x, y)
        if not forward_only:
            loss.backward()
            if master is not None:
                opt.step(
                    grad_scale=clip_coef(
                        clip_grad_norm_(model.parameters(), 1.0, one, apply=False), 1.0
                    )
                )
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            opt.zero_grad(set_to_none=True)
            if after_step:
                after_step()
        losses.append(loss.detach().float())
        clocked.mark()
        summary = prof.after(step) or summary
    times = clocked.ready()
    losses = torch.stack(losses).tolist()
    warm = min(args.warmup, len(times) - 1)
    # the profiled steps (with the profiler's overhead) and the step after them (its interval holds
    # the profiler's export) stay out of tokens/s
    timed = [
        t
        for i, t in enumerate(times[warm:], start=warm + 1)
        if not (prof.covers(i) or prof.covers(i - 1))
    ]
    tok_s = len(timed) * args.batch * s["seq"] / sum(timed)
    # on CUDA: pinned, queued / blocking
    out = {
        "tokens_per_s": tok_s,
        "losses": losses,
        "step_ms": [t * 1e3 for t in times],
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else 0.0,
        "params": sum(p.numel() for p in model.parameters()),
        "forward_only": forward_only,
        "batch_copy": "moezoo.kernels.launch.to_device" if pinned else "Tensor.to",
    }
    if summary:
        out["profile"] = summary
    if name.startswith("ours"):  # how unevenly the last step routed: its grouped GEMMs' group sizes
        from moezoo.layers import MoE

        loads = [
            m.stats["tokens_per_expert"].float() for m in model.modules() if isinstance(m, MoE)
        ]
        out["expert_load_max_over_mean"] = [round((c.max() / c.mean()).item(), 2) for c in loads]
    if dev == "cuda":
        from moezoo.training.metrics import device_peak_flops

        peak = device_peak_flops(torch.device("cuda"))
        out["mfu"] = tok_s * plan["flops_per_token"] / peak if peak else None
    del model, opt
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--warmup", type=int, default=5, help="steps left out of tokens/s (compilation)"
    )
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument(
        "--only",
        default="ours,torchtitan,ours_bf16",
        help="ours_bf16: ours with train.param_dtype=bfloat16 (training.optim.MasterAdamW)",
    )
    ap.add_argument(
        "--profile-at",
        type=int,
        default=0,
        help="profile 3 steps from this one in both models (training.profile; 0 = off)",
    )
    ap.add_argument(
        "--profile-dir",
        default="/tmp/torchtitan_moe_profile",
        help="traces and op tables, per model",
    )
    ap.add_argument(
        "--feed",
        default="own",
        choices=("own", "pinned", "blocking"),
        help="how each batch reaches the GPU: as each trainer does "
        "(ours pinned and queued, torchtitan a blocking .to), or the same way for both",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    s = SMOKE if args.smoke else SHAPE
    plan = fit_check(s, args.layers, args.batch, args.device)
    print(
        "plan", {k: round(v, 3) if isinstance(v, float) else v for k, v in plan.items()}, flush=True
    )
    res = {"plan": plan, "shape": s, "args": vars(args), "torch": torch.__version__}
    builders = {"ours": build_ours, "ours_bf16": build_ours, "torchtitan": build_titan}
    failed = []
    for name in args.only.split(","):
        try:
            res[name] = train(name, builders[name], s, args, plan)
        except Exception:  # noqa: BLE001 - one model's failure must not cost the others' numbers
            import gc
            import traceback

            traceback.print_exc()
            print(name, "failed", flush=True)
            failed.append(name)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            continue
        r = res[name]
        print(
            name,
            f"{r['tokens_per_s']:.0f} tok/s",
            f"MFU {r.get('mfu') or 0:.3f}",
            f"peak {r['peak_gb']:.1f} GB",
            f"params {r['params']}",
            "loss",
            [round(v, 3) for v in r["losses"][:: max(1, args.steps // 6)]],
            flush=True,
        )
        if "expert_load_max_over_mean" in r:
            print(
                name,
                "last step, busiest expert's rows / mean, per layer:",
                r["expert_load_max_over_mean"],
                flush=True,
            )
        if "profile" in r:
            from moezoo.training.profile import format_summary

            print(name, "profile:", format_summary(r["profile"], args.device == "cuda"), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    for ours in ("ours", "ours_bf16"):
        if ours in res and "torchtitan" in res:
            print(
                f"{ours} / torchtitan tokens/s: "
                f"{res[ours]['tokens_per_s'] / res['torchtitan']['tokens_per_s']:.3f}"
            )
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
