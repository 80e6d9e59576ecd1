"""Sparse attention on one GPU: our layer vs SDPA causal (flash) and plain FlexAttention on the same
mask.

    python bench/attention.py --lengths 16384,32768,65536,131072 --out results.jsonl
    python bench/attention.py --patterns vs --vs-inputs structured,local,iid --modes fwd --no-plain
    # where vs time goes:
    python bench/attention.py --lengths "" --stages 131072 --vs-inputs local --profile DIR
    # where the capped tile union's selection time goes (scores, the per-row choice fused and as
    # torch ops, the whole plan):
    python bench/attention.py --lengths "" --select-stages 65536
    # FLASH vs Triton:
    python bench/attention.py --patterns topk,mix,a_shape --kernels triton,flash --no-plain

Shapes: B=1, 32 query heads, 8 KV heads, head dim 128, bf16. Patterns (block 128):
  bigbird  local 1024 + 128 sinks + 4 random blocks (~5% of causal pairs at 64k)
  a_shape  128 sinks + 2048 window (3.5% block density at 64k)
  vs       vertical-slash, MInference budgets (1000 columns, 6096 diagonals, last_q 64),
           timed *including* the per-input index estimation, column gather and block-mask build
  topk     block top-k, 16 blocks per query block (own block included), one selection per KV group
           (``share_group``), timed including the pooled estimation and block-mask build, on iid
           inputs (a model at init: the picks scatter, every visited block but the diagonal is full)
  topk_qmax  topk scoring each key block by its query block's best query (``query_max``:
             per-query scores)
  topk_nsa   topk_qmax plus NSA's compressed branch (``compress: 1``;
             layers.attention.compressed), timed as the layer runs it (the fine branch, then the
             compressed branch added to its heads; the gates' two elementwise products left out);
             its pooled-key pairs count in ``block_density``
  topk_union_max  per-token choices by single-key scores (``token_select: 2, score_block: 1``),
             each query block visiting the union of its queries' choices
  topk_union_share10  topk_union_max keeping a query's far choice only where it holds 10% of its
             softmax over its causal blocks (``min_share: 10``); iid inputs spread every query's
             scores, so no far block is kept: the row times the single-key scores and own blocks
  topk_union_cap16  topk_union_max with each query block visiting at most 16 blocks of its union,
             those its queries give the highest share (``union_blocks: 16``), in every head
  topk_share_max  per query block, ranked by its queries' best log share of single-key scores
             (``query_max: 2, score_block: 1``)
  mix      the long-context presets' layer: heads 0-15 A-shape, 16-31 block top-k (as topk)
``--kernels triton,flash``: flex's Triton backend and its FLASH backend (flash-attn-4), each row one
kernel. Modes: fwd, and fwd+bwd (``out.backward(do)``). Each number is the median of CUDA-event
timings after warm-up (compile excluded). ``block_density`` = visited 128x128 blocks / causal blocks
(for vs: the gathered-column blocks in front of the keys, ``prefix_density``, plus the rest of the
rule's blocks, ``main_density``, both over the causal blocks of the T x T part); ``limit`` = 1 /
block_density (= 0.5 / density-of-the-full-square, the issue's definition), the speed-up of a kernel
that visits only those blocks at SDPA's FLOP rate; ``of_limit`` = speedup / limit.

Vertical-slash picks its columns and diagonals from the input, so its speed depends on what the
input looks like; ``--vs-inputs`` times it on each of these synthetic families (none is measured
from a real model; a_shape and bigbird always run on ``iid``):
  structured  (the default) q and k share one per-head direction and go through RoPE (base
              10000), and the first 64 keys carry more of it. Scores fall off
              with distance only over ~1k tokens; past that RoPE's sum of cosines is a fixed ripple,
              so the tail of the 6096 diagonals and many columns land anywhere: the layout stays
              nearly dense.
  local       attention that decays with distance the way long-context LLMs' does: the shared RoPE'd
              component sits in the 22 lowest-frequency rotary pairs (base 500000 as in Llama 3,
              where real models keep long-range positional signal), so scores fall smoothly over
              thousands of tokens and the top diagonals form one band next to the main diagonal; on
              top, 4 sinks and 20 scattered "heavy hitter" keys that every query scores ~30 (a
              component added after RoPE, standing for the near-zero-frequency dimensions real
              models attend through regardless of position) become vertical lines. Each heavy hitter
              also puts 64 diagonals (one per estimating query) into the slash ranking: a few extra
              block offsets.
  iid         q, k, v i.i.d. normal: no structure, the estimate's picks scatter over every block and
              no block-sparse kernel can skip work (the worst case).
Block densities of the gathered vs layout (prefix + main, 32 query heads, 8 KV heads): local 70% /
41% / 22% / 10.6% at 16k / 32k / 64k / 128k, structured 57% at 128k, iid ~100% throughout
(BENCHMARKS.md, Sparse attention layer). Writes one JSON object per measurement to ``--out`` as
it goes (a timeout keeps what finished).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import timeit  # noqa: E402
from moezoo.configs import exit_code  # noqa: E402
from moezoo.configs.attention import FLEX_KERNELS  # noqa: E402
from moezoo.configs.errors import choice_list, int_list  # noqa: E402
from moezoo.kernels.key_block_max import key_block_max  # noqa: E402
from moezoo.kernels.token_block_topk import token_block_topk  # noqa: E402
from moezoo.layers import RotaryEmbedding, SparsityPattern, apply_rotary, sparse_attention  # noqa: E402
from moezoo.layers.attention import flex as sa_mod  # noqa: E402
from moezoo.layers.attention.compressed import (
    compress_heads,
    compressed_attention,
    compressed_density,
)  # noqa: E402
from moezoo.layers.attention.module import put_heads, take_heads  # noqa: E402
from moezoo.layers.attention.pattern import head_patterns  # noqa: E402
from moezoo.layers.attention.plan import _union_per_query_block, plan_pattern  # noqa: E402
from moezoo.layers.attention.selection import (  # noqa: E402
    _causal_own_block,
    _own_block_max,
    _slot_mean,
    _token_topk_reference,
    index_tensor,
    selection_density,
)

H, HK, D, BS = 32, 8, 128, 128
PATTERNS = {
    "bigbird": SparsityPattern(
        type="bigbird", window=1024, sinks=128, random_blocks=4, block_size=BS
    ),
    "a_shape": SparsityPattern(type="a_shape", sinks=128, window=2048, block_size=BS),
    "vs": SparsityPattern(
        type="vertical_slash", n_vertical=1000, n_slash=6096, last_q=64, block_size=BS
    ),
    "topk": SparsityPattern(type="block_topk", top_k=16, share_group=1, block_size=BS),
    "topk_qmax": SparsityPattern(
        type="block_topk", top_k=16, share_group=1, query_max=1, block_size=BS
    ),
    "topk_nsa": SparsityPattern(
        type="block_topk", top_k=16, share_group=1, query_max=1, compress=1, block_size=BS
    ),
    # per-token choices by single-key scores (kernels.key_block_max), the query block's union
    "topk_union_max": SparsityPattern(
        type="block_topk", top_k=16, share_group=1, token_select=2, score_block=1, block_size=BS
    ),
    # the union keeping only the choices that hold 10% of a query's block softmax: on iid inputs
    # no far block does, so this times the single-key scores and the own blocks
    "topk_union_share10": SparsityPattern(
        type="block_topk",
        top_k=16,
        share_group=1,
        token_select=2,
        score_block=1,
        min_share=10,
        block_size=BS,
    ),
    # per query block by its queries' best log share of single-key scores
    "topk_share_max": SparsityPattern(
        type="block_topk", top_k=16, share_group=1, query_max=2, score_block=1, block_size=BS
    ),
}
# topk_union_max with each query block capped at the per-query budget (``union_blocks``)
PATTERNS["topk_union_cap16"] = dataclasses.replace(PATTERNS["topk_union_max"], union_blocks=16)
PATTERNS["mix"] = [PATTERNS["a_shape"]] * (H // 2) + [PATTERNS["topk"]] * (H // 2)
PATTERNS["mix_union_max"] = [PATTERNS["a_shape"]] * (H // 2) + [PATTERNS["topk_union_max"]] * (
    H // 2
)
PATTERNS["mix_share_max"] = [PATTERNS["a_shape"]] * (H // 2) + [PATTERNS["topk_share_max"]] * (
    H // 2
)


VS_INPUTS = ("structured", "local", "iid")


def make_inputs(S, family="iid", seed=0, device="cuda"):
    """bf16 ``q [1, H, S, D]``, ``k, v [1, HK, S, D]`` of one input family (module docstring)."""
    g = torch.Generator(device=device).manual_seed(seed)
    noise = 0.5 if family == "local" else 1.0
    q = noise * torch.randn(1, H, S, D, device=device, generator=g)
    k = noise * torch.randn(1, HK, S, D, device=device, generator=g)
    v = torch.randn(1, HK, S, D, device=device, generator=g, dtype=torch.bfloat16)
    if family == "structured":
        u = torch.randn(HK, D, device=device, generator=g)
        q = q + 1.5 * u.repeat_interleave(H // HK, 0)[None, :, None]
        k = k + 1.5 * u[None, :, None]
        k[:, :, :64] += 3 * u[None, :, None]
        cos, sin = RotaryEmbedding(D, theta=10000.0)(torch.arange(S, device=device))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    elif family == "local":
        low = 22  # lowest-frequency rotary pairs: i = 64-22 .. 63
        pair = torch.arange(D // 2, device=device) >= D // 2 - low
        u = torch.randn(HK, D, device=device, generator=g) * pair.repeat(2) * (D / 2 / low) ** 0.5
        q = q + 1.5 * u.repeat_interleave(H // HK, 0)[None, :, None]
        k = k + 1.5 * u[None, :, None]
        cos, sin = RotaryEmbedding(D, theta=500000.0)(torch.arange(S, device=device))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        hh = torch.cat(
            [
                torch.arange(4, device=device),
                4 + torch.randperm(S - 4, device=device, generator=g)[:20],
            ]
        )
        w = torch.randn(HK, D, device=device, generator=g)
        k[:, :, hh] = (
            noise * torch.randn(1, HK, hh.numel(), D, device=device, generator=g)
            + 30 / D**0.5 * w[None, :, None]
        )
        # q . k_hh / sqrt(D) ~ 30 at any distance
        q = q + w.repeat_interleave(H // HK, 0)[None, :, None]
    elif family != "iid":
        raise ValueError(f"unknown input family {family!r}; expected one of {', '.join(VS_INPUTS)}")
    return q.bfloat16(), k.bfloat16(), v


def sdpa_causal(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


_plain_compiled = None


def plain_flex(q, k, v, plan):
    """Plain FlexAttention: the documented route, ``create_block_mask`` evaluating the same mask_mod
    on every block (ours builds the block lists from indices instead). Returns the call to time."""
    global _plain_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _plain_compiled is None:
        _plain_compiled = torch.compile(flex_attention)
    S = q.shape[2]
    mask_mod = sa_mod.plan_mask_mod(plan)
    bm = create_block_mask(mask_mod, 1, H, S, S, device="cuda", BLOCK_SIZE=BS, _compile=True)
    return lambda: _plain_compiled(q, k, v, block_mask=bm, enable_gqa=True)


def layout_density(plan):
    """Visited blocks of the BlockMask ``sparse_attention`` builds for ``plan`` over causal blocks
    of the T x T part: ``{"block_density"}``, plus ``prefix_density`` / ``main_density`` when
    vertical-slash columns are gathered in front of the keys (``column_slots``)."""
    slots = sa_mod.column_slots(plan) if plan.cols is not None else None
    bm = sa_mod.flex_block_mask(plan, slots)
    pn, pi, fn = bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks
    n = (plan.T + BS - 1) // BS
    causal = pn.shape[0] * H * n * (n + 1) / 2
    out = dict(block_density=float((pn.sum() + fn.sum()) / causal))
    if slots is not None:
        listed = torch.arange(pi.shape[-1], device=pi.device) < pn[..., None]
        pre = float(((pi < slots.shape[-1] // BS) & listed).sum() / causal)
        out.update(prefix_density=round(pre, 4), main_density=round(out["block_density"] - pre, 4))
    return out


def record(out, row):
    print(json.dumps(row), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


_SDPA_MS: dict = {}


def _dynamic(p):
    return any(x.dynamic for x in (p if isinstance(p, list) else [p]))


def layer_attention(q, k, v, p, kern):
    """What layers.Attention computes for pattern ``p`` before its gates: the fine (mask) branch,
    plus the compressed branch on the heads with ``compress: 1``."""
    out = sparse_attention(q, k, v, p, backend="flex", kernel=kern)
    heads = compress_heads(head_patterns(p, H))
    if not heads:
        return out
    kv_heads = index_tensor([h // (H // HK) for h in heads], q.device)
    cmp = compressed_attention(take_heads(q, heads), k, v, BS, 0, kv_heads)
    return put_heads(out, heads, take_heads(out, heads) + cmp)


def compressed_share(p, S, training):
    """The compressed branch's pooled-key pairs and the selection's scores (selection_density; a
    scored pair is a sixth of an attended pair's work forward + backward, half forward only) in
    units of the layout's causal blocks, mean over heads."""
    n = (S + BS - 1) // BS
    pats = head_patterns(p, H)
    share = compressed_density(pats, S, BS * BS * n * (n + 1) / 2)
    scores = selection_density(tuple(pats), S, HK, training)
    return (sum(share) + sum(scores) * S * (S + 1) / 2 / (BS * BS * n * (n + 1) / 2)) / len(share)


def bench_length(S, names, modes, with_plain, out, vs_inputs=("structured",), kernels=("triton",)):
    for name, family in [
        (n, f) for n in names for f in (vs_inputs if n.startswith("vs") else ("iid",))
    ]:
        p = PATTERNS[name]
        q, k, v = make_inputs(S, family)
        plan = plan_pattern(p, H, 0, S, S, 0, q, k)
        densities = layout_density(plan)
        del plan
        for mode in modes:
            grad = mode == "fwdbwd"
            dens = densities["block_density"] + compressed_share(p, S, grad)
            qg, kg, vg = (t.detach().requires_grad_(grad) for t in (q, k, v))
            do = torch.randn_like(q)

            def run(f):
                def go():
                    o = f()
                    if grad:
                        o.backward(do)

                return go

            if (S, mode) not in _SDPA_MS:  # dense causal does not depend on the pattern
                _SDPA_MS[S, mode] = timeit(run(lambda: sdpa_causal(qg, kg, vg)))
            sdpa = _SDPA_MS[S, mode]
            for kern in kernels:
                t0 = time.perf_counter()
                try:
                    ours = timeit(run(lambda: layer_attention(qg, kg, vg, p, kern)))
                except Exception as e:  # a kernel that cannot run this pattern is a result too
                    record(out, dict(S=S, pattern=name, mode=mode, kernel=kern, error=str(e)[:300]))
                    continue
                compile_s = time.perf_counter() - t0
                row = dict(
                    S=S,
                    pattern=name,
                    inputs=family,
                    mode=mode,
                    kernel=kern,
                    **{**densities, "block_density": round(dens, 4)},
                    ours_ms=round(ours, 3),
                    sdpa_ms=round(sdpa, 3),
                    speedup=round(sdpa / ours, 2),
                    limit=round(1 / dens, 2),
                    of_limit=round(sdpa / ours * dens, 3),
                    first_call_s=round(compile_s, 1),
                )
                if kern != kernels[0] or not with_plain:
                    record(out, row)
                    continue
                if _dynamic(p):  # plain flex must estimate and build its mask every call too

                    def pf():
                        pl = plan_pattern(p, H, 0, S, S, 0, qg, kg)
                        return plain_flex(qg, kg, vg, pl)()

                    plain = timeit(run(pf))
                else:
                    pl = plan_pattern(p, H, 0, S, S, 0, device="cuda")
                    plain = timeit(run(plain_flex(qg, kg, vg, pl)))
                row.update(plain_flex_ms=round(plain, 3), vs_plain=round(plain / ours, 2))
                record(out, row)
            del qg, kg, vg, do
            torch.cuda.empty_cache()


def bench_crossover(lengths, out):
    """Short lengths: reference (SDPA + materialised mask) vs flex sparse vs SDPA causal, a_shape
    fwd."""
    p = SparsityPattern(type="a_shape", sinks=128, window=1024, block_size=BS)
    for S in lengths:
        q, k, v = make_inputs(S)
        row = dict(
            S=S,
            pattern="a_shape_1024",
            mode="fwd",
            reference_ms=round(
                timeit(lambda: sparse_attention(q, k, v, p, backend="reference")), 3
            ),
            flex_ms=round(timeit(lambda: sparse_attention(q, k, v, p, backend="flex")), 3),
            sdpa_ms=round(timeit(lambda: sdpa_causal(q, k, v)), 3),
        )
        record(out, row)


def sweep_kernel_options(S, out):
    """Flex tile shapes for a_shape at one length, fwd+bwd: what the defaults leave on the table."""
    p = PATTERNS["a_shape"]
    q, k, v = (t.requires_grad_() for t in make_inputs(S))
    do = torch.randn_like(q)
    for opts in (
        None,
        {
            "BLOCK_M1": 64,
            "BLOCK_N1": 64,
            "BLOCK_M2": 64,
            "BLOCK_N2": 64,
            "num_stages": 3,
            "num_warps": 4,
        },
        {
            "BLOCK_M1": 32,
            "BLOCK_N1": 128,
            "BLOCK_M2": 128,
            "BLOCK_N2": 32,
            "num_stages": 3,
            "num_warps": 8,
        },
        {
            "BLOCK_M1": 64,
            "BLOCK_N1": 128,
            "BLOCK_M2": 128,
            "BLOCK_N2": 64,
            "num_stages": 2,
            "num_warps": 8,
        },
    ):

        def step():
            sparse_attention(
                q, k, v, p, backend="flex", kernel="triton", kernel_options=opts
            ).backward(do)

        try:
            ms = timeit(step)
            record(
                out,
                dict(
                    S=S, pattern="a_shape", mode="fwdbwd", kernel_options=opts, ours_ms=round(ms, 3)
                ),
            )
        except Exception as e:  # a tile shape the template rejects is a result too
            record(
                out,
                dict(
                    S=S, pattern="a_shape", mode="fwdbwd", kernel_options=opts, error=str(e)[:200]
                ),
            )


def vs_stages(S, family, out, profile_dir=None):
    """Where a vertical-slash forward's time goes at length S: estimation + plan, column slots +
    gather, BlockMask build, the flex kernel, and the whole call; plus a kernel table of one
    call."""
    p = PATTERNS["vs"]
    q, k, v = make_inputs(S, family)
    plan = plan_pattern(p, H, 0, S, S, 0, q, k)
    slots = sa_mod.column_slots(plan)
    kg, vg = sa_mod.gather_columns(k, v, slots)
    bm = sa_mod.flex_block_mask(plan, slots, backward=False)
    stages = {
        "plan (estimation)": lambda: plan_pattern(p, H, 0, S, S, 0, q, k),
        "column_slots + gather_columns": lambda: sa_mod.gather_columns(
            k, v, sa_mod.column_slots(plan)
        ),
        "flex_block_mask (fwd lists)": lambda: sa_mod.flex_block_mask(plan, slots, backward=False),
        "block_layout": lambda: plan.block_layout(include_cols=False),
        "flex kernel": lambda: sa_mod.flex_attention_call(q, kg, vg, bm),
        "whole call": lambda: sparse_attention(q, k, v, p, backend="flex"),
        "sdpa causal": lambda: sdpa_causal(q, k, v),
    }
    row = dict(S=S, pattern="vs", inputs=family, mode="fwd-stages", **layout_density(plan))
    for name, fn in stages.items():
        row[name] = round(timeit(fn), 3)
    record(out, row)
    if profile_dir:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            stages["whole call"]()
            torch.cuda.synchronize()
        table = prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=30, max_name_column_width=90
        )
        with open(os.path.join(profile_dir, f"profile_vs_{S}_{family}.txt"), "w") as f:
            f.write(table)


