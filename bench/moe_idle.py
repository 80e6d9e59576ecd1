"""Where a grouped-MoE step leaves the GPU idle: host syncs and the largest gaps between kernels.

    python bench/moe_idle.py [--shape mixtral]

One forward+backward of ``MoE(..., backend="grouped")`` at a bench/moe.py shape after warm-up:
(1) under ``torch.cuda.set_sync_debug_mode(1)``, printing every synchronising call; (2) under the
profiler, printing CPU-side costs and the 12 largest gaps between consecutive kernels, plus the
kernel span vs busy time; (3) ``--steps N`` back-to-back steps under the profiler (no sync between
them, as bench/moe.py's queued timing): per step the kernel busy time, the grouped-GEMM part of it
and the span, so a timed step longer than one isolated step's kernels shows whether its kernels ran
slower (clocks) or the GPU sat idle between them. Used for the "why" of BENCHMARKS.md's MoE section.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe import SHAPES, zero_grads  # noqa: E402  (bench/moe.py)
from moe import fwd_bwd as moe_fwd_bwd  # noqa: E402

from moezoo.layers import MoE  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=8, help="back-to-back steps traced in (3)")
    a = ap.parse_args()
    T, D, H, E, K = (SHAPES[a.shape][k] for k in "TDHEK")
    moe = MoE(D, H, E, K, backend="grouped").cuda().to(torch.bfloat16)
    moe.init_weights(0.02, 0.02)  # random, as bench/moe.py: a GEMM's power draw depends on its data
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)

    zero, fwd_bwd = zero_grads(moe, x), moe_fwd_bwd(moe, x, dy)

    def step():
        zero()
        fwd_bwd()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    syncs = [
        w
        for w in caught
        if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)
    ]
    print("synchronising calls:", len(syncs))
    for w in syncs[:10]:
        print(" ", str(w.message)[:200], w.filename, w.lineno)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60
        )
    )
    ev = kernels(prof)
    gaps = sorted(
        (
            (b["ts"] - (a["ts"] + a["dur"]), a["name"][:50], b["name"][:50])
            for a, b in zip(ev, ev[1:])
        ),
        reverse=True,
    )[:12]
    for g, before, after in gaps:
        print(f"gap {g:9.1f} us after {before} before {after}")
    span = (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) / 1e3
    print(f"kernel span {span:.2f} ms, busy {sum(e['dur'] for e in ev) / 1e3:.2f} ms")

    # (3) back-to-back steps: one CUDA-event pair per step, kernels attributed to the step they
    #     start in.
    marks = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(a.steps)
    ]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s, e in marks:
            s.record()
            step()
            e.record()
        torch.cuda.synchronize()
    ev = kernels(prof)
    per = max(1, len(ev) // a.steps)
    print(
        f"{a.steps} back-to-back steps (~{per} kernels each): "
        "event ms | kernel busy ms | grouped GEMM ms | span ms"
    )
    for i, (s, e) in enumerate(marks):
        chunk = ev[i * per : (i + 1) * per]
        busy = sum(k["dur"] for k in chunk) / 1e3
        gemm = sum(k["dur"] for k in chunk if is_gemm(k["name"])) / 1e3
        span = (chunk[-1]["ts"] + chunk[-1]["dur"] - chunk[0]["ts"]) / 1e3
        print(f"step {i}: {s.elapsed_time(e):8.2f} | {busy:8.2f} | {gemm:8.2f} | {span:8.2f}")


def is_gemm(name: str) -> bool:
    n = name.lower()
    return any(w in n for w in ("gemm", "cutlass", "sm90_xmma", "nvjet"))


def kernels(prof) -> list[dict]:
    """The profiler's GPU kernel events (chrome-trace dicts: name, ts, dur in us), in start
    order."""
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    return sorted(
        (e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"),
        key=lambda e: e["ts"],
    )


if __name__ == "__main__":
    main()
