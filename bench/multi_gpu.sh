#!/usr/bin/env bash
# Issue 19 on one multi-GPU host (NCCL): weak scaling of train.py under torchrun at N = 1, 2, 4, 8 for an
# expert-parallel preset (OLMoE-1B-7B's layer shape, parallel.ep=N) and a dense FSDP2 preset (LLaMA-7B's
# layer shape), the loss against one GPU with the same global batch (grad_accum=N there), the share of
# device time in communication (logging.profile_at), and DCP checkpoints: save at the largest N, resume
# there (bit-exact), load at N/2 with twice the per-GPU batch (resharding, the loss continuing).
#
#     OUT=/tmp/out bash bench/multi_gpu.sh [scale loss ckpt]      # NGPU defaults to nvidia-smi's count
#     OUT=/tmp/out bash bench/multi_gpu.sh summary                 # only the summary of runs already made
#
# Per-GPU batch is fixed (weak scaling): tokens/s per GPU and MFU at each N from metrics.jsonl, efficiency
# = per-GPU tokens/s at N over N=1. Keep NVLink multicast off (the device README): NCCL_NVLS_ENABLE=0.
set -u
PARTS=${*:-scale loss ckpt}
. "$(dirname "$0")/gpu_env.sh" /tmp/multi_gpu_out
RUNS=${RUNS:-/tmp/multi_gpu_runs}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
COMMON="logging.wandb=disabled logging.progress=false logging.log_every=5 train.eval_every=1000 \
train.eval_batches=2 checkpoint.every=0 data.max_files=700 data.cache_dir=/tmp/moezoo_cache train.compile=true ${EXTRA:-}"
# the two models (config, then overrides); EP, DENSE and EXTRA (appended to every run) may be set from outside,
# e.g. the CPU smoke run: NGPU=2 EP=zoo/tiny_moe.yaml DENSE=zoo/tiny_dense.yaml EXTRA="train.device=cpu train.compile=false"
EP_BATCH=${EP_BATCH:-4}     # sequences per GPU of the EP runs
EP=${EP:-"zoo/olmoe_1b_7b.yaml model.n_layers=4 model.vocab_size=8192 train.batch_size=$EP_BATCH"}
DENSE=${DENSE:-"zoo/llama_7b.yaml model.n_layers=4 model.vocab_size=8192 train.batch_size=2 train.seq_len=4096"}
NS=(); for n in 1 2 4 8; do [ "$n" -le "$NGPU" ] && NS+=("$n"); done
MAXN=${NS[-1]}

launch() {   # launch N NAME CONFIG OVERRIDES...: train.py on N local GPUs into $RUNS/NAME (RESUME=1: --resume)
  # argparse order: --config, every override (the call's after $COMMON, so they win), then --resume
  local n=$1 name=$2 cfg=$3; shift 3
  if [ "$n" -eq 1 ]; then cmd=($PY train.py); else cmd=($PY -m torch.distributed.run --standalone --nproc_per_node "$n" train.py); fi
  timeout ${T_RUN:-300} "${cmd[@]}" --config "$cfg" $COMMON "$@" train.out_dir="$RUNS/$name" ${RESUME:+--resume} \
    > "$RUNS/$name.log" 2>&1
  echo "$name rc=$? $(tail -n 1 "$RUNS/$name.log")"
}

