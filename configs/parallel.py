"""``parallel``: data / expert parallel layout over a DeviceMesh (training.parallel).

The world is ``dp_replicate x dp_shard`` ranks, every one a data-parallel rank (each reads its own
batch). Dense weights are FSDP-sharded over ``dp_shard`` (and replicated over ``dp_replicate``:
HSDP). Expert parallelism borrows from ``dp_shard``: ``ep`` consecutive ranks split the experts
(each holds ``num_experts / ep``) and exchange tokens by all-to-all; expert weights are FSDP-sharded
over the remaining ``dp_shard / ep`` ranks (torchtitan's "efsdp").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import check, check_choice


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # HSDP replicas (1 = plain FSDP)
    dp_shard: int = -1  # FSDP shard degree; -1 = world_size / dp_replicate (fill)
    ep: int = 1  # expert-parallel degree (divides num_experts and dp_shard)
    # shard with FSDP2 when world > 1; False = replicate (DDP semantics; ep must be 1)
    fsdp: bool = True
    # recompute each transformer block in backward (saves its input only)
    activation_checkpointing: bool = False
    backend: str = "auto"  # process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo

    def validate(self, key: str = "parallel") -> None:
        check(
            self.dp_replicate >= 1, f"{key}.dp_replicate", f"must be >= 1, got {self.dp_replicate}"
        )
        check(
            self.dp_shard == -1 or self.dp_shard >= 1,
            f"{key}.dp_shard",
            f"must be -1 or >= 1, got {self.dp_shard}",
        )
        check(self.ep >= 1, f"{key}.ep", f"must be >= 1, got {self.ep}")
        check(
            self.fsdp or self.ep == 1,
            f"{key}.fsdp",
            f"ep={self.ep} needs fsdp: true (the DDP path replicates every weight)",
        )
        check_choice(self.backend, ("auto", "nccl", "gloo"), f"{key}.backend")

    def resolve(
        self, world_size: int, num_experts: Optional[int] = None, key: str = "parallel"
    ) -> tuple[int, int, int]:
        """``(dp_replicate, dp_shard, ep)`` for ``world_size`` ranks, or ConfigError naming the bad
        degree.

        ``num_experts`` is the routed expert count of the model's MoE layers (None: no MoE layer).
        """
        self.validate(key)
        rep, ep = self.dp_replicate, self.ep
        if not self.fsdp:
            check(
                self.dp_shard in (-1, 1),
                f"{key}.dp_shard",
                "fsdp: false replicates every weight on every rank; "
                f"dp_shard must be -1 or 1, got {self.dp_shard}",
            )
            return world_size, 1, 1
        if self.dp_shard == -1:
            check(
                world_size % rep == 0,
                f"{key}.dp_replicate",
                f"dp_replicate={rep} does not divide the world size {world_size}",
            )
            shard = world_size // rep
        else:
            shard = self.dp_shard
            check(
                rep * shard == world_size,
                f"{key}.dp_shard",
                f"dp_replicate={rep} x dp_shard={shard} = {rep * shard} != world size {world_size}",
            )
        if ep > 1:
            check(num_experts is not None, f"{key}.ep", f"ep={ep} but the model has no MoE layer")
            check(
                num_experts % ep == 0,
                f"{key}.ep",
                f"ep={ep} does not divide model.moe.num_experts={num_experts}",
            )
            check(
                shard % ep == 0,
                f"{key}.ep",
                f"ep={ep} does not divide dp_shard={shard} "
                f"(world size {world_size} / dp_replicate {rep})",
            )
        return rep, shard, ep
