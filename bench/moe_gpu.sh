#!/usr/bin/env bash
# The MoE end-to-end runs of BENCHMARKS.md (issue 16) in one GPU call (H200): our model vs torchtitan's on
# the identical OLMoE-shaped model (with a 3-step profile of each: where the device time goes), the
# dim-512 MoE step against the dense step (compiled, profiled), FP8 experts vs bf16 over 300 steps, and
# equal-time quality (dense, MoE, neuron-routed; two seeds; each run trains until 45 s of steady GPU time,
# the neuron-routed ones a step count from the probe: bench/train_moe.py). Each part has its own time limit.
#
#     python bench/train_moe.py --prepare .tok2k --max-files 40        # once, on any machine (vocab 2048)
#     python bench/train_moe.py --prepare .tok25 --max-files 120 --max-tokens 26000000   # for `equal`: 45 s of
#         the dense D 512 model reads ~50M tokens, 5 epochs of .tok2k's 9.8M; 26M tokens still fit one transfer
#     OUT=/tmp/out TOK=.tok2k bash bench/moe_gpu.sh [titan small fp8 equal]
#     (EQUAL_SUITE=equal_time_graphs: `equal` with dense and MoE as CUDA graphs, each at its fastest step;
#     EQUAL_SUITE=equal_time_moe_shapes EQUAL_SEEDS=0: dense and three other MoE layouts (the top-1 ones on
#     the Switch router), one seed, ~450 s)
#
# torchtitan 0.3.0 and what it imports that the H200 image lacks travel as wheels on PYTHONPATH
# (bench/torchtitan_moe.py's docstring lists them). Results under $OUT (json per part, one log).
set -u
TOK=${TOK:?TOK: a folder written by bench/train_moe.py --prepare}
PARTS=${*:-titan small fp8 equal}
. "$(dirname "$0")/gpu_env.sh" /tmp/moe_gpu_out
for part in $PARTS; do
  t0=$(date +%s)
  case $part in
    titan) timeout ${T_TITAN:-240} $PY bench/torchtitan_moe.py --layers 8 --batch 4 --steps 30 --tokens "$TOK" \
             --profile-at 12 --profile-dir "$OUT/titan_profile" --out "$OUT/titan.json" ;;
    small) timeout ${T_SMALL:-240} $PY bench/train_moe.py --tokens "$TOK" --suite speed_512 --speed-steps 40 --compile \
             --profile-at 30 --runs /tmp/moe_small --out "$OUT/small.json" ;;
    fp8)   timeout ${T_FP8:-240} $PY bench/train_moe.py --tokens "$TOK" --suite speed_fp8 --speed-steps 300 \
             --runs /tmp/moe_fp8 --out "$OUT/fp8.json" ;;
    equal) timeout ${T_EQUAL:-420} $PY bench/train_moe.py --tokens "$TOK" --suite ${EQUAL_SUITE:-equal_time} --seconds 45 --seeds ${EQUAL_SEEDS:-0,1} \
             --compile --runs /tmp/moe_equal --out "$OUT/equal.json" ;;
    *) echo "unknown part $part (titan small fp8 equal)"; exit 2 ;;
  esac
  echo "== $part: $(( $(date +%s) - t0 )) s"
done 2>&1 | grep -v -i "warn" | tee "$OUT/moe_gpu.log"
