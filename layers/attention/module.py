"""Multi-head attention with GQA, RoPE and a KV cache; dense (SDPA) or sparse by pattern.

One module for training, prefill and decode. LLaMA naming: ``wq [Hq*Dh, D]``, ``wk, wv [Hk*Dh, D]``,
``wo [D, Hq*Dh]``, no bias unless ``bias=True`` (q/k/v biases only, as in Qwen2); Hc block top-k
heads with ``compress: 1`` (NSA's compressed branch) add ``branch_gate [2*Hc, D]`` with a bias.
``head_dim`` defaults to ``D / Hq`` (Qwen3 sets it apart). ``qk_norm``: RMSNorm of q and k before
RoPE, ``head`` over each head's Dh (Qwen3: ``q_norm, k_norm [Dh]``) or ``full`` over the whole
projection (OLMoE: ``q_norm [Hq*Dh]``, ``k_norm [Hk*Dh]``). ``ssmax=True`` adds ``ssmax [Hq]``
(SSMax, Nakanishi 2025): each query at position p is multiplied by ``max(0, 1 + ssmax[h] * log(p +
1))`` after RoPE, zero at init. ``mask`` (optional ``layers.attention.masking.AttnMask``): the pairs
padding and packed documents leave, ANDed with causality and the pattern. ``pattern`` is None
(dense), a ``SparsityPattern`` or a per-head list; sparse patterns go through
``layers.attention.functional.sparse_attention`` with the same causal semantics in every mode.

Shapes: B batch, S new tokens, T cached + new tokens, D model dim, Hq/Hk query/KV heads, Dh head
dim.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..aux_loss import AuxLossModule
from ..norm import RMSNorm
from ..rope import apply_rotary
from ..shapes import check_attention_inputs
from .compressed import compress_block, compress_heads, compressed_attention, compressed_density
from .flash import flash_attn_dense
from .functional import dense_causal_attention, sparse_attention
from .indexer import Indexer, distillation_loss
from .masking import masked_causal_attention
from .pattern import head_patterns, layer_block_size
from .selection import index_tensor


def head_runs(heads: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct head indices -> the maximal runs ``[a, b)`` of consecutive ones (``[4, 5,
    7]`` -> ``[(4, 6), (7, 8)]``)."""
    runs: list[tuple[int, int]] = []
    for h in heads:
        if runs and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + 1)
        else:
            runs.append((h, h + 1))
    return runs


# Head subsets by slices and one cat rather than index / index_copy: under torch 2.11's AOTAutograd
# the backward of index_copy on the (permuted) attention output decomposes into a copy_ into a
# permuted empty tensor, a non-functional graph that aot_eager_decomp_partition rejects. Slice
# backwards are slice_scatter, functional in every version; the heads are static, so the loop is
# too.
def take_heads(t: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """``t [B, H, ...]`` -> ``t[:, heads]`` (sorted distinct heads), by slices."""
    pieces = [t[:, a:b] for a, b in head_runs(heads)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)


def put_heads(t: torch.Tensor, heads: list[int], rows: torch.Tensor) -> torch.Tensor:
    """``t [B, H, ...]`` with head ``heads[j]`` replaced by ``rows[:, j]`` (sorted distinct heads),
    out of place."""
    pieces, j, prev = [], 0, 0
    for a, b in head_runs(heads):
        if a > prev:
            pieces.append(t[:, prev:a])
        pieces.append(rows[:, j : j + b - a])
        j, prev = j + b - a, b
    if prev < t.shape[1]:
        pieces.append(t[:, prev:])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)


