"""Gated feed-forward (Shazeer 2020), LLaMA naming: ``w2(act(w1 x) * w3 x)``; SwiGLU with the
default silu.

``act`` is the gate activation HF configs name in ``hidden_act``: ``silu`` (SwiGLU), ``gelu``
(GeGLU, exact erf), ``gelu_tanh`` (GeGLU with the tanh approximation, HF ``gelu_pytorch_tanh``),
``relu2`` (squared ReLU).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .shapes import check_width


def relu2(a: torch.Tensor) -> torch.Tensor:
    """Squared ReLU in a's dtype. A product, not ``square`` / ``** 2``: CUDA autocast runs ``pow``
    in float32, which made a bf16 layer's hidden state float32 (and its down projection a float32
    GEMM)."""
    r = F.relu(a)
    return r * r


def _gelu_tanh(a: torch.Tensor) -> torch.Tensor:
    return F.gelu(a, approximate="tanh")


GATE_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": _gelu_tanh, "relu2": relu2}


def gate_act(name: str):
    """The elementwise gate activation called ``name`` (one of ``GATE_ACTS``)."""
    if name not in GATE_ACTS:
        raise ValueError(f"unknown FFN activation {name!r}; expected one of {', '.join(GATE_ACTS)}")
    return GATE_ACTS[name]


class SwiGLU(nn.Module):
    """``forward(x[..., D]) -> [..., D]``; w1 (gate) and w3 (up) are [H, D], w2 (down) is [D, H]."""

    def __init__(self, dim: int, hidden_dim: int, act: str = "silu"):
        super().__init__()
        self.dim, self.hidden_dim, self.act = dim, hidden_dim, act
        self._act = gate_act(act)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_width("SwiGLU", x, self.dim)
        return self.w2(self._act(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float = 0.02, out_std: float = 0.02) -> None:
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=out_std)
