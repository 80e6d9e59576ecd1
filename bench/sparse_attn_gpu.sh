#!/usr/bin/env bash
# The sparse-attention runs of BENCHMARKS.md ("Sparse attention layer", "Sparse attention end to end",
# "Long-context quality") in one GPU call (H200):
# end to end dense vs the sparse preset at 64k and 128k (bench/train_attention.py, the trainer itself:
# vocab 8192, activation checkpointing, bf16, eager blocks), the layer rows for block top-k and the
# presets' layer (bench/attention.py), and the GPU tests of layers/attention. Each part has its own
# time limit so a slow one leaves the rest. Results under $OUT (one log, the jsonl rows).
#     OUT=/tmp/out bash bench/sparse_attn_gpu.sh [e2e64 layer e2e128 tests layer_short flash select quality]
# (E2E_VARIANTS: the end-to-end parts' variants, e.g. dense,preset,query_max: bench/train_attention.py's list;
# E2E_ARGS: its options, e.g. "--score-block 1"; LAYOUT=ashape_topk: the A-shape + tile top-k layout of
# bench/configs/ instead of the zoo presets, the `preset` of most rows and the base of the selecting variants)
set -u
PARTS=${*:-e2e64 layer e2e128 tests}
. "$(dirname "$0")/gpu_env.sh" /tmp/sparse_attn_out
if [ "${LAYOUT:-}" = ashape_topk ]; then
  CFG64=bench/configs/ashape_topk_1b_64k.yaml CFG128=bench/configs/ashape_topk_1b_128k.yaml
  CFG16=bench/configs/ashape_topk_small_16k.yaml
else
  CFG64=zoo/sparse_attn_1b_64k.yaml CFG128=zoo/sparse_attn_1b_128k.yaml CFG16=zoo/sparse_attn_small_16k.yaml
