"""1-bit masks: ``pack_bits(bool[..., C]) -> uint8[..., ceil(C/8)]`` and its inverse
``unpack_bits``.

Packed along the last dim only, row by row, so a packed mask has the weight's leading dims and
shards on dim 0 exactly like the weight (FSDP2 ``Shard(0)``): each rank's packed shard is the
packing of its weight shard. Bit j of byte b holds entry ``8 b + j`` (little-endian within the
byte).
"""

from __future__ import annotations

import torch


def packed_cols(cols: int) -> int:
    return (cols + 7) // 8


def _weights(device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``bool[..., C] -> uint8[..., ceil(C/8)]``."""
    C = mask.shape[-1]
    pad = packed_cols(C) * 8 - C
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)) if pad else mask.to(torch.uint8)
    # products are 0 or one power of two per lane, so the sum of the 8 lanes fits in uint8 exactly
    return (m.view(*mask.shape[:-1], -1, 8) * _weights(mask.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """``uint8[..., ceil(C/8)] -> bool[..., C]``."""
    bits = (packed.unsqueeze(-1) & _weights(packed.device)) != 0
    return bits.view(*packed.shape[:-1], -1)[..., :cols]
