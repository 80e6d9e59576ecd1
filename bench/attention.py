"""Sparse attention on one GPU: our layer vs SDPA causal (flash) and plain FlexAttention on the same mask.

    python bench/attention.py --lengths 16384,32768,65536,131072 --out results.jsonl

Shapes: B=1, 32 query heads, 8 KV heads, head dim 128, bf16. Patterns (block 128):
  bigbird  local 1024 + 128 sinks + 4 random blocks (~5% of causal pairs at 64k)
  a_shape  128 sinks + 2048 window (3.5% block density at 64k)
  vs       vertical-slash, MInference budgets (1000 columns, 6096 diagonals, last_q 64),
           timed *including* the per-input index estimation and block-mask build
Modes: fwd, and fwd+bwd (``out.backward(do)``). Each number is the median of CUDA-event timings
after warm-up (compile excluded). ``block_density`` = visited 128x128 blocks / causal blocks;
``limit`` = 1 / block_density (= 0.5 / density-of-the-full-square, the issue's definition), the speed-up
of a kernel that visits only those blocks at SDPA's FLOP rate; ``of_limit`` = speedup / limit.

Vertical-slash inputs are structured like real attention so the estimate has something to find:
q and k share a per-head direction and go through RoPE (scores decay with distance), and the first
64 keys carry an extra shared component (sinks). On i.i.d. random inputs the chosen columns and
diagonals scatter over every block and no block-sparse kernel can skip work.
Writes one JSON object per measurement to ``--out`` as it goes (a timeout keeps what finished).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from layers import RotaryEmbedding, SparsityPattern, apply_rotary, sparse_attention  # noqa: E402
from layers.patterns import plan_pattern  # noqa: E402

sa_mod = sys.modules["layers.sparse_attention"]

H, HK, D, BS = 32, 8, 128, 128
PATTERNS = {
    "bigbird": SparsityPattern(type="bigbird", window=1024, sinks=128, random_blocks=4, block_size=BS),
    "a_shape": SparsityPattern(type="a_shape", sinks=128, window=2048, block_size=BS),
    "vs": SparsityPattern(type="vertical_slash", n_vertical=1000, n_slash=6096, last_q=64, block_size=BS),
}


def timeit(fn, min_reps=3, budget_s=1.5):
    """Median milliseconds over CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = time.perf_counter() - t0
    reps = max(min_reps, min(20, int(budget_s / max(est, 1e-4))))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def make_inputs(S, structured, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, H, S, D, device="cuda", generator=g)
    k = torch.randn(1, HK, S, D, device="cuda", generator=g)
    v = torch.randn(1, HK, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
    if structured:
        u = torch.randn(HK, D, device="cuda", generator=g)
        q = q + 1.5 * u.repeat_interleave(H // HK, 0)[None, :, None]
        k = k + 1.5 * u[None, :, None]
        k[:, :, :64] += 3 * u[None, :, None]
        cos, sin = RotaryEmbedding(D, theta=10000.0)(torch.arange(S, device="cuda"))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q.bfloat16(), k.bfloat16(), v


def sdpa_causal(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


_plain_compiled = None


def plain_flex(q, k, v, plan):
    """Plain FlexAttention: the documented route, ``create_block_mask`` evaluating the same mask_mod on
    every block (ours builds the block lists from indices instead). Returns the call to time."""
    global _plain_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _plain_compiled is None:
        _plain_compiled = torch.compile(flex_attention)
    S = q.shape[2]
    mask_mod = sa_mod.plan_mask_mod(plan)
    bm = create_block_mask(mask_mod, 1, H, S, S, device="cuda", BLOCK_SIZE=BS, _compile=True)
    return lambda: _plain_compiled(q, k, v, block_mask=bm, enable_gqa=True)


def block_density(plan):
    partial, full = plan.block_layout()
    n = partial.shape[-1]
    return float((partial | full).float().sum() / (partial.shape[0] * H * n * (n + 1) / 2))


def record(out, row):
    print(json.dumps(row), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


_SDPA_MS: dict = {}


def bench_length(S, names, modes, with_plain, out):
    for name in names:
        p = PATTERNS[name]
        q, k, v = make_inputs(S, structured=(name == "vs"))
        plan = plan_pattern(p, H, 0, S, S, 0, q, k)
        dens = block_density(plan)
        del plan
        for mode in modes:
            grad = mode == "fwdbwd"
            qg, kg, vg = (t.detach().requires_grad_(grad) for t in (q, k, v))
            do = torch.randn_like(q)

            def run(f):
                def go():
                    o = f()
                    if grad:
                        o.backward(do)
                return go

            t0 = time.perf_counter()
            ours = timeit(run(lambda: sparse_attention(qg, kg, vg, p, backend="flex")))
            compile_s = time.perf_counter() - t0
            if (S, mode) not in _SDPA_MS:      # dense causal does not depend on the pattern
                _SDPA_MS[S, mode] = timeit(run(lambda: sdpa_causal(qg, kg, vg)))
            sdpa = _SDPA_MS[S, mode]
            row = dict(S=S, pattern=name, mode=mode, block_density=round(dens, 4), ours_ms=round(ours, 3),
                       sdpa_ms=round(sdpa, 3), speedup=round(sdpa / ours, 2), limit=round(1 / dens, 2),
                       of_limit=round(sdpa / ours * dens, 3), first_call_s=round(compile_s, 1))
            if with_plain:
                if name == "vs":   # plain flex must estimate and build its mask every call too
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
    """Short lengths: reference (SDPA + materialised mask) vs flex sparse vs SDPA causal, a_shape fwd."""
    p = SparsityPattern(type="a_shape", sinks=128, window=1024, block_size=BS)
    for S in lengths:
        q, k, v = make_inputs(S, structured=False)
        row = dict(S=S, pattern="a_shape_1024", mode="fwd",
                   reference_ms=round(timeit(lambda: sparse_attention(q, k, v, p, backend="reference")), 3),
                   flex_ms=round(timeit(lambda: sparse_attention(q, k, v, p, backend="flex")), 3),
                   sdpa_ms=round(timeit(lambda: sdpa_causal(q, k, v)), 3))
        record(out, row)


def sweep_kernel_options(S, out):
    """Flex tile shapes for a_shape at one length, fwd+bwd: what the defaults leave on the table."""
    p = PATTERNS["a_shape"]
    q, k, v = (t.requires_grad_() for t in make_inputs(S, structured=False))
    do = torch.randn_like(q)

    def step():
        sparse_attention(q, k, v, p, backend="flex").backward(do)

    for opts in (None, {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_stages": 3, "num_warps": 4},
                 {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_stages": 3, "num_warps": 8},
                 {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_stages": 2, "num_warps": 8}):
        sa_mod.FLEX_KERNEL_OPTIONS = opts
        sa_mod._compiled_flex = None
        try:
            ms = timeit(step)
            record(out, dict(S=S, pattern="a_shape", mode="fwdbwd", kernel_options=opts, ours_ms=round(ms, 3)))
        except Exception as e:  # a tile shape the template rejects is a result too
            record(out, dict(S=S, pattern="a_shape", mode="fwdbwd", kernel_options=opts, error=str(e)[:200]))
    sa_mod.FLEX_KERNEL_OPTIONS = None
    sa_mod._compiled_flex = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16384,32768,65536,131072")
    ap.add_argument("--patterns", default="a_shape,bigbird,vs")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-FlexAttention baseline")
    ap.add_argument("--crossover", default="", help="short lengths for the dense crossover, e.g. 1024,2048,4096")
    ap.add_argument("--sweep", type=int, default=0, help="length for a flex tile-shape sweep (0 = none)")
    ap.add_argument("--out", default="bench_attention.jsonl")
    a = ap.parse_args()
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                          triton=__import__("triton").__version__, cuda=torch.version.cuda)), flush=True)
    for S in (int(x) for x in a.lengths.split(",") if x):
        bench_length(S, a.patterns.split(","), a.modes.split(","), not a.no_plain, a.out)
    if a.crossover:
        bench_crossover([int(x) for x in a.crossover.split(",")], a.out)
    if a.sweep:
        sweep_kernel_options(a.sweep, a.out)


if __name__ == "__main__":
    main()
