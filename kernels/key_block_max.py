"""Each query's best score in each key block: ``out[b, h, i, j] = max over keys t of block j of
q[b, h, i] . k[b, h, t] * scale``, the token-level selection score of block top-k heads with
``score_block: 1`` (MiniMax's MSA and DeepSeek's DSA score single keys and max-pool them to the
block), without the ``[S, T]`` score matrix.

Shapes: q [B, H, S, D] (queries at positions ``q_start ..``), k [B, H, T, D] -> float32 [B, H, S,
nk], nk = ceil(T / bs). Blocks that start after a query's own block are -inf (its causal future);
keys past T take no part. The own block is scored over all its keys, later ones included: the
selection keeps a query's own block whatever its score, so that score is never read.

Layers: ``@triton.jit`` kernel + launcher ``key_block_max`` (CUDA, or CPU under
TRITON_INTERPRET=1); ``key_block_max_reference`` is the torch oracle (float32 scores of every key,
then the max per block). 16-bit inputs multiply exactly into the float32 accumulator, so the two
agree up to summation order.
"""

from __future__ import annotations

import torch

from .launch import jit, tl, triton, use_triton


def key_block_max_reference(
    q: torch.Tensor, k: torch.Tensor, q_start: int, bs: int, scale: float
) -> torch.Tensor:
    """Pure torch: float32 ``[B, H, S, nk]`` (module docstring)."""
    S, T = q.shape[2], k.shape[2]
    nk = (T + bs - 1) // bs
    s = torch.einsum("bhsd,bhtd->bhst", q.float(), k.float()) * scale
    s = torch.nn.functional.pad(s, (0, nk * bs - T), value=float("-inf"))
    out = s.unflatten(-1, (nk, bs)).amax(-1)
    own = torch.div(torch.arange(q_start, q_start + S, device=q.device), bs, rounding_mode="floor")
    return out.masked_fill(torch.arange(nk, device=q.device)[None, :] > own[:, None], float("-inf"))


def _key_block_max_kernel(
    q_ptr,
    k_ptr,
    out_ptr,
    S,
    T,
    NK,
    q_start,
    scale,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    # grid (cdiv(S, BLOCK_Q), B * H): one query tile of one head walks the key blocks up to the
    # last row's own block; the output was filled with -inf, so later blocks need no store.
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rmask = rows < S
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    q = tl.load(
        q_ptr + bh * S * D + rows[:, None] * D + dd[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )
    own = (q_start + rows) // BS
    last = (q_start + tl.minimum(pid * BLOCK_Q + BLOCK_Q, S) - 1) // BS
    for j in range(0, last + 1):
        m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        for kk in range(0, BS, BLOCK_K):
            within = kk + tl.arange(0, BLOCK_K)
            keys = j * BS + within
            kmask = (keys < T) & (within < BS)  # BLOCK_K may exceed a small block
            kt = tl.load(
                k_ptr + bh * T * D + keys[None, :] * D + dd[:, None],
                mask=kmask[None, :] & dmask[:, None],
                other=0.0,
            )
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(kmask[None, :], s, float("-inf"))
            # tl.reduce with the elementwise max, as kernels.moe_fp8: the interpreter refuses tl.max
            # (itself a jit function) where triton was imported before TRITON_INTERPRET was set
            m = tl.maximum(m, tl.reduce(s, 1, tl.standard._elementwise_max))
        m = tl.where(own >= j, m * scale, float("-inf"))
        tl.store(out_ptr + bh * S * NK + rows * NK + j, m, mask=rmask)


def key_block_max(
    q: torch.Tensor,
    k: torch.Tensor,
    q_start: int,
    bs: int,
    scale: float,
    block_q: int = 64,
    block_k: int = 0,
    num_warps: int = 4,
) -> torch.Tensor:
    """float32 ``[B, H, S, nk]`` (module docstring): the Triton kernel where it runs
    (``use_triton``: CUDA, or CPU under TRITON_INTERPRET=1), else the reference. ``block_q``,
    ``block_k`` (0: the block, at most 128), ``num_warps``: the kernel's tile (queries a program
    holds, keys a ``tl.dot`` takes) and its warps. 128 keys a dot score 128-key blocks about 20%
    faster than 64 on an H100 (BENCHMARKS.md, selection stages)."""
    if not use_triton(q):
        return key_block_max_reference(q, k, q_start, bs, scale)
    B, H, S, D = q.shape
    T = k.shape[2]
    nk = (T + bs - 1) // bs
    out = torch.full((B, H, S, nk), float("-inf"), device=q.device, dtype=torch.float32)
    if S == 0 or T == 0:
        return out
    q, k = q.contiguous(), k.to(q.dtype).contiguous()
    block_d = max(16, triton.next_power_of_2(D))
    grid = (triton.cdiv(S, block_q), B * H)
    jit(_key_block_max_kernel)[grid](
        q,
        k,
        out,
        S,
        T,
        nk,
        q_start,
        scale,
        D=D,
        BS=bs,
        BLOCK_Q=block_q,
        BLOCK_K=max(16, min(triton.next_power_of_2(bs), block_k or 128)),  # tl.dot takes >= 16
        BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
    )
    return out
