"""Multi-query associative recall over a long context: a CPU screen of sparse-attention selection.

MQAR (Arora et al. 2023, "Zoology: measuring and improving recall in efficient language models")
shows a model key-value pairs and later asks for some keys' values. Zoology puts every pair at the
start, which sinks alone would solve; this variant scatters the pairs over the context and packs
many queries into the last part of the sequence, each asking a different key, so that a query
block's one selection cannot serve all of its queries and a window never reaches a pair.

Layout of one row (``mqar_batch``), in 2-token slots: the first ``1 - query_frac`` of the slots are
the context, where ``n_pairs`` random slots hold ``key value`` and the rest ``noise noise``; the
last ``query_frac`` of the slots are the query region, where ``n_queries`` random slots hold ``key
value`` for distinct keys drawn from the context's pairs, in random order, and the rest noise. The
target at a query's key position is its value (the model predicts the value from the key; the value
is the next input, so a query reads like a pair); every other target is -100. The vocabulary is
split into noise ``[0, V/4)``, keys ``[V/4, 5V/8)`` and values ``[5V/8, V)``: a key occurs only
as itself, exactly once before its query, and keys and values are distinct within a row. Chance
accuracy is ``1 / (3V/8)``; a model that only guesses among the row's values gets ``1 /
n_pairs``.

Recall is an induction circuit: something must write "my previous token is key k" into each
value position, and a query must match its key against that and copy the value. Over two plain
attention layers this is slow to learn (a 2-layer dim-64 model stayed on the loss plateau for 3000
steps at 64 tokens); with a short key convolution (``--key-conv``, ``model.attention.key_conv``,
the short convolution Zoology's attention models carry too) one layer does it, and 64 tokens are
learned in 500-900 steps, depending on the seed. Longer rows then need only a short phase each
(``--warm``): the defaults learn at 64 and 256 tokens and screen at 1024, the same schedule for
every variant (block top-k heads select at 256 tokens already; at 64 they are dense).
Block top-k heads must select the block of the pair's value token; ``selection_recall`` reads that
per layer from the selection the model records (``Attention.record_selection``,
layers/attention/plan.py ``BlockSelection.covers``), over queries whose pair lies in an earlier
key block.

    nice -n 5 python bench/mqar.py --variants dense,a_shape,topk_qmax --seeds 0,1 \\
        --out runs/mqar.jsonl

With the defaults (1024 tokens, 24 pairs and 24 queries: ~6 queries per 32-token query block;
blocks of 32, top-3 blocks, window 32, 16 sinks: ~25% of the causal blocks) dense attention
reaches ~85% in ~3-4 minutes on two shared CPU cores and A-shape stays at chance (4%).

Variants (``VARIANTS``): one dict each, the pattern of every head of the sparse layers; ``block``,
``top_k``, ``window`` and ``sinks`` come from the command line so that all compare at one budget.
Keys of ``AttentionConfig`` (e.g. ``ssmax``, ``key_conv``, ``dense_warmup``) go to
``model.attention``; ``dense_last: n`` leaves the last n layers without a pattern (dense). The
``*_kconv`` entries differ from their plain twins only under ``--key-conv 0``. Dense phases run as
the trainer runs them (``AttentionStats``); the eval always uses the sparse patterns. One JSON line
per (variant, seed) is appended to ``--out`` as each finishes, and a table is printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moezoo.configs import ModelConfig, OptimConfig  # noqa: E402
from moezoo.configs.attention import COMMON_PARAMS, PATTERN_TYPES, AttentionConfig  # noqa: E402
from moezoo.layers.attention import Attention, AttentionStats  # noqa: E402
from moezoo.training.optim import build_optimizer, build_scheduler  # noqa: E402
from moezoo.zoo import build_model  # noqa: E402

# name -> pattern of the sparse layers' heads (None: every layer dense). Each block_topk variant
# shares one selection per KV group (share_group, as the presets) and keeps the A-shape window and
# sinks (NSA's sliding branch), so the variants differ only in how blocks are chosen.
VARIANTS: dict[str, dict | None] = {
    "dense": None,
    "a_shape": {"type": "a_shape"},
    "topk_mean": {"type": "block_topk"},
    "topk_qmax": {"type": "block_topk", "query_max": 1},
    "topk_qmax_sb": {"type": "block_topk", "query_max": 1, "score_block": 8},
    "topk_qmax_compress": {"type": "block_topk", "query_max": 1, "compress": 1},
    "hybrid_last_dense": {"type": "block_topk", "query_max": 1, "dense_last": 1},
    "topk_token": {"type": "block_topk", "token_select": 1},
    "topk_token_sb": {"type": "block_topk", "token_select": 1, "score_block": 8},
    "topk_token_max": {"type": "block_topk", "token_select": 1, "score_block": 1},
    "topk_union_max": {"type": "block_topk", "token_select": 2, "score_block": 1},
    "topk_qmax_max": {"type": "block_topk", "query_max": 1, "score_block": 1},
    "topk_qshare_max": {"type": "block_topk", "query_max": 2, "score_block": 1},
    "topk_union_share3": {
        "type": "block_topk",
        "token_select": 2,
        "score_block": 1,
        "min_share": 3,
    },
    "topk_union_share10": {
        "type": "block_topk",
        "token_select": 2,
        "score_block": 1,
        "min_share": 10,
    },
    "topk_union_share20": {
        "type": "block_topk",
        "token_select": 2,
        "score_block": 1,
        "min_share": 20,
    },
    "topk_union_share30": {
        "type": "block_topk",
        "token_select": 2,
        "score_block": 1,
        "min_share": 30,
    },
    "topk_union_nope": {"type": "block_topk", "token_select": 2, "score_nope": 1},
    "topk_union_max_nope": {
        "type": "block_topk",
        "token_select": 2,
        "score_block": 1,
        "score_nope": 1,
    },
    "topk_token_compress": {"type": "block_topk", "token_select": 1, "compress": 1},
    "hybrid_token": {"type": "block_topk", "token_select": 1, "dense_last": 1},
    "topk_token_kconv": {"type": "block_topk", "token_select": 1, "key_conv": 4},
    "topk_qmax_kconv": {"type": "block_topk", "query_max": 1, "key_conv": 4},
    "a_shape_kconv": {"type": "a_shape", "key_conv": 4},
    "dense_kconv": {"key_conv": 4},
    "topk_union": {"type": "block_topk", "token_select": 2},
    "topk_union_kconv": {"type": "block_topk", "token_select": 2, "key_conv": 4},
}
# filled in from the command line where a pattern type takes them
BUDGET = ("block_size", "top_k", "window", "sinks", "share_group")
BUDGET_DEFAULTS = {"share_group": 1}

# --------------------------------------------------------------------------------------------------
# Data


def vocab_ranges(vocab: int) -> tuple[range, range, range]:
    """(noise, keys, values) token ranges of a ``vocab``-token task (module docstring)."""
    a, b = vocab // 4, vocab // 4 + 3 * vocab // 8
    return range(0, a), range(a, b), range(b, vocab)


def _sample_without_replacement(n: int, k: int, batch: int, g: torch.Generator) -> torch.Tensor:
    """int64 ``[batch, k]``: k distinct values of ``0 .. n-1`` per row, in random order."""
    return torch.rand(batch, n, generator=g).argsort(-1)[:, :k]


def mqar_batch(
    batch: int,
    seq_len: int,
    n_pairs: int,
    n_queries: int,
    vocab: int,
    generator: torch.Generator,
    query_frac: float = 0.25,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` int64 ``[batch, seq_len]``; targets -100 except at the queries' key
    positions, which hold the value (module docstring). A pure function of the generator's state."""
    slots = seq_len // 2
    q_slots = int(slots * query_frac)
    c_slots = slots - q_slots
    noise, keys, values = vocab_ranges(vocab)
    if seq_len % 2 or n_pairs > c_slots or n_queries > min(n_pairs, q_slots) or n_queries < 1:
        raise ValueError(
            f"seq_len {seq_len} (even) with query_frac {query_frac} holds {c_slots} pair slots and "
            f"{q_slots} query slots: need n_queries {n_queries} <= n_pairs {n_pairs} <= "
            f"{c_slots} and n_queries <= {q_slots}"
        )
    if n_pairs > min(len(keys), len(values)):
        raise ValueError(f"vocab {vocab} has {len(keys)} keys and values for {n_pairs} pairs")
    g = generator
    tokens = torch.randint(noise.start, noise.stop, (batch, seq_len), generator=g)
    targets = torch.full((batch, seq_len), -100, dtype=torch.long)
    rows = torch.arange(batch)[:, None]
    pair_slot = _sample_without_replacement(c_slots, n_pairs, batch, g)  # [B, N]
    key = keys.start + _sample_without_replacement(len(keys), n_pairs, batch, g)
    val = values.start + _sample_without_replacement(len(values), n_pairs, batch, g)
    tokens[rows, 2 * pair_slot], tokens[rows, 2 * pair_slot + 1] = key, val
    asked = _sample_without_replacement(n_pairs, n_queries, batch, g)  # [B, M] pair indices
    q_slot = c_slots + _sample_without_replacement(q_slots, n_queries, batch, g)
    q_key, q_val = key.gather(1, asked), val.gather(1, asked)
    tokens[rows, 2 * q_slot], tokens[rows, 2 * q_slot + 1] = q_key, q_val
    targets[rows, 2 * q_slot] = q_val
    return tokens, targets


