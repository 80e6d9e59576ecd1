"""Grouped-GEMM engines for the MoE experts at bench/moe.py's shapes, one GPU, bf16: can a fused or
re-tiled grouped GEMM beat what layers.GroupedExperts runs (torch._grouped_mm, CUTLASS)?

    python bench/moe_gemm.py [--shapes mixtral,fine] [--reps 15] [--out results.json]
        [--roles gate,dgrad] [--only gmm_kmajor,mm] [--skew 1.0]

Contenders, per GEMM of the expert layer ("role"), timed round-robin within the role
(bench/moe.py's time_interleaved: the H200 runs these shapes at its power cap), waited and queued:
- ``gmm``: torch._grouped_mm on the expert-sorted rows (the product path);
- ``mm``: the same FLOPs as one dense torch.mm (cuBLAS; the "/dense" reference);
- ``triton`` / ``triton_gather``: bench/triton_grouped_gemm.py, autotuned, rows read through the
  token index (no permuted copy) in the ``_gather`` variants;
- ``quack`` / ``quack_gather``: QuACK's CuTe-DSL varlen GEMMs (``quack.gemm_interface``, the engine
  of SonicMoE), default configuration, when ``quack`` imports (carry nvidia-cutlass-dsl and
  quack-kernels wheels to the device: BENCHMARKS.md, header). Roles: ``gate`` xs w1^T; ``down`` h
  w2^T; ``dgrad`` dy w2 (the down projection's input gradient; also with the weight read K-major,
  ``gmm_kmajor``, and that transposed copy made in the call, ``gmm_kmajor_copy``); ``dgrad_gate`` da
  w1 (the gate projection's input gradient, the same contenders); ``wgrad`` dy^T h (its weight
  gradient); ``wgrad_gather`` da^T xs (the gate's weight gradient, xs gathered); and two fused
  stages: ``gate_up_swiglu`` (ours: permute + two grouped GEMMs + the SwiGLU kernel with the routing
  weight; triton: one two-accumulator kernel; quack: one gated GEMM over [w1; w3] concatenated,
  which the experts do not store, so ``quack_cat`` adds that copy) and ``down_bwd`` (ours: the dgrad
  GEMM + the SwiGLU backward kernel; quack: one GEMM with the SwiGLU-backward, routing-weight and
  weight-gradient epilogue, dy gathered from token order). Every contender's output is checked
  against its role's torch._grouped_mm result (relative L2 error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import triton_grouped_gemm as tg  # noqa: E402
from bench.moe import SHAPES, rel, time_interleaved  # noqa: E402
from moezoo.kernels.moe_permute import moe_permute  # noqa: E402
from moezoo.kernels.moe_swiglu import swiglu, swiglu_backward  # noqa: E402
from moezoo.layers.moe.experts import make_plan  # noqa: E402


def load_quack():
    """``quack.gemm_interface`` or the reason it is unavailable.

    quack-kernels 0.6.5 keys its epilogue cache on everything an epilogue function reaches, and
    nvidia-cutlass-dsl 4.8.1 added module constants there that the key builder rejects (a
    ContextVar, ``CodeType.co_positions``, a logger: TypeError on every gated epilogue). They are
    the DSL's own fixed objects, so their type and name identify them.
    """
    try:
        import quack.gemm_runtime.identity as ident
        from quack import gemm_interface
    except Exception as e:  # not installed (the CPU image, the default device image)
        return None, f"{type(e).__name__}: {e}"
    original = ident.semantic_value_key

    def key(value, seen=None, *args, **kw):
        try:
            return original(value, seen, *args, **kw)
        except TypeError as e:
            if "fail-closed semantic key" not in str(e) or f"{value!r}" not in str(e):
                raise  # not about this value (children come through key): a real error
            return (
                "opaque",
                type(value).__module__,
                type(value).__qualname__,
                getattr(value, "__qualname__", getattr(value, "name", None)),
            )

    ident.semantic_value_key = key
    return gemm_interface, None


def operands(T, D, H, E, K, skew=0.0):
    """The role GEMMs' operands at one shape. ``skew``: expert e's routing score gets ``-skew *
    log(e + 1)`` added (Zipf-like popularity: 0 is balanced random routing; a trainer's early steps
    route unevenly)."""
    torch.manual_seed(0)
    dev = "cuda"
    r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
    scores = torch.randn(T, E, device=dev) - skew * torch.log(
        torch.arange(1, E + 1, device=dev, dtype=torch.float32)
    )
    idx = scores.topk(K, -1).indices
    plan = make_plan(idx, E)
    M = T * K
    src = torch.empty(M, dtype=torch.int32, device=dev)  # token of each sorted row
    src[plan.inv.reshape(-1).long()] = torch.arange(
        T, device=dev, dtype=torch.int32
    ).repeat_interleave(K)
    ends = torch.cumsum(plan.counts, 0, dtype=torch.int32)
    o = dict(
        plan=plan,
        M=M,
        src=src,
        ends=ends,
        cu=torch.cat([ends.new_zeros(1), ends]),
        x=r(T, D),
        w1=r(E, H, D) * 0.02,
        w3=r(E, H, D) * 0.02,
        w2=r(E, D, H) * 0.02,
        h=r(M, H),
        dy=r(M, D),
        dout=r(T, D),
        da=r(M, H),
        db=r(M, H),
        scale=torch.rand(M, device=dev),
    )
    o["xs"] = moe_permute(o["x"], plan.inv, M, False)
    o["w13"] = torch.cat([o["w1"], o["w3"]], 1)
    o["w2t"], o["w1t"] = o["w2"].mT.contiguous(), o["w1"].mT.contiguous()
    return o


def roles(o, q):
    """{role: {contender: fn}}; the first contender of each role is the one the others are checked
    against."""
    gmm = torch._grouped_mm
    x, xs, w1, w3, w2, h, dy, ends, src = (
        o[k] for k in ("x", "xs", "w1", "w3", "w2", "h", "dy", "ends", "src")
    )
    plan, M, cu, scale, da, db = o["plan"], o["M"], o["cu"], o["scale"], o["da"], o["db"]
    R = {
        "gate": {
            "gmm": lambda: gmm(xs, w1.mT, offs=ends),
            "mm": lambda: torch.mm(xs, w1[0].t()),
            "triton": lambda: tg.grouped_mm(xs, w1, ends),
            "triton_gather": lambda: tg.grouped_mm(x, w1, ends, src=src),
        },
        "down": {
            "gmm": lambda: gmm(h, w2.mT, offs=ends),
            "mm": lambda: torch.mm(h, w2[0].t()),
            "triton": lambda: tg.grouped_mm(h, w2, ends),
        },
        # gmm_kmajor: the weight operand K-major, as the forward GEMM reads it (a transposed copy
        # held, w2t [E, H, D]); gmm_kmajor_copy: that copy made in the call
        "dgrad": {
            "gmm": lambda: gmm(dy, w2, offs=ends),
            "mm": lambda: torch.mm(dy, w2[0]),
            "gmm_kmajor": lambda: gmm(dy, o["w2t"].mT, offs=ends),
            "gmm_kmajor_copy": lambda: gmm(dy, w2.mT.contiguous().mT, offs=ends),
            "triton": lambda: tg.grouped_mm(dy, w2, ends, b_kmajor=False),
        },
        "dgrad_gate": {
            "gmm": lambda: gmm(da, w1, offs=ends),
            "mm": lambda: torch.mm(da, w1[0]),
            "gmm_kmajor": lambda: gmm(da, o["w1t"].mT, offs=ends),
            "gmm_kmajor_copy": lambda: gmm(da, w1.mT.contiguous().mT, offs=ends),
        },
        "wgrad": {
            "gmm": lambda: gmm(dy.t(), h, offs=ends),
            "mm": lambda: torch.mm(dy.t(), h),
            "triton": lambda: tg.grouped_mm_t(dy, h, ends),
        },
        "wgrad_gather": {
            "gmm": lambda: gmm(da.t(), xs, offs=ends),
            "triton_gather": lambda: tg.grouped_mm_t(da, x, ends, src_b=src),
        },
        "gate_up_swiglu": {
            "ours": lambda: (
                lambda s: swiglu(gmm(s, w1.mT, offs=ends), gmm(s, w3.mT, offs=ends), scale)
            )(moe_permute(x, plan.inv, M, False)),
            "triton_gather": lambda: tg.grouped_swiglu(x, w1, w3, ends, src=src, scale=scale)[2],
        },
        "down_bwd": {"ours": lambda: swiglu_backward(gmm(dy, w2, offs=ends), da, db, scale)[0]},
    }
    if q is not None:
        R["gate"]["quack"] = lambda: q.gemm(xs, w1.mT, cu_seqlens_m=cu, tuned=False)
        R["gate"]["quack_gather"] = lambda: q.gemm(
            x, w1.mT, cu_seqlens_m=cu, A_idx=src, tuned=False
        )
        R["down"]["quack"] = lambda: q.gemm(h, w2.mT, cu_seqlens_m=cu, tuned=False)
        R["dgrad"]["quack"] = lambda: q.gemm(dy, w2, cu_seqlens_m=cu, tuned=False)
        R["wgrad"]["quack"] = lambda: q.gemm(dy.t(), h, cu_seqlens_k=cu, tuned=False)
        # x^T gathered by columns gives the transposed gradient [E, D, H]; compared as .mT
        R["wgrad_gather"]["quack_gather"] = lambda: (
            q.gemm(x.t(), da, cu_seqlens_k=cu, A_idx=src, tuned=False).mT
        )
        R["gate_up_swiglu"]["quack_gather"] = lambda: quack_gated(q, x, o["w13"], cu, src)
        R["gate_up_swiglu"]["quack_gather_cat"] = lambda: quack_gated(
            q, x, torch.cat([w1, w3], 1), cu, src
        )
        # [gate, up] pairs interleaved, as QuACK keeps them
        pre = torch.stack([da, db], -1).reshape(M, -1)
        R["down_bwd"]["quack_gather"] = lambda: q.gemm_dact(
            o["dout"],
            w2,
            pre,
            activation="swiglu",
            cu_seqlens_m=cu,
            A_idx=src,
            colvec_scale=scale,
            colvec_reduce=True,
            tuned=False,
        )[0][:, 0::2]
    return R


def quack_gated(q, x, w13, cu, src):
    """h [M, H] = silu(x w1^T) * (x w3^T) from one gated GEMM over [w1; w3] (unscaled: QuACK's
    forward gated epilogue has no per-row scale; the routing weight would go to the combine)."""
    return q.gemm_act(
        x,
        w13.mT,
        activation="swiglu",
        cu_seqlens_m=cu,
        A_idx=src,
        concat_layout=("B",),
        tuned=False,
    )[1]


def checks(o, R) -> dict:
    """Relative error of each contender against the role's reference output (gmm, or ours for the
    fused stages); the fused stages' QuACK variants against the matching unscaled / gathered
    reference."""
    gmm = torch._grouped_mm
    want = {role: next(iter(c.values()))() for role, c in R.items()}
    src, ends = o["src"], o["ends"]
    a, b = gmm(o["xs"], o["w1"].mT, offs=ends), gmm(o["xs"], o["w3"].mT, offs=ends)
    special = {
        ("gate_up_swiglu", "quack_gather"): swiglu(a, b),
        ("gate_up_swiglu", "quack_gather_cat"): swiglu(a, b),
    }
    g = gmm(o["dout"][src.long()], o["w2"], offs=ends)
    special[("down_bwd", "quack_gather")] = swiglu_backward(g, o["da"], o["db"], o["scale"])[0]
    out = {}
    for role, contenders in R.items():
        for name, fn in list(contenders.items())[1:]:
            if name == "mm":
                continue
            try:
                out[f"{role}/{name}"] = rel(fn(), special.get((role, name), want[role]))
            except Exception as e:  # a contender that cannot run this role: report, drop it
                out[f"{role}/{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
                del contenders[name]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="mixtral,fine")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--roles", default="", help="comma list of roles to time (default: all)")
    ap.add_argument(
        "--skew", type=float, default=0.0, help="uneven routing: expert e's score -skew*log(e+1)"
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma list of contenders to time (default: all; each role's "
        "first is always kept as the reference)",
    )
    args = ap.parse_args()
    import triton

    q, why = load_quack()
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "quack": why or __import__("quack").__version__,
    }
    print(env, flush=True)
    res = {"env": env, "shapes": {}}
    for shape in args.shapes.split(","):
        s = SHAPES[shape]
        o = operands(**s, skew=args.skew)
        counts = o["plan"].counts.float()
        print(
            f"{shape}: rows per expert "
            f"max / mean {counts.max().item() / counts.mean().item():.2f}, "
            f"min / mean {counts.min().item() / counts.mean().item():.2f} (skew {args.skew})",
            flush=True,
        )
        R = roles(o, q)
        if args.roles:
            R = {k: v for k, v in R.items() if k in args.roles.split(",")}
        if args.only:
            keep = args.only.split(",")
            R = {
                k: {n: f for i, (n, f) in enumerate(v.items()) if i == 0 or n in keep}
                for k, v in R.items()
            }
        r = res["shapes"][shape] = {"rel_err": checks(o, R), "ms": {}, "ms_queued": {}}
        print(shape, json.dumps(r["rel_err"], indent=1), flush=True)
        flops = 2 * o["M"] * s["D"] * s["H"]
        for role, contenders in R.items():
            steps = {name: (fn, None) for name, fn in contenders.items()}
            r["ms"][role] = time_interleaved(steps, args.reps)
            r["ms_queued"][role] = time_interleaved(steps, args.reps, queued=True)
            f = flops * (2 if role == "gate_up_swiglu" else 1)
            for name in contenders:
                w, qd = r["ms"][role][name], r["ms_queued"][role][name]
                print(
                    f"{shape:8s} {role:15s} {name:17s} {w:7.3f} ms {f / w / 1e9:5.0f} TF/s | "
                    f"queued {qd:7.3f} ms {f / qd / 1e9:5.0f} TF/s",
                    flush=True,
                )
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(res, fh, indent=1)
        del o, R
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
