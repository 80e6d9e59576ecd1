"""The FP8 expert quantizers (``kernels/moe_fp8.py``) alone, at the Mixtral layer's operands,
against the copy bandwidth of the same GPU: which tile shapes of the two passes (amax, then cast)
run nearest the bytes.

    python bench/fp8_quant.py [--reps 20] [--out results.json] [--best FILE]

Operands (bf16, Mixtral shape T 16384, k 2: R = 32768 expert rows, E 8 groups of random sizes):
``x`` [R, 4096] and ``h`` [R, 14336] by rows and per group column (``quantize_dual_triton``: the
forward / dgrad operand and the wgrad operand), ``dy_cols`` [R, 4096] per group column only
(``quantize_groups_t_triton``), and an expert weight [8, 14336, 4096] in bf16 and float32 by output
and by input channel (``quantize_weight_dual_triton``, the forward and dgrad operands).

For each operand, every pair of an amax tile and a cast tile from AMAX_TILES x CAST_TILES (rows,
columns, warps) is checked bit for bit against the default tiles' output and timed (median of
CUDA-event timings). Bytes: the amax pass reads the operand, the cast pass reads it again and writes
1 byte per element per layout; "vs copy" is that byte count at the rate of ``torch.clone`` of the
operand (read + write) on this GPU, over the measured time (1.0 = the quantizer moves its bytes as
fast as a copy does). ``--best FILE`` writes the pair with the least total time over all operands,
as ``--fp8-tiles`` of ``bench/moe.py`` takes it (``ar,ac,aw;cr,cc,cw``).
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
from moezoo.configs import exit_code  # noqa: E402
from moezoo.configs.errors import check  # noqa: E402
from moezoo.kernels import moe_fp8 as f  # noqa: E402

AMAX_TILES = [(128, 64, 16), (128, 64, 8), (64, 64, 4), (32, 128, 4)]
CAST_TILES = [(128, 64, 16), (128, 64, 8), (64, 64, 4), (32, 128, 4), (64, 128, 8)]


def operands(gen: torch.Generator) -> dict:
    """name -> (launcher: tiles (None: the defaults) -> the quantizer's outputs, the operand, bytes
    the two passes move per element)."""
    R, E = 32768, 8
    sizes = torch.distributions.Dirichlet(torch.full((E,), 4.0)).sample() * R
    offs = sizes.cumsum(0).round().int().clamp(max=R)
    offs[-1] = R
    offs = offs.cuda()
    pends = f.padded_group_ends(offs)
    P = f.padded_rows(R, E)
    out = {}
    for name, cols in (("x", 4096), ("h", 14336)):
        t = torch.randn(R, cols, generator=gen, device="cuda").bfloat16()
        out[name] = (
            lambda tiles, t=t: f._quantize_tiles(t, offs, pends, 0, P, True, f.FP8, tiles),
            t,
            2 + 2 + 2,
        )
    t = torch.randn(R, 4096, generator=gen, device="cuda").bfloat16()
    out["dy_cols"] = (
        lambda tiles, t=t: f._quantize_tiles(t, offs, pends, 0, P, False, f.FP8, tiles),
        t,
        2 + 2 + 1,
    )
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        w = torch.randn(E, 14336, 4096, generator=gen, device="cuda").to(dtype)
        out[f"w_{str(dtype)[6:]}"] = (
            lambda tiles, w=w: f._quantize_tiles(
                w.view(-1, 4096), None, None, 14336, 0, True, f.FP8, tiles
            ),
            w,
            size + size + 2,
        )
    return out


def tiles_key(amax, cast) -> str:
    """The pair as ``--fp8-tiles`` of bench/moe.py takes it: ``ar,ac,aw;cr,cc,cw``."""
    return f"{','.join(map(str, amax))};{','.join(map(str, cast))}"


def same(a, b) -> bool:
    return all(
        (x is None and y is None)
        or torch.equal(
            x.view(torch.uint8) if x.dtype == f.FP8 else x,
            y.view(torch.uint8) if y.dtype == f.FP8 else y,
        )
        for x, y in zip(a, b)
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--best", default=None)
    args = ap.parse_args()
    check(args.reps > 0, "--reps", f"must be > 0, got {args.reps}")
    check(
        torch.cuda.is_available(),
        "device",
        "bench/fp8_quant.py times CUDA kernels: no CUDA device here",
    )
    import triton

    torch.manual_seed(0)  # the group sizes
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {
        "env": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "default": [f.AMAX_TILE, f.CAST_TILE],
        "operands": {},
    }
    totals: dict = {}
    for name, (run, t, bytes_per_elem) in operands(gen).items():
        copy_ms = timeit(lambda: t.clone(), reps=args.reps)
        copy_rate = 2 * t.numel() * t.element_size() / copy_ms  # bytes per ms
        ideal = bytes_per_elem * t.numel() / copy_rate
        want = run(None)
        rows = {}
        for amax, cast in itertools.product(AMAX_TILES, CAST_TILES):
            key = tiles_key(amax, cast)
            try:
                ok = same(run((amax, cast)), want)
                ms = timeit(lambda: run((amax, cast)), reps=args.reps)
            except Exception as e:  # a tile that does not compile here is reported
                rows[key] = {"error": f"{type(e).__name__}: {e}"[:200]}
                continue
            rows[key] = {"ms": ms, "vs_copy": ideal / ms, "equal": ok}
            totals[key] = totals.get(key, 0.0) + (ms if ok else float("inf"))
        best = min((r["ms"], k) for k, r in rows.items() if "ms" in r)
        dflt = rows.get(tiles_key(f.AMAX_TILE, f.CAST_TILE), {})
        res["operands"][name] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype),
            "copy_ms": copy_ms,
            "ideal_ms": ideal,
            "tiles": rows,
        }
        print(
            f"{name:8s} {str(tuple(t.shape)):20s} copy {copy_ms:6.3f} ms  "
            f"at copy rate {ideal:6.3f} ms  "
            f"default {dflt.get('ms', float('nan')):6.3f} ms  best {best[0]:6.3f} ms ({best[1]})",
            flush=True,
        )
        bad = [k for k, r in rows.items() if r.get("equal") is False or "error" in r]
        if bad:
            print(f"  differs from the default or failed: {bad}", flush=True)
    ranked = sorted(totals.items(), key=lambda kv: kv[1])
    res["ranked_total_ms"] = ranked
    print(
        "total over the operands, best 8:", *(f"  {k}: {v:.3f} ms" for k, v in ranked[:8]), sep="\n"
    )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    if args.best:
        with open(args.best, "w") as fh:
            fh.write(ranked[0][0])


if __name__ == "__main__":
    sys.exit(exit_code(main))
