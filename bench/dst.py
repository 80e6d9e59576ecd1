"""Dynamic sparse training cost on one GPU: mask-update and per-step overhead on a ~1B LLaMA-style model,
memory per masked weight, the 2:4 semi-structured path, and a small dense vs 80% ERK-RigL quality run.

    python bench/dst.py --out dst.json [--variants rigl_erk80,...] [--quality-steps 1200] [--skip-quality]

1B model: TinyLlama-1.1B shape (dim 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632, vocab 32000) built
with zoo.build_model, fp32 master weights, bf16 autocast, fused AdamW, batch 8 x 2048 tokens.
Per variant: ``train`` = fwd + bwd + optimizer step (median, CUDA events); ``per_step`` = ``dst.step``
at a step with no update (re-applies the masks); ``update`` = ``dst.step`` at an update step (scores,
top-k per layer / expert, moment reset); ``amortised`` = ``(update - per_step) / update_every`` as a
share of ``train``. Memory: bytes per masked weight of the buffers DST adds (allocated before/after
construction) and the transient peak during an update.
2:4 path: one FFN linear (16384 tokens, bf16), fwd+bwd, ``F.linear`` on the masked weight vs
``SemiSparseLinear`` (cuSPARSELt/CUTLASS), plain and transposable.
Quality: a ~10M-parameter model on the bytes of this interpreter's standard library (vocab 256, no
tokenizer), dense vs 80% ERK-RigL at equal tokens, validation loss on held-out files.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import ModelConfig  # noqa: E402
from layers import DynamicSparsity  # noqa: E402
from layers.dst.masks import transposable_nm_select  # noqa: E402
from kernels.semi_sparse_linear import SemiSparseLinear  # noqa: E402
from zoo import build_model  # noqa: E402

ONE_B = ModelConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
                    max_seq_len=2048)
VARIANTS = {
    "rigl_erk80": dict(sparsity=0.8, method="rigl", distribution="erk"),
    "rigl_erk80_ema": dict(sparsity=0.8, method="rigl", distribution="erk", grad_ema=0.1),
    "set_erk80": dict(sparsity=0.8, method="set", distribution="erk"),
    "rigl_block1x128": dict(sparsity=0.8, method="rigl", distribution="uniform", granularity="block", block=[1, 128]),
    "rigl_2to4": dict(sparsity=0.5, method="rigl", granularity="nm", n=2, m=4),
    "rigl_2to4_transposable": dict(sparsity=0.5, method="rigl", granularity="nm", n=2, m=4, transposable=True),
}


def cuda_ms(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def bench_1b(variants, batch, seq, steps, update_every):
    results = []
    x = torch.randint(0, ONE_B.vocab_size, (batch, seq + 1), device="cuda")
    tokens, targets = x[:, :-1], x[:, 1:]

    def train(model, opt):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model.loss(tokens, targets)
        loss.backward()
        opt.step()

    for name in ["dense", *variants]:
        torch.manual_seed(0)
        model = build_model(ONE_B, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        n_params = sum(p.numel() for p in model.parameters())
        r = {"variant": name, "params": n_params}
        train(model, opt)                                          # allocate optimizer state first
        torch.cuda.synchronize()
        dst = None
        if name != "dense":
            before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            dst = DynamicSparsity(model, opt, total_steps=100 * update_every, update_every=update_every,
                                  stop_fraction=1.0, **VARIANTS[name])
            torch.cuda.synchronize()
            r["setup_s"] = time.perf_counter() - t0
            masked = sum(t.numel for t in dst.targets)
            r["masked_weights"] = masked
            r["bytes_per_masked_weight"] = (torch.cuda.memory_allocated() - before) / masked
        t_train, t_step = [], []
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            t_train.append(cuda_ms(lambda: train(model, opt)))
            if dst is not None:
                t_step.append(cuda_ms(lambda: dst.step(i + 1)))      # i + 1 < update_every: no update
        r["train_ms"] = median(t_train[1:])
        if dst is not None:
            r["per_step_ms"] = median(t_step[1:])
            t_upd, peaks = [], []
            for j in (1, 2, 3):
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                t_upd.append(cuda_ms(lambda: dst.step(j * update_every)))
                peaks.append(torch.cuda.max_memory_allocated() - base)
            r["update_ms"] = median(t_upd)
            r["update_peak_extra_mb"] = max(peaks) / 2 ** 20
            r["amortised_ms"] = (r["update_ms"] - r["per_step_ms"]) / update_every
            r["amortised_share"] = r["amortised_ms"] / r["train_ms"]
            r["per_step_share"] = r["per_step_ms"] / r["train_ms"]
            r["density"] = dst.stats()["density"]
        print(json.dumps(r), flush=True)
        results.append(r)
        del model, opt, dst
        torch.cuda.empty_cache()
    return results


def bench_semi(tokens=16384, shapes=((5632, 2048), (2048, 5632))):
    out = []
    for o, i in shapes:
        torch.manual_seed(0)
        w = torch.randn(o, i, device="cuda")
        w = (w * transposable_nm_select(w.abs().view(1, o, i), 2, 4).view(o, i)).requires_grad_()  # 2:4 both ways
        x = torch.randn(tokens, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, o, device="cuda", dtype=torch.bfloat16)

        def dense():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = F.linear(x, w)
            y.backward(g)

        def semi(transposable):
            return lambda: SemiSparseLinear.apply(x, w, torch.bfloat16, transposable).backward(g)

        r = {"shape_out_in": [o, i], "tokens": tokens}
        for name, fn in (("dense", dense), ("semi", semi(False)), ("semi_transposable", semi(True))):
            try:
                for _ in range(3):
                    fn()
                r[f"{name}_ms"] = median([cuda_ms(fn) for _ in range(10)])
            except Exception as e:  # report, don't crash: the kernels are shape/arch dependent
                r[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        with torch.no_grad():
            ref = F.linear(x.float(), w).float()
            got = SemiSparseLinear.apply(x, w, torch.bfloat16, False).float() if "semi_ms" in r else None
            if got is not None:
                r["semi_rel_err"] = ((got - ref).norm() / ref.norm()).item()
                r["bf16_dense_rel_err"] = ((F.linear(x, w.bfloat16()).float() - ref).norm() / ref.norm()).item()
        print(json.dumps(r), flush=True)
        out.append(r)
    return out


def bench_apply():
    """The per-step mask re-application over the 1B model's masked weight shapes (fp32 W, bool mask), done
    several ways; ``dst.step`` uses ``masked_fill_`` with the mask's negation computed per layer."""
    d, h, kv = ONE_B.dim, ONE_B.hidden_dim, ONE_B.kv_heads * ONE_B.head_dim
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (h, d), (h, d), (d, h)] * ONE_B.n_layers
    ws = [torch.randn(s, device="cuda") for s in shapes]
    ms = [torch.rand(s, device="cuda") < 0.2 for s in shapes]
    inv = [~m for m in ms]
    ways = {
        "loop_mul_bool": lambda: [w.mul_(m) for w, m in zip(ws, ms)],
        "foreach_mul_bool": lambda: torch._foreach_mul_(ws, ms),
        "loop_masked_fill_inverted": lambda: [w.masked_fill_(i, 0.0) for w, i in zip(ws, inv)],
        "loop_masked_fill_not": lambda: [w.masked_fill_(m.logical_not(), 0.0) for w, m in zip(ws, ms)],
    }
    n = sum(w.numel() for w in ws)
    r = {"weights": n}
    for name, fn in ways.items():
        try:
            for _ in range(2):
                fn()
            t = median([cuda_ms(fn) for _ in range(7)])
            r[name + "_ms"] = t
            r[name + "_GBps"] = n * 9 / t / 1e6                  # 4 B read + 4 B write + 1 B mask
        except Exception as e:
            r[name + "_error"] = f"{type(e).__name__}: {str(e)[:150]}"
    print(json.dumps(r), flush=True)
    del ws, ms, inv
    torch.cuda.empty_cache()
    return r


