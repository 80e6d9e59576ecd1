"""The learned indexer of block top-k heads with ``indexer: Di`` (DeepSeek-V3.2's lightning indexer,
MiniMax's MSA): per KV group a small query and key projection of the layer's input, detached from
the model, whose single-key scores choose each query's blocks in place of the attention's own
``q . k``, trained by KL distillation towards the attention's own block mass.

Shapes: x [B, S, D]; indexer queries and keys [B, Hk, S, Di]; the attention's q [B, Hq, S, Dh]
(after RoPE and SSMax: the logits it attends with) and k [B, Hk, T, Dh]; block masses and log
probabilities float32 [B, Hk, S, nk], nk = ceil(T / bs).

The selection gets no gradient (layers.attention.selection), so with the attention's own scores it
learns only through the blocks it already picks. The indexer has a learning signal of its own: for
each query, the KL divergence from the attention's probability mass per key block (summed over the
block's keys, averaged over the KV group's query heads, causal) to the softmax over blocks of the
indexer's block scores (its best single key in each block, the rule ``score_block: 1`` ranks by).
The target is computed without gradient and the indexer reads a detached input, so the
distillation's gradient reaches the indexer alone and the model's gradients are those it has
without it (DSA trains its indexer on a detached input the same way); the trainer's global
gradient-norm clip (``optim.grad_clip``) counts both. The target is the dense attention's mass in
every step, through torch ops in query chunks: its cost is a causal ``QK^T`` per query head, forward
only, once a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..rope import apply_rotary
from .masking import causal_mask

# elements of one query chunk's [B, Hq, chunk, T] scores: bounds the memory of the target and of
# the indexer's scores (each chunk is recomputed in the backward)
CHUNK_ELEMENTS = 1 << 25


class Indexer(nn.Module):
    """``forward(x [B, S, D], cos, sin) -> (q [B, Hk, S, Di], k [B, Hk, S, Di])`` of the detached
    input: one indexer query and key per KV group. As DeepSeek-V3.2's indexer (64 of its 128 dims),
    the first half of each (``rope_dim``, even) is rotated by the query's and key's positions and
    the rest is not: the position half lets it learn the recency the attention's block mass has
    (a query's previous block), the other half chooses by content."""

    def __init__(self, dim: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.rope_dim = head_dim // 4 * 2
        self.wq = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos/sin [S, Dh]`` or ``[B, S, Dh]``: the attention's rotary angles (rotate-half
        layout, Dh its head dim). The indexer takes every ``Dh / rope_dim``-th of their
        frequencies: RoPE of width ``rope_dim`` with the same theta when ``rope_dim`` divides Dh
        (otherwise the nearest of its frequencies at or above those)."""
        x = x.detach()
        d, r = self.head_dim, self.rope_dim
        q, k = (rearrange(w(x), "b s (h d) -> b h s d", d=d) for w in (self.wq, self.wk))
        if not r:
            return q, k
        idx = torch.arange(r // 2, device=cos.device) * (cos.shape[-1] // 2) // (r // 2)
        cos, sin = (torch.cat([t[..., idx]] * 2, dim=-1) for t in (cos, sin))
        return tuple(
            torch.cat([apply_rotary(t[..., :r], cos, sin), t[..., r:]], dim=-1) for t in (q, k)
        )

    def init_weights(self, std: float = 0.02, out_std: float = 0.02) -> None:
        """Normal(0, std) (the model's init; ``out_std`` unused: no residual output)."""
        for w in (self.wq, self.wk):
            nn.init.normal_(w.weight, std=std)


def _chunk(B: int, H: int, T: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(B * H * T, 1))


def _per_block(x: torch.Tensor, bs: int, nk: int, reduce: str) -> torch.Tensor:
    """``x [..., T]`` -> ``[..., nk]``: the sum or max over each block of ``bs`` keys (keys past T
    padded with the reduction's identity)."""
    T = x.shape[-1]
    fill = 0.0 if reduce == "sum" else float("-inf")
    x = F.pad(x, (0, nk * bs - T), value=fill).unflatten(-1, (nk, bs))
    return x.sum(-1) if reduce == "sum" else x.amax(-1)


@torch.no_grad()
def attention_block_mass(q: torch.Tensor, k: torch.Tensor, q_offset: int, bs: int) -> torch.Tensor:
    """float32 ``[B, Hk, S, nk]``: each query's causal softmax attention (``q . k / sqrt(Dh)``, the
    queries at positions ``q_offset ..``) summed over each key block and averaged over the KV
    group's query heads. Rows sum to 1; blocks after the query's own are 0."""
    B, Hq, S, D = q.shape
    Hk, T = k.shape[1], k.shape[2]
    nk = (T + bs - 1) // bs
    out = torch.empty(B, Hk, S, nk, device=q.device, dtype=torch.float32)
    kf = k.float()
    step = _chunk(B, Hq, T)
    for r0 in range(0, S, step):
        r1 = min(S, r0 + step)
        qc = rearrange(q[:, :, r0:r1].float(), "b (hk g) c d -> b hk g c d", hk=Hk)
        s = torch.einsum("bkgcd,bktd->bkgct", qc, kf) * D**-0.5
        s = s.masked_fill(~causal_mask(r1 - r0, T, q_offset + r0, q.device), float("-inf"))
        out[:, :, r0:r1] = _per_block(s.softmax(-1), bs, nk, "sum").mean(2)
    return out


def indexer_block_log_probs(
    qi: torch.Tensor, ki: torch.Tensor, q_offset: int, bs: int
) -> torch.Tensor:
    """float32 ``[B, Hk, S, nk]``: log softmax over each query's causal blocks of the indexer's
    block scores, the best ``qi . ki / sqrt(Di)`` over each block's keys up to the query (-inf for
    blocks after its own). With gradient; the reference of what ``distillation_loss`` computes in
    chunks."""
    T = ki.shape[2]
    s = torch.einsum("bksd,bktd->bkst", qi.float(), ki.float()) * qi.shape[-1] ** -0.5
    s = s.masked_fill(~causal_mask(qi.shape[2], T, q_offset, qi.device), float("-inf"))
    return _per_block(s, bs, (T + bs - 1) // bs, "max").log_softmax(-1)


def _chunk_kl_sum(qi, ki, target, q_offset: int, bs: int) -> torch.Tensor:
    """The summed KL(target || indexer) of one query chunk (``qi [B, Hk, c, Di]`` at positions
    ``q_offset ..``)."""
    logq = indexer_block_log_probs(qi, ki, q_offset, bs)
    # blocks with no target mass (the causal future) add nothing; their log q is -inf
    cross = (target * logq.masked_fill(target == 0, 0.0)).sum()
    return torch.xlogy(target, target).sum() - cross


@torch.compiler.disable
def distillation_loss(
    qi: torch.Tensor, ki: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_offset: int, bs: int
) -> torch.Tensor:
    """Scalar float32: the mean over (batch, KV group, query) of KL(attention's block mass ||
    indexer's block distribution), with gradient to ``qi`` and ``ki`` only (module docstring). In
    query chunks, each recomputed in the backward, so no ``[S, T]`` tensor outlives its chunk.
    Eager under torch.compile (a Python loop over chunks with checkpoints)."""
    B, Hk, S, _ = qi.shape
    step = _chunk(B, q.shape[1], ki.shape[2])
    total = qi.new_zeros((), dtype=torch.float32)
    for r0 in range(0, S, step):
        r1 = min(S, r0 + step)
        target = attention_block_mass(q[:, :, r0:r1], k, q_offset + r0, bs)
        total = total + checkpoint(
            _chunk_kl_sum, qi[:, :, r0:r1], ki, target, q_offset + r0, bs, use_reentrant=False
        )
    return total / (B * Hk * S)
