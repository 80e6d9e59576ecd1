#!/usr/bin/env bash
# The trainer end to end on one GPU: every preset's GPU path (bf16 autocast, fused AdamW, grouped MoE,
# FlexAttention inside the model, DST masks, neuron routing, torch.compile, activation checkpointing)
# for a few hundred steps, then one JSON summary (first/last losses, tokens/s, MFU, peak memory).
#
#     OUT=/tmp/gpu bash bench/train_gpu.sh [names...]      # default: all runs below
#
# Runs write under $RUNS_DIR/<name> (default runs/train_gpu); every run's output is appended to
# $OUT/train_gpu.log and the summary goes to $OUT/train_gpu.json and stdout.
set -uo pipefail
OUT=${OUT:-runs/train_gpu}
RUNS_DIR=${RUNS_DIR:-runs/train_gpu}
mkdir -p "$OUT" "$RUNS_DIR"
common=(logging.wandb=disabled logging.progress=false train.device=cuda)

declare -A RUNS=(
  # tiny presets as shipped (the CPU numbers in the README's presets table), on the GPU
  [tiny_dense]="--config zoo/tiny_dense.yaml train.steps=600"
  [tiny_moe]="--config zoo/tiny_moe.yaml train.steps=600"
  [tiny_moe_compiled]="--config zoo/tiny_moe.yaml train.steps=600 train.compile=true"
  [tiny_dst]="--config zoo/tiny_dst.yaml train.steps=600"
  [tiny_neuron]="--config zoo/tiny_neuron.yaml train.steps=600"
  # sparse attention above the dense crossover, so FlexAttention runs forward and backward in the model
  [tiny_sparse_attn_8k]="--config zoo/tiny_sparse_attn.yaml train.steps=200 train.seq_len=8192 model.max_seq_len=8192 train.batch_size=2 data.max_files=0"
  # Mixtral's layer shape (2 of its 32 layers, 16k tokens a step), compiled: tokens/s and MFU of real GEMMs
  [mixtral_2layer]="--config zoo/mixtral_8x7b.yaml model.n_layers=2 model.vocab_size=8192 train.batch_size=4 train.steps=40 train.compile=true train.eval_every=40 train.eval_batches=2 data.max_files=0 logging.log_every=5"
  # fine-grained MoE with shared experts (DeepSeekMoE 16B's layer shape, 4 of its 28 layers)
  [deepseek_4layer]="--config zoo/deepseek_moe_16b.yaml model.n_layers=4 model.vocab_size=8192 train.batch_size=4 train.steps=40 train.compile=true train.eval_every=40 train.eval_batches=2 data.max_files=0 logging.log_every=5"
  # the 1B long-context sparse-attention preset at 64k tokens (its 64k phase: the short dense phase
  # off), activation checkpointing
  [sparse_attn_1b_64k]="--config zoo/sparse_attn_1b_64k.yaml train.short_steps=0 train.short_seq_len=0 model.attention.dense_warmup=0 model.vocab_size=8192 train.steps=12 train.eval_every=12 train.eval_batches=1 data.max_files=0 logging.log_every=2 parallel.activation_checkpointing=true"
)
ORDER=(mixtral_2layer deepseek_4layer sparse_attn_1b_64k tiny_moe_compiled tiny_dense tiny_moe tiny_dst tiny_neuron tiny_sparse_attn_8k)
[ $# -gt 0 ] && ORDER=("$@")

for name in "${ORDER[@]}"; do
  echo "== $name: python3 train.py ${RUNS[$name]}"
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout 420 python3 train.py ${RUNS[$name]} "${common[@]}" train.out_dir="$RUNS_DIR/$name" \
    > "$RUNS_DIR/$name.log" 2>&1
  rc=$?
  echo "rc=$rc wall=$(( $(date +%s) - start ))s"
  tail -n 4 "$RUNS_DIR/$name.log"
  { echo "== $name rc=$rc"; cat "$RUNS_DIR/$name.log"; } >> "$OUT/train_gpu.log"
done

python3 - "$OUT" "$RUNS_DIR" "${ORDER[@]}" <<'EOF'
import json, os, sys
out, runs, names = sys.argv[1], sys.argv[2], sys.argv[3:]
summary = {}
for n in names:
    path = os.path.join(runs, n, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    train = [r for r in rows if "loss/total" in r]
    val = [r for r in rows if "val/loss" in r]
    speed = [r for r in train[1:]]     # the first log window holds compilation / warm-up
    s = {"val_first": val[0]["val/loss"] if val else None, "val_last": val[-1]["val/loss"] if val else None,
         "loss_first": train[0]["loss/total"] if train else None,
         "loss_last": train[-1]["loss/total"] if train else None,
         "steps": train[-1]["step"] if train else 0,
         "skipped": sum(bool(r.get("skipped")) for r in train)}
    for k in ("tokens_per_s", "mfu", "mem/peak_gb"):
        vals = [r[k] for r in speed if k in r]
        if vals:
            s[k] = sorted(vals)[len(vals) // 2]
    summary[n] = s
    print(n, json.dumps(s))
json.dump(summary, open(os.path.join(out, "train_gpu.json"), "w"), indent=1)
EOF
