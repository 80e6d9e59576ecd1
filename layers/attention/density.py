"""Attention density for logging: the fraction of causal (q, k) pairs each head attends."""

from __future__ import annotations

from typing import Optional

import torch

from ..neuron.schedule import phase_bounds
from .compressed import compressed_density
from .module import Attention
from .pattern import PatternLike, head_patterns, selecting_heads_dense
from .plan import budget_plan
from .selection import selection_density


def pattern_density(
    pattern: PatternLike,
    n_heads: int,
    seq_len: int,
    layer: int = 0,
    max_rows: int = 2048,
    chunk: int = 256,
    device=None,
) -> torch.Tensor:
    """float64 ``[n_heads]``: the fraction of causal (q, k) pairs each head of ``pattern`` attends
    at ``seq_len``.

    Input-dependent heads count what their budgets allow (``patterns.budget_plan``). Exact when
    ``seq_len <= max_rows``; longer inputs count ``max_rows`` query rows in evenly spaced chunks and
    interpolate the allowed keys per row linearly across the rows in between (exact for windows,
    sinks and dense heads). Masks are built ``chunk`` rows at a time on ``device``.
    """
    if seq_len <= max_rows:
        starts = range(0, seq_len, chunk)
    else:
        n_chunks = max(max_rows // chunk, 2)
        starts = sorted({round(i * (seq_len - chunk) / (n_chunks - 1)) for i in range(n_chunks)})
    rows = [range(s, min(s + chunk, seq_len)) for s in starts]
    # [H, rows] allowed keys
    per_row = [
        budget_plan(pattern, n_heads, seq_len, layer, r, device).token_mask()[0].sum(-1).double()
        for r in rows
    ]
    allowed = sum(c.sum(-1) for c in per_row)
    for a, b, ra, rb in zip(per_row, per_row[1:], rows, rows[1:]):  # trapezoid over skipped rows
        allowed = allowed + (rb.start - ra.stop) * (a[:, -1] + b[:, 0]) / 2
    return (allowed / (seq_len * (seq_len + 1) / 2)).cpu()  # one host copy per layer


def attention_density(
    model_or_attention: torch.nn.Module, seq_len: int, max_rows: int = 2048, chunk: int = 256
) -> dict:
    """Fraction of causal (q, k) pairs each head attends at ``seq_len``.

    Returns ``{"layer{L}/head{h}": float, "layer{L}": mean over heads, "mean": over all heads}`` for
    every ``layers.Attention`` inside the module (dense heads are 1.0), each layer by
    ``pattern_density`` (exact up to ``max_rows``, sampled beyond). Masks are built on the module's
    device.
    """
    out, all_heads = {}, []
    for m in model_or_attention.modules():
        if not isinstance(m, Attention):
            continue
        H, L = m.n_heads, m.layer_id
        if m.pattern is None:
            dens = torch.ones(H, dtype=torch.float64)
        else:
            # masks are built where the model lives (a 64k model's rows are slow on CPU, instant on
            # GPU)
            dev = m.wq.weight.device if m.wq.weight.device.type != "meta" else torch.device("cpu")
            dens = pattern_density(m.pattern, H, seq_len, L, max_rows, chunk, dev)
        for h in range(H):
            out[f"layer{L}/head{h}"] = float(dens[h])
        out[f"layer{L}"] = float(dens.mean())
        all_heads.append(dens)
    if all_heads:
        out["mean"] = float(torch.cat(all_heads).mean())
    return out


def budget_density(pattern: PatternLike, n_heads: int, seq_len: int) -> torch.Tensor:
    """float64 ``[n_heads]``: the causal (q, k) pairs each head's budget attends at ``seq_len``,
    counted per query row in closed form (O(T) per head, so a 128k plan is instant; ``--plan``).

    Exact for dense, window and sink heads. Block heads (random blocks, block top-k per block or per
    token, vertical-slash's columns and diagonals) count their budget as whole blocks beyond the
    window, disjoint from it: what the budget buys when the picks do not overlap the window (a
    per-token selection's kernel visits the union of a tile's choices, more, which ``attn/density``
    measures; with ``union_blocks`` they count that cap, the union's bound). The compressed branch
    adds its pooled-key pairs (``compressed_density``); the selection's scores are
    ``selection_work``.
    """
    T = seq_len
    q = torch.arange(T, dtype=torch.float64)
    n = q + 1  # causal keys per row
    out, seen = [], {}
    for p in head_patterns(pattern, n_heads):
        if p in seen:  # heads of one pattern count once
            out.append(seen[p])
            continue
        if p.is_dense_at(T):
            out.append(seen.setdefault(p, 1.0))
            continue
        bs = p.block_size
        win = torch.clamp(n, max=p.window) if p.window else torch.zeros_like(q)
        far_start = n - p.window if p.window else n  # keys before the window: 0 .. far_start-1
        sink = torch.clamp(torch.clamp(far_start, min=0), max=p.sinks)
        whole_far = torch.div(torch.clamp(far_start - sink, min=0), bs, rounding_mode="floor")
        if p.type in ("local", "a_shape"):
            extra = torch.zeros_like(q)
        elif p.type == "bigbird":
            extra = torch.clamp(whole_far, max=p.random_blocks) * bs
        elif p.type == "block_topk":
            own = torch.remainder(q, bs) + 1  # the own block's keys up to the query
            win = torch.maximum(win, own)
            # a capped union's bound (union_blocks); else the per-query budget
            budget = p.union_blocks or p.top_k
            extra = torch.clamp(whole_far, max=max(budget - 1, 0)) * bs
        else:  # vertical_slash: columns, and diagonals dilated to the query block
            own = torch.remainder(q, bs) + 1
            win = torch.maximum(win, own)
            extra = torch.full_like(q, float(p.n_vertical + p.n_slash))
        allowed = torch.minimum(win + sink + extra, n)
        out.append(seen.setdefault(p, float(allowed.sum() / n.sum())))
    dens = torch.tensor(out, dtype=torch.float64)
    cmp = compressed_density(head_patterns(pattern, n_heads), T, T * (T + 1) / 2)
    return dens + torch.tensor(cmp, dtype=torch.float64)


def selection_work(
    pattern: PatternLike, n_heads: int, seq_len: int, n_kv_heads: int, head_dim: int = 0
) -> torch.Tensor:
    """float64 ``[n_heads]``: the density block top-k selection's scores add at ``seq_len``
    (``selection_density``: per KV group of ``n_kv_heads`` where ``share_group`` heads share one
    selection; ``head_dim``: the attention's, for heads with ``indexer``); 0 for other heads."""
    pats = tuple(head_patterns(pattern, n_heads))
    work = selection_density(pats, seq_len, n_kv_heads, head_dim=head_dim)
    return torch.tensor(work, dtype=torch.float64)


def attention_metrics(model: torch.nn.Module, seq_len: int) -> dict:
    """Scalars (0-d tensors, no host sync) from every ``layers.Attention``'s last forward, for
    logging:

    - ``attn/density``: the mean over all heads of all layers of the causal pairs computed
      (block-sparse heads: visited blocks x block area / causal pairs; dense heads 1): what hardware
      FLOPs count. A sparse layer without recorded stats (compiled blocks record none) counts its
      budget density at ``seq_len`` (``pattern_density``, token-level, so never more than its kernel
      did; computed once). Block top-k heads with ``compress: 1`` add their compressed branch's
      pairs (``compressed_density``), every block top-k head its selection's scores
      (``selection_density``).
    - ``attn/topk_entropy``, ``attn/topk_mass``: block top-k selection sharpness (mean over the
      layers with block top-k heads): normalised entropy of the softmax over each query block's
      pooled scores (1 = uniform, falls as the choice sharpens) and the share of that softmax the
      chosen blocks hold. Empty when the model has no sparse layer.
    """
    dens, ent, mass, any_sparse = [], [], [], False
    for m in model.modules():
        if not isinstance(m, Attention):
            continue
        s = m.attn_stats
        pattern = m.active_pattern()
        if pattern is None:
            dens.append(torch.ones((), device=next(m.parameters()).device))
            continue
        any_sparse = True
        if "density" in s:
            # the kernel's visited blocks plus the selection's scores (functional._selection_work)
            dens.append((s["density"].float() + s.get("score_work", 0.0)).mean())
        else:
            cached = m.__dict__.get("_budget_density")
            if cached is None or cached[0] != (seq_len, m.dense_phase):
                dev = (
                    m.wq.weight.device if m.wq.weight.device.type != "meta" else torch.device("cpu")
                )
                dens_h = pattern_density(pattern, m.n_heads, seq_len, m.layer_id, device=dev)
                # plus the compressed branch's pooled-key pairs (block top-k compress: 1) and the
                # selection's scores, token-level shares too
                pats = head_patterns(pattern, m.n_heads)
                cmp = compressed_density(pats, seq_len, seq_len * (seq_len + 1) / 2)
                sel = selection_work(pats, m.n_heads, seq_len, m.n_kv_heads, m.head_dim)
                dens_h = dens_h + (torch.tensor(cmp, dtype=torch.float64) + sel).to(dens_h)
                m._budget_density = cached = ((seq_len, m.dense_phase), dens_h.mean().float())
            dens.append(cached[1])
        if "entropy" in s:
            ent.append(s["entropy"].float())
            mass.append(s["topk_mass"].float())
    if not any_sparse:
        return {}
    dev = dens[0].device
    out = {"attn/density": torch.stack([d.to(dev) for d in dens]).mean()}
    if ent:
        out["attn/topk_entropy"] = torch.stack(ent).mean()
        out["attn/topk_mass"] = torch.stack(mass).mean()
    return out


class AttentionStats:
    """The sparse attention layers as one sparsity method (layers.sparsity_method): before each
    step, the dense phases (``dense_warmup`` / ``dense_finish``: fractions of ``total_steps`` at the
    start / end in which every sparse layer runs dense causal attention, boundaries as
    ``layers.neuron.schedule.phase_bounds``); ``metrics()`` is ``attention_metrics`` of the last
    forward (density for the honest MFU, block top-k selection sharpness) and ``attn/dense_phase``.

    A dense warm-up lets the model learn where to look before the selection has to find it (DSA
    and MSA warm their indexers up on dense attention); a dense finish is MoBA's recipe for
    reaching full attention's loss. A pure function of the step, so resuming needs no state.
    ``dense_phase_heads`` (``model.attention.dense_phase_heads``): "all" opens every head in the
    phases, "selecting" only the input-dependent ones (pattern.selecting_heads_dense), so the
    copy heads a warm-up teaches form where they still reach far after it. With ``log_every``
    (the trainer's ``logging.log_every``), the block top-k selection computes its sharpness stats
    only in the steps the trainer logs (for per-token selection, a softmax over every query's
    blocks a step).
    """

    skips_on_device = True  # nothing to do after a step (layers.sparsity_method)

    def __init__(
        self,
        model: torch.nn.Module,
        seq_len: int,
        total_steps: int = 0,
        dense_warmup: float = 0.0,
        dense_finish: float = 0.0,
        dense_phase_heads: str = "all",
        log_every: int = 0,
    ):
        self.model, self.seq_len = model, seq_len
        self.total_steps, self.log_every = total_steps, log_every
        self.bounds = phase_bounds(total_steps, dense_warmup, dense_finish)
        self.phased = dense_warmup > 0 or dense_finish > 0
        self.dense = False
        for m in model.modules():
            if isinstance(m, Attention) and m.pattern is not None:
                m.phase_pattern = (
                    selecting_heads_dense(m.pattern, m.n_heads)
                    if dense_phase_heads == "selecting"
                    else None
                )

    def before_step(self, step: int) -> None:
        # the selection's sharpness stats only where metrics() will read them: the steps the
        # trainer logs (those after which the step count is a multiple of log_every, and the last)
        done = step + 1
        sharp = not self.log_every or done % self.log_every == 0 or done >= self.total_steps
        if self.phased:
            self.dense = step < self.bounds[0] or step >= self.bounds[1]
        for m in self.model.modules():
            if isinstance(m, Attention):
                m.record_sharpness = sharp
                if self.phased:
                    m.dense_phase = self.dense

    def after_optimizer_step(self, step: int, applied: Optional[torch.Tensor] = None) -> None:
        pass

    def skipped_step(self) -> None:
        pass

    def metrics(self) -> dict:
        out = attention_metrics(self.model, self.seq_len)
        if self.phased:
            out["attn/dense_phase"] = float(self.dense)
        return out
