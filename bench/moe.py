"""MoE layer benchmark on one GPU: ours (grouped) vs megablocks dMoE vs the torch reference, bf16
fwd+bwd.

    python bench/moe.py [--shapes mixtral,fine] [--reps 20] [--out results.json] [--profile DIR]
    python bench/moe.py --shapes mixtral --only ours,ours_fp8      # bf16 vs FP8 expert GEMMs

Per shape, in one process:
(1) correctness of the grouped path at the real shape against a float32 per-expert loop (relative
    errors of output and gradients, next to the same-dtype plain-torch error: the FlashAttention
    criterion err(ours) <= 2 err(bf16 torch)), for every variant timed (``ours_fp8``, FP8 expert
    GEMMs: within FP8 error instead, every relative error below FP8_REL_ERR);
(2) medians of CUDA-event timings of forward+backward after warm-up: the torch reference alone, then
    our variants (VARIANTS: the default path and each change on its own), megablocks (when
    importable) and the dense GEMM step round-robin (time_interleaved: the H200 is power-capped at
    these shapes, so every contender must run in the same power state), once with the CPU waiting
    for each step and once queued (``*_queued``: it never waits, as inside a model, where a
    sync-free layer's launches run ahead of the GPU);
(3) the dense GEMM rate: ``dense_gemm_step``, the same nine GEMMs as plain torch.mm, timed in that
    rotation ("/dense" = its time over the contender's, same timing mode), and one GEMM after a
    pause (``dense_burst_tflops``, full clocks);
(4) for "ours", what a step can wait on besides kernels: allocator device allocs/frees per step, SM
clock and power.
TFLOP/s count the routed-expert GEMMs only: 3 GEMMs x 2*T*K*D*H FLOPs, x3 for forward+backward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moezoo.configs import exit_code  # noqa: E402
from moezoo.configs.errors import check, check_choice, choice_list  # noqa: E402
from moezoo.kernels import grouped_wgrad  # noqa: E402
from moezoo.kernels.moe_swiglu import swiglu_reference  # noqa: E402
from moezoo.layers import MoE  # noqa: E402
from moezoo.layers.moe import experts as moe_experts  # noqa: E402

SHAPES = {  # T tokens, D model dim, H expert hidden, E experts, K top-k
    "mixtral": dict(T=16384, D=4096, H=14336, E=8, K=2),
    "fine": dict(T=16384, D=4096, H=1024, E=64, K=8),
    # the dim-512 MoE of bench/train_moe.py (seq 1024 x batch 32)
    "small": dict(T=32768, D=512, H=704, E=8, K=2),
    # bench/torchtitan_moe.py's layer (OLMoE-1B-7B), 16k tokens
    "olmoe": dict(T=16384, D=2048, H=1024, E=64, K=8),
    "tiny": dict(T=256, D=64, H=96, E=8, K=2),  # smoke test of this script (also on CPU)
}
DEV = "cuda"

# Our variants, each a set of overrides on the default path ("ours": compiled routing stage, routing
# weights folded into SwiGLU): MoEConfig fields set on the benchmarked layer's own cfg, or an
# (owner, attribute) pair patched for the block (a kernel swapped for its reference). "ours_before"
# is the path before the first two changes (but with the cheaper unweighted permute backward).
VARIANTS = {
    "ours": {},
    "ours_before": {"compile_routing": None, "fold_weights": False},
    "ours_eager_routing": {"compile_routing": None},
    "ours_weighted_combine": {"fold_weights": False},
    "ours_align16": {"group_align": 16},
    "ours_eager_swiglu": {(moe_experts, "swiglu"): swiglu_reference},
    "ours_fp32_router": {"low_precision_router": False},
    "ours_unfused_permute": {"fuse_permute": False},
    # model.moe.precision: rowwise-scaled e4m3 expert GEMMs (kernels.moe_fp8)
    "ours_fp8": {"precision": "fp8"},
    # the weight gradients' row split (kernels.grouped_wgrad) forced to S parts; "ours" picks S
    # itself
    **{f"ours_wgrad_split{s}": {(grouped_wgrad, "SPLITS"): s} for s in (1, 2, 4)},
}


def torchao_fp8_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, in] -> [N, out] = x w[e]^T through torchao's FP8 rowwise MoE training op (its own
    Triton quantizers, torch._scaled_grouped_mm); needs every group a multiple of 16 rows
    (group_align 16)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        x, w.transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False
    )


def torchao_gate_up(x, w1, w3, offs, inv=None, num_rows=0, zero_fill=False, fp8=False):
    """kernels.moe_gate_up.gate_up's contract with torchao's FP8 GEMMs (the peer's path: x quantized
    once per GEMM, the permute's backward a separate pass)."""
    from moezoo.kernels.moe_permute import moe_permute

    xs = x if inv is None else moe_permute(x, inv, num_rows, zero_fill)
    return torchao_fp8_mm(xs, w1, offs), torchao_fp8_mm(xs, w3, offs)


# torchao 0.18's prototype MoE FP8 training path (issue 16 item 4 asks for both measured): our layer
# with groups padded to 16 rows (its requirement) and its expert GEMMs swapped for torchao's op.
VARIANTS["torchao_fp8"] = {
    "precision": "fp8",
    "group_align": 16,
    (moe_experts, "gate_up"): torchao_gate_up,
    (moe_experts, "fp8_grouped_linear"): torchao_fp8_mm,
}
# normwise, against float32: e4m3 keeps 3 mantissa bits (~0.066 through the layer's 3 GEMMs)
FP8_REL_ERR = 0.1


@contextlib.contextmanager
def variant(name: str, moe: MoE):
    """Apply VARIANTS[name]'s overrides to ``moe`` (its cfg fields) for the duration of the
    block."""
    targets = {k: (moe.cfg, k) if isinstance(k, str) else k for k in VARIANTS[name]}
    saved = {k: getattr(*t) for k, t in targets.items()}
    try:
        for k, value in VARIANTS[name].items():
            setattr(*targets[k], value)
        yield
    finally:
        for k, value in saved.items():
            setattr(*targets[k], value)


def moe_flops(T, D, H, E, K):
    return 3 * 2 * T * K * D * H * 3


def time_ms(step, reps: int, warmup: int = 3, before=None, queued: bool = False) -> float:
    """Median of CUDA-event timings of ``step()``; ``before()`` runs untimed before each rep (one
    entry of time_interleaved)."""
    return time_interleaved({"step": (step, before)}, reps, warmup, queued)["step"]


def time_interleaved(steps: dict, reps: int, warmup: int = 3, queued: bool = False) -> dict:
    """``steps`` {name: (step, before | None)} -> {name: median ms}, the steps timed round-robin
    (rep r of every step before rep r + 1 of any), so every contender runs in the same power state.

    Why round-robin: at these shapes the H200 sits at its 700 W cap within two or three steps and
    its SM clock drops from 1980 to ~1400-1600 MHz (nvidia-smi: clocks event reason 0x4, SW power
    cap; BENCHMARKS.md, GPUs), so a contender timed right after a pause runs faster than one timed
    after another's steps. ``before()`` runs untimed before each rep. ``queued=False``: the CPU
    waits for each rep. ``queued=True``: it never waits (one sync at the end), so each step's
    launches queue behind the previous step's kernels, as a layer's do inside a model: a sync-free
    layer shows no launch gaps, one that reads back from the GPU still pays its stall. On CPU:
    wall-clock per rep.
    """

    def run(name):
        step, before = steps[name]
        if before:
            before()
        if DEV != "cuda":
            t0 = time.perf_counter()
            step()
            return (time.perf_counter() - t0) * 1e3
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        if not queued:
            b.synchronize()
        return a, b

    for _ in range(warmup):
        for name in steps:
            run(name)
    if DEV == "cuda":
        torch.cuda.synchronize()
    got = {name: [] for name in steps}
    for _ in range(reps):
        for name in steps:
            got[name].append(run(name))
    if DEV != "cuda":
        return {name: statistics.median(ts) for name, ts in got.items()}
    torch.cuda.synchronize()
    return {name: statistics.median(a.elapsed_time(b) for a, b in evs) for name, evs in got.items()}


def dense_gemm_step(T, D, H, K):
    """The nine GEMMs of a SwiGLU expert layer's forward+backward on T*K rows as plain ``torch.mm``
    (one expert holding every row): the same shapes and FLOPs as the MoE's grouped GEMMs, so timed
    beside the MoE it gives the dense GEMM rate in the same power state."""
    g = torch.Generator(device=DEV).manual_seed(1)
    r = lambda *s: torch.randn(*s, device=DEV, dtype=torch.bfloat16, generator=g)  # noqa: E731
    M = T * K
    xs, h, dy = r(M, D), r(M, H), r(M, D)
    w_in, w_out = r(D, H), r(H, D)

    def step():
        torch.mm(xs, w_in), torch.mm(xs, w_in), torch.mm(h, w_out)  # gate, up, down
        torch.mm(dy, w_out.t()), torch.mm(h.t(), dy)  # down: dh, dw2
        torch.mm(h, w_in.t()), torch.mm(h, w_in.t())  # gate/up: dxs
        torch.mm(xs.t(), h), torch.mm(xs.t(), h)  # gate/up: dw1, dw3

    return step


def allocator_and_clocks(step, reps: int = 5, before=None) -> dict:
    """What a timed step may wait on besides its kernels, over ``reps`` back-to-back steps: device
    allocations / frees by the caching allocator (each cudaFree synchronises the device), and the SM
    clock (MHz) and power (mW) read through NVML before the steps and after each step's launch,
    while the device runs the steps queued before it (power-capped clocks drop under load, by how
    much depends on the kernels: the medians say it per contender)."""
    if DEV != "cuda":
        return {}

    def nvml(fn):
        try:
            return fn()
        except Exception as e:  # NVML (pynvml) missing on the image: report, do not fail the bench
            return f"unavailable ({type(e).__name__})"

    def median(xs):
        nums = [x for x in xs if isinstance(x, (int, float))]
        return statistics.median(nums) if nums else xs[0]

    torch.cuda.synchronize()
    m0 = torch.cuda.memory_stats()
    out = {
        "sm_clock_before": nvml(torch.cuda.clock_rate),
        "power_before": nvml(torch.cuda.power_draw),
    }
    clocks, power = [], []
    for _ in range(reps):
        if before:
            before()
        step()
        clocks.append(nvml(torch.cuda.clock_rate))
        power.append(nvml(torch.cuda.power_draw))
    out.update(sm_clock_under_load=median(clocks), power_under_load=median(power))
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_stats()
    for k in ("num_device_alloc", "num_device_free", "num_alloc_retries"):
        out[k + "_per_step"] = (m1.get(k, 0) - m0.get(k, 0)) / reps
    return out


def dense_rate(M, D, H, reps) -> float:
    a = torch.randn(M, D, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(D, H, device=DEV, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.mm(a, b), reps)
    return 2 * M * D * H / ms / 1e9


def in_variant(name: str, moe: MoE, step):
    """``step`` run under VARIANTS[name]'s overrides of ``moe``."""

    def run():
        with variant(name, moe):
            step()

    return run


def fwd_bwd(module, x, dy):
    def step():
        module(x).backward(dy)

    return step


def zero_grads(*mods_and_tensors):
    def f():
        for m in mods_and_tensors:
            if isinstance(m, torch.Tensor):
                m.grad = None
            else:
                for p in m.parameters():
                    p.grad = None

    return f


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm()) / max(float(b.norm()), 1e-30)


def grads_of(moe, x, dy):
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = moe(x)
    y.backward(dy.to(y.dtype))
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dgate": moe.gate.weight.grad,
        "dw1": moe.experts.w1.grad,
        "dw2": moe.experts.w2.grad,
        "dw3": moe.experts.w3.grad,
    }