mkdir -p "$RUNS"; echo "ranks: $NGPU"
for part in $PARTS; do
  t0=$(date +%s)
  case $part in
    scale)   # 30 steps each, profile of steps 20-22 (communication share), per-GPU batch fixed
      for n in "${NS[@]}"; do
        launch "$n" "ep_n$n" $EP parallel.ep=$n train.steps=30 logging.profile_at=20
        launch "$n" "dense_n$n" $DENSE train.steps=30 logging.profile_at=20
      done ;;
    loss)    # 20 steps at N = MAXN against one GPU with the same global batch. The MoE reference takes it as
             # one batch, not grad_accum: the balance loss is over the global batch under EP
             # (model.moe.global_balance) but per micro-batch when accumulating (4e-3 apart in the CPU smoke)
      launch 1 "ep_ref" $EP train.batch_size=$((EP_BATCH * MAXN)) train.steps=20
      launch "$MAXN" "ep_loss" $EP parallel.ep=$MAXN train.steps=20
      launch 1 "dense_ref" $DENSE train.grad_accum=$MAXN train.steps=20
      launch "$MAXN" "dense_loss" $DENSE train.steps=20 ;;
    ckpt)    # save at step 10 of 20 at MAXN; resume there; load at MAXN/2 with twice the per-GPU batch
      launch "$MAXN" "ckpt_full" $EP parallel.ep=$MAXN train.steps=20 checkpoint.every=10
      cp -r "$RUNS/ckpt_full" "$RUNS/ckpt_half"
      rm -rf "$RUNS/ckpt_full/checkpoints/step_00000020" "$RUNS/ckpt_half/checkpoints/step_00000020"
      cp "$RUNS/ckpt_full/metrics.jsonl" "$RUNS/ckpt_full_straight.jsonl"
      RESUME=1 launch "$MAXN" "ckpt_full" $EP parallel.ep=$MAXN train.steps=20 checkpoint.every=10
      [ "$MAXN" -gt 1 ] && RESUME=1 launch $((MAXN / 2)) "ckpt_half" $EP parallel.ep=$((MAXN / 2)) \
        train.batch_size=$((EP_BATCH * 2)) train.steps=20 checkpoint.every=10 ;;
  esac
  echo "== $part: $(( $(date +%s) - t0 )) s"
done 2>&1 | tee "$OUT/multi_gpu.log"

$PY - "$RUNS" "$OUT" <<'EOF'
import glob, json, os, sys
runs, out = sys.argv[1], sys.argv[2]
def rows(name):
    p = os.path.join(runs, name, "metrics.jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
def losses(rs):
    return {r["step"]: r["loss/total"] for r in rs if "loss/total" in r}
summary = {}
for kind in ("ep", "dense"):
    base = None
    dirs = [d for d in glob.glob(os.path.join(runs, f"{kind}_n*")) if os.path.isdir(d)]
    for d in sorted(dirs, key=lambda p: int(p.rsplit("n", 1)[1])):
        n = int(d.rsplit("n", 1)[1]); rs = rows(os.path.basename(d))
        speed = [r for r in rs if "tokens_per_s" in r][1:]          # the first window holds compilation
        speed = [r for r in speed if "profile/step_ms" not in r]
        if not speed:
            continue
        tps = sum(r["tokens_per_s"] for r in speed) / len(speed) / n
        prof = next((r for r in rs if "profile/step_ms" in r), {})
        base = base or tps
        summary[f"{kind}_n{n}"] = {"tokens_per_s_per_gpu": round(tps), "efficiency": round(tps / base, 3),
                                   "mfu": speed[-1].get("mfu"), "comm_share": prof.get("profile/communication_share"),
                                   "step_ms_profiled": prof.get("profile/step_ms")}
for kind in ("ep", "dense"):
    a, b = losses(rows(f"{kind}_ref")), losses(rows(f"{kind}_loss"))
    if a and b:
        summary[f"{kind}_loss_max_diff_vs_1gpu"] = max(abs(a[s] - b[s]) for s in a if s in b)
straight = losses([json.loads(l) for l in open(os.path.join(runs, "ckpt_full_straight.jsonl"))]) \
    if os.path.exists(os.path.join(runs, "ckpt_full_straight.jsonl")) else {}
for name in ("ckpt_full", "ckpt_half"):
    got = losses(rows(name))
    if straight and got:
        summary[f"{name}_resume_max_diff"] = max(abs(straight[s] - got[s]) for s in got if s in straight and s > 10)
print(json.dumps(summary, indent=1))
json.dump(summary, open(os.path.join(out, "multi_gpu.json"), "w"), indent=1)
EOF
