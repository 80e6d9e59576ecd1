"""Quality of the DST schedules at equal tokens: dense vs RigL vs SET vs the seeds' recipe, several
seeds.

    # one GPU: dim 512, 8 layers, 700 steps
    python bench/train_dst.py --out train_dst.json
    # CPU:
    python bench/train_dst.py --dim 64 --layers 2 --steps 300 --batch 8 --seq 64 --update-every 25

Data: the bytes of this interpreter's standard library (vocab 256, no tokenizer), split by file
(every 20th file is validation). Model: zoo.build_model LLaMA-style, heads of 64. Optimizer: AdamW
(0.9, 0.95), weight decay 0.1, clip 1.0, linear warm-up then cosine to 10%. Runs (``RUNS``):
- ``dense``: LR ``--lr``.
- ``rigl``: RigL (|grad| grow), ERK 80% from the start, update every N, drop 0.3 cosine, stop at
  75%.
- ``set``: the same with random growth (SET).
- ``recipe`` (seeds 000/001): grow by the gradient EMA ``0.1 |g| + 0.9 S``, ERK, sparsity ramping
  80% -> 50% on a cosine over the first half, the same update cadence, LR 25% lower, warm-up twice
  as long.
- ``rigl50``: RigL at the recipe's final density (50% sparse from the start), to separate the
  recipe's schedule from its density. Validation loss: the mean of 40 held-out batches (fixed
  generator), in nats per byte.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moezoo.configs import ModelConfig  # noqa: E402
from moezoo.layers import DynamicSparsity  # noqa: E402
from moezoo.zoo import build_model  # noqa: E402

RIGL = dict(method="rigl", distribution="erk", sparsity=0.8, drop_fraction=0.3, stop_fraction=0.75)
RUNS = {
    "dense": dict(dst=None, lr_scale=1.0, warmup_scale=1.0),
    "rigl": dict(dst=RIGL, lr_scale=1.0, warmup_scale=1.0),
    "set": dict(dst=dict(RIGL, method="set"), lr_scale=1.0, warmup_scale=1.0),
    "recipe": dict(
        dst=dict(
            RIGL,
            grad_ema=0.1,
            initial_sparsity=0.8,
            sparsity=0.5,
            sparsity_schedule="cosine",
            ramp_fraction=0.5,
        ),
        lr_scale=0.75,
        warmup_scale=2.0,
    ),
    "rigl50": dict(dst=dict(RIGL, sparsity=0.5), lr_scale=1.0, warmup_scale=1.0),
}


def stdlib_bytes():
    """Train/val byte streams: the standard library's .py files, split by file name (every 20th is
    val)."""
    files = sorted(
        glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)
    )
    tr, va = [], []
    for k, f in enumerate(files):
        with open(f, "rb") as fh:
            (va if k % 20 == 0 else tr).append(fh.read())
    as_t = lambda bs: torch.frombuffer(bytearray(b"\n".join(bs)), dtype=torch.uint8).long()  # noqa: E731
    return as_t(tr), as_t(va)


def train_one(name, seed, a, data, dev):
    run = RUNS[name]
    train_t, val_t = data
    cfg = ModelConfig(
        vocab_size=256,
        dim=a.dim,
        n_layers=a.layers,
        n_heads=max(1, a.dim // 64),
        n_kv_heads=max(1, a.dim // 64),
        ffn_hidden=int(8 * a.dim / 3) // 64 * 64 or 64,
        max_seq_len=a.seq,
    )

    def batch_at(data, gen):
        ix = torch.randint(0, data.numel() - a.seq - 1, (a.batch,), generator=gen, device=dev)
        x = torch.stack([data[i : i + a.seq + 1] for i in ix.tolist()])
        return x[:, :-1], x[:, 1:]

    torch.manual_seed(seed)
    model = build_model(cfg, device=dev)
    lr, warm = a.lr * run["lr_scale"], int(a.warmup * run["warmup_scale"])
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev == "cuda"
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / a.steps)))
        ),
    )
    dst = (
        None
        if run["dst"] is None
        else DynamicSparsity(
            model, opt, total_steps=a.steps, update_every=a.update_every, seed=seed, **run["dst"]
        )
    )
    gen = torch.Generator(device=dev).manual_seed(1000 + seed)
    t0 = time.perf_counter()
    for s in range(a.steps):
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
    out = {
        "run": name,
        "seed": seed,
        "val_loss": vl,
        "train_s": time.perf_counter() - t0,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if dst is not None:
        st = dst.stats()
        out.update(density=st["density"], ever_active=st["ever_active"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="train_dst.json")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--update-every", type=int, default=100)
    ap.add_argument(
        "--time-limit", type=float, default=0, help="seconds; start no new run after it (0: none)"
    )
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    data = tuple(t.to(dev) for t in stdlib_bytes())
    res = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(a),
        "runs": [],
    }
    t0 = time.perf_counter()
    for seed in [int(s) for s in a.seeds.split(",")]:
        for name in a.runs.split(","):
            if a.time_limit and time.perf_counter() - t0 > a.time_limit:
                break
            r = train_one(name, seed, a, data, dev)
            print(json.dumps(r), flush=True)
            res["runs"].append(r)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    # mean val loss per run and its gap to dense
    by = {}
    for r in res["runs"]:
        by.setdefault(r["run"], []).append(r["val_loss"])
    dense = sum(by["dense"]) / len(by["dense"]) if "dense" in by else None
    print(f"{'run':8s} {'seeds':>5s} {'val loss':>9s} {'vs dense':>9s}")
    for name, v in by.items():
        m = sum(v) / len(v)
        print(
            f"{name:8s} {len(v):5d} {m:9.4f} "
            f"{'' if dense is None else f'{100 * (m / dense - 1):+8.2f}%'}"
        )


if __name__ == "__main__":
    main()