def megablocks_peer(moe):
    """A megablocks dMoE holding a copy of ``moe``'s weights (bf16, grouped GEMM)."""
    from moezoo.layers.moe.megablocks import build_dmoe, megablocks_params

    dmoe = build_dmoe(moe.dim, moe.hidden_dim, moe.num_experts, moe.top_k, torch.device(DEV))
    with torch.no_grad():
        for name, t in megablocks_params(moe).items():
            dmoe.get_parameter(name).copy_(t)
    return dmoe


def profile_step(step, before, path: str) -> None:
    """One profiled run of ``step`` (after an untimed one), as the waited timing runs it: its kernel
    table (by device time) to ``path``, then how long the device sat idle between its first and last
    kernel (waiting on the host's launches; the profiler's own host overhead makes it an upper
    bound) and the largest such gaps, with the kernels around them."""
    from torch.profiler import ProfilerActivity, profile

    from moezoo.training.profile import device_gaps

    for _ in range(2):
        before()
        step()
    before()
    with profile(
        activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]
    ) as prof:
        step()
        if DEV == "cuda":
            torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by=f"{'cuda' if DEV == 'cuda' else 'cpu'}_time_total", row_limit=30
    )
    if DEV == "cuda":
        span, idle, gaps = device_gaps(prof.events(), top=5)
        table += (
            f"\ndevice idle {idle / 1e3:.2f} ms of the {span / 1e3:.2f} ms "
            "from the first kernel to the last; largest gaps:\n"
            + "".join(f"  {us / 1e3:.3f} ms after {a[:60]} before {b[:60]}\n" for us, a, b in gaps)
        )
    with open(path, "w") as f:
        f.write(table)
    print(path, table, sep="\n", flush=True)


