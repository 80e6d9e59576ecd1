"""The fused AdamW pass of ``train.param_dtype: bfloat16`` (``kernels/adamw.py``) alone, against the
copy bandwidth of the same GPU and torch's fused AdamW on float32 parameters: which block size and
warp count stream nearest the bytes.

    python bench/adamw.py [--tensors 8] [--numel 134217728] [--reps 10] [--out results.json]

The tensors stand for the expert weights of the OLMoE-shaped model of BENCHMARKS.md (64 x 2048 x
1024 = 134M elements each, 8 of them: 1.07B weights, 17 GB with their state). Per weight the pass
reads the bf16 gradient, the float32 master and both moments and writes the master, the moments and
the bf16 copy: 28 bytes. "vs copy" is that byte count at the rate of ``torch.clone`` of one float32
master (read + write), over the measured time (1.0: as fast as a copy moves bytes). ``torch_fused``
is torch.optim.AdamW(fused=True) over float32 weights with float32 gradients (torchtitan's
optimizer: 16 bytes read, 12 written a weight).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import timeit  # noqa: E402
from moezoo.configs import exit_code  # noqa: E402
from moezoo.configs.errors import check  # noqa: E402
from moezoo.kernels import adamw as A  # noqa: E402

CONFIGS = [(2048, 8), (1024, 4), (4096, 8), (2048, 4), (4096, 16), (1024, 8), (8192, 16)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--numel", type=int, default=64 * 2048 * 1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for key in ("tensors", "numel", "reps"):
        check(getattr(args, key) > 0, f"--{key}", f"must be > 0, got {getattr(args, key)}")
    check(
        torch.cuda.is_available(),
        "device",
        "bench/adamw.py times CUDA kernels: no CUDA device here",
    )
    import triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = args.numel, args.tensors
    masters = [torch.randn(n, generator=gen, device="cuda") for _ in range(k)]
    grads = [torch.randn(n, generator=gen, device="cuda").bfloat16() for _ in range(k)]
    m = [torch.zeros(n, device="cuda") for _ in range(k)]
    v = [torch.rand(n, generator=gen, device="cuda") for _ in range(k)]
    params = [w.bfloat16() for w in masters]
    copy_ms = timeit(lambda: masters[0].clone(), reps=args.reps)
    rate = 2 * 4 * n / copy_ms  # bytes per ms
    ideal = 28 * n * k / rate
    res = {
        "env": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "tensors": k,
        "numel": n,
        "copy_ms_one_master": copy_ms,
        "ideal_ms": ideal,
        "default": [A.BLOCK, A.NUM_WARPS],
        "configs": {},
    }
    print(
        f"{k} x {n} weights: at the copy rate ({rate / 1e9:.2f} TB/s) "
        f"28 B a weight take {ideal:.2f} ms",
        flush=True,
    )
    # decay, beta1, beta2, eps, step size, sqrt(bc2)
    hp = (1 - 1e-3 * 0.1, 0.9, 0.95, 1e-8, 1e-3, 0.3)
    scale = torch.tensor(0.5, device="cuda")
    for block, warps in CONFIGS:
        ms = timeit(
            lambda: A._adamw_triton(
                masters, grads, m, v, params, *hp, scale, block=block, num_warps=warps
            ),
            reps=args.reps,
        )
        res["configs"][f"{block},{warps}"] = {"ms": ms, "vs_copy": ideal / ms}
        print(
            f"  BLOCK {block:5d} warps {warps:2d}: {ms:7.2f} ms  "
            f"{28 * n * k / ms / 1e9:5.2f} TB/s  vs copy {ideal / ms:.2f}",
            flush=True,
        )
    del params, grads
    # torch's fused AdamW over float32 weights and float32 gradients, one launch set for all tensors
    ws = [torch.nn.Parameter(t) for t in masters]
    for w in ws:
        w.grad = torch.randn(n, generator=gen, device="cuda")
    opt = torch.optim.AdamW(ws, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ms = timeit(opt.step, reps=args.reps)
    res["torch_fused_fp32"] = {"ms": ms, "tb_s": 28 * n * k / ms / 1e9}
    print(
        f"  torch.optim.AdamW(fused=True), float32 weights and gradients: {ms:7.2f} ms  "
        f"{28 * n * k / ms / 1e9:5.2f} TB/s",
        flush=True,
    )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    sys.exit(exit_code(main))
