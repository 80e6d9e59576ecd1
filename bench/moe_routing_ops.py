"""Launch count of MoE's routing stage (logits -> top-k, weights, losses, stats, dispatch plan) and
of its backward, eager vs torch.compile'd (layers.moe.routing_stage), counted with torch.profiler.

    python bench/moe_routing_ops.py [--device cpu|cuda] [--T 4096 --E 64 --K 8]

CPU: counts leaf aten ops that touch data (metadata-only ops such as view / empty are left out),
plus for the compiled stage the kernels inductor generated. CUDA: counts GPU kernels in the trace.
One line per variant: forward, backward, total.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moezoo.layers.moe.routing_stage import RoutingSpec, compiled_routing_stage, routing_stage  # noqa: E402

# aten ops that launch no kernel (metadata, allocation, autograd bookkeeping).
NO_KERNEL = {
    "aten::view",
    "aten::reshape",
    "aten::_unsafe_view",
    "aten::as_strided",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::detach",
    "aten::detach_",
    "aten::t",
    "aten::transpose",
    "aten::expand",
    "aten::select",
    "aten::slice",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::alias",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::lift_fresh",
    "aten::result_type",
    "aten::is_nonzero",
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::permute",
    "aten::chunk",
    "aten::split",
    "aten::unbind",
    "aten::contiguous",
    "aten::to",
    "aten::_to_copy_meta",
}


def count(prof, device: str) -> int:
    if device == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in NO_KERNEL:
            continue
        if any(c.name.startswith("aten::") and c.name not in NO_KERNEL for c in e.cpu_children):
            continue  # composite: its children are counted
        n += 1
    return n


def loss_of(r):
    """What the rest of the layer backpropagates into the routing stage."""
    extra = r.row_weights.sum() if r.row_weights is not None else 0.0
    return r.weights.sum() + r.aux_loss + extra


def measure(fn, logits, spec, device):
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for _ in range(2):  # compile / warm up
        r = fn(logits, None, spec)
        torch.autograd.grad(loss_of(r), logits)
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as pf:
        r = fn(logits, None, spec)
        if device == "cuda":
            torch.cuda.synchronize()
    loss = loss_of(r)
    with profile(activities=acts) as pb:
        torch.autograd.grad(loss, logits)
        if device == "cuda":
            torch.cuda.synchronize()
    return count(pf, device), count(pb, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--K", type=int, default=8)
    args = ap.parse_args()
    spec = RoutingSpec(
        "softmax", args.K, False, True, args.E, 0.01, 0.001, None, 1, True, True, row_weights=True
    )
    logits = torch.randn(args.T, args.E, device=args.device, requires_grad=True)
    from torch._inductor import metrics

    metrics.reset()
    variants = {"eager": routing_stage, "compiled": compiled_routing_stage("inductor", spec)}
    print(
        f"routing stage, T={args.T} E={args.E} K={args.K}, {args.device}: "
        f"{'kernels' if args.device == 'cuda' else 'leaf aten ops'} forward / backward / total"
    )
    for name, fn in variants.items():
        f, b = measure(fn, logits, spec, args.device)
        print(f"  {name:9s} {f:4d} {b:4d} {f + b:4d}")
    print(
        f"  (inductor generated {metrics.generated_kernel_count} kernels "
        "for the compiled forward + backward)"
    )


if __name__ == "__main__":
    main()
