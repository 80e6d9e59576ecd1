"""When DST masks change and to what: update steps, sparsity ramp, drop-fraction decay, dense finish.

A pure function of the step (no state), so a resumed run makes the same decisions.
Conventions (RigL, google-research/rigl; SRigL's ``T_end``): masks update after the optimizer step of
every step ``t`` with ``0 < t <= stop_step`` and ``t % update_every == 0``, ``stop_step =
int(stop_fraction * total_steps)``. Cosine drop fraction: ``a/2 * (1 + cos(pi * t / stop_step))``.
Cosine sparsity ramp (seed 001): from ``initial_sparsity`` at step 0 to ``sparsity`` at
``ramp_fraction * total_steps``; it takes effect at update steps only. With ``dense_finish`` every mask
is dropped at ``stop_step`` and training ends dense.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DSTSchedule:
    total_steps: int
    update_every: int = 100
    stop_fraction: float = 0.75
    drop_fraction: float = 0.3
    drop_schedule: str = "cosine"
    sparsity: float = 0.8
    initial_sparsity: Optional[float] = None
    sparsity_schedule: str = "constant"
    ramp_fraction: float = 0.5
    dense_finish: bool = False

    @property
    def stop_step(self) -> int:
        return int(self.stop_fraction * self.total_steps)

    def is_update(self, step: int) -> bool:
        return 0 < step <= self.stop_step and step % self.update_every == 0

    def is_dense(self, step: int) -> bool:
        """True once the dense finish has begun (masks all ones, no masking)."""
        return self.dense_finish and step >= self.stop_step

    def sparsity_at(self, step: int) -> float:
        if self.sparsity_schedule == "constant" or self.initial_sparsity is None:
            return self.sparsity
        ramp = max(1, int(self.ramp_fraction * self.total_steps))
        c = 0.5 * (1.0 + math.cos(math.pi * min(step / ramp, 1.0)))
        return self.sparsity + (self.initial_sparsity - self.sparsity) * c

    def drop_fraction_at(self, step: int) -> float:
        if self.drop_schedule == "constant":
            return self.drop_fraction
        return 0.5 * self.drop_fraction * (1.0 + math.cos(math.pi * min(step / max(1, self.stop_step), 1.0)))