class KVCache(nn.Module):
    """Static-size cache ``k, v [B, Hk, max_len, Dh]`` (gpt-fast style: no reallocation in
    decode); with ``pre_rope_keys`` also ``k_nope [B, Hk, max_len, score_dim]`` (default Dh), the
    keys that block top-k heads with ``score_nope`` (before RoPE) or ``indexer`` (the indexer's)
    select by."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype=torch.float32,
        device=None,
        pre_rope_keys: bool = False,
        score_dim: int = 0,
    ):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        nope = (
            torch.zeros(*shape[:3], score_dim or head_dim, dtype=dtype, device=device)
            if pre_rope_keys
            else None
        )
        self.register_buffer("k_nope", nope, persistent=False)

    def update(
        self,
        start_pos: int,
        k: torch.Tensor,
        v: torch.Tensor,
        k_nope: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [B, Hk, S, Dh]`` (and ``k_nope``, with ``pre_rope_keys``) at
        ``start_pos``; return the filled prefix ``[B, Hk, start_pos+S, Dh]`` of k and v."""
        end = start_pos + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache overflow: {end} > max_len {self.k.shape[2]}")
        self.k[:, :, start_pos:end] = k.to(self.k.dtype)
        self.v[:, :, start_pos:end] = v.to(self.v.dtype)
        if k_nope is not None:
            self.k_nope[:, :, start_pos:end] = k_nope.to(self.k_nope.dtype)
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(AuxLossModule):
    """``forward(x[B, S, D], cos, sin, start_pos=0, mask=None, positions=None) -> [B, S, D]``.

    ``cos/sin`` ([S, Dh] or [B, S, Dh]) are the rotary angles of the queries' positions, by default
    ``start_pos .. start_pos + S - 1``. With a cache set up (``setup_cache``), keys/values are
    appended at ``start_pos`` and queries attend to the prefix. A layer whose block top-k heads
    have ``indexer`` keeps its distillation loss (times ``indexer_weight``) from the last training
    forward in ``aux_loss`` (layers.attention.indexer).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: Optional[int] = None,
        pattern=None,
        backend: str = "auto",
        layer_id: int = 0,
        reference_below: int = -1,
        bias: bool = False,
        head_dim: Optional[int] = None,
        qk_norm: str = "none",
        norm_eps: float = 1e-6,
        flex_kernel: str = "auto",
        kernel_options: Optional[dict] = None,
        ssmax: bool = False,
        key_conv: int = 0,
        indexer_weight: float = 1.0,
    ):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if (head_dim is None and dim % n_heads) or n_heads % n_kv_heads:
            raise ValueError(
                f"dim={dim}, n_heads={n_heads}, n_kv_heads={n_kv_heads}: heads must divide evenly"
            )
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.head_dim = head_dim or dim // n_heads
        self.layer_id, self.backend, self.reference_below = layer_id, backend, reference_below
        self.flex_kernel, self.kernel_options = flex_kernel, dict(kernel_options or {})
        self._init_dispatch_state()
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        if qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be none, head or full, got {qk_norm!r}")
        self.qk_norm = qk_norm
        if qk_norm != "none":
            per_head = qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else n_heads * self.head_dim, norm_eps)
            self.k_norm = RMSNorm(
                self.head_dim if per_head else n_kv_heads * self.head_dim, norm_eps
            )
        # SSMax's per-head slope, float32 like the norms (1-D: no weight decay); zero = plain
        # softmax
        self.ssmax = nn.Parameter(torch.zeros(n_heads)) if ssmax else None
        # Short causal key convolution (``key_conv`` taps, 0 = none): each key channel becomes a
        # learned mix of its own and the previous ``key_conv - 1`` positions' projections, before
        # qk_norm and RoPE, identity at init. A key then carries what came just before it, so a
        # single layer can match "the token after x" (the copy that retrieval needs, otherwise an
        # induction circuit over two layers) and a block selection scores that match directly.
        if key_conv:
            self.k_conv = nn.Parameter(torch.zeros(n_kv_heads * self.head_dim, key_conv))
        else:
            self.k_conv = None
        self._k_tail: Optional[torch.Tensor] = None  # decode: the last raw keys the conv reads
        # a per-head list of the wrong length or mixed block sizes fails here, not in forward
        if pattern is not None:
            layer_block_size(head_patterns(pattern, n_heads))
        self.pattern = pattern
        self.compress_heads = (
            compress_heads(head_patterns(pattern, n_heads)) if pattern is not None else []
        )
        if self.compress_heads:
            # NSA's branch gates from the layer input: [fine, compressed] logits per compressed head
            self.branch_gate = nn.Linear(dim, 2 * len(self.compress_heads))
        dims = {p.indexer for p in head_patterns(pattern, n_heads) if p.indexer} if pattern else ()
        if len(dims) > 1:
            raise ValueError(f"a layer has one indexer: its heads must share indexer, got {dims}")
        # the block top-k heads' learned scorer and its distillation loss (layers.attention.indexer)
        self.indexer = Indexer(dim, n_kv_heads, dims.pop()) if dims else None
        self.indexer_weight = indexer_weight
        if self.indexer is not None:
            self.aux_loss = torch.zeros(())
        # ((T, device), float32 [Hq]): the branch's share of the density stat
        self._compressed_density = None
        self.cache: Optional[KVCache] = None
        self._q_history: Optional[torch.Tensor] = None  # last queries, for decode-time estimation
        self._q_nope_history: Optional[torch.Tensor] = None  # the same before RoPE (score_nope)

    def _init_dispatch_state(self) -> None:
        """The state the sparse dispatch reads and the trainer sets (shared with MLA)."""
        # last forward's density / block top-k selection stats (layers.attention.density)
        self.attn_stats: dict = {}
        # True: eager forwards also keep their block top-k heads' chosen blocks,
        # attn_stats["selection"] (a layers.attention.plan.BlockSelection; the passkey eval's needle
        # recall sets it for its forwards)
        self.record_selection = False
        # False: the block top-k heads' selection skips its sharpness stats (entropy, top-k mass;
        # set per step by density.AttentionStats, True on the steps that log)
        self.record_sharpness = True
        # True: a sparse layer runs dense causal attention (the dense phases of
        # model.attention.dense_warmup / dense_finish, set per step by density.AttentionStats)
        self.dense_phase = False
        # what a dense phase runs: None (dense causal attention), or the pattern with only its
        # input-dependent heads dense (model.attention.dense_phase_heads: selecting, set by
        # density.AttentionStats)
        self.phase_pattern = None

    def setup_cache(self, batch: int, max_len: int, dtype=None, device=None) -> None:
        dtype = dtype or self.wk.weight.dtype
        device = device or self.wk.weight.device
        indexer = getattr(self, "indexer", None)  # MLA has none
        self.cache = KVCache(
            batch,
            self.n_kv_heads,
            max_len,
            self.head_dim,
            dtype,
            device,
            self._scores_apart(),
            indexer.head_dim if indexer is not None else 0,
        )

    def active_pattern(self):
        """The pattern this forward runs: ``pattern``, or in a dense phase ``phase_pattern``."""
        return self.phase_pattern if self.dense_phase else self.pattern

    def _scores_apart(self) -> bool:
        """Whether a head selects blocks by other queries and keys than the attention's
        (``score_nope``: before RoPE; ``indexer``: the indexer's)."""
        pats = head_patterns(self.pattern, self.n_heads) if self.pattern is not None else []
        return any(p.scores_apart for p in pats)

    def init_weights(self, std: float = 0.02, out_std: float = 0.02) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.normal_(w.weight, std=std)
            if w.bias is not None:
                nn.init.zeros_(w.bias)
        nn.init.normal_(self.wo.weight, std=out_std)
        if self.ssmax is not None:
            nn.init.zeros_(self.ssmax)
        if self.k_conv is not None:  # the identity filter: the last tap 1
            with torch.no_grad():
                self.k_conv.zero_()
                self.k_conv[:, -1] = 1.0
        if self.compress_heads:  # gates near sigmoid(0) = 1/2 for both branches at the start
            nn.init.normal_(self.branch_gate.weight, std=std)
            nn.init.zeros_(self.branch_gate.bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: int = 0,
        mask: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``positions`` ([S] or [B, S], default ``start_pos + arange(S)``): the queries' positions,
        the RoPE ones (per document when packed); read only by SSMax."""
        check_attention_inputs("Attention", x, self.dim, self.head_dim, cos, sin, positions)
        if self.compress_heads and mask is not None:
            raise ValueError(
                "block top-k compress: 1 cannot run with padding or packed-document masks: "
                "its pooled key blocks would mix documents and padding"
            )
        distil = self.indexer is not None and self.training and torch.is_grad_enabled()
        if distil and mask is not None:
            raise ValueError(
                "block top-k indexer cannot train with padding or packed-document masks: its "
                "distillation target is the causal attention over the whole window"
            )
        q, k = self.wq(x), self.wk(x)
        if self.k_conv is not None:
            k = self._convolve_keys(k, start_pos)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (rearrange(t, "b s (h d) -> b s h d", d=self.head_dim) for t in (q, k))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (rearrange(t, "b s h d -> b h s d") for t in (q, k))
        v = rearrange(self.wv(x), "b s (h d) -> b h s d", d=self.head_dim)
        q_scale = (
            None
            if self.ssmax is None
            else self._ssmax_scale(q.shape[2], q.device, start_pos, positions)
        )
        # score_nope heads select by q and k as they are before RoPE, indexer heads by the
        # indexer's (one query per KV group, repeated over its heads)
        if self.indexer is not None:
            qi, ki = self.indexer(x, cos, sin)
            pre = (qi.repeat_interleave(self.n_heads // self.n_kv_heads, 1), ki)
        else:
            pre = (q, k) if self._scores_apart() else None
        pre = None if self.dense_phase else pre
        q, k = apply_rotary(q, cos, sin, q_scale), apply_rotary(k, cos, sin)
        if self.indexer is not None:
            # towards the attention this forward runs over the whole window (a training forward
            # has no cache), dense phases included: DSA's dense warm-up trains its indexer alone
            self.aux_loss = (
                self.indexer_weight
                * distillation_loss(
                    qi,
                    ki,
                    q,
                    k,
                    start_pos,
                    layer_block_size(head_patterns(self.pattern, self.n_heads)),
                )
                if distil and self.cache is None and self.indexer_weight > 0
                else torch.zeros((), device=x.device)
            )
        if self.cache is not None:
            k, v = self.cache.update(start_pos, k, v, None if pre is None else pre[1])
            if pre is not None:
                pre = (pre[0], self.cache.k_nope[:, :, : k.shape[2]])
        stats_before = self.attn_stats
        out = self._attend(q, k, v, start_pos, mask, pre)
        if self.compress_heads:
            out = self._with_compressed(
                x, q, k, v, out, start_pos, self.attn_stats is not stats_before
            )
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))

    def _convolve_keys(self, k: torch.Tensor, start_pos: int) -> torch.Tensor:
        """``k [B, S, Hk*Dh]`` (the key projection at positions ``start_pos ..``) -> the causal
        depthwise convolution with ``k_conv [Hk*Dh, W]``: ``out[t] = sum_j k_conv[:, j] *
        k[t - W + 1 + j]``, positions before 0 reading 0. With a KV cache, the last ``W - 1``
        projections of the previous call continue the sequence, so decode equals prefill."""
        W = self.k_conv.shape[1]
        B, S, C = k.shape
        if self.cache is not None and start_pos > 0 and self._k_tail is not None:
            past = self._k_tail
        else:
            past = k.new_zeros(B, W - 1, C)
        full = torch.cat([past.to(k.dtype), k], dim=1)  # [B, W - 1 + S, C]
        if self.cache is not None:
            self._k_tail = full[:, full.shape[1] - (W - 1) :].detach()
        w = self.k_conv.to(k.dtype)[:, None, :]  # [C, 1, W]
        return F.conv1d(full.transpose(1, 2), w, groups=C).transpose(1, 2)

    def _ssmax_scale(
        self, S: int, device: torch.device, start_pos: int, positions: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """SSMax's query scale ``max(0, 1 + ssmax[h] * log(p + 1))``, float32 ``[Hq, S, 1]`` (``[B,
        Hq, S, 1]`` for per-row positions), applied to q after RoPE inside RoPE's float32 pass:
        SSMax's ``s log n`` with n = p + 1, the keys a causal query at p sees, plus a fixed 1 so
        that s = 0 is plain attention. Scaling q scales every logit of the row, so every kernel
        (SDPA, flex, FA4, the sparse selections) runs it unchanged. The scale is floored at 0: a
        slope s < 0 (what training at 16k learns, ~-0.08) makes rows past p = exp(-1/s) (~268k
        there) uniform over their keys instead of inverted, so a model run far past its training
        length degrades to averaging rather than attending to its least similar keys (for sparse
        heads: the keys its selection kept, ranked on all-equal scores there). A floored row passes
        no gradient to s or wq, so a slope below -1 / log 2 (every row with two or more keys
        floored) no longer trains; training at 16k stays near -0.08 (BENCHMARKS.md, Long-context
        quality)."""
        if positions is None:
            positions = torch.arange(start_pos, start_pos + S, device=device)
        # padding rows may carry negative position_ids (HF-style cumsum - 1): log1p(-1) = -inf would
        # give NaN
        logn = torch.log1p(positions.float().clamp(min=0))  # [S] or [B, S]
        # float32 (as RoPE's math): a bf16 scale would drop slopes below ~0.004 / log(p + 1)
        # [(B,) Hq, S]
        scale = (1.0 + self.ssmax.float()[:, None] * logn.unsqueeze(-2)).clamp(min=0.0)
        return scale.unsqueeze(-1)

    def _with_compressed(self, x, q, k, v, out, q_offset: int, fresh_stats: bool) -> torch.Tensor:
        """``out [B, Hq, S, Dh]`` with each compressed head's rows replaced by ``sigmoid(g_fine) *
        out + sigmoid(g_cmp) * compressed_attention`` (layers.attention.compressed)."""
        pats = head_patterns(self.pattern, self.n_heads)
        g = rearrange(torch.sigmoid(self.branch_gate(x)), "b s (two h) -> two b h s 1", two=2).to(
            out.dtype
        )
        # one call per pooling block size among the heads (a layer normally has one)
        by_block: dict[int, list[int]] = {}
        for i, h in enumerate(self.compress_heads):
            by_block.setdefault(compress_block(pats[h]), []).append(i)
        parts = []
        for cb, idx in by_block.items():
            hs = [self.compress_heads[i] for i in idx]
            kv_heads = index_tensor([h // (self.n_heads // self.n_kv_heads) for h in hs], q.device)
            parts.append(compressed_attention(take_heads(q, hs), k, v, cb, q_offset, kv_heads))
        if len(parts) == 1:
            cmp = parts[0]
        # back to compress_heads' order: head j sits at position order.index(j) of the concatenation
        else:
            order = [i for idx in by_block.values() for i in idx]
            cmp = torch.cat(parts, 1)[
                :, index_tensor([order.index(j) for j in range(len(order))], q.device)
            ]
        mixed = g[0] * take_heads(out, self.compress_heads) + g[1] * cmp.to(out.dtype)
        if (
            fresh_stats
            and "density" in self.attn_stats
            and q.shape[2] == k.shape[2]
            and q_offset == 0
        ):
            # honest FLOPs: the branch's (query, pooled key) pairs, in the block units of the
            # kernel's density
            T, bs = k.shape[2], layer_block_size(pats)
            if self._compressed_density is None or self._compressed_density[0] != (T, q.device):
                # a host list made a device tensor once per length (no copy per step)
                n = (T + bs - 1) // bs
                self._compressed_density = (
                    (T, q.device),
                    torch.tensor(
                        compressed_density(pats, T, bs * bs * n * (n + 1) / 2), device=q.device
                    ),
                )
            dens = self.attn_stats["density"] + self._compressed_density[1]
            self.attn_stats = {**self.attn_stats, "density": dens}
        return put_heads(out, self.compress_heads, mixed)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_offset: int,
        mask: Optional[torch.Tensor] = None,
        pre_rope: Optional[tuple] = None,
    ) -> torch.Tensor:
        """``pre_rope``: ``(q, k)`` before RoPE (k the whole prefix), for ``score_nope`` heads."""
        pattern = self.active_pattern()
        if pattern is None:
            if mask is not None:
                return masked_causal_attention(q, k, v, mask, q_offset)
            if self.backend == "flash_attn":
                return flash_attn_dense(q, k, v, q_offset)
            return dense_causal_attention(q, k, v, q_offset)
        history = nope_history = None
        dyn = [p for p in head_patterns(pattern, self.n_heads) if p.dynamic]
        if dyn and self.cache is not None:
            # Input-dependent patterns estimate from the last queries; keep enough of them that a
            # decode step re-estimates exactly what prefill of the same tokens would (last_q rows,
            # pooled block).
            history = self._q_history if q_offset > 0 else None
            keep = max(max(p.last_q, p.block_size) for p in dyn)
            self._q_history = (q if history is None else torch.cat([history, q], dim=2))[
                :, :, -keep:
            ].detach()
            if pre_rope is not None:  # the same history of the pre-RoPE queries
                nope_history = self._q_nope_history if q_offset > 0 else None
                self._q_nope_history = (
                    pre_rope[0]
                    if nope_history is None
                    else torch.cat([nope_history, pre_rope[0]], dim=2)
                )[:, :, -keep:].detach()
        # stats only in eager mode: a dict written inside a compiled block would be a graph side
        # effect
        stats = None
        if not torch.compiler.is_compiling():
            stats = {"selection": None} if self.record_selection else {}
            if not self.record_sharpness:
                stats["sharpness"] = False
        out = sparse_attention(
            q,
            k,
            v,
            pattern,
            backend=self.backend,
            layer=self.layer_id,
            q_offset=q_offset,
            q_history=history,
            reference_below=self.reference_below,
            kernel=self.flex_kernel,
            kernel_options=self.kernel_options,
            stats=stats,
            mask=mask,
            score_qk=None if pre_rope is None else (*pre_rope, nope_history),
        )
        if stats:
            self.attn_stats = stats
        return out
