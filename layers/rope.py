"""Rotary position embedding (Su et al. 2021) with linear, NTK-aware and Llama 3 context scaling.

Uses the "rotate half" layout of HF transformers (pairs are (i, i + D/2)), so HF Llama q/k weights
load without permutation. Linear scaling divides positions by ``factor`` (Chen et al. 2023, position
interpolation); NTK-aware scaling raises theta to ``theta * factor ** (D / (D - 2))`` (bloc97 2023);
Llama 3 scaling (Meta's Llama 3.1 reference, ``apply_scaling``) divides only the low frequencies by
``factor`` and blends smoothly in between (see ``llama3_inv_freq``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

SCALINGS = ("none", "linear", "ntk", "llama3")


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_seq_len: int) -> torch.Tensor:
    """Llama 3.1 rescaling of ``inv_freq[D/2]`` (float32 in, float32 out).

    A frequency whose wavelength ``2*pi/f`` is shorter than ``original_max_seq_len / high_freq_factor``
    is kept, one longer than ``original_max_seq_len / low_freq_factor`` is divided by ``factor``, and
    in between ``f`` is blended as ``(1 - s) * f / factor + s * f`` with
    ``s = (original_max_seq_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    The operations and their order follow transformers' ``_compute_llama3_parameters`` so the result is
    bit-identical to HF's buffer.
    """
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """``forward(positions[S]) -> (cos[S, D], sin[S, D])``; ``apply_rotary(x[B, H, S, D], cos, sin)``.

    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_seq_len`` are read only by the
    ``llama3`` scaling (defaults: Llama 3.1's 1, 4, 8192).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: str = "none", factor: float = 1.0,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, original_max_seq_len: int = 8192):
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"unknown rope scaling {scaling!r}")
        if scaling == "llama3" and not 0 < low_freq_factor < high_freq_factor:
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, "
                             f"got {low_freq_factor}, {high_freq_factor}")
        self.head_dim, self.scaling, self.factor = head_dim, scaling, factor
        self.low_freq_factor, self.high_freq_factor = low_freq_factor, high_freq_factor
        self.original_max_seq_len = original_max_seq_len
        self.theta = theta * factor ** (head_dim / (head_dim - 2)) if scaling == "ntk" else theta
        # Not a persistent buffer: it is derived from the config, and meta-device builds recompute it.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                         / self.head_dim))
        if self.scaling == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, self.factor, self.low_freq_factor, self.high_freq_factor,
                                       self.original_max_seq_len)
        return inv_freq

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
