"""``model.neuron``: neuron-level expert routing of the FFN (layers.NeuronRoutedFFN). Semantics in
docs/neuron_ffn.md.

The FFN's hidden units are split into ``num_groups`` equal groups; a router predicts each group's
share of the activation mass and, in sparse steps, every token computes only its ``top_k_groups``
groups. Training schedule over ``train.steps``: dense warm-up (``warmup_fraction``), then sparse and
dense steps alternating with ``sparse_ratio`` of them sparse, then a dense finish
(``finish_fraction``). With ``recluster`` the groups are re-formed from the warmed-up weights when
the warm-up ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import check, check_choice

NEURON_ACTIVATIONS = ("swiglu", "relu2")
NEURON_ROUTER_LOSSES = ("ce", "mse")
# as model.moe.backend ("torch" = "reference")
NEURON_BACKENDS = ("auto", "reference", "grouped", "torch")


@dataclass
class NeuronConfig:
    num_groups: int = 16
    top_k_groups: int = 4
    activation: str = "swiglu"  # swiglu (w2(silu(w1 x) * w3 x)) | relu2 (w2(relu(w1 x)^2), no w3)
    # ce: soft-target cross-entropy (reported as KL) | mse: on the group shares
    router_loss: str = "ce"
    # weight of the router loss in the total loss (router-only gradient)
    router_loss_coef: float = 0.1
    warmup_fraction: float = 0.1  # dense steps at the start, as a fraction of train.steps
    # share of sparse steps between warm-up and finish (0.75 = 3 sparse : 1 dense)
    sparse_ratio: float = 0.75
    finish_fraction: float = 0.1  # dense steps at the end, as a fraction of train.steps
    # balanced k-means iterations when clustering W1 rows (from_dense, recluster)
    kmeans_iters: int = 20
    # re-group the units by k-means on the trained W1 rows when warm-up ends
    recluster: bool = False
    backend: str = "auto"  # auto | reference | grouped (as model.moe.backend)
    # router GEMM on bf16 inputs (autocast's copy), fp32 accumulation/logits
    low_precision_router: bool = True

    def validate(self, key: str = "model.neuron", hidden_dim: Optional[int] = None) -> None:
        """Raise ConfigError naming the key; ``hidden_dim`` (the FFN's) checks that the groups
        divide it."""
        for n in ("num_groups", "top_k_groups", "kmeans_iters"):
            v = getattr(self, n)
            check(
                isinstance(v, int) and v > 0, f"{key}.{n}", f"must be a positive integer, got {v!r}"
            )
        check(
            self.top_k_groups <= self.num_groups,
            f"{key}.top_k_groups",
            f"top_k_groups={self.top_k_groups} > num_groups={self.num_groups}",
        )
        if hidden_dim is not None:
            check(
                hidden_dim % self.num_groups == 0,
                f"{key}.num_groups",
                f"FFN hidden size {hidden_dim} is not divisible by num_groups={self.num_groups}",
            )
        check_choice(self.activation, NEURON_ACTIVATIONS, f"{key}.activation")
        check_choice(self.router_loss, NEURON_ROUTER_LOSSES, f"{key}.router_loss")
        check_choice(self.backend, NEURON_BACKENDS, f"{key}.backend")
        check(
            self.router_loss_coef >= 0,
            f"{key}.router_loss_coef",
            f"must be >= 0, got {self.router_loss_coef}",
        )
        for n in ("warmup_fraction", "sparse_ratio", "finish_fraction"):
            v = getattr(self, n)
            check(0.0 <= v <= 1.0, f"{key}.{n}", f"must be in [0, 1], got {v}")
        check(
            self.warmup_fraction + self.finish_fraction <= 1.0,
            f"{key}.finish_fraction",
            "warmup_fraction + finish_fraction = "
            f"{self.warmup_fraction + self.finish_fraction:g} exceeds 1",
        )
