#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2), from the repository root: the seventh session's calls
# (benchmarks/NOTES.md), each under 10 minutes.
#   PART=1: the CUDA tests of everything since they last ran: the fused all-reduce + RMSNorm
#     kernel test (fixed, not re-run), the skinny GEMM's split-K partial sums summed by the
#     RMSNorm (kernel and engine), the pinned token slots, the staging ring, and the engine
#     and TP tests, which last ran before the scheduler's CachedRequestData (18fd8e3).
#   PART=2: decode ms per step, alternating rounds of three codes on one start:
#       old  = before the sixth session's host-side changes (0c4c5a6~1)
#       main = 0a515bc (the sixth session's end)
#       new  = this tree (partial sums into the norm, token slots)
#     1B at batch 1 / 8 / 64 / 256 and 3B at batch 1 / 8 / 64. The old codes travel as
#     untracked folders, made here before the call:
#       mkdir -p .ab_old .ab_main && git archive 0c4c5a6~1 src | tar -x -C .ab_old \
#         && git archive 0a515bc src | tar -x -C .ab_main
# Everything lands in $OUT; the tables print.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${PART:-1}" = 1 ]; then
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_custom_all_reduce.py \
  -k "fused" 2>&1 | tail -30 > "$OUT/pytest_fused_kernel.log"
tail -3 "$OUT/pytest_fused_kernel.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py \
  2>&1 | tail -30 > "$OUT/pytest_kernels.log"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py \
  -k rms_norm 2>&1 | tail -30 >> "$OUT/pytest_kernels.log"
tail -3 "$OUT/pytest_kernels.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/executor/test_pending.py \
  tests/executor/test_input_batch.py 2>&1 | tail -30 > "$OUT/pytest_executor.log"
tail -3 "$OUT/pytest_executor.log"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/engine/test_skinny_gemm_engine.py \
  tests/engine/test_triton_engine.py tests/distributed/test_tp_cuda.py 2>&1 | tail -30 \
  > "$OUT/pytest_engine.log"
tail -3 "$OUT/pytest_engine.log"
elif [ "${PART}" = 3 ]; then
# Small batches only, where the skinny GEMM runs: main, the token slots alone (this tree with
# layers/linear.py DEFER_SPLIT_K_REDUCE = False, in .ab_slots/src), and this tree.
for round in $(seq "${ROUNDS:-2}"); do
  for code in main slots new; do
    P=src
    [ "$code" = main ] && P=.ab_main/src
    [ "$code" = slots ] && P=.ab_slots/src
    echo "== round $round, $code"
    PYTHONPATH=$P timeout 60 $B latency --model llama-3.2-1b --batches 1,8,16 \
      --json "$OUT/small_1b_${round}_$code.json" 2>&1 | grep -E "^\| [0-9]"
    PYTHONPATH=$P timeout 60 $B latency --model llama-3.2-3b --batches 1,8 \
      --json "$OUT/small_3b_${round}_$code.json" 2>&1 | grep -E "^\| [0-9]"
  done
done
else
for round in $(seq "${ROUNDS:-2}"); do
  for code in old main new; do
    P=src
    [ "$code" = old ] && P=.ab_old/src
    [ "$code" = main ] && P=.ab_main/src
    [ -d "$P" ] || continue
    echo "== round $round, $code"
    PYTHONPATH=$P timeout 80 $B latency --model llama-3.2-1b --batches 1,8,64,256 \
      --json "$OUT/ab_1b_${round}_$code.json" 2>&1 | grep -E "^\| [0-9]"
    [ "$code" = old ] && continue
    PYTHONPATH=$P timeout 80 $B latency --model llama-3.2-3b --batches 1,8,64 \
      --json "$OUT/ab_3b_${round}_$code.json" 2>&1 | grep -E "^\| [0-9]"
  done
done
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