def answer_sources(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(rows, q_pos, k_pos)`` int64 ``[n_answers]``: each answer's row, its query position and
    the position of the first occurrence of its key (the pair; the value sits at ``k_pos + 1``)."""
    rows, q_pos = (targets != -100).nonzero(as_tuple=True)
    same = tokens[rows] == tokens[rows, q_pos][:, None]  # [n, T]
    return rows, q_pos, same.int().argmax(-1)


# --------------------------------------------------------------------------------------------------
# Model


def variant_attention(
    name: str,
    n_layers: int,
    block: int,
    top_k: int,
    window: int,
    sinks: int,
    base: dict | None = None,
) -> AttentionConfig:
    """``model.attention`` of a variant: its pattern on every head of the sparse layers (all but
    the last ``dense_last``), the budget params its type takes filled in from the arguments.
    ``base``: entries every variant starts from (e.g. ``key_conv``); the variant's own win."""
    spec = dict(base or {}, **(VARIANTS[name] or {}))
    dense_last = spec.pop("dense_last", 0)
    fields = {f.name for f in dataclasses.fields(AttentionConfig)}
    attn = {k: spec.pop(k) for k in list(spec) if k in fields}
    if not spec:
        return AttentionConfig(backend="reference", **attn)
    required, optional = PATTERN_TYPES[spec["type"]]
    budget = dict(BUDGET_DEFAULTS, block_size=block, top_k=top_k, window=window, sinks=sinks)
    for p in BUDGET:
        if p in required + optional + COMMON_PARAMS and p not in spec:
            spec[p] = budget[p]
    sparse = n_layers - dense_last
    if sparse < 1:
        raise ValueError(f"variant {name}: dense_last {dense_last} leaves no sparse layer")
    return AttentionConfig(backend="reference", patterns={f"0-{sparse - 1}": spec}, **attn)


def model_config(args, variant: str) -> ModelConfig:
    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=2 * args.dim,
        max_seq_len=args.seq,
        attention=variant_attention(
            variant,
            args.layers,
            args.block,
            args.top_k,
            args.window,
            args.sinks,
            {"key_conv": args.key_conv} if args.key_conv else None,
        ),
    )
    cfg.validate()
    return cfg


