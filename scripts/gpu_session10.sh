#!/usr/bin/env bash
# On the GPU machine (nvidia-h200), from the repository root: the tenth session's calls.
#   PART=1: the CUDA tests of the eager warm-up (test_first_requests_compile_nothing with and
#     without graphs) and of the attention kernels (num_splits no longer specialized), then
#     `benchmarks/first_run.py --enforce-eager` on an empty Triton cache: what an eager
#     engine still compiles after its start (before: 10 compiles on the first 8 requests,
#     5 in the first throughput run).
#   PART=2: the no-compile test before and after; first_run.py --enforce-eager again (the LM
#     head at one row now warmed up too); then decode latency, graphs on, of the code before
#     (extracted by the caller to .ab_old/src with `git archive 87d6a5a src`) and after,
#     alternating: the attention's split count unspecialized and the decode kernel's unused
#     merge tile fixed must cost nothing.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${PART:-1}" = 3 ]; then :
elif [ "${PART:-1}" = 1 ]; then
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/engine/test_triton_engine.py \
  tests/kernels tests/executor -k "not interpreter" 2>&1 | tail -6
TRITON_CACHE_DIR=$(mktemp -d) timeout 240 python3 benchmarks/first_run.py --enforce-eager \
  --runs 2 --json "$OUT/first_run_eager_1b.json" 2>&1 | grep -v "it/s" | tail -20
else
# The no-compile test on this tree, then on the code before (expected to fail there: the eager
# engine's attention variants, and the LM head of a small batch at max_num_seqs 32).
for src in src .ab_old/src; do
  echo "== test_first_requests_compile_nothing with $src"
  PYTHONPATH=$src timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_triton_engine.py -k compile_nothing 2>&1 | grep -E "passed|failed|assert" | tail -4
done
TRITON_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/first_run.py --enforce-eager \
  --runs 1 --json "$OUT/first_run_eager_1b_final.json" 2>&1 | grep -v "it/s" | tail -6
for round in 1 2; do
  for side in old new; do
    src=src; [ "$side" = old ] && src=.ab_old/src
    echo "== round $round $side"
    PYTHONPATH=$src timeout 150 python3 $src/llm_inference/entrypoints/bench.py latency --model ${SHAPE:-llama-3.2-1b} --batches 1,8,64,256 \
      --json "$R/latency_${side}_$round.json" 2>&1 | grep -v "it/s" | tail -6
  done
done
tar -cf "$OUT/ab_latency.tar" -C "$R" .
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
# PART=3: the CUDA tests of the final tree on one GPU (the TP=2 ones skip there), after the
# session's CPU-side fixes (the CPU tests of these folders run too).
if [ "${PART:-1}" = 3 ]; then
timeout 540 python3 -m pytest -q -p no:cacheprovider tests/engine tests/kernels tests/layers \
  tests/executor tests/distributed tests/entrypoints/test_llm.py \
  -k "not interpreter" 2>&1 | tee "$OUT/pytest_cuda_all.log" | tail -8
fi
