"""When DST masks change and to what: update steps, sparsity ramp, drop-fraction decay, dense
finish.

A pure function of the step (no state), so a resumed run makes the same decisions. Conventions
(RigL, google-research/rigl; SRigL's ``T_end``): masks update after the optimizer step of every step
``t`` with ``0 < t <= stop_step`` and ``t % update_every == 0``, ``stop_step = int(stop_fraction *
total_steps)``. Cosine drop fraction: ``a/2 * (1 + cos(pi * t / stop_step))``. Cosine sparsity ramp
(seed 001): from ``initial_sparsity`` at step 0 to ``sparsity`` at ``ramp_fraction * total_steps``;
it takes effect at update steps only. With ``dense_finish`` every mask is dropped at ``stop_step``
and training ends dense. ``total_steps=None`` is open-ended training: updates never stop, which only
a schedule with no fraction of training in it allows (``from_config`` checks).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Optional

from moezoo.configs import ConfigError, DSTConfig


@dataclass(frozen=True)
class DSTSchedule:
    total_steps: Optional[int]
    update_every: int = 100
    stop_fraction: float = 0.75
    drop_fraction: float = 0.3
    drop_schedule: str = "cosine"
    sparsity: float = 0.8
    initial_sparsity: Optional[float] = None
    sparsity_schedule: str = "constant"
    ramp_fraction: float = 0.5
    dense_finish: bool = False

    @classmethod
    def from_config(cls, cfg: DSTConfig, total_steps: Optional[int]) -> DSTSchedule:
        """The schedule of ``cfg``; ``ConfigError`` when it needs ``total_steps`` and has none."""
        if total_steps is None:
            need = {
                "stop_fraction": cfg.stop_fraction < 1.0,
                "drop_schedule": cfg.drop_schedule != "constant",
                "sparsity_schedule": cfg.sparsity_schedule != "constant",
                "dense_finish": cfg.dense_finish,
            }
            named = ", ".join(f"{k}={getattr(cfg, k)!r}" for k, v in need.items() if v)
            if named:
                raise ConfigError(
                    "dst.total_steps",
                    f"{named} are fractions of training: pass total_steps=N, or "
                    "drop_schedule='constant', stop_fraction=1.0 for open-ended runs",
                )
        elif not (isinstance(total_steps, int) and total_steps > 0):
            raise ConfigError("train.steps", f"DST needs total_steps > 0, got {total_steps}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"total_steps"}
        return cls(total_steps, **{k: getattr(cfg, k) for k in fields})

    @property
    def stop_step(self) -> int:
        return (
            sys.maxsize if self.total_steps is None else int(self.stop_fraction * self.total_steps)
        )

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
        return (
            0.5
            * self.drop_fraction
            * (1.0 + math.cos(math.pi * min(step / max(1, self.stop_step), 1.0)))
        )