fi
# end to end: the long phase's speed (a preset's short-context phase and dense warm-up off)
E2E="train.short_steps=0 train.short_seq_len=0 model.attention.dense_warmup=0"
COMMON="model.vocab_size=8192 data.max_files=700 train.eval_batches=1 eval.passkey_lengths=[] data.cache_dir=/tmp/moezoo_cache"
# quality_run VARIANTS OUT_DIR TIMEOUT [OVERRIDES..]: the 16k quality model trained as each variant
quality_run() {
  timeout -s INT -k 60 "$3" $PY bench/train_attention.py --config $CFG16 \
    --steps ${Q_STEPS:-2400} --variants "$1" --eval-every ${Q_EVAL_EVERY:-600} --a-shape-window 1024 \
    --out "$2" ${Q_ARGS:-} data.cache_dir=/tmp/moezoo_cache ${Q_OVERRIDES:-} "${@:4}"
}
for part in $PARTS; do
  t0=$(date +%s)
  case $part in
    e2e64)  timeout ${T_E2E64:-130} $PY bench/train_attention.py --config $CFG64 --steps 5 \
              --variants ${E2E_VARIANTS:-dense,preset} --out /tmp/e2e64 ${E2E_ARGS:-} $COMMON $E2E ;
            cp /tmp/e2e64/train_attention.jsonl "$OUT/e2e64.jsonl" 2>/dev/null ;;
    e2e128) timeout ${T_E2E128:-130} $PY bench/train_attention.py --config $CFG128 --steps 3 \
              --variants ${E2E_VARIANTS:-preset,dense} --out /tmp/e2e128 ${E2E_ARGS:-} $COMMON $E2E ;
            cp /tmp/e2e128/train_attention.jsonl "$OUT/e2e128.jsonl" 2>/dev/null ;;
    layer)  timeout ${T_LAYER:-70} $PY bench/attention.py --lengths 65536,131072 --patterns topk,mix --modes fwd,fwdbwd \
              --no-plain --out "$OUT/layer.jsonl" ;;
    # the capped tile union's selection split into its stages (scores, the fused choice and the
    # torch ops it replaces, the whole plan) at 64k and 128k
    select) timeout ${T_SELECT:-150} $PY bench/attention.py --lengths "" --select-stages 65536 \
              --out "$OUT/select.jsonl" ;
            timeout ${T_SELECT:-150} $PY bench/attention.py --lengths "" --select-stages 131072 \
              --out "$OUT/select.jsonl" ;;
    layer_short) timeout 90 $PY bench/attention.py --lengths 16384,32768 --patterns topk --modes fwd,fwdbwd \
              --no-plain --out "$OUT/layer.jsonl" ;;
    flash)  timeout 150 $PY bench/attention.py --lengths 65536 --patterns a_shape,topk,mix --modes fwd,fwdbwd \
              --no-plain --kernels triton,flash --out "$OUT/flash.jsonl" ;;
    # quality at equal tokens: the 31M model at 16k (zoo/sparse_attn_small_16k.yaml), dense and the preset,
    # 2400 steps each (passkeys in the training windows), val loss and passkey at 4k, 16k every 600 steps;
    # both at once on one GPU take ~1200 s: two calls (Q_ARGS="--checkpoint-every 300", then --resume).
    # LAYOUT=ashape_topk: the A-shape + tile top-k model, whose variants rewrite its block top-k heads
    # (Q_VARIANTS=a_shape: every head A-shape with a 1024 window; query_max: block top-k scoring by each
    # query block's best query; nsa: query_max plus NSA's gated compressed branch on those heads, compress: 1;
    # Q_ARGS="--score-block 32 --compress-block 32": their selection scores a key block by its best 32-key
    # sub-block, the compressed branch's own logits, as NSA selects; "--top-k 16": they keep 16 blocks, not 8;
    # Q_VARIANTS=token_union Q_ARGS="--score-block 1": per-token choices by single-key scores, the tile's union;
    # Q_VARIANTS=query_share Q_ARGS="--score-block 1": per query block, ranked by its queries' best log share;
    # Q_VARIANTS=union_all: token_union in every head, the A-shape heads too: with "--union-blocks 8" and
    # the preset's SSMax, short phase and dense warm-up, the zoo preset's recipe)
    # (Q_STEPS, Q_EVAL_EVERY, Q_OVERRIDES: other steps, eval cadence, overrides; Q_OUT, Q_ARGS: a run longer
    # than one call: Q_ARGS="--checkpoint-every 600" in the first call, which the time limit stops with a
    # checkpoint (SIGINT), Q_ARGS="--checkpoint-every 600 --resume" in the next while the machine is warm)
    # (Q_SEEDS="0 1": one process per variant and seed, all at once on the GPU (quality runs share it;
    # their tokens/s are then not speeds), out in $Q_OUT/s<seed>; the first runs alone until it has
    # written the token cache, so all train on one tokenizer; a variant's own overrides after "@",
    # e.g. Q_VARIANTS="dense,union_all@model.attention.dense_warmup=0.75")
    quality) Q_OUT=${Q_OUT:-/tmp/q16}
            if [ -z "${Q_SEEDS:-}" ]; then
              quality_run ${Q_VARIANTS:-dense,preset} $Q_OUT ${T_QUALITY:-570}
            else
              tq=$(date +%s); first=1
              for s in $Q_SEEDS; do
                for v in ${Q_VARIANTS//,/ }; do
                  log="$OUT/quality_s${s}_${v%%@*}.log"
                  quality_run "$v" $Q_OUT/s$s $(( ${T_QUALITY:-570} - $(date +%s) + tq )) train.seed=$s > "$log" 2>&1 &
                  if [ $first = 1 ]; then  # the corpus line follows the cached tokens
                    first=0; for i in $(seq 150); do grep -q "^data: " "$log" && break; sleep 2; done
                  fi
                done
              done
              wait
            fi
            cat $Q_OUT/train_attention.jsonl $Q_OUT/s*/train_attention.jsonl > "$OUT/quality.jsonl" 2>/dev/null
            for f in $Q_OUT/*/metrics.jsonl; do
              [ -f "$f" ] && cp "$f" "$OUT/quality_$(basename "${f%/*}").metrics.jsonl"
            done
            for f in $Q_OUT/s*/*/metrics.jsonl; do  # quality_s<seed>_<variant>.metrics.jsonl
              d=${f%/*}; [ -f "$f" ] && cp "$f" "$OUT/quality_$(basename "${d%/*}")_$(basename "$d").metrics.jsonl"
            done ;;
    tests)  timeout ${T_TESTS:-45} $PY -m pytest -q -m gpu tests/layers/attention/test_block_topk.py -p no:cacheprovider 2>&1 | tail -n 15 ;;
  esac
  echo "== $part: $(( $(date +%s) - t0 )) s"
done
