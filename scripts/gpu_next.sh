#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2), from the repository root: the first call of the session
# after 2026-11-30's sixth (benchmarks/NOTES.md, "For the next GPU session"), two calls of
# under 10 minutes: PART=1 item 1, PART=2 items 2-3.
#   1. the CUDA tests: the fused all-reduce + RMSNorm kernel test (now calling the kernel
#      directly; it failed last session only through the engine's routing), under a timeout;
#      then the TP and engine tests, which last ran before the scheduler's CachedRequestData
#      became parallel lists (18fd8e3);
#   2. the sixth session's host-side changes together (the pinned staging ring, 0c4c5a6, and
#      the scheduler's fast paths, 18fd8e3) against the code before them, 1B bench latency at
#      batch 1 / 64 / 256, ROUNDS alternating rounds. The code before 0c4c5a6 travels as an
#      untracked folder, made here before the call:
#        mkdir -p .ab_before && git archive 0c4c5a6~1 src | tar -x -C .ab_before
#      (BEFORE_SRC=.ab_before/src, the default; without it only the ring runs);
#   3. benchmarks/decode_gaps.py for the 1B at batch 64 and 256 (what they left).
# Everything lands in $OUT; the tables print.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${PART:-1}" = 1 ]; then
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_custom_all_reduce.py \
  -k "fused" 2>&1 | tail -30 > "$OUT/pytest_fused_kernel.log"
tail -3 "$OUT/pytest_fused_kernel.log"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_tp_cuda.py \
  tests/executor/test_input_batch.py tests/engine/test_seq_order_gpu.py \
  tests/engine/test_triton_engine.py 2>&1 | tail -30 > "$OUT/pytest_next.log"
tail -3 "$OUT/pytest_next.log"
else
BEFORE=${BEFORE_SRC:-.ab_before/src}
for round in $(seq "${ROUNDS:-2}"); do
  for code in before after; do
    P=src
    if [ "$code" = before ]; then
      [ -d "$BEFORE" ] || continue
      P=$BEFORE
    fi
    echo "== round $round, $code"
    PYTHONPATH=$P timeout 80 $B latency --model llama-3.2-1b --batches 1,64,256 \
      --json "$OUT/staging_${round}_$code.json" 2>&1 | grep -E "^\| [0-9]"
  done
done
for bs in 64 256; do
  timeout 90 python3 benchmarks/decode_gaps.py --model llama-3.2-1b --batch $bs \
    --json "$OUT/gaps_1b_bs$bs.json" 2>&1 | grep -v "it/s\|warn" | tail -6
done
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