# --------------------------------------------------------------------------------------------------
# Evaluation


def selection_recall(model, tokens: torch.Tensor, targets: torch.Tensor) -> dict[int, list[int]]:
    """Per layer with block top-k heads: ``[hits, total]`` over (far answer, block top-k head),
    where a hit is a selection for the query that holds the block of the pair's value token
    (``BlockSelection.covers``: the query block's blocks, or the query's own for per-token
    selection) and an answer is far when that block lies before the query's block. Reads the
    selections of the last forward (run with ``record_selection`` on)."""
    rows, q_pos, k_pos = answer_sources(tokens, targets)
    out = {}
    for m in model.modules():
        sel = getattr(m, "attn_stats", {}).get("selection") if isinstance(m, Attention) else None
        if sel is None:
            continue
        hits = total = 0
        for r, q, k in zip(rows.tolist(), q_pos.tolist(), (k_pos + 1).tolist()):
            if k // sel.block_size < q // sel.block_size:
                hit = sel.covers(q, [k])[r]  # [heads]
                hits, total = hits + int(hit.sum()), total + hit.numel()
        out[m.layer_id] = [hits, total]
    return out


@torch.no_grad()
def evaluate(model, args, seed: int) -> dict:
    """Accuracy (answer argmax == value), loss on the answers, per-layer selection recall and the
    attention density, over ``args.eval_batches`` fresh batches."""
    g = torch.Generator().manual_seed(1_000_003 + seed)
    model.eval()
    for m in model.modules():
        if isinstance(m, Attention):
            # the sparse patterns are what is screened, also after a dense finish
            m.record_selection, m.dense_phase = True, False
    hits = total = 0
    loss_sum = 0.0
    recall: dict[int, list[int]] = {}
    density: list[float] = []
    for _ in range(args.eval_batches):
        tokens, targets = (
            t.to(args.device)
            for t in mqar_batch(
                args.batch, args.seq, args.pairs, args.queries, args.vocab, g, args.query_frac
            )
        )
        logits = model(tokens)
        ans = targets != -100
        hits += int((logits.argmax(-1)[ans] == targets[ans]).sum())
        total += int(ans.sum())
        loss_sum += float(
            torch.nn.functional.cross_entropy(logits[ans], targets[ans], reduction="sum")
        )
        for layer, (h, n) in selection_recall(model, tokens, targets).items():
            acc = recall.setdefault(layer, [0, 0])
            acc[0], acc[1] = acc[0] + h, acc[1] + n
        # layers without a pattern keep no stats: they compute every causal block
        density += [
            float(b.attention.attn_stats.get("density", torch.ones(1)).mean()) for b in model.layers
        ]
    model.train()
    return {
        "accuracy": hits / total,
        "eval_loss": loss_sum / total,
        "recall": {str(k): v[0] / max(v[1], 1) for k, v in sorted(recall.items())},
        "density": sum(density) / len(density),
    }


