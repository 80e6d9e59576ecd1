"""The FP8 expert quantizers (``kernels/moe_fp8.py``) alone, at the Mixtral layer's operands, against the
copy bandwidth of the same GPU: which tile shapes of the two passes (amax, then cast) run nearest the bytes.

    python bench/fp8_quant.py [--reps 20] [--out results.json] [--best FILE]

Operands (bf16, Mixtral shape T 16384, k 2: R = 32768 expert rows, E 8 groups of random sizes):
``x`` [R, 4096] and ``h`` [R, 14336] by rows and per group column (``quantize_dual_triton``: the forward /
dgrad operand and the wgrad operand), ``dy_cols`` [R, 4096] per group column only
(``quantize_groups_t_triton``), and an expert weight [8, 14336, 4096] in bf16 and float32 by output and by
input channel (``quantize_weight_dual_triton``, the forward and dgrad operands).

For each operand, every pair of an amax tile and a cast tile from AMAX_TILES x CAST_TILES (rows, columns,
warps) is checked bit for bit against the default tiles' output and timed (median of CUDA-event timings).
Bytes: the amax pass reads the operand, the cast pass reads it again and writes 1 byte per element per
layout; "vs copy" is that byte count at the rate of ``torch.clone`` of the operand (read + write) on this
GPU, over the measured time (1.0 = the quantizer moves its bytes as fast as a copy does).
``--best FILE`` writes the pair with the least total time over all operands, as ``--fp8-tiles`` of
``bench/moe.py`` takes it (``ar,ac,aw;cr,cc,cw``), followed by ``;sr,sc,sw``, the fastest SwiGLU tile.

``--parts swiglu`` (of ``quant,swiglu``, both by default): the SwiGLU that hands its FP8 amax on
(kernels.moe_swiglu ``*_amax``, then the cast pass alone, ``fp8_cast_dual``) against the plain SwiGLU
kernel then the whole dual pass, forward (h) and backward (da, db), at the h operand's shape with a row
scale, for each tile of SWIGLU_TILES (rows, columns, warps of the forward; the backward twice the warps);
each checked bit for bit against the unfused outputs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import timeit  # noqa: E402
from configs import exit_code  # noqa: E402
from configs.errors import check, choice_list  # noqa: E402
from kernels import moe_fp8 as f  # noqa: E402

AMAX_TILES = [(128, 64, 16), (128, 64, 8), (64, 64, 4), (32, 128, 4)]
CAST_TILES = [(128, 64, 16), (128, 64, 8), (64, 64, 4), (32, 128, 4), (64, 128, 8)]
SWIGLU_TILES = [(32, 128, 4), (64, 64, 4), (16, 256, 4), (32, 64, 4), (64, 128, 4)]
R_ROWS, E_GROUPS = 32768, 8     # Mixtral shape: T 16384 x k 2 expert rows, 8 experts


def group_ends(gen: torch.Generator):
    """Random group sizes (Dirichlet, as routing gives) -> (offs, pends, P) on the GPU."""
    sizes = torch.distributions.Dirichlet(torch.full((E_GROUPS,), 4.0)).sample() * R_ROWS
    offs = sizes.cumsum(0).round().int().clamp(max=R_ROWS)
    offs[-1] = R_ROWS
    offs = offs.cuda()
    return offs, f.padded_group_ends(offs), f.padded_rows(R_ROWS, E_GROUPS)


def operands(gen: torch.Generator) -> dict:
    """name -> (launcher: tiles (None: the defaults) -> the quantizer's outputs, the operand, bytes the two
    passes move per element)."""
    R, E = R_ROWS, E_GROUPS
    offs, pends, P = group_ends(gen)
    out = {}
    for name, cols in (("x", 4096), ("h", 14336)):
        t = torch.randn(R, cols, generator=gen, device="cuda").bfloat16()
        out[name] = (lambda tiles, t=t: f._quantize_tiles(t, offs, pends, 0, P, True, f.FP8, tiles), t, 2 + 2 + 2)
    t = torch.randn(R, 4096, generator=gen, device="cuda").bfloat16()
    out["dy_cols"] = (lambda tiles, t=t: f._quantize_tiles(t, offs, pends, 0, P, False, f.FP8, tiles), t, 2 + 2 + 1)
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        w = torch.randn(E, 14336, 4096, generator=gen, device="cuda").to(dtype)
        out[f"w_{str(dtype)[6:]}"] = (lambda tiles, w=w: f._quantize_tiles(w.view(-1, 4096), None, None, 14336, 0, True,
                                                                           f.FP8, tiles), w, size + size + 2)
    return out


def tiles_key(amax, cast) -> str:
    """The pair as ``--fp8-tiles`` of bench/moe.py takes it: ``ar,ac,aw;cr,cc,cw``."""
    return f"{','.join(map(str, amax))};{','.join(map(str, cast))}"


def same(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(x.view(torch.uint8) if x.dtype == f.FP8 else x,
                                                        y.view(torch.uint8) if y.dtype == f.FP8 else y)
               for x, y in zip(a, b))


def swiglu_part(gen: torch.Generator, reps: int) -> tuple[dict, str]:
    """The SwiGLU with the amax handed on vs the plain one + the whole dual pass -> (results, best tile key)."""
    from kernels import moe_swiglu as sw
    offs, pends, P = group_ends(gen)
    H = 14336
    a, b, dh = (torch.randn(R_ROWS, H, generator=gen, device="cuda").bfloat16() for _ in range(3))
    scale = torch.rand(R_ROWS, generator=gen, device="cuda")
    n = int(pends[-1])

    def dual(t):
        q, d, qt, dt = f.quantize_dual_triton(t, offs, pends, P)
        return [t, q, d, qt[:, :n], dt]          # qt past the last padded group is unspecified

    def cast(t, amax):
        q, d, qt, dt = f.cast_dual_triton(t, offs, pends, P, amax)
        return [t, q, d, qt[:, :n], dt]
    runs = {"fwd": (lambda: dual(sw.swiglu_rows_fwd(a, b, scale)),
                    lambda: cast(*sw.swiglu_amax_rows_fwd(a, b, scale, offs))),
            "bwd": (lambda: [x for t in sw.swiglu_rows_bwd(dh, a, b, scale)[:2] for x in dual(t)],
                    lambda: (lambda r: cast(r[0], r[3]) + cast(r[1], r[4]))(sw.swiglu_amax_rows_bwd(dh, a, b, scale, offs)))}
    default = sw.AMAX_TILE
    res, totals = {"default": default}, {}
    for way, (unfused, fused) in runs.items():
        want = unfused()
        res[way] = {"unfused_ms": timeit(unfused, reps=reps), "tiles": {}}
        for tile in SWIGLU_TILES:
            sw.AMAX_TILE = tile
            key = ",".join(map(str, tile))
            ok = same(fused(), want)
            ms = timeit(fused, reps=reps)
            res[way]["tiles"][key] = {"ms": ms, "equal": ok}
            totals[key] = totals.get(key, 0.0) + ms
        sw.AMAX_TILE = default
        best = min((r["ms"], k) for k, r in res[way]["tiles"].items())
        dflt = res[way]["tiles"][",".join(map(str, default))]["ms"]
        print(f"swiglu {way}: plain + dual pass {res[way]['unfused_ms']:.3f} ms, with the amax + cast pass: default "
              f"{dflt:.3f} ms, best {best[0]:.3f} ms ({best[1]}); equal: "
              f"{[k for k, r in res[way]['tiles'].items() if r['equal']]}", flush=True)
    best = min(totals, key=totals.get)
    res["ranked_total_ms"] = sorted(totals.items(), key=lambda kv: kv[1])
    return res, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--best", default=None)
    ap.add_argument("--parts", default="quant,swiglu", help="comma list of quant, swiglu")
    args = ap.parse_args()
    check(args.reps > 0, "--reps", f"must be > 0, got {args.reps}")
    parts = choice_list(args.parts, ("quant", "swiglu"), "--parts")
    check(torch.cuda.is_available(), "device", "bench/fp8_quant.py times CUDA kernels: no CUDA device here")
    import triton
    torch.manual_seed(0)                                  # the group sizes
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__},
           "default": [f.AMAX_TILE, f.CAST_TILE], "operands": {}}
    totals: dict = {}
    if "quant" in parts:
        for name, (run, t, bytes_per_elem) in operands(gen).items():
            copy_ms = timeit(lambda: t.clone(), reps=args.reps)
            copy_rate = 2 * t.numel() * t.element_size() / copy_ms       # bytes per ms
            ideal = bytes_per_elem * t.numel() / copy_rate
            want = run(None)
            rows = {}
            for amax, cast in itertools.product(AMAX_TILES, CAST_TILES):
                key = tiles_key(amax, cast)
                try:
                    ok = same(run((amax, cast)), want)
                    ms = timeit(lambda: run((amax, cast)), reps=args.reps)
                except Exception as e:                        # a tile that does not compile here is reported
                    rows[key] = {"error": f"{type(e).__name__}: {e}"[:200]}
                    continue
                rows[key] = {"ms": ms, "vs_copy": ideal / ms, "equal": ok}
                totals[key] = totals.get(key, 0.0) + (ms if ok else float("inf"))
            top = min((r["ms"], k) for k, r in rows.items() if "ms" in r)
            dflt = rows.get(tiles_key(f.AMAX_TILE, f.CAST_TILE), {})
            res["operands"][name] = {"shape": list(t.shape), "dtype": str(t.dtype), "copy_ms": copy_ms,
                                     "ideal_ms": ideal, "tiles": rows}
            print(f"{name:8s} {str(tuple(t.shape)):20s} copy {copy_ms:6.3f} ms  at copy rate {ideal:6.3f} ms  "
                  f"default {dflt.get('ms', float('nan')):6.3f} ms  best {top[0]:6.3f} ms ({top[1]})", flush=True)
            bad = [k for k, r in rows.items() if r.get("equal") is False or "error" in r]
            if bad:
                print(f"  differs from the default or failed: {bad}", flush=True)
        ranked = sorted(totals.items(), key=lambda kv: kv[1])
        res["ranked_total_ms"] = ranked
        print("total over the operands, best 8:", *(f"  {k}: {v:.3f} ms" for k, v in ranked[:8]), sep="\n")
    best = ranked[0][0] if totals else tiles_key(f.AMAX_TILE, f.CAST_TILE)
    if "swiglu" in parts:
        res["swiglu"], best_swiglu = swiglu_part(gen, args.reps)
        best += ";" + best_swiglu
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    if args.best:
        with open(args.best, "w") as fh:
            fh.write(best)


if __name__ == "__main__":
    sys.exit(exit_code(main))
