"""CUDA-event timing shared by the bench/ scripts: ``timeit`` for one callable at a time,
``StepTimes`` for the steps of a training run."""

from __future__ import annotations

import time

import torch


def timeit(fn, min_reps: int = 3, budget_s: float = 1.5, reps: int = 0) -> float:
    """Median milliseconds of ``fn()`` over CUDA events, after two warm-up calls: ``reps`` timings
    if given, else as many as fit ``budget_s`` by one untimed call's length (``min_reps`` to 20)."""
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


class StepTimes:
    """Seconds per training step without making the host wait after each step (as train.py does
    not): on CUDA an event after each step's launches (``mark()``), each step's time the interval
    between its event and the previous one on the device's clock (including any wait for the host);
    on CPU the wall clock.

    ``ready(keep)``: the times of the steps marked so far but the newest ``keep``, not returned
    before; with ``keep=1`` it waits only for the previous step's end, which the device has passed
    once it runs the newest step (so a caller that reads them as it goes, e.g. a clock, stays at
    most a step ahead)."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks, self.read = cuda, [], 0
        self.mark()  # the first step's start

    def mark(self) -> None:
        """After a step's launches."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def ready(self, keep: int = 0) -> list[float]:
        out = []
        while self.read < len(self.marks) - 1 - keep:
            a, b = self.marks[self.read], self.marks[self.read + 1]
            if self.cuda:
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                out.append(b - a)
            self.read += 1
        return out
