#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2), from the repository root: the first call of the session
# after 2026-11-30's fifth (benchmarks/NOTES.md, "For the next GPU session"), in two calls of
# under 10 minutes each: PART=1 items 1-2, PART=2 items 3-5 (the same machine start):
#   1. the CUDA tests of the fused all-reduce + RMSNorm (kernel against NCCL + RMSNorm, eager
#      and in a graph; the engine's tokens with and without) and of the ordered decode splits,
#      each under a timeout (a fused kernel that deadlocks must not eat the call);
#   2. benchmarks/all_reduce.py --norm (us per all-reduce + RMSNorm, unfused and fused);
#   3. 3B TP=2 bench latency and throughput without, then with --fused-all-reduce-norm;
#   4. benchmarks/seq_order_ab.py for the 3B (batch order against longest first with the
#      ordered split rule, ORDERED_WAVES); 5. 3B bench latency with a profile at batch 1 and 64
#      (host time per step).
# Everything lands in $OUT (pytest logs, nextPART.tar); the tables print.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${PART:-1}" = 1 ]; then
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_custom_all_reduce.py \
  -k "fused" 2>&1 | tail -30 > "$OUT/pytest_fused_kernel.log"
tail -3 "$OUT/pytest_fused_kernel.log"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_tp_cuda.py \
  tests/engine/test_seq_order_gpu.py 2>&1 | tail -30 > "$OUT/pytest_next.log"
tail -3 "$OUT/pytest_next.log"
timeout 120 python3 benchmarks/all_reduce.py --norm --json "$R/all_reduce_norm.json" 2>&1 | tail -9
else
for flag in "" --fused-all-reduce-norm; do
  echo "== 3B TP=2 ${flag:-unfused}"
  timeout 100 $B latency --model llama-3.2-3b --tensor-parallel-size 2 $flag \
    --json "$R/tp2_latency${flag:+_fused}.json" 2>&1 | grep -v "it/s" | tail -6
  timeout 100 $B throughput --model llama-3.2-3b --tensor-parallel-size 2 $flag \
    --json "$R/tp2_throughput${flag:+_fused}.json" 2>&1 | tail -1
done
timeout 150 python3 benchmarks/seq_order_ab.py --json "$R/seq_order_ab_3b.json" 2>&1 \
  | grep "^|\|llama"
# Issue 10's host time per step at batch 64 (wall minus GPU kernel time), 3B at TP=1.
timeout 100 $B latency --model llama-3.2-3b --profile 1,64 --json "$R/latency_3b_profile.json" \
  2>&1 | grep -v "it/s" | grep -E "^\| [0-9]|profile" | head -8
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/gpu.txt"
tar -cf "$OUT/next${PART:-1}.tar" -C "$R" .