def bench_shape(name, T, D, H, E, K, reps, profile_dir=None, skip=(), only=None) -> dict:
    res = {"shape": dict(T=T, D=D, H=H, E=E, K=K), "flops": moe_flops(T, D, H, E, K)}
    torch.manual_seed(0)
    moe = MoE(D, H, E, K, backend="grouped").to(DEV).to(torch.bfloat16)
    moe.init_weights(0.02, 0.02)
    x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)

    # (1) correctness at the real shape: fp32 loop reference, bf16 loop (same-dtype torch), ours.
    ref32 = MoE(D, H, E, K, backend="torch").to(DEV)
    ref32.load_state_dict({k: v.float() for k, v in moe.state_dict().items()})
    want = grads_of(ref32, x.float(), dy.float())
    del ref32
    ref16 = MoE(D, H, E, K, backend="torch").to(DEV).to(torch.bfloat16)
    ref16.load_state_dict(moe.state_dict())
    plain = grads_of(ref16, x, dy)
    res["rel_err_bf16_torch"] = {k: rel(plain[k], want[k]) for k in want}
    del plain
    print(
        name,
        "rel err bf16 torch",
        {k: f"{v:.2e}" for k, v in res["rel_err_bf16_torch"].items()},
        flush=True,
    )
    res["rel_err"], res["within_2x_torch"], res["variant_errors"] = {}, {}, {}
    variants = [v for v in (only or VARIANTS) if v == "ours" or v not in skip]
    for v in variants:  # compiles the routing stage (outside the timings)
        try:
            with variant(v, moe):
                got = grads_of(moe, x, dy)
        except Exception as e:  # one broken variant must not cost the others' numbers
            frames = [
                ln.strip()
                for ln in traceback.format_exc().splitlines()
                if ln.strip().startswith("File")
            ]
            where = " <- ".join(frames[-3:])
            res["variant_errors"][v] = f"{type(e).__name__}: {e} (at {where})"
            print(name, v, "failed:", res["variant_errors"][v], flush=True)
            continue
        res["rel_err"][v] = {k: rel(got[k], want[k]) for k in want}
        del got
        if VARIANTS[v].get("precision") == "fp8":
            res.setdefault("within_fp8_error", {})[v] = ok = all(
                e < FP8_REL_ERR for e in res["rel_err"][v].values()
            )
            verdict = f"within FP8 error (< {FP8_REL_ERR}): {ok}"
        else:
            res["within_2x_torch"][v] = ok = all(
                res["rel_err"][v][k] <= 2 * res["rel_err_bf16_torch"][k] + 1e-6 for k in want
            )
            verdict = f"within 2x bf16 torch: {ok}"
        print(
            name,
            "rel err",
            v,
            {k: f"{e:.2e}" for k, e in res["rel_err"][v].items()},
            verdict,
            flush=True,
        )

    # (2) timings: the torch reference alone (slow), then every other contender round-robin
    # (time_interleaved: same power state), waited-for and queued.
    zg = zero_grads(moe, x)
    t = {
        "torch_reference": time_ms(
            fwd_bwd(ref16, x, dy), max(3, reps // 4), before=zero_grads(ref16, x)
        )
    }
    del ref16
    contenders = {
        v: (in_variant(v, moe, fwd_bwd(moe, x, dy)), zg)
        for v in variants
        if v not in res["variant_errors"]
    }
    try:
        dmoe = megablocks_peer(moe)
        xm = x.detach().unsqueeze(1).requires_grad_()
        res["rel_err_megablocks"] = rel(dmoe(xm).squeeze(1), want["y"])
        from megablocks.layers.moe import clear_load_balancing_loss

        def mb_step():
            dmoe(xm).backward(dy.unsqueeze(1))
            clear_load_balancing_loss()

        contenders["megablocks"] = (mb_step, zero_grads(dmoe, xm))
        mb_backend = MoE(D, H, E, K, backend="megablocks").to(DEV).to(torch.bfloat16)
        mb_backend.load_state_dict(moe.state_dict())
        res["rel_err_megablocks_backend"] = rel(grads_of(mb_backend, x, dy)["y"], want["y"])
        del mb_backend
    except Exception as e:  # megablocks absent or broken: report, keep going
        res["megablocks_error"] = f"{type(e).__name__}: {e}"
        print(name, "megablocks:", res["megablocks_error"], flush=True)
    del want
    contenders["dense_gemm_step"] = (dense_gemm_step(T, D, H, K), None)
    t.update(time_interleaved(contenders, reps))
    t.update({k + "_queued": v for k, v in time_interleaved(contenders, reps, queued=True).items()})
    # every contender's clocks and power under its own load: back to back, a step's kernels run
    # slower than in one profiled step, by an amount that differs between contenders (BENCHMARKS.md,
    # FP8 experts)
    res["step_waits"] = {
        k: allocator_and_clocks(step, reps=max(5, reps // 2), before=before)
        for k, (step, before) in contenders.items()
    }
    for k, w in res["step_waits"].items():
        print(name, k, "step waits", w, flush=True)
    contenders.clear()
    res["ms"] = t
    res["tflops"] = {k: res["flops"] / v / 1e9 for k, v in t.items()}
    # "/dense": the time of the same GEMMs as plain torch.mm, timed beside ours in the same mode
    res["dense_gemm_tflops"] = res["tflops"]["dense_gemm_step"]
    res["frac_of_dense"] = {
        k: t["dense_gemm_step_queued" if k.endswith("_queued") else "dense_gemm_step"] / v
        for k, v in t.items()
    }
    res["dense_burst_tflops"] = dense_rate(T * K, D, H, reps)  # one GEMM after a pause: full clocks
    if "megablocks" in t:
        res["speedup_vs_megablocks"] = {
            k: t["megablocks_queued" if k.endswith("_queued") else "megablocks"] / v
            for k, v in t.items()
        }

    if profile_dir:
        for v in variants:
            if v not in res["variant_errors"]:
                profile_step(
                    in_variant(v, moe, fwd_bwd(moe, x, dy)),
                    zg,
                    os.path.join(profile_dir, f"profile_{name}_{v}.txt"),
                )
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="mixtral,fine")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="folder for per-shape profiler tables")
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script")
    ap.add_argument(
        "--skip", default="", help="comma list of our variants to leave out, e.g. ours_align16"
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma list of our variants to run (default: all), e.g. ours,ours_fp8",
    )
    ap.add_argument(
        "--fp8-tiles",
        default="",
        help="the FP8 quantizers' tiles, 'ar,ac,aw;cr,cc,cw' (rows, "
        "columns, warps of the amax and the cast pass; bench/fp8_quant.py --best writes it)",
    )
    args = ap.parse_args()
    # every choice checked before the GPU is touched: a bad one is one line and exit 2
    if args.fp8_tiles:
        from moezoo.kernels import moe_fp8

        try:
            tiles = [tuple(int(v) for v in part.split(",")) for part in args.fp8_tiles.split(";")]
        except ValueError:
            tiles = []
        check(
            [len(t) for t in tiles] == [3, 3],
            "--fp8-tiles",
            f"expected 'ar,ac,aw;cr,cc,cw' (six integers), got {args.fp8_tiles!r}",
        )
        moe_fp8.AMAX_TILE, moe_fp8.CAST_TILE = tiles
    shapes = choice_list(args.shapes, tuple(SHAPES), "--shapes")
    only = tuple(choice_list(args.only, tuple(VARIANTS), "--only")) if args.only else None
    skip = tuple(choice_list(args.skip, tuple(VARIANTS), "--skip")) if args.skip else ()
    check_choice(args.device, ("cuda", "cpu"), "--device")
    check(args.reps > 0, "--reps", f"must be > 0, got {args.reps}")
    global DEV
    DEV = args.device
    if args.profile:
        # before the timings: a missing folder lost them once
        os.makedirs(args.profile, exist_ok=True)
    import triton

    env = {
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
    }
    try:
        import megablocks

        env["megablocks"] = getattr(megablocks, "__version__", "installed")
    except Exception as e:
        env["megablocks"] = f"unavailable ({type(e).__name__})"
    # the GPU's square-GEMM rate; on CPU (a smoke test) a size that runs in ms
    n = 8192 if DEV == "cuda" else 256
    out = {
        "env": env,
        "dense_square_gemm": n,
        "dense_square_tflops": dense_rate(n, n, n, args.reps),
        "shapes": {},
    }
    print(env, f"dense {n}^3:", f"{out['dense_square_tflops']:.0f} TFLOP/s", flush=True)
    for name in shapes:
        out["shapes"][name] = bench_shape(
            name, **SHAPES[name], reps=args.reps, profile_dir=args.profile, skip=skip, only=only
        )
        if DEV == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    print(
        f"\n{'shape':8s} {'variant':30s} {'ms':>8s} {'TFLOP/s':>8s} {'/dense':>7s} "
        f"{'vs mb':>6s} {'MHz':>6s} {'W':>5s}"
    )
    for name, r in out["shapes"].items():
        for k, ms in r["ms"].items():
            sp = r.get("speedup_vs_megablocks", {}).get(k, float("nan"))
            w = r["step_waits"].get(k, {})  # SM clock and power under the contender's own load
            mhz, mw = w.get("sm_clock_under_load"), w.get("power_under_load")
            load = (
                f" {mhz:6.0f} {mw / 1e3:5.0f}"
                if isinstance(mhz, (int, float)) and isinstance(mw, (int, float))
                else ""
            )
            print(
                f"{name:8s} {k:30s} {ms:8.2f} {r['tflops'][k]:8.0f} "
                f"{r['frac_of_dense'][k]:7.3f} {sp:6.2f}{load}"
            )
        print(f"{name:8s} {'dense GEMM, one burst':30s} {'':8s} {r['dense_burst_tflops']:8.0f}")


if __name__ == "__main__":
    sys.exit(exit_code(main))
