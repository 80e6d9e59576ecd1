"""RMSNorm (Zhang & Sennrich 2019), as in LLaMA: x / rms(x) * weight, computed in float32."""

import torch
from torch import nn

from .shapes import check_width


class RMSNorm(nn.Module):
    """``forward(x[..., D]) -> [..., D]`` in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_width("RMSNorm", x, self.dim)
        # float32 statistics: bf16 rsqrt of a mean of squares loses ~3 digits.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)

    def init_weights(self, std: float = 0.0, out_std: float = 0.0) -> None:
        nn.init.ones_(self.weight)
