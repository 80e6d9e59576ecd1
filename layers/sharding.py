"""Whole and local views of tensors that may be FSDP2-sharded DTensors, for layers that must see a
whole weight now and then (DST mask updates, neuron re-clustering) and write back each rank's shard.

All three are the identity on plain tensors.
"""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch built without distributed
    DTensor, distribute_tensor = (), None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``; in-place ops on it change ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather for a sharded DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``ref``: a DTensor with ref's mesh and placements, each rank slicing
    its own shard without communication (every rank must hold the same ``full``); ``full`` itself
    otherwise."""
    if isinstance(ref, DTensor):
        return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)
    return full
