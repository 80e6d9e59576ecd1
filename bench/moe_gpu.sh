#!/usr/bin/env bash
# The MoE end-to-end runs of BENCHMARKS.md (issue 16) in one GPU call (H200): our model vs torchtitan's on
# the identical OLMoE-shaped model (with a 3-step profile of each: where the device time goes), the
# dim-512 MoE step against the dense step (compiled, profiled), FP8 experts vs bf16 over 300 steps, and
# equal-time quality (dense, MoE, neuron-routed; two seeds; each run trains until 45 s of steady GPU time,
# the neuron-routed ones a step count from the probe: bench/train_moe.py). Each part has its own time limit.
#
#     python bench/train_moe.py --prepare .tok2k --max-files 40        # once, on any machine (vocab 2048)
#     OUT=/tmp/out TOK=.tok2k bash bench/moe_gpu.sh [titan small fp8 equal layer]
#     `layer` (no TOK needed): bench/moe.py at the dim-512 model's shape with the weight gradients split in
#     1, 2, 4 parts and the automatic choice, then the FP8 quantizers' tile sweep (bench/fp8_quant.py), then
#     the Mixtral shape bf16 / ours FP8 at the sweep's best tiles / torchao's FP8 (with a profile per
#     variant), then the fine-grained shape against megablocks when it is importable (build it
#     first: bash .peers/build_megablocks.sh, ~190 s). `split`: the dim-512 dense and MoE steps as CUDA graphs
#     (speed_512_graphs, 40 steps) with the MoE's weight gradients split as kernels.grouped_wgrad chooses and
#     unsplit (--wgrad-splits 1), in one call; the split run also times both with train.param_dtype=bfloat16
#     (speed_512_graphs_bf16w: bf16 matmul weights, float32 masters in the optimizer). SPLITS picks the runs
#     (default "auto 1"; SPLITS=auto: the split run only).
#     `equal` reads EQUAL_TOK, by default a folder it tokenises on the device from every installed package
#     (data.source python_packages, ~80 s on the H200's 16 cores, 151M training tokens on its image; kept in
#     /tmp/tok_pkgs while the machine stays warm). 45 s of the dense D 512 model reads ~65M tokens: a folder
#     that fits one transfer (64 MiB, e.g. --prepare .tok25 --max-files 120 --max-tokens 26000000) is read
#     2.5 times over, and val loss then rewards the slower model (bench/train_moe.py prints the epochs).
#     EQUAL_SECONDS: each run's steady seconds (45). The .tok25 rows of BENCHMARKS.md: EQUAL_TOK=.tok25.
#     (EQUAL_SUITE=equal_time_graphs: `equal` with dense and MoE as CUDA graphs, each at its fastest step;
#     EQUAL_SUITE=equal_time_moe_shapes EQUAL_SEEDS=0: dense and three other MoE layouts (the top-1 ones on
#     the Switch router), one seed, ~450 s; EQUAL_SUITE=equal_time_moe_experts / equal_time_moe_interleaved
#     EQUAL_SEEDS=0: top-2 of 16 and 32 experts in every layer / top-2 of 8 and 16 in every other layer, ~430 s)
#
# torchtitan 0.3.0 and what it imports that the H200 image lacks travel as wheels on PYTHONPATH
# (bench/torchtitan_moe.py's docstring lists them). Results under $OUT (json per part, one log).
set -u
PARTS=${*:-titan small fp8 equal layer split}
case " $PARTS " in *" titan "*|*" small "*|*" fp8 "*|*" split "*)
  TOK=${TOK:?TOK: a folder written by bench/train_moe.py --prepare (titan, small, fp8 and split read it)} ;; esac
. "$(dirname "$0")/gpu_env.sh" /tmp/moe_gpu_out
for part in $PARTS; do
  t0=$(date +%s)
  case $part in
    titan) timeout ${T_TITAN:-330} $PY bench/torchtitan_moe.py --layers 8 --batch 4 --steps 30 --tokens "$TOK" \
             --profile-at 12 --profile-dir "$OUT/titan_profile" --out "$OUT/titan.json" ;;
    small) timeout ${T_SMALL:-240} $PY bench/train_moe.py --tokens "$TOK" --suite speed_512 --speed-steps 40 --compile \
             --profile-at 30 --runs /tmp/moe_small --out "$OUT/small.json" ;;
    fp8)   timeout ${T_FP8:-240} $PY bench/train_moe.py --tokens "$TOK" --suite speed_fp8 --speed-steps 300 \
             --runs /tmp/moe_fp8 --out "$OUT/fp8.json" ;;
    equal) EQUAL_TOK=${EQUAL_TOK:-/tmp/tok_pkgs}
           [ -f "$EQUAL_TOK/meta.json" ] || timeout ${T_PREP:-200} $PY bench/train_moe.py --prepare "$EQUAL_TOK" --cache-dir /tmp/tok_cache \
             || { echo "equal: tokenising into $EQUAL_TOK failed"; continue; }
           timeout ${T_EQUAL:-420} $PY bench/train_moe.py --tokens "$EQUAL_TOK" --suite ${EQUAL_SUITE:-equal_time} --seconds ${EQUAL_SECONDS:-45} --seeds ${EQUAL_SEEDS:-0,1} \
             --compile --runs /tmp/moe_equal --out "$OUT/equal.json" ;;
    layer) mkdir -p "$OUT/layer_profile"
           timeout ${T_LAYER_SMALL:-100} $PY bench/moe.py --shapes small --reps 20 --only ours,ours_wgrad_split1,ours_wgrad_split2,ours_wgrad_split4 \
             --profile "$OUT/layer_profile" --out "$OUT/layer_small.json" | grep -E "^small "
           rm -f "$OUT/fp8_tiles"
           timeout ${T_QUANT:-120} $PY bench/fp8_quant.py --out "$OUT/fp8_quant.json" --best "$OUT/fp8_tiles"
           tiles=$(cat "$OUT/fp8_tiles" 2>/dev/null)
           timeout ${T_LAYER_MIXTRAL:-170} $PY bench/moe.py --shapes mixtral --reps 10 --only ours,ours_fp8,torchao_fp8 \
             ${tiles:+--fp8-tiles "$tiles"} --profile "$OUT/layer_profile" --out "$OUT/layer_mixtral.json" | grep -E "^mixtral |failed"
           if $PY -c "import megablocks" 2>/dev/null; then
             timeout ${T_LAYER_FINE:-150} $PY bench/moe.py --shapes fine --reps 10 --only ours --out "$OUT/layer_fine.json" | grep -E "^fine "
           fi ;;
    split) for sp in ${SPLITS:-auto 1}; do
             if [ $sp = auto ]; then extra=(--suite speed_512_graphs,speed_512_graphs_bf16w)
             else extra=(--suite speed_512_graphs --wgrad-splits $sp); fi
             timeout ${T_SPLIT:-150} $PY bench/train_moe.py --tokens "$TOK" --speed-steps 40 --compile \
               "${extra[@]}" --runs /tmp/moe_split_$sp --out "$OUT/split_$sp.json" | grep -A3 "^run "
           done ;;
    *) echo "unknown part $part (titan small fp8 equal layer split)"; exit 2 ;;
  esac
  echo "== $part: $(( $(date +%s) - t0 )) s"
done 2>&1 | grep -v -i "warn" | tee "$OUT/moe_gpu.log"
