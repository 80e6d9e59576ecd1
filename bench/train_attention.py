"""End to end: the same model trained dense and sparse in one process, the trainer itself
(train.py's loop).

    python bench/train_attention.py --config zoo/sparse_attn_1b_64k.yaml --steps 8 \\
        --variants dense,preset model.vocab_size=8192 --out DIR

Variants (same config, seed, data and steps; only ``model.attention.patterns`` differs):

- ``dense``: every head dense causal attention (patterns cleared).
- ``preset``: the config's patterns as written.
- ``a_shape``: every head of every layer A-shape (128 sinks + ``--a-shape-window`` window, the
  preset's block size): the static baseline, expected to lose retrieval beyond its window.
- ``query_max``: the preset with its block top-k heads scoring key blocks by each query block's best
  query (``query_max: 1``: MoBA / NSA's per-query affinity) instead of its mean query.
- ``query_share``: query_max ranking by each query's log share of a block instead of its raw score
  (``query_max: 2``: the max over the query block of each query's log softmax over its causal
  blocks).
- ``nsa``: query_max plus NSA's compressed branch on those heads (``compress: 1``: each query's
  softmax over the mean-pooled blocks, gated with the selected blocks' attention; the gradient path
  that can teach the selection about blocks outside its top-k; ``--compress-block N``: its pooling
  block, e.g. 32 as NSA's, where a 128-token block's mean dilutes a short needle).
- ``token``: the preset with its block top-k heads choosing per query token (``token_select: 1``,
  NSA Eq. 9-11 / MoBA: each query its own ``top_k`` blocks, shared over the KV group).
- ``token_nsa``: token plus the compressed branch.
- ``token_union``: per-token choices, each query attending the union its query block chose
  (``token_select: 2``: every visited block is full, no per-token mask in the kernel).
- ``union_all``: token_union in every head: the static heads (A-shape) of a layer take that
  layer's block top-k pattern, so every head can reach the whole context (NSA / MoBA / DSA layouts).

A variant may carry its own overrides after ``@``, separated by ``;`` (no commas: they separate
variants), e.g. hybrid layouts and dense phases: ``token@model.attention.dense_layers=last:1``,
``preset@model.attention.dense_warmup=0.1;train.seed=1``.
``--score-block N`` (query_max, query_share, nsa and the token variants): those heads' selection
pools keys over sub-blocks of N and scores a key block by its best sub-block (``score_block``; 1 =
single keys; with ``--compress-block`` N too, the selection ranks the compressed branch's own
logits, as NSA does);
``--score-nope 1``: it scores q and k before RoPE (``score_nope``). ``--min-share P`` (token
variants): each query keeps a far block only if it holds P% of its softmax over its causal blocks
(``min_share``). ``--union-blocks N`` (token_union, union_all): a query block visits at most N
blocks of its union, those its queries give the highest share (``union_blocks``): a bound on the
work, so a speed run from initialisation without ``--min-share`` measures the cost the cap allows.
``--indexer N`` (token variants, with ``--score-block 1``): their selection scores with a learned
indexer of head dim N, distilled towards the attention's block mass (``indexer``,
``model.attention.indexer_weight``).
``--top-k N`` (query_max and nsa): those heads keep N key blocks per query block instead of the
preset's ``top_k``. Per variant:
tokens/s (mean over log steps after the first, which holds compilation and warm-up), ``mfu`` (the
attention work done: visited-block density) and ``mfu_model`` (dense-equivalent FLOPs), peak memory,
the last validation loss, the logged attention density and, with ``eval.passkey_lengths`` set,
passkey accuracy at the end (and, for block top-k heads, needle recall: the share of their
selections for the question that held the needle's block, training/passkey.py). Checkpoints are not
written (a 1B model's optimizer state is ~12 GB of disk per save) unless ``--checkpoint-every N``:
then each variant saves every N steps and on Ctrl-C / SIGINT (``timeout -s INT``), and ``--resume``
continues every variant from its latest checkpoint under ``--out``, so a run longer than one GPU
call spans two on the same machine. Rows go to ``DIR/train_attention.jsonl`` as they finish.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moezoo.configs import ConfigError, exit_code, load_config  # noqa: E402
from moezoo.training.loop import Trainer  # noqa: E402

# the variants that change the preset's block top-k heads
SELECTING = (
    "query_max",
    "query_share",
    "nsa",
    "token",
    "token_nsa",
    "token_union",
    "union_all",
)
VARIANTS = ("dense", "preset", "a_shape", *SELECTING)


class _NoSaveTrainer(Trainer):
    def save(self) -> str:
        return ""


def variant_config(
    path: str,
    overrides: list[str],
    variant: str,
    steps: int,
    out_dir: str,
    window: int = 2048,
    eval_every: int = 0,
    checkpoint_every: int = 0,
    resume: bool = False,
    compress_block: int = 0,
    score_block: int = 0,
    top_k: int = 0,
    score_nope: int = 0,
    min_share: int = 0,
    union_blocks: int = 0,
    indexer: int = 0,
):
    label = re.sub(r"[^A-Za-z0-9_.=-]+", "_", variant)
    variant, _, own = variant.partition("@")
    overrides = overrides + [o for o in own.split(";") if o]
    saves = (
        [f"checkpoint.every={checkpoint_every}", "checkpoint.keep_last=1"]
        if checkpoint_every
        else []
    )
    cfg = load_config(
        path,
        overrides
        + saves
        + (["checkpoint.resume=true"] if resume else [])
        + [
            f"train.steps={steps}",
            f"train.eval_every={eval_every or steps}",
            f"train.out_dir={out_dir}/{label}",
            "logging.wandb=disabled",
            "logging.progress=false",
            f"logging.log_every={max(steps // 4, 1)}",
        ],
    )
    # the preset's warm-up unless it is longer than a quarter of the run (a speed run of a few
    # steps)
    cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, max(steps // 4, 1))
    att = cfg.model.attention
    if variant == "dense":
        att.patterns, att.minference_json = {}, None
    elif variant == "a_shape":
        bs = next((p.get("block_size", 64) for p in att.patterns.values()), 128)
        att.patterns = {
            f"0-{cfg.model.n_layers - 1}:*": {
                "type": "a_shape",
                "sinks": min(128, window // 8),
                "window": window,
                "block_size": bs,
            }
        }
    elif variant in SELECTING:
        if not any(dict(p).get("type") == "block_topk" for p in att.patterns.values()):
            raise ConfigError(
                "--variants", f"{variant} needs block_topk heads, and {path} has none"
            )
        nsa = {"compress": 1, **({"compress_block": compress_block} if compress_block else {})}
        token = variant.startswith("token") or variant == "union_all"
        extra = {
            **(
                {"token_select": 2 if variant in ("token_union", "union_all") else 1}
                if token
                else {"query_max": 2 if variant == "query_share" else 1}
            ),
            **({"score_block": score_block} if score_block else {}),
            **({"score_nope": score_nope} if score_nope else {}),
            **({"min_share": min_share} if min_share and token else {}),
            **(
                {"union_blocks": union_blocks}
                if union_blocks and variant in ("token_union", "union_all")
                else {}
            ),
            **({"top_k": top_k} if top_k else {}),
            **({"indexer": indexer} if indexer and token else {}),
            **(nsa if variant.endswith("nsa") else {}),
        }
        drop = "query_max" if token else "token_select"
        att.patterns = {
            key: {**{k: v for k, v in dict(p).items() if k != drop}, **extra}
            if dict(p).get("type") == "block_topk"
            else p
            for key, p in att.patterns.items()
        }
        if variant == "union_all":
            # keys "layers:heads": each layer range's block top-k pattern for all its heads
            topk = {
                key.split(":")[0]: p
                for key, p in att.patterns.items()
                if dict(p).get("type") == "block_topk"
            }
            att.patterns = {k: topk.get(k.split(":")[0], p) for k, p in att.patterns.items()}
    elif variant != "preset":
        raise ConfigError(
            "--variants", f"unknown {variant!r}; expected some of {','.join(VARIANTS)}"
        )
    return cfg.validate()


def run_variant(cfg, variant: str, save: bool = False) -> dict:
    import torch

    t0 = time.perf_counter()
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    trainer = (Trainer if save else _NoSaveTrainer)(cfg)
    summary = trainer.fit()
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "tokens_per_s" in r]
    timed = steps[1:] or steps
    mean = lambda k: sum(r[k] for r in timed if k in r) / max(sum(1 for r in timed if k in r), 1)  # noqa: E731
    out = dict(
        variant=variant,
        steps=summary["step"],
        tokens_per_s=round(mean("tokens_per_s")),
        mfu=round(mean("mfu"), 4),
        mfu_model=round(mean("mfu_model"), 4),
        peak_gb=round(max((r.get("mem/peak_gb", 0) for r in steps), default=0), 1),
        val_loss=round(summary["val_history"][-1][1], 4),
        attn_density=round(
            mean("attn/density") if any("attn/density" in r for r in timed) else 1.0, 4
        ),
        wall_s=round(time.perf_counter() - t0, 1),
    )
    if any("attn/topk_entropy" in r for r in timed):
        out["topk_entropy"] = round(mean("attn/topk_entropy"), 4)
    pk = [r for r in rows if any(k.startswith("passkey/") for k in r)]
    if pk:
        out["passkey"] = {k.split("/")[1]: v for k, v in pk[-1].items() if k.startswith("passkey/")}
        # block top-k heads: did the selection hold the needle (per length, mean over layers and
        # heads)
        recall = {
            k.split("/")[1]: round(v, 3)
            for k, v in pk[-1].items()
            if k.startswith("passkey_recall/") and k.count("/") == 1
        }
        if recall:
            out["needle_recall"] = recall
    slopes = [
        [round(v, 3) for v in b.attention.ssmax.tolist()]
        for b in trainer.model.layers
        if getattr(b.attention, "ssmax", None) is not None
    ]
    if slopes:  # SSMax: what each layer's heads learned (1 + s log(p + 1) at 16k is 1 + 9.7 s)
        out["ssmax"] = slopes
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--variants", default="dense,preset")
    ap.add_argument("--out", default="runs/train_attention")
    ap.add_argument(
        "--a-shape-window",
        type=int,
        default=2048,
        help="window of the a_shape variant (sinks: 128 or window/8)",
    )
    ap.add_argument(
        "--compress-block",
        type=int,
        default=0,
        help="the nsa variant's compressed-branch pooling block "
        "(compress_block; 0 = the block size)",
    )
    ap.add_argument(
        "--score-block",
        type=int,
        default=0,
        help="query_max / nsa: the selection's key sub-block, a block scored by its best "
        "(score_block; 0 = whole blocks)",
    )
    ap.add_argument(
        "--score-nope",
        type=int,
        default=0,
        choices=(0, 1),
        help="query_max / nsa / token variants: 1 = their selection scores q and k before RoPE "
        "(score_nope)",
    )
    ap.add_argument(
        "--min-share",
        type=int,
        default=0,
        help="token variants: a query keeps a far block only if it holds this percent of its "
        "softmax over its causal blocks (min_share; 0 = every choice)",
    )
    ap.add_argument(
        "--union-blocks",
        type=int,
        default=0,
        help="token_union / union_all: a query block visits at most N blocks of its union, those "
        "its queries give the highest share of their softmax (union_blocks; 0 = the whole union)",
    )
    ap.add_argument(
        "--indexer",
        type=int,
        default=0,
        help="token variants with --score-block 1: their selection scores with a learned indexer "
        "of this head dim, distilled towards the attention's block mass (indexer; 0 = none)",
    )
    ap.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="query_max / nsa: key blocks each query block keeps (top_k; 0 = the preset's)",
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="validate (and run the passkey eval) every N steps; 0 = at the end only",
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="save each variant every N steps and on SIGINT, for --resume (0 = never save)",
    )
    ap.add_argument(
        "--resume", action="store_true", help="continue each variant from its latest checkpoint"
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides for every variant, e.g. model.vocab_size=8192",
    )
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    results = []
    # every variant's config first: a bad override or variant stops the script before any training
    cfgs = {
        v: variant_config(
            a.config,
            a.overrides,
            v,
            a.steps,
            a.out,
            a.a_shape_window,
            a.eval_every,
            a.checkpoint_every,
            a.resume,
            a.compress_block,
            a.score_block,
            a.top_k,
            a.score_nope,
            a.min_share,
            a.union_blocks,
            a.indexer,
        )
        for v in a.variants.split(",")
    }
    for v, cfg in cfgs.items():
        r = run_variant(cfg, v, save=a.checkpoint_every > 0)
        r["seq_len"], r["seed"] = cfg.train.seq_len, cfg.train.seed
        results.append(r)
        print(json.dumps(r), flush=True)
        with open(os.path.join(a.out, "train_attention.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
    base = next((r["tokens_per_s"] for r in results if r["variant"] == "dense"), None)
    print(
        "\n| variant | seq | tok/s | vs dense | mfu (work done) | mfu_model | peak GB | val loss "
        "| attn density | passkey | needle recall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        print(
            f"| {r['variant']} | {r['seq_len']} | {r['tokens_per_s']} | {ratio} | {r['mfu']:.3f} | "
            f"{r['mfu_model']:.3f} | {r['peak_gb']} | {r['val_loss']:.4f} | "
            f"{r['attn_density']:.3f} | {r.get('passkey', '')} | {r.get('needle_recall', '')} |"
        )


if __name__ == "__main__":
    try:
        sys.exit(exit_code(main))
    # the trainer's Interrupted names the checkpoint it saved (--checkpoint-every)
    except KeyboardInterrupt as e:
        print(str(e) or "interrupted", file=sys.stderr)
        sys.exit(130)
