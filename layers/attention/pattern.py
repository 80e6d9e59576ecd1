"""Sparse attention patterns: the causal token-level mask ``allowed(q, k)`` of each (layer, head),
defined once.

Every backend (layers.attention.functional) must compute attention under exactly this mask.
Conventions (docs/sparse_attention.md), for a query at absolute position q and a key at position k,
always with ``k <= q``:

- ``local``:  ``q - k < window`` (window W covers keys q-W+1 .. q), optionally plus ``sinks``.
- ``a_shape``: ``k < sinks`` or ``q - k < window`` (StreamingLLM / MInference A-shape).
- ``bigbird``: A-shape plus ``random_blocks`` whole key blocks per query block, drawn from the
  strictly earlier blocks ``0 .. qb-1`` by a counter-based hash of (seed, layer, head, query block,
  key block): identical in every process and on every device, and independent of the sequence length
  (so decode sees the blocks prefill saw).
- ``vertical_slash``: ``k`` in the top-``n_vertical`` key columns or ``q - k`` in the
  top-``n_slash`` diagonals, ranked by the softmax mass the last ``last_q`` queries of the input put
  on them (MInference, Jiang et al. 2024, sec. 3.2): columns first, then diagonals by the mass
  outside the chosen columns (MInference ranks diagonals by all their mass, so a heavy column's
  "shadow" diagonals take slash budget that covers nothing new). Diagonal 0 is always chosen.
  Columns are exact; diagonals are dilated to the query block as in MInference's kernel: a query
  block starting at ``qs`` takes, for each chosen diagonal d, the ``block_size`` keys ``qs - d .. qs
  - d + block_size - 1`` (the keys its queries meet on d, as one range), i.e. query q keeps key k
  iff ``qs - k <= d <= qs - k + block_size - 1`` for some chosen d (so every key of its own block,
  up to causality). A diagonal chosen from noise among its neighbours then costs whole blocks, not
  blocks the kernel must mask element by element.
- ``block_topk``: the ``top_k`` key blocks (of ``block_size``) with the highest mean-pooled
  ``q_block . k_block`` score per query block, among blocks ``<= qb``; the diagonal block is always
  one of them. Pooling a query block uses all its queries present in the input, so within one block
  the choice can depend on later queries of that block (as in MInference and MoBA). Optional
  ``sinks`` and ``window`` add A-shape's rule on top (NSA's sliding branch). ``share_group: 1``: one
  selection per KV group (NSA): every block_topk head of a group scores blocks by the mean of the
  group's heads' scores (= the group-mean pooled query . pooled key), so the heads of a group read
  the same blocks. ``query_max: 1``: a key block's score for a query block is the max over the
  block's queries of ``q . mean-pooled k`` instead of the pooled query's (MoBA and NSA score per
  query; the max keeps one query's preference, e.g. the position that must copy a far-back key, from
  being averaged away by the rest of its block; the top-k budget stays per query block, so the
  kernel stays block-sparse). ``query_max: 2``: the max over the block's queries of each query's log
  share of the block, its log softmax over its causal key blocks' scores (the own block scored over
  the keys up to the query): raw scores favour the queries whose scores run high everywhere, shares
  compare what each query would give the block of its own attention. Selection gets no gradient
  (MoBA, NSA's selection branch); it trains through the attention it gates: q and k learn inside the
  chosen blocks, and the choice sharpens as they do. ``compress: 1``: the head also runs NSA's
  compressed branch (layers.attention.compressed: each query's softmax over the mean-pooled complete
  key blocks before it), mixed with this mask's attention by learned per-head gates in
  layers.Attention. Its logits are the per-query scores the selection ranks, so it is the gradient
  path that teaches the selection about blocks outside the top-k. The mask ``allowed(q, k)`` above
  is the fine branch's only; ``compress`` does not change it. ``compress_block``: the branch pools
  blocks of this many keys instead of ``block_size`` (NSA compresses 32-token blocks and selects
  64-token ones): a short needle is diluted less in a smaller block's mean, at ``T /
  compress_block`` pooled keys per query; the selection keeps ``block_size``. ``score_block``: the
  selection pools keys over sub-blocks of this many (a power of two, at most ``block_size``, which
  is the plain rule) and scores a key block by its best sub-block, so one far key is averaged with
  ``score_block`` keys instead of ``block_size`` (NSA selects 64-key blocks by the scores of its
  32-key compression blocks); with ``compress: 1, compress_block`` equal to it, the selection ranks
  exactly the compressed branch's logits again. ``score_block: 1`` scores single keys, max-pooled to
  the block (MSA's and DSA's token-level rule with the attention's own q, k), through
  kernels.key_block_max where Triton runs. ``score_nope: 1``: the selection scores the queries and
  keys before RoPE (InfLLM-v2's ``use_nope``; after ``qk_norm`` and ``key_conv``), so a block is
  chosen by content alone: pooled RoPE-rotated keys cancel their fast-rotating dimensions (a
  low-pass filter with positional blind spots, Prism), and the distance between query and key does
  not move the score. The attention itself keeps RoPE. layers.Attention passes the pre-RoPE tensors
  (``sparse_attention(score_qk=...)``) and caches pre-RoPE keys for decode. ``indexer: Di`` (with
  ``token_select`` and ``score_block: 1``): the selection scores with the layer's learned indexer
  (layers.attention.indexer: per KV group a width-Di query and key of the detached layer input,
  distilled towards the attention's block mass) instead of the attention's q, k, passed the same
  way. ``token_select: 1``:
  each query token chooses its own ``top_k`` key blocks among the blocks that start at or before it,
  its own block always one of them (NSA, Yuan et al. 2025, Eq. 9-11; MoBA's per-token gate), scored
  by ``q . mean-pooled k`` (or by the best ``score_block`` sub-block), one choice per KV group with
  ``share_group`` (by the group's mean query, as NSA sums the group's scores). The query keeps key k
  iff k's block is one of its own choices (or window / sinks allow it): a query block serves as many
  different far keys as it has queries, where the per-block rule gives all its queries one budget.
  The kernel visits the union of a query tile's choices (partial blocks, evaluated per token through
  a 32-blocks-per-word bit table), so the work done is at least the budget and grows with how much a
  tile's queries disagree; ``attn/density`` reports it. ``query_max`` does not apply (each query
  scores for itself). ``token_select: 2``: the same per-token choices, but each query attends the
  union of the blocks its query block's queries chose (its own among them), so the mask is
  block-level again: every visited block is full, the kernel reads no per-token table, and the work
  is the union's size (MoBA-style gating with the tile as the unit; within a block the choice can
  depend on later queries of that block, as with per-block pooling). ``min_share`` (percent, with
  ``token_select``): a query keeps a chosen block other than its own only if the block holds at
  least that share of the query's softmax over its causal blocks' scores (the own block scored over
  the keys up to the query): a query whose scores are spread over many blocks, most of a tile, adds
  nothing to the tile's union, while one that points at a far block keeps it, so the union, and the
  work, shrinks to what the queries look for.
  ``union_blocks`` (with ``token_select: 2``, at least ``top_k``): a query block visits at most
  this many blocks of its union: its own, then those to which one of its queries gives the highest
  share of its softmax over its causal blocks (``min_share``'s share; ties: the later block), so a
  question keeps its needle's block over blocks many queries weakly chose (ranking by how many
  queries chose a block loses retrieval in the CPU screen). A bound on the work whatever the queries
  learn, which ``--plan`` counts: the union itself grows with how much a tile's queries disagree (at
  initialisation nearly every block), ``min_share`` shrinks it only once the heads point.
- ``vertical_slash`` extras (MInference's kernel): ``keep_columns`` forces the first N key columns
  and ``keep_diagonals`` the N diagonals nearest the main one into the top-k (their scores set above
  every estimate before it, earliest / nearest first when the budget is smaller).
- ``dense``: causal.

Every type also takes ``dense_below`` (tokens, 0 = never): over ``T`` keys, a head with ``T <
dense_below`` attends every causal pair, i.e. is exactly dense causal attention (MInference applies
its estimated patterns to long inputs only; below its crossover a sparse kernel is slower than
SDPA). ``T`` is the number of keys of the call, so a decode step at total length T (T keys, new one
included) follows the same rule as prefill over T keys, and all rows of one call share it.
``SparsityPattern.is_dense_at`` is the one place that decides; every consumer asks it.

The input-dependent patterns (vertical_slash, block_topk) estimate from the queries of the *input*;
decode reproduces prefill's estimate from a short history of queries (layers.Attention keeps it), so
each decode step re-estimates: ``last_q x T`` scores, ``last_q`` times a dense decode step's QK^T.

Shapes: B batch, H query heads, S queries, T keys, D head dim, nq/nk query/key blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from moezoo.configs.attention import (
    COMMON_PARAMS,
    DEFAULT_BLOCK_SIZE,
    PATTERN_TYPES,
    validate_pattern,
)
from moezoo.configs.errors import ConfigError, check_choice

DYNAMIC_TYPES = ("vertical_slash", "block_topk")


@dataclass(frozen=True)
class SparsityPattern:
    """One head's pattern. Params are named as in docs/sparse_attention.md; 0 means "not used" for
    optional counts."""

    type: str = "dense"
    window: int = 0
    sinks: int = 0
    random_blocks: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = 0
    n_vertical: int = 0
    n_slash: int = 0
    last_q: int = 64
    top_k: int = 0
    dense_below: int = 0
    # vertical-slash: the first N key columns always among the chosen (MInference: 30)
    keep_columns: int = 0
    # vertical-slash: the N diagonals nearest the main one always chosen (MInference: 100)
    keep_diagonals: int = 0
    share_group: int = 0  # block top-k: 1 = one selection per KV group (NSA-style, GQA-native)
    # block top-k: 1 = a query block scores key blocks by its best query (MoBA/NSA per-query
    # affinity); 2 = by its best query's log share (softmax over the query's causal blocks)
    query_max: int = 0
    # block top-k: 1 = plus NSA's compressed branch, gated (layers.attention.compressed)
    compress: int = 0
    compress_block: int = 0  # the compressed branch's pooling block (power of two; 0 = block_size)
    # block top-k: keys pooled per sub-block, a block scored by its best (0 = block_size)
    score_block: int = 0
    # block top-k: 1 = each query token chooses its own top_k blocks (NSA / MoBA per-token gating)
    token_select: int = 0
    # block top-k: 1 = the selection scores q and k before RoPE (InfLLM-v2's use_nope)
    score_nope: int = 0
    # block top-k with token_select: a query keeps a far choice only if the block holds at least
    # this percent of its softmax over its causal blocks' scores (0 = every choice)
    min_share: int = 0
    # block top-k with token_select 2: a query block visits at most this many key blocks of its
    # union, those its queries give the highest share of their softmax (0 = the whole union)
    union_blocks: int = 0
    # block top-k with token_select and score_block 1: the selection scores with the layer's
    # indexer of this head dim (its own detached projections, distilled towards the attention's
    # block mass; layers.attention.indexer) instead of the attention's q, k (0 = none)
    indexer: int = 0

    def __post_init__(self):
        validate_pattern(self.to_dict(), "pattern")

    @classmethod
    def from_dict(cls, d: dict, key: str = "pattern") -> SparsityPattern:
        """``{type: a_shape, sinks: 64, window: 1024}`` -> pattern; bad dicts raise ConfigError
        naming ``key``."""
        validate_pattern(d, key)
        return cls(**dict(d))

    def to_dict(self) -> dict:
        """The YAML form: type, its required params, and optional ones that differ from the
        default."""
        check_choice(self.type, tuple(PATTERN_TYPES), "pattern.type")
        required, optional = PATTERN_TYPES[self.type]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        out = {"type": self.type}
        for name in required:
            out[name] = getattr(self, name)
        for name in optional + COMMON_PARAMS:
            if getattr(self, name) != defaults[name]:
                out[name] = getattr(self, name)
        return out

    @property
    def scores_apart(self) -> bool:
        """True when the selection scores other q, k than the attention's: ``score_nope`` (before
        RoPE) or ``indexer`` (the layer's indexer), passed as ``score_qk``."""
        return bool(self.score_nope or self.indexer)

    @property
    def dynamic(self) -> bool:
        """True when the mask depends on the input (needs q, k)."""
        return self.type in DYNAMIC_TYPES

    def is_dense_at(self, T: int) -> bool:
        """True when, over ``T`` keys, the pattern allows every causal pair (so dense attention is
        exact): fewer keys than ``dense_below``, or a window / budget that covers all ``T`` keys."""
        if self.type == "dense" or T < self.dense_below:
            return True
        if self.type == "vertical_slash":
            return max(self.n_vertical, self.n_slash) >= T
        if self.type == "block_topk":
            return self.top_k >= (T + self.block_size - 1) // self.block_size or self.window >= T
        return self.window >= T


PatternLike = Union[SparsityPattern, Sequence[SparsityPattern]]
DENSE_PATTERN = SparsityPattern()


def head_patterns(pattern: PatternLike, n_heads: int) -> list[SparsityPattern]:
    """One pattern per query head (a single pattern is shared by all heads)."""
    if isinstance(pattern, SparsityPattern):
        return [pattern] * n_heads
    pats = list(pattern)
    if len(pats) != n_heads:
        raise ValueError(f"per-head pattern list has {len(pats)} entries for {n_heads} heads")
    return [p if p is not None else SparsityPattern() for p in pats]


def selecting_heads_dense(pattern: PatternLike, n_heads: int) -> list[SparsityPattern] | None:
    """``pattern`` with its input-dependent heads (block top-k, vertical-slash) dense and its
    static heads as they are: a dense phase with ``dense_phase_heads: selecting``. None when no
    static sparse head is left (the layer is then dense causal attention)."""
    pats = [SparsityPattern() if p.dynamic else p for p in head_patterns(pattern, n_heads)]
    return pats if any(p.type != "dense" for p in pats) else None


def layer_block_size(pats: Sequence[SparsityPattern]) -> int:
    """The block size shared by a layer's sparse heads (kernels tile one block size per layer)."""
    sizes = {p.block_size for p in pats if p.type != "dense"} or {SparsityPattern().block_size}
    if len(sizes) != 1:
        raise ConfigError(
            "pattern.block_size", f"heads of one layer must share block_size, got {sorted(sizes)}"
        )
    return sizes.pop()
