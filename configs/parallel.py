"""``parallel``: data / expert parallel layout over a DeviceMesh (training.parallel)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import check, check_choice


@dataclass
class ParallelConfig:
    dp_replicate: int = 1    # HSDP replicas (1 = plain FSDP)
    dp_shard: int = -1       # FSDP shard degree; -1 = world_size / (dp_replicate) (fill)
    ep: int = 1              # expert-parallel degree (divides num_experts and the dp ranks)
    fsdp: bool = True        # shard with FSDP2 when world > 1; False = DDP
    backend: str = "auto"    # process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo

    def validate(self, key: str = "parallel") -> None:
        check(self.dp_replicate >= 1, f"{key}.dp_replicate", f"must be >= 1, got {self.dp_replicate}")
        check(self.dp_shard == -1 or self.dp_shard >= 1, f"{key}.dp_shard", f"must be -1 or >= 1, got {self.dp_shard}")
        check(self.ep >= 1, f"{key}.ep", f"must be >= 1, got {self.ep}")
        check_choice(self.backend, ("auto", "nccl", "gloo"), f"{key}.backend")
