"""Rotary position embedding (Su et al. 2021) with linear, NTK-aware and Llama 3 context scaling.

Uses the "rotate half" layout of HF transformers (pairs are (i, i + D/2)), so HF Llama q/k weights
load without permutation. Linear scaling divides positions by ``factor`` (Chen et al. 2023, position
interpolation); NTK-aware scaling raises theta to ``theta * factor ** (D / (D - 2))`` (bloc97 2023);
Llama 3 scaling (Meta's Llama 3.1 reference, ``apply_scaling``) divides only the low frequencies by
``factor`` and blends smoothly in between (see ``llama3_inv_freq``). YaRN (Peng et al. 2023,
``yarn_inv_freq``) interpolates low frequencies, keeps high ones, ramps between and scales cos/sin
by its attention factor; ``dynamic`` is HF's dynamic NTK: theta grows with the longest position of
the call once past ``original_max_seq_len`` (stateless here: a fresh HF forward over the same
positions computes the same). Every formula follows transformers' ``modeling_rope_utils`` operation
for operation.

Positions are ``[S]`` (one row for the batch) or ``[B, S]`` (HF ``position_ids``: padding, packed
documents); cos/sin come out ``[S, D]`` or ``[B, S, D]`` and ``apply_rotary`` broadcasts either over
heads.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCALINGS = ("none", "linear", "ntk", "llama3", "yarn", "dynamic")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(
    factor: float,
    mscale: float = 1.0,
    mscale_all_dim: float = 0.0,
    attention_factor: float | None = None,
) -> float:
    """The cos/sin scale of YaRN as HF infers it (DeepSeek's mscale / mscale_all_dim ratio when both
    set)."""
    if attention_factor is not None:
        return attention_factor
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original_max_seq_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN ``inv_freq[dim/2]``: dims rotating fewer than ``beta_slow`` times over the original
    length are divided by ``factor``, more than ``beta_fast`` kept, linear ramp between (HF
    ``_compute_yarn_parameters``)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max_seq_len / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_seq_len: int,
) -> torch.Tensor:
    """Llama 3.1 rescaling of ``inv_freq[D/2]`` (float32 in, float32 out).

    A frequency whose wavelength ``2*pi/f`` is shorter than ``original_max_seq_len /
    high_freq_factor`` is kept, one longer than ``original_max_seq_len / low_freq_factor`` is
    divided by ``factor``, and in between ``f`` is blended as ``(1 - s) * f / factor + s * f`` with
    ``s = (original_max_seq_len / wavelength - low_freq_factor) / (high_freq_factor -
    low_freq_factor)``. The operations and their order follow transformers'
    ``_compute_llama3_parameters`` so the result is bit-identical to HF's buffer.
    """
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """``forward(positions[S]) -> (cos[S, D], sin[S, D])``; ``apply_rotary(x[B, H, S, D], cos,
    sin)``.

    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_seq_len`` are read only by the
    ``llama3`` scaling (defaults: Llama 3.1's 1, 4, 8192).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        scaling: str = "none",
        factor: float = 1.0,
        low_freq_factor: float = 1.0,
        high_freq_factor: float = 4.0,
        original_max_seq_len: int = 8192,
        yarn: dict | None = None,
    ):
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"unknown rope scaling {scaling!r}")
        if scaling == "llama3" and not 0 < low_freq_factor < high_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, "
                f"got {low_freq_factor}, {high_freq_factor}"
            )
        self.head_dim, self.scaling, self.factor = head_dim, scaling, factor
        self.low_freq_factor, self.high_freq_factor = low_freq_factor, high_freq_factor
        self.original_max_seq_len = original_max_seq_len
        # yarn: beta_fast, beta_slow, truncate, mscale, mscale_all_dim, attention_factor
        # (RopeScalingConfig's fields)
        self.yarn = dict(yarn or {})
        y = self.yarn
        self.attention_scaling = (
            yarn_attention_factor(
                factor,
                y.get("mscale", 1.0),
                y.get("mscale_all_dim", 0.0),
                y.get("attention_factor"),
            )
            if scaling == "yarn"
            else 1.0
        )
        self.theta = theta * factor ** (head_dim / (head_dim - 2)) if scaling == "ntk" else theta
        # Not a persistent buffer: it is derived from the config, and meta-device builds recompute
        # it.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    @classmethod
    def from_config(cls, head_dim: int, theta: float, rs) -> RotaryEmbedding:
        """From a ``configs.RopeScalingConfig`` ``rs``."""
        yarn = dict(
            beta_fast=rs.beta_fast,
            beta_slow=rs.beta_slow,
            truncate=rs.truncate,
            mscale=rs.mscale,
            mscale_all_dim=rs.mscale_all_dim,
            attention_factor=rs.attention_factor,
        )
        return cls(
            head_dim,
            theta,
            rs.type,
            rs.factor,
            rs.low_freq_factor,
            rs.high_freq_factor,
            rs.original_max_seq_len,
            yarn,
        )

    def _inv_freq(self, device=None, seq_len: int = 0) -> torch.Tensor:
        if self.scaling == "yarn":
            y = self.yarn
            return yarn_inv_freq(
                self.head_dim,
                self.theta,
                self.factor,
                self.original_max_seq_len,
                y.get("beta_fast", 32.0),
                y.get("beta_slow", 1.0),
                y.get("truncate", True),
            ).to(device)
        theta = self.theta
        if self.scaling == "dynamic":
            # HF: base * (factor * L / L0 - (factor - 1)) ** (D / (D - 2)) with L = max(seq_len, L0)
            L0, D = self.original_max_seq_len, self.head_dim
            theta = theta * ((self.factor * max(seq_len, L0) / L0) - (self.factor - 1)) ** (
                D / (D - 2)
            )
            return 1.0 / (
                theta
                ** (
                    torch.arange(0, D, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
                    / D
                )
            )
        inv_freq = 1.0 / (
            self.theta
            ** (
                torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                / self.head_dim
            )
        )
        if self.scaling == "llama3":
            inv_freq = llama3_inv_freq(
                inv_freq,
                self.factor,
                self.low_freq_factor,
                self.high_freq_factor,
                self.original_max_seq_len,
            )
        return inv_freq

    def init_weights(self, std: float = 0.0, out_std: float = 0.0) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.float()
        if self.scaling == "linear":
            pos = pos / self.factor
        inv_freq = self.inv_freq.to(pos.device)
        if self.scaling == "dynamic":
            L = int(positions.max()) + 1 if positions.numel() else 0  # one host sync, dynamic only
            if L > self.original_max_seq_len:
                inv_freq = self._inv_freq(pos.device, L)
        freqs = pos[..., None] * inv_freq  # = torch.outer for [S] positions, bit for bit
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.attention_scaling != 1.0:
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return emb.cos(), emb.sin()


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate ``x[B, H, S, D]`` by the angles of ``cos/sin[S, D]`` (or per row ``[B, S, D]``);
    float32 math, x's dtype out. ``scale`` (float32, broadcastable to ``[B, H, S, 1]``) multiplies
    the rotated rows inside the same float32 pass (SSMax's per-position query scale: one rounding to
    x's dtype, and no second read and write of q in eager mode)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = xf * cos + rotated * sin
    return (out if scale is None else out * scale).to(x.dtype)
