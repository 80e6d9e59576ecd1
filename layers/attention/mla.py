"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3): low-rank q and kv,
decoupled RoPE.

``forward(x[B, S, D], cos[S, Dr], sin[S, Dr], start_pos=0, mask=None) -> [B, S, D]``, with

    q     = wq_b(q_norm(wq_a(x)))  (or wq(x) when q_lora_rank is None)   -> [B, H, S, Dn + Dr]
    c, kr = split(wkv_a(x), [R, Dr]);  c = kv_norm(c)                    c [B, T, R], kr [B, T, Dr]
    k, v  = split(wkv_b(c), [Dn, Dv]) per head; k = cat(k, rope(kr) shared by all H heads)
    out   = wo(attention(cat(q_nope, rope(q_rope)), k, v))              heads of Dv

Legend: H heads, R ``kv_lora_rank``, Dn ``qk_nope_head_dim``, Dr ``qk_rope_head_dim``, Dv
``v_head_dim``. The decode cache holds only the compressed ``c [B, T, R]`` and rotated ``kr [B, T,
Dr]`` (R + Dr numbers a token and layer instead of 2 H Dh), re-expanded through ``wkv_b`` each step
(no weight absorption yet). ``rope_interleave`` (DeepSeek's checkpoints): rope dims are (even, odd)
pairs; they are de-interleaved before the rotate-half rotation, which equals HF's
``apply_rotary_pos_emb_interleave``. Scores are scaled by ``1/sqrt(Dn + Dr)`` times
``softmax_scale_factor`` (YaRN's ``mscale_all_dim`` correction squared).

Sparse patterns apply as in layers.attention.module.Attention (whose pattern dispatch this class
reuses): q and k are ordinary [B, H, T, Dn + Dr] tensors by the time they meet the pattern, values
have Dv dims. Parameter names follow DeepSeek's reference model (zoo.hf maps HF's).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..norm import RMSNorm
from ..rope import apply_rotary, yarn_mscale
from ..shapes import check_attention_inputs
from .compressed import compress_heads
from .module import Attention
from .pattern import head_patterns, layer_block_size

# HF's DeepseekV3RMSNorm of q_a / kv_a keeps its default eps, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MLACache(nn.Module):
    """Static-size latent cache ``c [B, max_len, R]``, ``kr [B, max_len, Dr]``."""

    def __init__(
        self, batch: int, max_len: int, rank: int, rope_dim: int, dtype=torch.float32, device=None
    ):
        super().__init__()
        self.register_buffer(
            "c", torch.zeros(batch, max_len, rank, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "kr",
            torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device),
            persistent=False,
        )

    def update(
        self, start_pos: int, c: torch.Tensor, kr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``c [B, S, R]``, ``kr [B, S, Dr]`` at ``start_pos``; return the filled prefixes."""
        end = start_pos + c.shape[1]
        if end > self.c.shape[1]:
            raise ValueError(f"MLA cache overflow: {end} > max_len {self.c.shape[1]}")
        self.c[:, start_pos:end] = c.to(self.c.dtype)
        self.kr[:, start_pos:end] = kr.to(self.kr.dtype)
        return self.c[:, :end], self.kr[:, :end]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., (x0, x1, x2, x3, ...)] -> [..., (x0, x2, ..., x1, x3, ...)]``: pairs to halves."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLA(Attention):
    """Latent attention with Attention's interface (``setup_cache``, ``cache``, patterns, masks)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: Optional[int],
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_interleave: bool = True,
        softmax_scale_factor: float = 1.0,
        pattern=None,
        backend: str = "auto",
        layer_id: int = 0,
        reference_below: int = -1,
        flex_kernel: str = "auto",
        kernel_options: Optional[dict] = None,
    ):
        nn.Module.__init__(self)  # own projections; Attention contributes only the pattern dispatch
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_interleave, self.softmax_scale_factor = rope_interleave, softmax_scale_factor
        self.layer_id, self.backend, self.reference_below = layer_id, backend, reference_below
        self.flex_kernel, self.kernel_options = flex_kernel, kernel_options
        self._init_dispatch_state()  # as Attention's: stats, selection record, dense phases
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        if pattern is not None:
            pats = head_patterns(pattern, n_heads)
            layer_block_size(pats)
            if compress_heads(pats):
                raise ValueError(
                    "block top-k compress: 1 runs in layers.Attention only, not in MLA"
                )
        self.pattern = pattern
        self.compress_heads = []
        self.cache: Optional[MLACache] = None
        self._q_history: Optional[torch.Tensor] = None

    @classmethod
    def from_config(cls, cfg, **kw) -> MLA:
        """From a ``configs.ModelConfig`` with ``attention_type: mla`` (``kw``: pattern, backend,
        layer_id, ...)."""
        m, rs = cfg.mla, cfg.rope_scaling
        factor = 1.0
        # DeepSeek: softmax scale times mscale(all_dim)^2
        if rs.type == "yarn" and rs.mscale_all_dim:
            factor = yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
        return cls(
            cfg.dim,
            cfg.n_heads,
            m.q_lora_rank,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.rope_interleave,
            factor,
            **kw,
        )

    def setup_cache(self, batch: int, max_len: int, dtype=None, device=None) -> None:
        w = self.wkv_a.weight
        self.cache = MLACache(
            batch, max_len, self.kv_lora_rank, self.rope_dim, dtype or w.dtype, device or w.device
        )

    def init_weights(self, std: float = 0.02, out_std: float = 0.02) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                nn.init.normal_(getattr(self, name).weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(deinterleave(x) if self.rope_interleave else x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: int = 0,
        mask: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        # positions: Attention's signature, which the block calls; only SSMax reads them, and MLA
        # has none
        check_attention_inputs("MLA", x, self.dim, self.rope_dim, cos, sin, positions)
        B, S, _ = x.shape
        H, Dn, Dr, Dv = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)
        q = q.view(B, S, H, Dn + Dr).transpose(1, 2)
        q = torch.cat([q[..., :Dn], self._rope(q[..., Dn:], cos, sin)], dim=-1)
        # every attention path scales by 1/sqrt(Dn + Dr); fold the rest into q
        if self.softmax_scale_factor != 1.0:
            q = q * self.softmax_scale_factor
        c, kr = self.wkv_a(x).split([self.kv_lora_rank, Dr], dim=-1)
        c, kr = self.kv_norm(c), self._rope(kr[:, None], cos, sin)[:, 0]  # [B, S, R], [B, S, Dr]
        if self.cache is not None:
            c, kr = self.cache.update(start_pos, c, kr)
        T = c.shape[1]
        kv = self.wkv_b(c).view(B, T, H, Dn + Dv).transpose(1, 2)
        k = torch.cat([kv[..., :Dn], kr[:, None].expand(B, H, T, Dr)], dim=-1)
        out = self._attend(q, k, kv[..., Dn:], start_pos, mask)
        return self.wo(out.transpose(1, 2).reshape(B, S, H * Dv))