# --------------------------------------------------------------------------------------------------
# Training


def curriculum(args) -> list[tuple[int, int, int, int]]:
    """``(seq, steps, pairs, queries)`` of each training phase: the ``--warm`` lengths, then
    ``--seq`` for ``--steps``. A short phase has at most as many pairs as query slots, and at
    most half its context slots (the rest noise)."""
    out = []
    for seq, steps in args.warm:
        slots = seq // 2
        q_slots = int(slots * args.query_frac)
        pairs = min(args.pairs, q_slots, (slots - q_slots) // 2)
        out.append((seq, steps, pairs, min(args.queries, pairs)))
    return out + [(args.seq, args.steps, args.pairs, args.queries)]


def run_one(args, variant: str, seed: int) -> dict:
    """Train one model from scratch on fresh batches (``curriculum``) and evaluate it at
    ``--seq``: the JSON row."""
    cfg = model_config(args, variant)
    torch.manual_seed(seed)
    model = build_model(cfg, device=args.device)
    g = torch.Generator().manual_seed(seed)
    a = cfg.attention
    # model.attention.dense_warmup / dense_finish, as the trainer applies them
    plan = [(seq, pairs, queries) for seq, n, pairs, queries in curriculum(args) for _ in range(n)]
    # the trainer's AdamW (no decay on norms) and warm-up-stable-decay schedule: a decaying lr
    # slows the escape from MQAR's loss plateau, which comes late in a short run
    ocfg = OptimConfig(lr=args.lr, warmup_steps=args.warmup, schedule="wsd", beta2=0.98)
    opt = build_optimizer(model, ocfg, torch.device(args.device).type)
    sched = build_scheduler(opt, ocfg, len(plan))
    phases = AttentionStats(
        model, args.seq, len(plan), a.dense_warmup, a.dense_finish, a.dense_phase_heads
    )
    t0 = time.perf_counter()
    losses = []
    for step, (seq, pairs, queries) in enumerate(plan):
        phases.before_step(step)
        tokens, targets = (
            t.to(args.device)
            for t in mqar_batch(args.batch, seq, pairs, queries, args.vocab, g, args.query_frac)
        )
        loss, _ = model(tokens, targets)  # the mean cross-entropy over the answers
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ocfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if args.log_every and (step + 1) % args.log_every == 0:
            print(
                f"  {variant} seed {seed} step {step + 1} (seq {seq}): loss {losses[-1]:.3f} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    train_s = time.perf_counter() - t0
    res = evaluate(model, args, seed)
    tail = losses[-max(1, args.steps // 20) :]
    return {
        "variant": variant,
        "seed": seed,
        **res,
        "loss": sum(tail) / len(tail),
        "seconds": round(train_s, 1),
        "patterns": cfg.attention.patterns,
        "settings": {
            k: getattr(args, k)
            for k in (
                "seq",
                "pairs",
                "queries",
                "query_frac",
                "vocab",
                "dim",
                "layers",
                "heads",
                "kv_heads",
                "block",
                "top_k",
                "window",
                "sinks",
                "key_conv",
                "steps",
                "warm",
                "batch",
                "lr",
                "device",
            )
        },
    }


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'variant':<20} {'seed':>4} {'acc':>6} {'loss':>6} {'eval':>6} {'dens':>5} "
        f"{'sec':>6}  recall per layer"
    ]
    for r in rows:
        rec = " ".join(f"L{k}:{v:.2f}" for k, v in r["recall"].items()) or "-"
        lines.append(
            f"{r['variant']:<20} {r['seed']:>4} {r['accuracy']:>6.1%} {r['loss']:>6.3f} "
            f"{r['eval_loss']:>6.3f} {r['density']:>5.2f} {r['seconds']:>6.0f}  {rec}"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated VARIANTS")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--pairs", type=int, default=24)
    p.add_argument("--queries", type=int, default=24)
    p.add_argument("--query-frac", type=float, default=0.25, help="share of slots for queries")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--warm",
        default="64:1500,256:200",
        help="shorter phases first, SEQ:STEPS,... (e.g. 64:400): all variants learn the recall at "
        "short range, where it takes few cheap steps, then at --seq for --steps",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument(
        "--key-conv",
        type=int,
        default=4,
        help="model.attention.key_conv of every variant that sets none (0: none)",
    )
    p.add_argument("--seeds", default="0")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch's default); on a shared 2-core machine one thread "
        "ran a step 3-5x faster than two",
    )
    p.add_argument("--out", default="", help="JSONL file to append one row per (variant, seed)")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant {bad[0]!r}; choose from {', '.join(VARIANTS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.warm = [tuple(int(x) for x in w.split(":")) for w in args.warm.split(",") if w]
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for variant in args.variants:
        for seed in args.seeds:
            row = run_one(args, variant, seed)
            rows.append(row)
            print(format_table([row]).splitlines()[1], flush=True)
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
