"""``dst``: weight-level dynamic sparse training (layers.DynamicSparsity).

The one place each option and its default is declared: ``DynamicSparsity(model, opt, cfg=...,
**overrides)`` takes this dataclass plus keyword overrides of its fields, and the YAML ``dst:``
section fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .errors import check, check_choice

DST_METHODS = ("rigl", "set", "magnitude")
DST_DISTRIBUTIONS = ("uniform", "erk")
DST_GRANULARITIES = ("unstructured", "block", "nm")
DST_SCHEDULES = ("constant", "cosine")


@dataclass
class DSTConfig:
    enabled: bool = False
    sparsity: float = 0.8  # target fraction of zeros (global, over masked weights)
    # ramp start (cosine schedule); None = constant at `sparsity`
    initial_sparsity: Optional[float] = None
    sparsity_schedule: str = "constant"  # constant | cosine (initial_sparsity -> sparsity)
    ramp_fraction: float = 0.5  # fraction of training over which the sparsity ramps
    method: str = "rigl"  # rigl | set | magnitude
    distribution: str = "erk"  # uniform | erk
    update_every: int = 100
    drop_fraction: float = 0.3  # initial fraction of active weights replaced per update
    drop_schedule: str = "cosine"  # constant | cosine decay to 0 at stop_fraction
    stop_fraction: float = 0.75  # no mask updates after this fraction of training
    grad_ema: Optional[float] = None  # a in a*|g| + (1-a)*S_prev; None = plain |g| (RigL)
    granularity: str = "unstructured"  # unstructured | block | nm
    block: list[int] = field(default_factory=lambda: [1, 1024])  # block shape for granularity=block
    n: int = 2  # N:M
    m: int = 4
    transposable: bool = False  # N:M on W and W^T
    dense_finish: bool = False  # drop masks for the last steps after stop_fraction
    erk_power: float = 1.0  # ERK raw density ((n_in + n_out) / (n_in * n_out)) ** erk_power
    # fnmatch patterns on parameter names. include=None (default, any model): every 2-D nn.Linear
    # weight and every >= 3-D stacked-expert weight except embeddings and the output head
    # (layers.dst.targets); a list: every >= 2-D parameter matching one. Names matching exclude
    # (routers and the compressed-attention branch gates, by default: gates, not features) are never
    # masked.
    include: Optional[list[str]] = None
    exclude: list[str] = field(
        default_factory=lambda: [
            "*.gate.weight",
            "*.noise.weight",
            "*router*",
            "*.branch_gate.weight",
        ]
    )
    seed: int = 0  # SET random growth: drawn from (seed, step, layer), same on every rank
    # 2:4 layers run through torch.sparse semi-structured kernels (CUDA)
    semi_structured: bool = False
    # Optimizer and DST state for active weights only (layers.dst.compact): bit-packed masks, a bf16
    # EMA score and AdamW moments held for the active entries (training.optim.CompactAdamW). Needs
    # that optimizer.
    compact_state: bool = False

    def validate(self, key: str = "dst") -> None:
        check(
            0.0 <= self.sparsity < 1.0, f"{key}.sparsity", f"must be in [0, 1), got {self.sparsity}"
        )
        if self.initial_sparsity is not None:
            check(
                0.0 <= self.initial_sparsity < 1.0,
                f"{key}.initial_sparsity",
                f"must be in [0, 1), got {self.initial_sparsity}",
            )
        check_choice(self.method, DST_METHODS, f"{key}.method")
        check_choice(self.distribution, DST_DISTRIBUTIONS, f"{key}.distribution")
        check_choice(self.granularity, DST_GRANULARITIES, f"{key}.granularity")
        check_choice(self.sparsity_schedule, DST_SCHEDULES, f"{key}.sparsity_schedule")
        check_choice(self.drop_schedule, DST_SCHEDULES, f"{key}.drop_schedule")
        check(self.update_every > 0, f"{key}.update_every", f"must be > 0, got {self.update_every}")
        check(
            0.0 < self.drop_fraction <= 1.0,
            f"{key}.drop_fraction",
            f"must be in (0, 1], got {self.drop_fraction}",
        )
        check(
            0.0 < self.stop_fraction <= 1.0,
            f"{key}.stop_fraction",
            f"must be in (0, 1], got {self.stop_fraction}",
        )
        check(
            0.0 < self.ramp_fraction <= 1.0,
            f"{key}.ramp_fraction",
            f"must be in (0, 1], got {self.ramp_fraction}",
        )
        if self.grad_ema is not None:
            check(
                0.0 < self.grad_ema <= 1.0,
                f"{key}.grad_ema",
                f"must be in (0, 1], got {self.grad_ema}",
            )
        check(0 < self.n < self.m, f"{key}.n", f"N:M needs 0 < N < M, got {self.n}:{self.m}")
        check(
            len(self.block) == 2 and all(b > 0 for b in self.block),
            f"{key}.block",
            f"must be two positive ints [rows, cols], got {list(self.block)}",
        )
        check(self.erk_power > 0, f"{key}.erk_power", f"must be > 0, got {self.erk_power}")
        if self.include is not None:
            check(
                len(self.include) > 0,
                f"{key}.include",
                "needs at least one pattern (or null for the default)",
            )
        if self.granularity == "nm":
            check(
                abs(self.sparsity - (1 - self.n / self.m)) < 1e-9,
                f"{key}.sparsity",
                f"N:M {self.n}:{self.m} fixes sparsity at {1 - self.n / self.m:g}, "
                f"got {self.sparsity}",
            )
            check(
                self.sparsity_schedule == "constant",
                f"{key}.sparsity_schedule",
                "N:M masks need a constant sparsity",
            )
        if self.transposable:
            check(self.granularity == "nm", f"{key}.transposable", "needs granularity=nm")
            check(
                self.m <= 4,
                f"{key}.m",
                f"transposable N:M enumerates m x m tile patterns; needs m <= 4, got {self.m}",
            )
        if self.semi_structured:
            check(
                self.granularity == "nm" and (self.n, self.m) == (2, 4),
                f"{key}.semi_structured",
                "needs granularity=nm with n=2, m=4",
            )
        if self.compact_state:
            check(
                not self.dense_finish,
                f"{key}.compact_state",
                "dense_finish makes every weight active: there is no compact state to keep",
            )
        if self.sparsity_schedule == "cosine":
            check(
                self.initial_sparsity is not None,
                f"{key}.initial_sparsity",
                "the cosine schedule ramps from it; set it",
            )
            check(
                self.ramp_fraction <= self.stop_fraction,
                f"{key}.ramp_fraction",
                f"the ramp ({self.ramp_fraction}) must end by "
                f"stop_fraction ({self.stop_fraction}): sparsity only changes at mask updates",
            )
