"""Training phases of a neuron-routed FFN (layers.NeuronRoutedFFN): dense warm-up, sparse/dense
alternation, dense finish (the sparse-then-dense recipe of Hu et al. 2024 and arXiv 2602.06183).

``neuron_phase(step, total_steps, warmup_fraction, sparse_ratio, finish_fraction)`` returns one of
``"warmup"`` (dense), ``"sparse"``, ``"dense"`` (a dense step inside the alternation, which also
trains the router) or ``"finish"`` (dense). Boundaries: the first ``round(warmup_fraction *
total_steps)`` steps warm up, the last ``round(finish_fraction * total_steps)`` finish (halves round
up). In between, step i of the alternation is sparse when ``floor((i + 1) * r) > floor(i * r)`` with
r = sparse_ratio: exactly ``r`` of the steps are sparse, spread evenly (r = 0.75 gives dense,
sparse, sparse, sparse, dense, ...). A pure function of the step, so resuming from a checkpoint
needs no schedule state.
"""

from __future__ import annotations

import math

PHASES = ("warmup", "sparse", "dense", "finish")


def _steps(fraction: float, total_steps: int) -> int:
    return int(math.floor(fraction * total_steps + 0.5))


def phase_bounds(
    total_steps: int, warmup_fraction: float, finish_fraction: float
) -> tuple[int, int]:
    """(first step after the warm-up, first step of the dense finish)."""
    return _steps(warmup_fraction, total_steps), total_steps - _steps(finish_fraction, total_steps)


def neuron_phase(
    step: int, total_steps: int, warmup_fraction: float, sparse_ratio: float, finish_fraction: float
) -> str:
    """Phase of ``step`` (0-based) in a run of ``total_steps``; steps past the end count as
    ``finish``."""
    warm, finish_start = phase_bounds(total_steps, warmup_fraction, finish_fraction)
    if step < warm:
        return "warmup"
    if step >= finish_start:
        return "finish"
    i = step - warm
    # the 1e-9 keeps ratios like 0.3 (3 * 0.1 = 0.30000000000000004 in binary) on their exact
    # pattern
    sparse = math.floor((i + 1) * sparse_ratio + 1e-9) > math.floor(i * sparse_ratio + 1e-9)
    return "sparse" if sparse else "dense"
