"""Dynamic sparse training cost on one GPU: step time, peak memory and optimizer state of a ~1B
LLaMA-style model with DST (dense or compact state) against dense, the mask-update cost, and the 2:4
FFN path against torchao's. Quality of the schedules: bench/train_dst.py.

    python bench/dst.py --out dst.json [--variants rigl_erk80,rigl_erk80_compact,...] [--skip-semi]
    python bench/dst.py --smoke --out /tmp/dst.json       # CPU, tiny model: checks the script

1B model: TinyLlama-1.1B shape (dim 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632, vocab 32000)
built with zoo.build_model, fp32 master weights, bf16 autocast, fused AdamW (CompactAdamW for
``*_compact``), batch 8 x 2048 tokens. Per variant (bench_1b): ``step_ms`` (fwd + bwd + optimizer
step + ``dst.step`` without an update, median, CUDA events), ``step_peak_gb``, ``optimizer_gb``,
``dst_buffers_gb``; the mask update's extra time amortised over ``update_every`` as a share of the
step. 2:4 path (bench_semi): one LLaMA-7B SwiGLU FFN (4096 -> 11008 -> 4096), 16384 tokens, bf16,
fwd+bwd: dense vs ours (kernels.semi_sparse_linear) vs torchao.sparsity.training (when installed).
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

from moezoo.configs import ModelConfig  # noqa: E402
from moezoo.kernels.semi_sparse_linear import SemiSparseLinear  # noqa: E402
from moezoo.layers import DynamicSparsity  # noqa: E402
from moezoo.layers.dst.masks import transposable_nm_select  # noqa: E402
from moezoo.training.optim import CompactAdamW  # noqa: E402
from moezoo.zoo import build_model  # noqa: E402

ONE_B = ModelConfig(
    vocab_size=32000,
    dim=2048,
    n_layers=22,
    n_heads=32,
    n_kv_heads=4,
    ffn_hidden=5632,
    max_seq_len=2048,
)
VARIANTS = {
    "rigl_erk80": dict(sparsity=0.8, method="rigl", distribution="erk"),
    "rigl_erk80_compact": dict(sparsity=0.8, method="rigl", distribution="erk", compact_state=True),
    "rigl_erk80_ema_compact": dict(
        sparsity=0.8, method="rigl", distribution="erk", grad_ema=0.1, compact_state=True
    ),
    "rigl_erk80_ema": dict(sparsity=0.8, method="rigl", distribution="erk", grad_ema=0.1),
    "set_erk80": dict(sparsity=0.8, method="set", distribution="erk"),
    "rigl_block1x128": dict(
        sparsity=0.8, method="rigl", distribution="uniform", granularity="block", block=[1, 128]
    ),
    "rigl_2to4": dict(sparsity=0.5, method="rigl", granularity="nm", n=2, m=4),
    "rigl_2to4_transposable": dict(
        sparsity=0.5, method="rigl", granularity="nm", n=2, m=4, transposable=True
    ),
}


def cuda_ms(fn) -> float:
    if not torch.cuda.is_available():  # --smoke on CPU: wall clock
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _mem():
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _peak_reset():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak():
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def optimizer_state_bytes(opt) -> int:
    """Bytes the optimizer keeps between steps: its state tensors, plus CompactAdamW's active
    indices."""
    n = sum(
        v.untyped_storage().nbytes()
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )
    n += sum(c.idx.numel() * c.idx.element_size() for c in getattr(opt, "_compact", {}).values())
    return n


def bench_1b(variants, batch, seq, steps, update_every, mcfg=ONE_B, dev="cuda"):
    """Per variant: ``step_ms`` = fwd + bwd + optimizer step + ``dst.step`` (no update) against
    dense; ``step_peak_gb`` = peak allocated during one such step; ``optimizer_gb`` = optimizer
    state (+ indices); ``dst_buffers_gb`` = DST's buffers; the mask update amortised over
    ``update_every`` steps."""
    results = []
    x = torch.randint(0, mcfg.vocab_size, (batch, seq + 1), device=dev)
    tokens, targets = x[:, :-1], x[:, 1:]

    def train(model, opt):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            loss, _ = model.loss(tokens, targets)
        loss.backward()
        opt.step()

    for name in ["dense", *variants]:
        torch.manual_seed(0)
        model = build_model(mcfg, device=dev)
        opts = VARIANTS.get(name, {})
        Opt = CompactAdamW if opts.get("compact_state") else torch.optim.AdamW
        opt = Opt(model.parameters(), lr=1e-4, fused=dev == "cuda")
        r = {"variant": name, "params": sum(p.numel() for p in model.parameters())}
        dst = None
        if name != "dense":
            before = _mem()
            t0 = time.perf_counter()
            dst = DynamicSparsity(
                model,
                opt,
                total_steps=100 * update_every,
                update_every=update_every,
                stop_fraction=1.0,
                **opts,
            )
            if dev == "cuda":
                torch.cuda.synchronize()
            r["setup_s"] = time.perf_counter() - t0
            masked = sum(t.numel for t in dst.targets)
            r["masked_weights"] = masked
            r["dst_buffers_gb"] = (_mem() - before) / 1e9
            r["dst_bytes_per_masked_weight"] = (_mem() - before) / masked

        def step(i):
            train(model, opt)
            if dst is not None:
                dst.step(i)  # i < update_every: no update
            opt.zero_grad(set_to_none=True)

        step(1)  # optimizer state exists from here
        t_step, peaks = [], []
        for i in range(steps):
            base = _mem()
            _peak_reset()
            t_step.append(cuda_ms(lambda: step(i + 2)))
            peaks.append(_peak() - base)
        r["step_ms"] = median(t_step)
        r["resident_gb"] = _mem() / 1e9
        r["step_peak_gb"] = (_mem() + max(peaks)) / 1e9
        r["optimizer_gb"] = optimizer_state_bytes(opt) / 1e9
        if dst is not None:
            # dst.step alone, no update
            per = median([cuda_ms(lambda: dst.step(3)) for _ in range(3)])
            train(model, opt)  # grads present for the update's scores
            t_upd = []
            for j in (1, 2, 3):
                t_upd.append(cuda_ms(lambda: dst.step(j * update_every)))
            opt.zero_grad(set_to_none=True)
            r["dst_step_ms"] = per
            r["update_ms"] = median(t_upd)
            r["amortised_share"] = (r["update_ms"] - per) / update_every / r["step_ms"]
            r["density"] = dst.stats()["density"]
        print(json.dumps(r), flush=True)
        results.append(r)
        del model, opt, dst
        if dev == "cuda":
            torch.cuda.empty_cache()
    dense = results[0]
    for r in results[1:]:
        r["step_vs_dense"] = r["step_ms"] / dense["step_ms"]
        r["optimizer_vs_dense"] = r["optimizer_gb"] / dense["optimizer_gb"]
        r["peak_vs_dense"] = (
            r["step_peak_gb"] / dense["step_peak_gb"] if dense["step_peak_gb"] else None
        )
    return results


def _torchao_sparsify():
    """torchao's semi-structured training path (``torchao.sparsity.training``), or None when not
    installed."""
    try:
        from torchao.sparsity.training.autograd import semi_structured_sparsify

        return semi_structured_sparsify
    except ImportError:
        return None


def bench_semi(tokens=16384, dim=4096, hidden=11008):
    """One LLaMA-7B SwiGLU FFN (w1, w3 [H, D], w2 [D, H], transposable 2:4 weights, bf16),
    ``tokens`` x D input, fwd + bwd: dense ``F.linear`` vs ours (``SemiSparseLinear``, plain and
    transposable) vs torchao (``semi_structured_sparsify`` then ``F.linear``, cuSPARSELt and CUTLASS
    backends)."""
    torch.manual_seed(0)

    def weight(o, i):
        w = torch.randn(o, i, device="cuda") * 0.02
        w = w * transposable_nm_select(w.abs().view(1, o, i), 2, 4).view(o, i)
        return w.bfloat16().requires_grad_()

    w1, w3, w2 = weight(hidden, dim), weight(hidden, dim), weight(dim, hidden)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    sparsify = _torchao_sparsify()
    linears = {
        "dense": F.linear,
        "ours": lambda a, w: SemiSparseLinear.apply(a, w, torch.bfloat16, False),
        "ours_transposable": lambda a, w: SemiSparseLinear.apply(a, w, torch.bfloat16, True),
    }
    if sparsify is not None:
        linears["torchao_cusparselt"] = lambda a, w: F.linear(a, sparsify(w, backend="cusparselt"))
        linears["torchao_cutlass"] = lambda a, w: F.linear(a, sparsify(w, backend="cutlass"))
    r = {"tokens": tokens, "dim": dim, "hidden": hidden, "torchao": sparsify is not None}
    ref = None
    for name, lin in linears.items():

        def ffn():
            return lin(F.silu(lin(x, w1)) * lin(x, w3), w2)

        def fwd_bwd():
            ffn().backward(g)

        try:
            for _ in range(3):
                fwd_bwd()
            r[f"{name}_ms"] = median([cuda_ms(fwd_bwd) for _ in range(10)])
            with torch.no_grad():
                y = ffn().float()
                ref = y if ref is None else ref
                r[f"{name}_rel_err"] = ((y - ref).norm() / ref.norm()).item()
        except Exception as e:  # report, don't crash: the kernels are shape/arch dependent
            r[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for name in linears:
        if f"{name}_ms" in r and name != "dense":
            r[f"{name}_speedup"] = r["dense_ms"] / r[f"{name}_ms"]
    print(json.dumps(r), flush=True)
    return r


def bench_apply():
    """The per-step mask re-application over the 1B model's masked weight shapes (fp32 W, bool
    mask), done several ways; ``dst.step`` uses ``masked_fill_`` with the mask's negation computed
    per layer."""
    d, h, kv = ONE_B.dim, ONE_B.hidden_dim, ONE_B.kv_heads * ONE_B.head_dim
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (h, d), (h, d), (d, h)] * ONE_B.n_layers
    ws = [torch.randn(s, device="cuda") for s in shapes]
    ms = [torch.rand(s, device="cuda") < 0.2 for s in shapes]
    inv = [~m for m in ms]
    ways = {
        "loop_mul_bool": lambda: [w.mul_(m) for w, m in zip(ws, ms)],
        "foreach_mul_bool": lambda: torch._foreach_mul_(ws, ms),
        "loop_masked_fill_inverted": lambda: [w.masked_fill_(i, 0.0) for w, i in zip(ws, inv)],
        "loop_masked_fill_not": lambda: [
            w.masked_fill_(m.logical_not(), 0.0) for w, m in zip(ws, ms)
        ],
    }
    n = sum(w.numel() for w in ws)
    r = {"weights": n}
    for name, fn in ways.items():
        try:
            for _ in range(2):
                fn()
            t = median([cuda_ms(fn) for _ in range(7)])
            r[name + "_ms"] = t
            r[name + "_GBps"] = n * 9 / t / 1e6  # 4 B read + 4 B write + 1 B mask
        except Exception as e:
            r[name + "_error"] = f"{type(e).__name__}: {str(e)[:150]}"
    print(json.dumps(r), flush=True)
    del ws, ms, inv
    torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="dst.json")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--update-every", type=int, default=100)
    ap.add_argument("--skip-semi", action="store_true")
    ap.add_argument("--skip-apply", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, a tiny model, the 1B section only (checks the script)",
    )
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    if a.smoke:
        tiny = ModelConfig(
            vocab_size=256,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_hidden=128,
            max_seq_len=64,
        )
        res = {"one_b": bench_1b(variants, 2, 32, 2, 4, tiny, "cpu")}
    else:
        res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        if not a.skip_apply:
            res["apply"] = bench_apply()
        if not a.skip_semi:
            res["semi_structured"] = bench_semi()
        res["one_b"] = bench_1b(variants, a.batch, a.seq, a.steps, a.update_every)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
