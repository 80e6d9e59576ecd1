"""``model.moe``: routed mixture-of-experts FFN (layers.MoE). Semantics in docs/moe.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import check, check_choice, check_positive

ROUTERS = ("softmax", "noisy_topk", "sigmoid", "switch")
# One vocabulary with model.attention.backend: auto | reference | <fast paths>. "torch" is an alias
# of "reference", so configs that name it keep loading.
MOE_BACKENDS = ("auto", "reference", "grouped", "megablocks", "torch")
MOE_PRECISIONS = ("bf16", "fp8")
# torch._scaled_grouped_mm: every GEMM's inner and outer dims (16-byte fp8 rows)
FP8_DIM_MULTIPLE = 16


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: Optional[int] = None  # expert hidden size; None = the model's dense FFN hidden size
    # softmax (Mixtral) | noisy_topk (Shazeer) | sigmoid (DeepSeek-V3) | switch (top-1)
    router: str = "softmax"
    # softmax over all experts, then top-k (renormalised if norm_topk)
    softmax_before_topk: bool = False
    norm_topk: bool = True  # renormalise the chosen k weights to sum to one
    aux_loss_coef: float = 0.01  # Switch balance loss E * sum_e f_e * P_e
    z_loss_coef: float = 0.0  # router z-loss mean(logsumexp(logits)^2)
    bias_update_rate: float = 0.0  # DeepSeek-V3 aux-loss-free balancing; 0 disables
    capacity_factor: Optional[float] = None  # None = dropless
    shared_experts: int = 0  # always-on experts (DeepSeekMoE / Qwen2-MoE)
    # hidden size of the shared expert block; None = hidden_dim * shared_experts
    shared_hidden_dim: Optional[int] = None
    shared_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert output
    global_balance: bool = True  # balance loss on the global data-parallel batch (= one process);
    # false: each rank's own tokens (megablocks / torchtitan)
    backend: str = "auto"  # auto | reference | grouped | megablocks
    n_group: int = 1  # DeepSeek-V2/V3 group-limited routing: experts in n_group groups,
    topk_group: int = 1  # ... each token picks its top-k inside its topk_group best groups
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (DeepSeek-V3: 2.5)
    # Speed switches of the grouped CUDA path, read per layer (bench/moe.py's A/B variants flip them
    # on one instance). None of them changes the math beyond bf16 rounding.
    # torch.compile backend of the routing stage; None = eager
    compile_routing: Optional[str] = "inductor"
    fold_weights: bool = True  # routing weights folded into the SwiGLU epilogue (no EP)
    group_align: int = 1  # grouped-GEMM group alignment (rows); 1 = unpadded groups
    # router GEMM on bf16 inputs (autocast's copy), fp32 accumulation/logits
    low_precision_router: bool = True
    fuse_permute: bool = True  # permute fused into the gate/up grouped GEMMs' backward
    # Expert GEMMs' operand precision on the grouped CUDA path. bf16: torch._grouped_mm. fp8:
    # rowwise-scaled float8_e4m3fn forward, dgrad and wgrad (kernels.moe_fp8; torchao's MoE fp8
    # rowwise recipe), bf16 out and bf16 / float32 master weights untouched; needs a Hopper or
    # Blackwell GPU and dims that are multiples of 16 (ConfigError naming model.moe.precision
    # otherwise). Changes the math by FP8 rounding.
    precision: str = "bf16"

    def validate(self, key: str = "model.moe") -> None:
        check_positive(
            self, key, "num_experts", "top_k", "hidden_dim", "shared_hidden_dim", "group_align"
        )
        check(
            self.top_k <= self.num_experts,
            f"{key}.top_k",
            f"top_k={self.top_k} > num_experts={self.num_experts}",
        )
        check(
            self.shared_experts >= 0,
            f"{key}.shared_experts",
            f"must be >= 0, got {self.shared_experts}",
        )
        check_choice(self.router, ROUTERS, f"{key}.router")
        check(
            self.router != "switch" or self.top_k == 1, f"{key}.top_k", "the switch router is top-1"
        )
        check_choice(self.backend, MOE_BACKENDS, f"{key}.backend")
        check_positive(self, key, "n_group", "topk_group", "routed_scaling_factor")
        check(
            self.num_experts % self.n_group == 0,
            f"{key}.n_group",
            f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}",
        )
        check(
            self.topk_group <= self.n_group,
            f"{key}.topk_group",
            f"topk_group={self.topk_group} > n_group={self.n_group}",
        )
        if self.n_group > 1:
            check(
                self.router in ("sigmoid", "softmax"),
                f"{key}.router",
                "group-limited routing needs sigmoid or softmax",
            )
            check(
                self.top_k <= self.topk_group * self.num_experts // self.n_group,
                f"{key}.top_k",
                f"top_k={self.top_k} > the experts of topk_group={self.topk_group} groups",
            )
        check(
            self.compile_routing is None or isinstance(self.compile_routing, str),
            f"{key}.compile_routing",
            f"must be a torch.compile backend name or null, got {self.compile_routing!r}",
        )
        if self.capacity_factor is not None:
            check(
                self.capacity_factor > 0,
                f"{key}.capacity_factor",
                f"must be > 0, got {self.capacity_factor}",
            )
        for n in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            check(getattr(self, n) >= 0, f"{key}.{n}", f"must be >= 0, got {getattr(self, n)}")
        check_choice(self.precision, MOE_PRECISIONS, f"{key}.precision")
        check(
            self.precision != "fp8" or self.backend in ("auto", "grouped"),
            f"{key}.precision",
            f"fp8 runs on the grouped backend (auto or grouped), not backend={self.backend}",
        )
        if self.backend == "megablocks":
            import importlib.util

            check(
                importlib.util.find_spec("megablocks") is not None,
                f"{key}.backend",
                "megablocks is not installed (see README: optional GPU backends)",
            )

    def check_trainable(self, key: str = "model.moe") -> None:
        """The router learns from the task loss: ConfigError naming ``<key>.top_k`` for top-1 with a
        renormalising router (softmax, noisy_topk or sigmoid with ``norm_topk``), whose one weight
        is w / w = 1.0 for every token, so the LM loss has no gradient to the router (only the
        balance and z losses train it).

        Not part of ``validate``: that checks a function (ModelConfig, the MoE layer, zoo.hf
        imports), and HF's Mixtral / Qwen-MoE / OLMoE with num_experts_per_tok=1 and norm_topk_prob
        compute that same constant 1.0, so they must import with exact logits. Config.validate (a
        run: train.py, the benches) calls this; a run that starts from such an HF model
        (model.init_from) is refused too, since it would train the router no better."""
        check(
            not (self.top_k == 1 and self.norm_topk and self.router != "switch"),
            f"{key}.top_k",
            f"top_k=1 with router={self.router} and norm_topk renormalises "
            "the one routing weight to 1.0, so the router gets no gradient from the loss; "
            "use router: switch, or norm_topk: false",
        )

    def check_precision_shapes(
        self, dim: int, hidden_dim: int, act: str, key: str = "model.moe"
    ) -> None:
        """fp8: the model dim and the expert hidden size are multiples of 16
        (torch._scaled_grouped_mm), and the experts are the grouped path's SwiGLU (silu gate).
        ConfigError naming ``<key>.precision`` otherwise."""
        if self.precision != "fp8":
            return
        bad = [
            f"{n}={v}"
            for n, v in (("dim", dim), ("hidden_dim", hidden_dim))
            if v % FP8_DIM_MULTIPLE
        ]
        check(
            not bad,
            f"{key}.precision",
            f"fp8 expert GEMMs need the model dim and the expert hidden size to be "
            f"multiples of {FP8_DIM_MULTIPLE}; got {', '.join(bad)}",
        )
        check(
            act == "silu",
            f"{key}.precision",
            f"fp8 runs the grouped SwiGLU path, whose gate is silu, not ffn_act={act}",
        )

    def check_runtime(self, device, key: str = "model.moe") -> None:
        """Before any work: fp8, when asked for, can run on ``device`` (ConfigError naming
        ``<key>.precision``)."""
        if self.precision == "fp8":
            why = fp8_missing(device)
            check(
                why is None,
                f"{key}.precision",
                f"fp8 expert GEMMs (torch._scaled_grouped_mm) cannot run here: {why}",
            )


def fp8_missing(device="cuda") -> Optional[str]:
    """None when FP8 grouped GEMMs run on ``device`` (a torch.device or its name); else why not, in
    words.

    torch._scaled_grouped_mm's rowwise kernels are built for compute capability 9.x (Hopper) and
    10.x (Blackwell) only: it refuses 8.9 (Ada) and 12.x although those have FP8 tensor cores."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return f"device is {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.version.hip:
        return "ROCm builds are not supported by this path"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return (
            f"GPU compute capability {major}.{minor} (torch._scaled_grouped_mm needs 9.x or 10.x)"
        )
    return None
