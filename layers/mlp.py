"""SwiGLU feed-forward (Shazeer 2020), LLaMA naming: ``w2(silu(w1 x) * w3 x)``."""
import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``forward(x[..., D]) -> [..., D]``; w1 (gate) and w3 (up) are [H, D], w2 (down) is [D, H]."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.dim, self.hidden_dim = dim, hidden_dim
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float = 0.02, out_std: float = 0.02) -> None:
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=out_std)
