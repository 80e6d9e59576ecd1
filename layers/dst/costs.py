"""Bytes per masked weight that DST's options cost (what ``train.py --plan`` counts), at the
schedule's densest point: ``dst_state_bytes(cfg) -> DSTCost``.

Dense state (default): a bool mask and a bool ever-active flag (2 B), a float32 EMA grow score with
``grad_ema`` (4 B), and AdamW's two float32 moments for every weight, active or not (8 B).
``compact_state``: 1 bit each for mask and ever-active, a bf16 EMA score (2 B), and per *active*
weight the two moments plus an int32 index (12 B x density); inside the optimizer step the gathered
active weights and grads (8 B x density) exist too (training.optim.CompactAdamW).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moezoo.configs import DSTConfig


@dataclass
class DSTCost:
    buffers: float  # DST's own buffers (masks, score), B per masked weight
    optimizer: float  # AdamW state held for a masked weight, B per masked weight
    step_only: float = 0.0  # transient inside optimizer.step(), B per masked weight
    parts: dict = field(default_factory=dict)  # what each option costs, for the plan's notes


def peak_density(cfg: DSTConfig) -> float:
    """The largest global density of the masked weights over the schedule."""
    if cfg.granularity == "nm":
        return cfg.n / cfg.m
    lo = cfg.sparsity if cfg.initial_sparsity is None else min(cfg.sparsity, cfg.initial_sparsity)
    return 1.0 - lo


def dst_state_bytes(cfg: DSTConfig, margin: float = 1.0) -> DSTCost:
    """``margin``: the compact store's headroom for a weight sharded over ranks (1.1 under FSDP)."""
    ema = cfg.grad_ema is not None
    if not cfg.compact_state:
        parts = {
            "mask + ever-active (bool)": 2.0,
            **({"EMA score (fp32, grad_ema)": 4.0} if ema else {}),
            "AdamW moments (fp32, every weight)": 8.0,
        }
        return DSTCost(2.0 + 4.0 * ema, 8.0, 0.0, parts)
    d = peak_density(cfg) * margin
    parts = {
        "mask + ever-active (1 bit each)": 0.25,
        **({"EMA score (bf16, grad_ema)": 2.0} if ema else {}),
        f"AdamW moments + int32 index, active only (12 B x density {d:.2f})": 12.0 * d,
        f"gathered weights + grads, optimizer step only (8 B x {d:.2f})": 8.0 * d,
    }
    return DSTCost(0.25 + 2.0 * ema, 12.0 * d, 8.0 * d, parts)
