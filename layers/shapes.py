"""Input checks of the public layers: one ValueError naming the layer, the expected and the given
shape, instead of a reshape that silently regroups a wrong width (``x.reshape(-1, dim)`` of a
``[2, 5, 32]`` input to a ``dim=64`` layer is a valid ``[5, 64]``) or a matmul error deep inside.

The checks read only shapes and dtypes (Python ints, metadata): no device sync, and under
torch.compile they are guards, not graph ops.
"""

from __future__ import annotations

from typing import Optional

import torch


def _shape(t: torch.Tensor) -> str:
    # a list's format, not str() of each size: dynamo traces it (a fullgraph compile then reports
    # this ValueError rather than failing on the message)
    return f"{list(t.shape)}"


def check_width(layer: str, x: torch.Tensor, dim: int, name: str = "dim", arg: str = "x") -> None:
    """ValueError unless ``x`` is a floating-point ``[..., dim]`` tensor; ``layer`` names the
    module in the message, ``name`` the constructor argument ``dim`` came from."""
    if x.dim() == 0 or x.shape[-1] != dim:
        raise ValueError(
            f"{layer}({name}={dim}): expected {arg} of shape [..., {dim}], got {_shape(x)}"
        )
    if not x.is_floating_point():
        raise ValueError(f"{layer}: expected a floating-point {arg}, got {x.dtype}")


def check_attention_inputs(
    layer: str,
    x: torch.Tensor,
    dim: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
) -> None:
    """``x [B, S, dim]``, ``cos/sin [S, head_dim]`` or ``[B or 1, S, head_dim]``, ``positions [S]``
    or ``[B, S]``; ValueError naming the first argument that differs."""
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"{layer}(dim={dim}): expected x of shape [B, S, {dim}], got {_shape(x)}")
    check_width(layer, x, dim)
    B, S = x.shape[0], x.shape[1]
    for arg, t in (("cos", cos), ("sin", sin)):
        ok = t.dim() in (2, 3) and t.shape[-2] == S and t.shape[-1] == head_dim
        if ok and t.dim() == 3:
            ok = t.shape[0] in (1, B)
        if not ok:
            raise ValueError(
                f"{layer}(head_dim={head_dim}): expected {arg} of shape [S, {head_dim}] or "
                f"[B, S, {head_dim}] for x {_shape(x)} (S={S}), got {_shape(t)}"
            )
    if positions is not None and not (
        tuple(positions.shape) == (S,) or tuple(positions.shape) == (B, S)
    ):
        raise ValueError(
            f"{layer}: expected positions of shape [S] or [B, S] for x {_shape(x)} "
            f"(B={B}, S={S}), got {_shape(positions)}"
        )