def select_stages(S, out):
    """Where the capped tile union's selection time goes at length S (iid inputs, one slot per KV
    group, as ``estimate_token_topk`` runs it on CUDA): the single-key scores
    (kernels.key_block_max), each query's choice from them fused (kernels.token_block_topk) and as
    the torch ops it replaces (its reference), each kernel at other tile shapes, the fused choice's
    parts, the tile's union, the whole plan, the whole forward call."""
    p = PATTERNS["topk_union_cap16"]
    q, k, v = make_inputs(S)
    plan = plan_pattern(p, H, 0, S, S, 0, q, k)
    # the KV group's mean query, as estimate_token_topk scores a share_group slot
    qg = _slot_mean(q, [h // (H // HK) for h in range(H)]).to(q.dtype)
    scale = D**-0.5
    s = key_block_max(qg, k, 0, BS, scale)  # [1, HK, S, nk]
    own = _own_block_max(qg, k, 0, BS, scale)
    causal = _causal_own_block(s, qg, k, 0, BS, scale)
    nk = s.shape[-1]
    bits = torch.empty(1, HK, S, -(-nk // 32), dtype=torch.int32, device=q.device)
    tile = torch.full((1, HK, -(-S // BS), nk), float("-inf"), device=q.device)
    acc = torch.zeros(2, device=q.device)
    ks = index_tensor([p.top_k] * HK, q.device)
    ks1 = index_tensor([1] * HK, q.device)
    nq, cap = tile.shape[2], [p.union_blocks] * HK
    stages = {
        "plan (selection)": lambda: plan_pattern(p, H, 0, S, S, 0, q, k),
        "scores (key_block_max)": lambda: key_block_max(qg, k, 0, BS, scale),
        # other tiles of the scores' kernel (queries a program, keys a dot, warps)
        "scores, 128 queries, 8 warps": lambda: key_block_max(
            qg, k, 0, BS, scale, block_q=128, num_warps=8
        ),
        "scores, 64 keys": lambda: key_block_max(qg, k, 0, BS, scale, block_k=64),
        "scores, 128 x 128, 8 warps": lambda: key_block_max(
            qg, k, 0, BS, scale, block_q=128, block_k=128, num_warps=8
        ),
        "own blocks up to the query": lambda: _own_block_max(qg, k, 0, BS, scale),
        "choice, fused (token_block_topk)": lambda: token_block_topk(
            s, 0, BS, ks, bits, own, 0, tile, 0, acc
        ),
        # other tiles of the fused choice (rows a program, warps: one warp a row reduces by
        # shuffles alone, a row over several warps through shared memory)
        "choice, fused, 1 row, 1 warp": lambda: token_block_topk(
            s, 0, BS, ks, bits, own, 0, tile, 0, acc, rows=1, num_warps=1
        ),
        "choice, fused, 1 row, 2 warps": lambda: token_block_topk(
            s, 0, BS, ks, bits, own, 0, tile, 0, acc, rows=1, num_warps=2
        ),
        "choice, fused, 4 rows, 4 warps": lambda: token_block_topk(
            s, 0, BS, ks, bits, own, 0, tile, 0, acc, rows=4, num_warps=4
        ),
        # what the fused choice's parts cost: without the tile shares and stats, and top-1
        "choice, fused, top-k and bits only": lambda: token_block_topk(s, 0, BS, ks, bits),
        "choice, fused, top-1 and bits only": lambda: token_block_topk(s, 0, BS, ks1, bits),
        # the tile's union from every row's bits (unpacked to [B, Hk, S, nk]) or from the shares
        "union from the rows' bits": lambda: _union_per_query_block(bits, 0, BS, nq, nk),
        "union from the tile shares": lambda: _union_per_query_block(
            bits, 0, BS, nq, nk, cap, tile
        ),
        "choice, torch ops": lambda: _token_topk_reference(
            s, causal, 0, BS, [p.top_k] * HK, 0, tile, 0, acc
        ),
        "whole call": lambda: sparse_attention(q, k, v, p, backend="flex"),
        "sdpa causal": lambda: sdpa_causal(q, k, v),
    }
    row = dict(S=S, pattern="topk_union_cap16", inputs="iid", mode="fwd-stages")
    row.update(layout_density(plan))
    for name, fn in stages.items():
        row[name] = round(timeit(fn), 3)
        record(out, {**row, "partial": True})
    record(out, row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16384,32768,65536,131072")
    ap.add_argument("--patterns", default="a_shape,bigbird,vs")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-FlexAttention baseline")
    ap.add_argument(
        "--kernels", default="triton", help="flex kernels to time, from triton,flash (flash-attn-4)"
    )
    ap.add_argument(
        "--crossover", default="", help="short lengths for the dense crossover, e.g. 1024,2048,4096"
    )
    ap.add_argument(
        "--sweep", type=int, default=0, help="length for a flex tile-shape sweep (0 = none)"
    )
    ap.add_argument(
        "--vs-inputs",
        default="structured",
        help=f"input families for the vs rows, comma-separated from {','.join(VS_INPUTS)} "
        "(module docstring)",
    )
    ap.add_argument(
        "--vs-dense-below",
        type=int,
        default=0,
        help="time the vs pattern with this dense_below (tokens) too: "
        "the layer's crossover fallback",
    )
    ap.add_argument(
        "--stages",
        type=int,
        default=0,
        help="length for a vertical-slash forward split into its stages "
        "(on each --vs-inputs family)",
    )
    ap.add_argument("--profile", default=None, help="folder for the --stages kernel tables")
    ap.add_argument(
        "--select-stages",
        type=int,
        default=0,
        help="length for the capped tile union's selection split into its stages",
    )
    ap.add_argument("--out", default="bench_attention.jsonl")
    a = ap.parse_args()
    # every list checked before the GPU is touched: a bad one is one line and exit 2
    vs_inputs = tuple(choice_list(a.vs_inputs, VS_INPUTS, "--vs-inputs"))
    names = choice_list(a.patterns, tuple(PATTERNS), "--patterns")
    modes = choice_list(a.modes, ("fwd", "fwdbwd"), "--modes")
    kernels = tuple(choice_list(a.kernels, FLEX_KERNELS, "--kernels"))
    lengths, crossover = (
        int_list(a.lengths, "--lengths", allow_empty=True),
        int_list(a.crossover, "--crossover", True),
    )
    print(
        json.dumps(
            dict(
                gpu=torch.cuda.get_device_name(),
                torch=torch.__version__,
                triton=__import__("triton").__version__,
                cuda=torch.version.cuda,
            )
        ),
        flush=True,
    )
    if a.vs_dense_below:
        PATTERNS["vs_dense_below"] = dataclasses.replace(
            PATTERNS["vs"], dense_below=a.vs_dense_below
        )
        names = names + ["vs_dense_below"]
    for S in lengths:
        bench_length(S, names, modes, not a.no_plain, a.out, vs_inputs, kernels)
    if a.stages:
        for fam in vs_inputs:
            vs_stages(a.stages, fam, a.out, a.profile)
    if a.select_stages:
        select_stages(a.select_stages, a.out)
    if crossover:
        bench_crossover(crossover, a.out)
    if a.sweep:
        sweep_kernel_options(a.sweep, a.out)


if __name__ == "__main__":
    sys.exit(exit_code(main))