def stdlib_bytes():
    """Train/val byte streams: the standard library's .py files, split by file name (every 20th is val)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    tr, va = [], []
    for k, f in enumerate(files):
        with open(f, "rb") as fh:
            (va if k % 20 == 0 else tr).append(fh.read())
    as_t = lambda bs: torch.frombuffer(bytearray(b"\n".join(bs)), dtype=torch.uint8).long()  # noqa: E731
    return as_t(tr), as_t(va)


def quality(steps, batch=32, seq=256, sparsity=0.8, dev="cuda"):
    train_t, val_t = (t.to(dev) for t in stdlib_bytes())
    cfg = ModelConfig(vocab_size=256, dim=384, n_layers=6, n_heads=6, n_kv_heads=6, ffn_hidden=1024, max_seq_len=seq)

    def batch_at(data, gen):
        ix = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen, device=dev)
        x = torch.stack([data[i:i + seq + 1] for i in ix.tolist()])
        return x[:, :-1], x[:, 1:]

    out = {}
    for name in ("dense", f"rigl_erk{int(sparsity * 100)}"):
        torch.manual_seed(0)
        model = build_model(cfg, device=dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=dev == "cuda")
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
        dst = None if name == "dense" else DynamicSparsity(model, opt, sparsity=sparsity, method="rigl",
                                                           distribution="erk", update_every=50, total_steps=steps)
        gen = torch.Generator(device=dev).manual_seed(1)
        t0 = time.perf_counter()
        for s in range(steps):
            x, y = batch_at(train_t, gen)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                loss, _ = model.loss(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if dst is not None:
                dst.step(s)
            opt.zero_grad(set_to_none=True)
            sched.step()
        model.eval()
        vgen = torch.Generator(device=dev).manual_seed(2)
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            vl = sum(model.loss(*batch_at(val_t, vgen))[0].item() for _ in range(40)) / 40
        out[name] = {"val_loss": vl, "train_s": time.perf_counter() - t0,
                     "params": sum(p.numel() for p in model.parameters()),
                     **({"density": dst.stats()["density"], "ever_active": dst.stats()["ever_active"]} if dst else {})}
        print(json.dumps({name: out[name]}), flush=True)
    out.update(steps=steps, tokens=steps * batch * seq, model=dict(dim=cfg.dim, n_layers=cfg.n_layers,
                                                                   ffn_hidden=cfg.ffn_hidden, vocab=256))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="dst.json")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--update-every", type=int, default=100)
    ap.add_argument("--quality-steps", type=int, default=1500)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-semi", action="store_true")
    a = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["apply"] = bench_apply()
    if not a.skip_semi:
        res["semi_structured"] = bench_semi()
    res["one_b"] = bench_1b([v for v in a.variants.split(",") if v], a.batch, a.seq, a.steps, a.update_every)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    if not a.skip_quality:
        res["quality"] = quality(a.quality_steps)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
