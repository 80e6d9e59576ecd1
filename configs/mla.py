"""``model.mla``: Multi-head Latent Attention (DeepSeek-V2/V3; layers.attention.mla), read when
``model.attention_type: mla``. Defaults are DeepSeek-V3's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import check_positive


@dataclass
class MLAConfig:
    # rank of the low-rank query path; None = one full q projection (V2-Lite)
    q_lora_rank: Optional[int] = 1536
    kv_lora_rank: int = 512  # the compressed kv latent (what the decode cache holds)
    qk_nope_head_dim: int = 128  # per-head q/k dims without RoPE (from the latent)
    qk_rope_head_dim: int = 64  # per-head q dims with RoPE; k's are one head shared by all
    v_head_dim: int = 128
    # rope dims come in (even, odd) pairs (DeepSeek) not halves (HF rotate-half)
    rope_interleave: bool = True

    def validate(self, key: str = "model.mla") -> None:
        check_positive(
            self,
            key,
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        )
