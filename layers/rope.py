"""Rotary position embedding (Su et al. 2021) with linear and NTK-aware context scaling.

Uses the "rotate half" layout of HF transformers (pairs are (i, i + D/2)), so HF Llama q/k weights
load without permutation. Linear scaling divides positions by ``factor`` (Chen et al. 2023, position
interpolation); NTK-aware scaling raises theta to ``theta * factor ** (D / (D - 2))`` (bloc97 2023).
"""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """``forward(positions[S]) -> (cos[S, D], sin[S, D])``; ``apply_rotary(x[B, H, S, D], cos, sin)``."""

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: str = "none", factor: float = 1.0):
        super().__init__()
        if scaling not in ("none", "linear", "ntk"):
            raise ValueError(f"unknown rope scaling {scaling!r}")
        self.head_dim, self.scaling, self.factor = head_dim, scaling, factor
        self.theta = theta * factor ** (head_dim / (head_dim - 2)) if scaling == "ntk" else theta
        # Not a persistent buffer: it is derived from the config, and meta-device builds recompute it.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))

    def init_weights(self, std: float = 0.0, out_std: float = 0.0) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.float()
        if self.scaling == "linear":
            pos = pos / self.factor
        freqs = torch.outer(pos, self.inv_freq.to(pos.device))
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[B, H, S, D]`` by the angles of ``cos/sin[S, D]``; float32 math, x's dtype out."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
