"""Neuron-routed FFN layer benchmark on one GPU: the selected-groups path vs the dense SwiGLU, bf16
fwd+bwd.

    python bench/neuron_ffn.py [--shapes d2048,d4096] [--reps 20] [--out results.json]
        [--device cpu]

Per shape (T tokens, D dim, H hidden, G groups, K groups per token), in one process:
(1) correctness of the sparse grouped path (layers.NeuronRoutedFFN in sparse mode: top-K groups per
    token, make_plan sort, grouped GEMMs with the permute fused, unpermute sum) against the float32
    per-group loop on the same weights and routing, next to the bf16 loop's error (criterion
    err(ours) <= 2 err(bf16 torch), as bench/moe.py);
(2) medians of CUDA-event timings of forward+backward, round-robin (bench.moe.time_interleaved: same
    power state), waited-for and queued: ``dense`` (layers.SwiGLU, three F.linear),
    ``neuron_sparse`` (the sparse step), ``neuron_dense`` (the layer's dense step: whole FFN plus
    router loss); on CUDA also ``dense_graphed`` / ``neuron_sparse_graphed``: copies of the two with
    forward and backward captured as CUDA graphs (torch.cuda.make_graphed_callables), the host's
    launches taken out as the trainer's ``train.compile_mode: reduce-overhead`` does; each is
    compared with the other (``x dense``). TFLOP/s: dense 3 GEMMs x 2*T*D*H x3 (fwd+bwd); sparse the
    same x K/G (the groups computed).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench.moe as moe_bench  # noqa: E402
from bench.moe import rel, time_interleaved  # noqa: E402
from moezoo.layers import NeuronRoutedFFN, SwiGLU  # noqa: E402

SHAPES = {  # 25% of the groups (K/G = 4/16); H as LLaMA's 8/3 D rounded to 256 (1B- and 7B-like)
    "d2048": dict(T=16384, D=2048, H=5632, G=16, K=4),
    "d4096": dict(T=16384, D=4096, H=11008, G=16, K=4),
    "tiny": dict(T=256, D=64, H=128, G=8, K=2),  # smoke test of this script (also on CPU)
}


def ffn_flops(T, D, H):
    return 3 * 2 * T * D * H * 3


def fwd_bwd(module, x, dy):
    def step():
        module(x).backward(dy)

    return step


def zero_grads(module, x):
    def f():
        x.grad = None
        for p in module.parameters():
            p.grad = None

    return f


def grads_of(m, x, dy):
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = m(x)
    y.backward(dy.to(y.dtype))
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw1": m.experts.w1.grad,
        "dw2": m.experts.w2.grad,
        "dw3": m.experts.w3.grad,
    }


def graphed(module, x):
    """A copy of ``module`` whose forward and backward replay CUDA graphs captured on ``x``'s shape,
    or None with the reason printed when capture fails (the other contenders still run)."""
    try:
        # allow_unused_input: a sparse step's output does not depend on the router weight (top-k
        # indices)
        return torch.cuda.make_graphed_callables(
            copy.deepcopy(module), (x,), allow_unused_input=True
        )
    except Exception as e:  # noqa: BLE001 - report, keep the eager numbers
        print(
            f"CUDA graph capture of {type(module).__name__} failed: "
            f"{type(e).__name__}: {str(e)[:300]}",
            flush=True,
        )
        return None


def neuron(D, H, G, K, backend, dev, dtype, sparse=True):
    m = NeuronRoutedFFN(D, H, G, K, backend=backend).to(dev, dtype)
    m.sparse = sparse
    return m


def bench_shape(name, T, D, H, G, K, reps, dev) -> dict:
    bf = torch.bfloat16
    res = {
        "shape": dict(T=T, D=D, H=H, G=G, K=K),
        "flops_dense": ffn_flops(T, D, H),
        "flops_sparse": ffn_flops(T, D, H) * K / G,
    }
    torch.manual_seed(0)
    ours = neuron(D, H, G, K, "grouped", dev, bf)
    x = torch.randn(T, D, device=dev, dtype=bf, requires_grad=True)
    dy = torch.randn(T, D, device=dev, dtype=bf)
    ref32 = neuron(D, H, G, K, "torch", dev, torch.float32)
    ref32.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    # the reference routes on the same bf16 input values, so both pick the same groups
    want = grads_of(ref32, x.float(), dy.float())
    del ref32
    ref16 = neuron(D, H, G, K, "torch", dev, bf)
    ref16.load_state_dict(ours.state_dict())
    plain = grads_of(ref16, x, dy)
    del ref16
    got = grads_of(ours, x, dy)
    res["rel_err_bf16_torch"] = {k: rel(plain[k], want[k]) for k in want}
    res["rel_err"] = {k: rel(got[k], want[k]) for k in want}
    res["within_2x_torch"] = all(
        res["rel_err"][k] <= 2 * res["rel_err_bf16_torch"][k] + 1e-6 for k in want
    )
    print(
        name,
        "rel err",
        {k: f"{v:.2e}" for k, v in res["rel_err"].items()},
        "bf16 torch",
        {k: f"{v:.2e}" for k, v in res["rel_err_bf16_torch"].items()},
        "within 2x:",
        res["within_2x_torch"],
        flush=True,
    )
    del plain, got, want

    dense = SwiGLU(D, H).to(dev, bf)
    ours_dense = neuron(D, H, G, K, "grouped", dev, bf, sparse=False)
    contenders = {
        "dense": (fwd_bwd(dense, x, dy), zero_grads(dense, x)),
        "neuron_sparse": (fwd_bwd(ours, x, dy), zero_grads(ours, x)),
        "neuron_dense": (fwd_bwd(ours_dense, x, dy), zero_grads(ours_dense, x)),
    }
    if dev == "cuda":
        for key, module in (("dense_graphed", dense), ("neuron_sparse_graphed", ours)):
            g = graphed(module, x)
            if g is not None:
                contenders[key] = (fwd_bwd(g, x, dy), zero_grads(g, x))
    t = time_interleaved(contenders, reps)
    t.update({k + "_queued": v for k, v in time_interleaved(contenders, reps, queued=True).items()})
    res["ms"] = t

    def base(k):  # graphed contenders against graphed dense, when it was captured
        d = "dense_graphed" if "graphed" in k and "dense_graphed" in t else "dense"
        return t[d + "_queued" if k.endswith("_queued") else d]

    res["speedup_vs_dense"] = {k: base(k) / v for k, v in t.items()}
    res["tflops"] = {
        k: (res["flops_sparse"] if "sparse" in k else res["flops_dense"]) / v / 1e9
        for k, v in t.items()
    }
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="d2048,d4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests this script")
    args = ap.parse_args()
    moe_bench.DEV = args.device  # time_interleaved's timer: CUDA events, or wall clock on CPU
    env = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    out = {"env": env, "shapes": {}}
    print(env, flush=True)
    for name in args.shapes.split(","):
        out["shapes"][name] = bench_shape(name, **SHAPES[name], reps=args.reps, dev=args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    print(f"\n{'shape':6s} {'contender':22s} {'ms':>8s} {'TFLOP/s':>8s} {'x dense':>8s}")
    for name, r in out["shapes"].items():
        for k, ms in r["ms"].items():
            print(
                f"{name:6s} {k:22s} {ms:8.2f} {r['tflops'][k]:8.0f} {r['speedup_vs_dense'][k]:8.2f}"
            )


if __name__ == "__main__":
    main()
