"""``model``: a LLaMA-style decoder (zoo.Transformer), with per-layer FFN and attention choices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .attention import AttentionConfig
from .errors import check, check_choice, check_positive
from .mla import MLAConfig
from .moe import MoEConfig
from .neuron import NeuronConfig
from .ranges import assign_ranges

FFN_TYPES = ("dense", "moe", "neuron")
ROPE_SCALINGS = ("none", "linear", "ntk", "llama3", "yarn", "dynamic")
QK_NORMS = ("none", "head", "full")
# gate activation of the gated FFN (SwiGLU, GeGLU, ...)
FFN_ACTS = ("silu", "gelu", "gelu_tanh", "relu2")
ATTENTION_TYPES = ("mha", "mla")


@dataclass
class RopeScalingConfig:
    type: str = "none"  # none | linear (position interpolation) | ntk (NTK-aware theta) | llama3
    # | yarn (Peng et al. 2023) | dynamic (HF dynamic NTK: theta grows with length)
    factor: float = 1.0  # context extension factor
    # length the base model was trained at (llama3: where its bands are set)
    original_max_seq_len: int = 2048
    # llama3: wavelengths > original_max_seq_len / this are divided by factor
    low_freq_factor: float = 1.0
    # llama3: wavelengths < original_max_seq_len / this are kept; blended between
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0  # yarn: rotations per original length above which a dim is kept
    beta_slow: float = 1.0  # yarn: ... below which it is interpolated (divided by factor)
    mscale: float = 1.0  # yarn: cos/sin scale 0.1*mscale*ln(factor)+1, over that of mscale_all_dim
    # yarn (DeepSeek): also multiplies the MLA softmax scale by its mscale^2
    mscale_all_dim: float = 0.0
    # yarn: explicit cos/sin scale (None: from mscale / mscale_all_dim)
    attention_factor: Optional[float] = None
    truncate: bool = True  # yarn: round the correction range to whole dims (HF default)

    def validate(self, key: str = "model.rope_scaling") -> None:
        check_choice(self.type, ROPE_SCALINGS, f"{key}.type")
        check(self.factor >= 1.0, f"{key}.factor", f"must be >= 1, got {self.factor}")
        check_positive(self, key, "original_max_seq_len", "low_freq_factor", "high_freq_factor")
        check(
            self.beta_fast > self.beta_slow > 0,
            f"{key}.beta_fast",
            f"must be > beta_slow={self.beta_slow} > 0, got {self.beta_fast}",
        )
        check(
            self.high_freq_factor > self.low_freq_factor,
            f"{key}.high_freq_factor",
            f"must be > low_freq_factor={self.low_freq_factor}, got {self.high_freq_factor}",
        )


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None  # None = n_heads (MHA); fewer = GQA
    # None = LLaMA rule: 8/3*dim * ffn_dim_multiplier, rounded up to multiple_of
    ffn_hidden: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attn_bias: bool = False  # q/k/v projection biases (Qwen2 family); LLaMA has none
    # per-head q/k/v size; None = dim // n_heads (Qwen3 sets it apart)
    attn_head_dim: Optional[int] = None
    qk_norm: str = "none"  # RMSNorm on q and k before RoPE: none | head (Qwen3: over each head)
    # | full (OLMoE: over the whole q / k projection)
    # gate activation of dense and expert FFNs: silu | gelu | gelu_tanh | relu2
    ffn_act: str = "silu"
    # mha (GQA, Attention) | mla (DeepSeek-V2/V3 latent attention, see mla)
    attention_type: str = "mha"
    mla: MLAConfig = field(default_factory=MLAConfig)
    init_std: float = 0.02
    ffn: str = "dense"  # FFN of every layer: dense | moe | neuron
    # per-layer override, e.g. {"0": dense}
    ffn_layers: dict[str, str] = field(default_factory=dict)
    moe: MoEConfig = field(default_factory=MoEConfig)
    neuron: NeuronConfig = field(default_factory=NeuronConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    # An HF folder or a model id already in the HF cache (no download): training starts from its
    # weights (zoo.pretrained), and the fields above must describe the same architecture.
    init_from: Optional[str] = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Query/key head size (MLA: nope + rope dims)."""
        if self.attention_type == "mla":
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Rotated dims per head: all of head_dim, or MLA's decoupled qk_rope_head_dim."""
        return self.mla.qk_rope_head_dim if self.attention_type == "mla" else self.head_dim

    @property
    def hidden_dim(self) -> int:
        """Dense FFN hidden size (LLaMA: 4096 -> 11008, 8192 -> 22016)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        h = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            h = int(self.ffn_dim_multiplier * h)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)

    @property
    def expert_hidden_dim(self) -> int:
        return self.moe.hidden_dim or self.hidden_dim

    @property
    def shared_expert_hidden_dim(self) -> int:
        """Hidden size of the MoE shared-expert SwiGLU block (all shared experts as one); 0 without
        any."""
        if not self.moe.shared_experts:
            return 0
        return self.moe.shared_hidden_dim or self.expert_hidden_dim * self.moe.shared_experts

    def layer_ffn_types(self) -> list[str]:
        """FFN type of each layer after applying ``ffn_layers`` overrides."""
        types = assign_ranges(
            dict(self.ffn_layers), self.n_layers, "model.ffn_layers", default=self.ffn
        )
        for spec, t in self.ffn_layers.items():
            check_choice(t, FFN_TYPES, f"model.ffn_layers.{spec}")
        return types

    def validate(self, key: str = "model") -> None:
        check_positive(
            self,
            key,
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden",
            "multiple_of",
            "ffn_dim_multiplier",
            "norm_eps",
            "rope_theta",
            "max_seq_len",
            "init_std",
            "attn_head_dim",
        )
        check(
            self.attn_head_dim is not None
            or self.attention_type == "mla"
            or self.dim % self.n_heads == 0,
            f"{key}.dim",
            f"dim={self.dim} is not divisible by n_heads={self.n_heads}",
        )
        check_choice(self.qk_norm, QK_NORMS, f"{key}.qk_norm")
        check_choice(self.ffn_act, FFN_ACTS, f"{key}.ffn_act")
        check_choice(self.attention_type, ATTENTION_TYPES, f"{key}.attention_type")
        if self.attention_type == "mla":
            self.mla.validate(f"{key}.mla")
            check(
                self.qk_norm == "none",
                f"{key}.qk_norm",
                "MLA normalises its latents; qk_norm must be none",
            )
            check(
                not self.attention.ssmax,
                f"{key}.attention.ssmax",
                "is for GQA attention (attention_type mha), not MLA",
            )
            check(
                not self.attention.key_conv,
                f"{key}.attention.key_conv",
                "is for GQA attention (attention_type mha), not MLA",
            )
            for opt, why in (
                ("score_nope", "scores keys before RoPE, which MLA splits off into its own dims"),
                ("indexer", "is for GQA attention (attention_type mha), not MLA"),
            ):
                bad = [
                    k
                    for k, p in self.attention.patterns.items()
                    if hasattr(p, "get") and p.get(opt)
                ]
                check(not bad, f"{key}.attention.patterns.{bad[0] if bad else ''}.{opt}", why)
        check(
            self.n_heads % self.kv_heads == 0,
            f"{key}.n_kv_heads",
            f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}",
        )
        check(
            self.rope_dim % 2 == 0, f"{key}.dim", f"head_dim={self.rope_dim} must be even for RoPE"
        )
        check_choice(self.ffn, FFN_TYPES, f"{key}.ffn")
        self.rope_scaling.validate(f"{key}.rope_scaling")
        types = self.layer_ffn_types()
        if "moe" in types:
            self.moe.validate(f"{key}.moe")
            self.moe.check_precision_shapes(
                self.dim, self.expert_hidden_dim, self.ffn_act, f"{key}.moe"
            )
        if "neuron" in types:
            self.neuron.validate(f"{key}.neuron", self.hidden_dim)
            check(
                self.ffn_act == "silu",
                f"{key}.ffn_act",
                "neuron-routed FFNs take model.neuron.activation instead",
            )
        self.attention.validate(self.n_layers, self.n_heads, f"{key}.attention")
        if self.attention_type == "mla":
            grid = self.attention.layer_head_patterns(self.n_layers, self.n_heads)
            check(
                not any(p and p.get("compress") for row in grid for p in row),
                f"{key}.attention.patterns",
                "block top-k compress: 1 runs with attention_type mha only "
                "(MLA has no compressed branch)",
            )
