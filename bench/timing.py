"""CUDA-event timing shared by the bench/ scripts that time one callable at a time."""
from __future__ import annotations

import time

import torch


def timeit(fn, min_reps: int = 3, budget_s: float = 1.5, reps: int = 0) -> float:
    """Median milliseconds of ``fn()`` over CUDA events, after two warm-up calls: ``reps`` timings if given,
    else as many as fit ``budget_s`` by one untimed call's length (``min_reps`` to 20)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    if not reps:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est = time.perf_counter() - t0
        reps = max(min_reps, min(20, int(budget_s / max(est, 1e-4))))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
