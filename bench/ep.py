"""Expert-parallel MoE at EP degree 1 on one GPU: the cost of the EP code paths against the plain
layer.

    python bench/ep.py [--shapes fine,mixtral] [--reps 20] [--out results.json]

In one process with a one-rank process group (nccl on CUDA, gloo on CPU), bf16 forward+backward of
the same MoE weights and tokens through three paths:
- ``plain``: ``MoE`` without an ep_group (what training runs at ep = 1);
- ``ep1``: ``MoE(..., ep_group=<1 rank>)``, which ``layers.moe.expert_parallel.ep_dispatch`` sends
  down the plain path (a one-rank group holds every expert);
- ``a2a``: the full all-to-all dispatch forced at one rank (count exchange, two all_to_all_single,
  the split sizes' host sync, regrouping): the fixed overhead EP pays on top of the expert GEMMs
  before any inter-GPU traffic. Reports medians of CUDA-event timings after warm-up, the ratios to
  ``plain`` and the max abs difference of outputs against ``plain``. Timing helpers are
  bench/moe.py's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench.moe as bm  # noqa: E402
from moezoo.layers import MoE  # noqa: E402
from moezoo.layers.moe import expert_parallel as moe_ep  # noqa: E402


def run_shape(name: str, reps: int) -> dict:
    s = bm.SHAPES[name]
    T, D, H, E, K = s["T"], s["D"], s["H"], s["E"], s["K"]
    dev, dtype = bm.DEV, (torch.bfloat16 if bm.DEV == "cuda" else torch.float32)
    torch.manual_seed(0)
    plain = MoE(D, H, E, K).to(dev, dtype)
    ep1 = copy.deepcopy(plain)
    ep1.ep_group = dist.group.WORLD
    x = torch.randn(T, D, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, D, device=dev, dtype=dtype)
    out = {"shape": name, **s}
    with torch.no_grad():
        ref = plain(x)
        out["maxdiff_ep1"] = (ep1(x) - ref).abs().max().item()
        forced = moe_ep.ep_dispatch
        moe_ep.ep_dispatch = moe_ep.all_to_all_dispatch
        try:
            out["maxdiff_a2a"] = (ep1(x) - ref).abs().max().item()
        finally:
            moe_ep.ep_dispatch = forced
    zero = bm.zero_grads(plain, ep1, x)
    out["plain_ms"] = bm.time_ms(bm.fwd_bwd(plain, x, dy), reps, before=zero)
    out["ep1_ms"] = bm.time_ms(bm.fwd_bwd(ep1, x, dy), reps, before=zero)
    moe_ep.ep_dispatch = moe_ep.all_to_all_dispatch
    try:
        out["a2a_ms"] = bm.time_ms(bm.fwd_bwd(ep1, x, dy), reps, before=zero)
    finally:
        moe_ep.ep_dispatch = forced
    out["ep1_vs_plain"] = out["ep1_ms"] / out["plain_ms"]
    out["a2a_vs_plain"] = out["a2a_ms"] / out["plain_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="fine,mixtral")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bm.DEV = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(
            "nccl" if bm.DEV == "cuda" else "gloo",
            init_method=f"file://{d}/store",
            rank=0,
            world_size=1,
        )
        try:
            results = {
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if bm.DEV == "cuda" else "cpu",
                "rows": [run_shape(n, args.reps) for n in args.shapes.split(",")],
            }
        finally:
            dist.destroy_process_group()
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
