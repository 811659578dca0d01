#!/usr/bin/env bash
# The ninth session's GPU calls (one nvidia-h200), from the repository root. $OUT gets a log
# and JSON (bundled in one tar where there are many); the tables print.
#   PART=1: the CUDA tests of the eighth session's last commits (prompt logprobs from the
#     graphs, the sampler on biased logits) and of this session's (L2 prefetch, the race's
#     approximate log); then the L2 prefetch alone (benchmarks/l2_prefetch.py) and the race
#     with the accurate and the approximate log (benchmarks/sampler_race.py).
#   Call 2 (inline): the prompt-logprobs test again, and `benchmarks/l2_prefetch.py --rows 1
#     --windows 0,4,8` with the empty-kernel column. The prefetch lost in both: the engine
#     A/B planned as PART=2 was not run, the wiring is l2_prefetch_engine.patch in the results.
#   PART=tests: the CUDA tests written after call 2 (prompt logprobs with the tolerance from
#     the GPU's rounding, biased and constrained rows on the Triton sampler).
#   PART=profile: the 1B batch-1 decode step's kernels, with PDL and without (issue 10's
#     0.87 ms target: what limits it).
# The vLLM pairs then run as scripts/gpu_vs_vllm.sh says, after the carry calls.
#   PART=reduce: the skinny GEMM's split-K sum in the GEMM's last program (no reduce kernel):
#     its CUDA tests, then bench latency at batch 1 / 8 / 16, 1B and 3B, alternating the code
#     before (.ab_x/src, `git archive e4da4fd src`) and after.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${PART:-1}" = 1 ]; then
timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=6 \
  tests/kernels/test_sampling_fast_log.py \
  tests/layers/test_sampler_gpu.py \
  tests/engine/test_triton_engine.py 2>&1 | tail -22 | tee "$OUT/pytest_cuda.log"
timeout 150 python3 benchmarks/l2_prefetch.py --rows 1,16 --json "$OUT/l2_prefetch.json" 2>&1 \
  | grep -v "^$" | tail -40
for flag in --accurate-log ""; do
  timeout 60 python3 benchmarks/sampler_race.py $flag 2>&1 | tail -8 | sed "s/^/[${flag:-fast}] /"
done
elif [ "$PART" = tests ]; then
timeout 200 python3 -m pytest -q -p no:cacheprovider -rA \
  "tests/engine/test_triton_engine.py::test_prompt_logprobs_with_graphs_equal_reference" \
  "tests/engine/test_triton_engine.py::test_biased_and_constrained_rows_on_the_triton_sampler" \
  tests/kernels/test_sampling_fast_log.py 2>&1 | tail -30 | tee "$OUT/pytest_cuda_tests.log"
elif [ "$PART" = reduce ]; then
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py \
  tests/kernels/test_pdl.py tests/engine/test_triton_engine.py 2>&1 | tail -6 \
  | tee "$OUT/pytest_reduce.log"
for model in llama-3.2-1b llama-3.2-3b; do
  for tree in .ab_x/src src .ab_x/src src; do
    tag=$([ $tree = src ] && echo new || echo old)
    PYTHONPATH=$tree timeout 100 $B latency --model $model --batches 1,8,16 \
      --json "$R/${model}_${tag}_$RANDOM.json" 2>&1 | grep "^| [0-9]" | sed "s/^/$model $tag /"
  done
done
tar -cf "$OUT/reduce_ab.tar" -C "$R" .
else
timeout 100 python3 -m pytest -q -p no:cacheprovider \
  "tests/engine/test_triton_engine.py::test_prompt_logprobs_with_graphs_equal_reference" \
  2>&1 | tail -3 | tee "$OUT/pytest_prompt_logprobs.log"
for pdl in --pdl --no-pdl; do
  timeout 150 $B latency --model llama-3.2-1b --batches 1 --profile 1 $pdl \
    --json "$OUT/latency_1b_bs1_profile${pdl#-}.json" 2>&1 | grep -v "it/s" | tail -14
done
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
