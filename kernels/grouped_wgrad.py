"""Expert weight gradients (grouped GEMMs over the token dimension) split along that dimension when
the experts are small, and the bf16 grouped linear that uses them.

``grouped_wgrad(a_t[M, R], b[R, N], offs[E]) -> [E, M, N]``: ``a_t[:, g_e] @ b[g_e]`` over each
expert's rows g_e = ``offs[e-1] .. offs[e]`` (int32 group ends, as torch._grouped_mm takes them),
bf16 out. ``grouped_linear(x[R, I], w[E, O, I], offs) -> [R, O]``: ``x w[e]^T`` per group, whose
backward computes dw with ``grouped_wgrad``.

Why: a weight gradient contracts over the rows, so its output is only E * M * N: with small experts
(the dim-512 MoE of BENCHMARKS.md: 8 experts of 704 x 512) the grouped GEMM has fewer output tiles
than the GPU has SMs, and each tile walks thousands of rows alone, at about half the rate of the
forward and dgrad GEMMs of the same FLOPs (BENCHMARKS.md, Tried and rejected). Splitting every
group's rows into S consecutive parts makes S times the tiles, each 1/S of the work; the S partial
products (bf16, as torch._grouped_mm writes them) are summed in float32. ``wgrad_splits`` picks S
from the tile count (that dim-512 MoE: S = 4); experts of the Mixtral / OLMoE / DeepSeek shapes have
tiles to spare and keep S = 1 (one GEMM). The split points are device arithmetic on ``offs``: no
host sync, CUDA-graph safe. bench/moe.py's ``small`` shape times S = 1, 2, 4 and the automatic
choice side by side.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

MAX_SPLITS = 4  # more parts add partial outputs to sum for little more parallelism
MIN_ROWS_PER_SPLIT = 1024  # average rows of a part: below this a part's tile is mostly prologue
# the output tile the occupancy estimate assumes (CUTLASS's sm90 grouped kernels)
TILE_M, TILE_N = (128, 256)
MIN_GAIN = 0.9  # split only when the estimate saves at least 10% of the GEMM
SPLITS: Optional[int] = None  # a fixed S for every call (benchmarks); None: ``wgrad_splits``


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(
        index if index >= 0 else torch.cuda.current_device()
    ).multi_processor_count


# read while tracing a compiled backward, a constant in its graph
@torch.compiler.assume_constant_result
def _num_sms(index: int) -> int:
    return _sm_count(index)


def wgrad_splits(rows: int, groups: int, m: int, n: int, device: torch.device) -> int:
    """S for a weight gradient of ``groups`` [m, n] outputs over ``rows`` rows: the S in
    1..MAX_SPLITS (each part at least MIN_ROWS_PER_SPLIT rows on average) that keeps the SMs
    busiest. A persistent grouped GEMM gives each SM ceil(S * tiles / SMs) tiles of 1/S the work, so
    the time goes as that over S: 96 tiles on 132 SMs take the same time split in 2 or 3 (2 or 3
    tiles on some SMs) and 3/4 of it split in 4. S = 1 unless the best saves at least 10%."""
    if SPLITS is not None:
        return SPLITS
    if device.type != "cuda" or not groups:
        return 1
    tiles = groups * math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
    sms = _num_sms(-1 if device.index is None else device.index)
    most = max(1, min(MAX_SPLITS, rows // (groups * MIN_ROWS_PER_SPLIT)))
    cost = lambda s: math.ceil(s * tiles / sms) / s  # noqa: E731
    best = min(range(1, most + 1), key=cost)  # ties: the fewest parts
    # a large GEMM's last partial wave is a few % of it: not worth the partial sums
    return best if cost(best) <= MIN_GAIN * cost(1) else 1


def split_group_ends(offs: torch.Tensor, splits: int) -> torch.Tensor:
    """offs [E] int32 group ends -> [E * S] int32 ends of each group's S consecutive parts (sizes
    differ by at most one row; an empty group gives S empty parts)."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    parts = torch.arange(1, splits + 1, device=offs.device, dtype=torch.int32)
    return ((offs - sizes)[:, None] + sizes[:, None] * parts // splits).reshape(-1).to(torch.int32)


def grouped_wgrad(a_t: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a_t [M, R] (a transposed view is fine), b [R, N], offs [E] -> [E, M, N] = a_t[:, g_e]
    b[g_e]."""
    E, (M, R), N = offs.numel(), a_t.shape, b.shape[1]
    S = wgrad_splits(R, E, M, N, a_t.device)
    if S == 1:
        return torch._grouped_mm(a_t, b, offs=offs)
    parts = torch._grouped_mm(a_t, b, offs=split_group_ends(offs, S))  # [E * S, M, N]
    return parts.view(E, S, M, N).sum(1, dtype=torch.float32).to(parts.dtype)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, w, offs=offs) if ctx.needs_input_grad[0] else None
        dw = grouped_wgrad(dy.t(), x, offs) if ctx.needs_input_grad[1] else None  # [E, O, I]
        return dx, dw, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y [R, O] = x [R, I] w[e]^T on each group's rows (w [E, O, I] in x's dtype);
    differentiable."""
    return _GroupedLinear.apply(x, w, offs)
