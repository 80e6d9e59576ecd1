"""Step profiles (``logging.profile_at``, ``logging.profile_steps``): torch.profiler over a few
training steps of a real run, written to the run folder, with where the device time went by kind.

    python train.py --config zoo/tiny_moe.yaml logging.profile_at=20 logging.profile_steps=3

writes, per rank, ``<out_dir>/profile/trace_rank<r>.json`` (open in https://ui.perfetto.dev or
chrome://tracing) and ``ops_rank<r>.txt`` (the ops by self time, torch's ``key_averages`` table),
and logs ``profile/<kind>_share`` (matmul, attention, communication, optimizer, other: shares of the
profiled device time, CPU op time on a CPU run), ``profile/step_ms``, ``profile/kernels_per_step``
(kernel launches; a small model's step is bound by them when the count is high and the step short)
and, on a GPU, ``profile/idle_ms`` (a step's time with no device work between the first and last
kernel: the device waiting on the host). The kinds are read off kernel names, as torchtitan's and
Megatron's profile summaries do: a rough split, the trace holds the truth. Profiling adds host
overhead to the profiled steps only.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

# (kind, name fragments), first match wins: collectives before everything (an NCCL kernel name can
# hold "gemm"-like words), attention before matmul (flash / flex kernels run matmuls inside).
KINDS = (
    (
        "communication",
        (
            "nccl",
            "all_to_all",
            "alltoall",
            "all_reduce",
            "allreduce",
            "reduce_scatter",
            "all_gather",
            "allgather",
            "c10d",
            "gloo",
        ),
    ),
    ("attention", ("flash", "fmha", "flex_attention", "attention", "sdpa", "triton_tem_fused")),
    (
        "matmul",
        (
            "gemm",
            "xmma",
            "nvjet",
            "cutlass",
            "grouped_mm",
            "matmul",
            "aten::mm",
            "aten::bmm",
            "aten::addmm",
            "aten::linear",
            "aten::_scaled",
        ),
    ),
    # the fused CUDA AdamW kernel; on CPU the per-parameter AdamW ops (lerp_, addcdiv_ are its own)
    ("optimizer", ("adam", "multi_tensor_apply", "_foreach", "aten::lerp_", "aten::addcdiv_")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, frags in KINDS if any(f in low for f in frags)), "other")


def _device_events(prof, on_gpu: bool):
    """(name, self time us, count) of each kernel (GPU run) or each CPU op (CPU run)."""
    rows = []
    for e in prof.key_averages():
        if on_gpu:
            t = getattr(e, "self_device_time_total", 0) or 0
            is_kernel = str(getattr(e, "device_type", "")).endswith("CUDA")
            # counted, scopes doubled the optimizer's share
            if t > 0 and is_kernel and not _is_scope(e):
                rows.append((e.key, t, e.count))
        # ops, not their scopes
        elif e.self_cpu_time_total > 0 and e.key.startswith(("aten::", "c10d::")):
            rows.append((e.key, e.self_cpu_time_total, e.count))
    return rows


def _is_scope(e) -> bool:
    # record_function scopes also appear on the GPU timeline ("Optimizer.step#AdamW.step", its span
    # of the optimizer's kernels): not device work of their own
    return getattr(e, "is_user_annotation", False) or "#" in e.key


def device_gaps(events, top: int = 3) -> tuple[float, float, list]:
    """The profiled device work (kernels, memsets, copies: events on the CUDA timeline;
    ``prof.events()``) -> (span, idle, largest gaps): microseconds from the first one's start to the
    last one's end, how many of them no device work ran (the union of the intervals: streams may
    overlap), and the ``top`` gaps as (us, work before, work after). Idle inside the span is the
    device waiting on the host: launches slower than the kernels, or a sync (an upper bound: the
    profiler adds host time to every op)."""
    iv = sorted(
        (e.time_range.start, e.time_range.end, e.key)
        for e in events
        if str(getattr(e, "device_type", "")).endswith("CUDA")
        and not _is_scope(e)
        and e.time_range.end > e.time_range.start
    )
    if not iv:
        return 0.0, 0.0, []
    gaps, end, last = [], iv[0][1], iv[0][2]
    for start, stop, name in iv[1:]:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    gaps.sort(key=lambda g: -g[0])
    return end - iv[0][0], sum(g[0] for g in gaps), gaps[:top]


def summarize(rows, steps: int, wall_s: float) -> dict:
    """Shares of the profiled time by kind, the mean step time and the kernel launches per step."""
    total = sum(t for _, t, _ in rows) or 1.0
    out = {f"profile/{kind}_share": 0.0 for kind, _ in KINDS}
    out["profile/other_share"] = 0.0
    for name, t, _ in rows:
        out[f"profile/{kind_of(name)}_share"] += t / total
    out["profile/step_ms"] = 1e3 * wall_s / max(steps, 1)
    out["profile/busy_ms"] = total / 1e3 / max(steps, 1)  # device (CPU: op) time per step
    out["profile/kernels_per_step"] = sum(c for _, _, c in rows) / max(steps, 1)
    return out


def format_summary(prof: dict, on_gpu: bool = True) -> str:
    """One line of ``summarize``'s dict: step time, shares by kind, launches a step."""
    shares = ", ".join(
        f"{k[len('profile/') : -len('_share')]} {v:.0%}"
        for k, v in prof.items()
        if k.endswith("_share")
    )
    idle = (
        f", the device idle {prof['profile/idle_ms']:.1f} ms a step"
        if "profile/idle_ms" in prof
        else ""
    )
    return (
        f"{prof['profile/step_ms']:.1f} ms a step, {shares}; "
        f"{prof['profile/kernels_per_step']:.0f} {'kernels' if on_gpu else 'ops'} a step{idle}"
    )


class StepProfiler:
    """Profiles training steps ``[start, start + steps)`` (1-based step numbers, as logged).

    ``before(step)`` ahead of each step, ``after(step)`` behind it; ``after`` returns the summary
    (``summarize``) once the last profiled step is done, else None.
    """

    def __init__(self, start: int, steps: int, folder: str, rank: int, device: torch.device):
        self.start, self.stop, self.folder, self.rank, self.device = (
            start,
            start + steps,
            folder,
            rank,
            device,
        )
        self.prof, self.t0 = None, 0.0

    @property
    def enabled(self) -> bool:
        return self.start > 0

    def covers(self, step: int) -> bool:
        """Whether ``step`` is profiled (its time carries the profiler's overhead)."""
        return self.enabled and self.start <= step < self.stop

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, step: int) -> None:
        if not self.enabled or step != self.start:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
        )
        self._sync()
        self.prof = profile(activities=acts)
        self.prof.start()
        self.t0 = time.perf_counter()

    def after(self, step: int) -> Optional[dict]:
        if self.prof is None or step != self.stop - 1:
            return None
        self._sync()
        wall = time.perf_counter() - self.t0
        self.prof.stop()
        on_gpu = self.device.type == "cuda"
        os.makedirs(self.folder, exist_ok=True)
        self.prof.export_chrome_trace(os.path.join(self.folder, f"trace_rank{self.rank}.json"))
        sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        with open(os.path.join(self.folder, f"ops_rank{self.rank}.txt"), "w") as f:
            f.write(self.prof.key_averages().table(sort_by=sort, row_limit=60))
        out = summarize(_device_events(self.prof, on_gpu), self.stop - self.start, wall)
        if on_gpu:  # between the profiled steps' first and last kernel, waiting on the host
            out["profile/idle_ms"] = (
                device_gaps(self.prof.events())[1] / 1e3 / (self.stop - self.start)
            )
        self.prof = None
        return out
