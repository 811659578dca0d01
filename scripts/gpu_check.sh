#!/usr/bin/env bash
# On the GPU machine, from the repository root: the CUDA tests, then (BENCH=1) an A/B of this
# tree against another on one machine start, the check that a change made nothing slower.
#   RUN_TESTS=1 (default): pytest on TESTS (default: the folders that hold CUDA tests, their
#     CPU tests included; -k "not interpreter", whose cases need the CPU machine's Triton) into
#     $OUT/pytest_cuda.log. On one H200 (2026-12-02) tests/engine, tests/sample and
#     tests/kernels took 518 s and the rest 415 s: more than one call's 10 minutes, so give
#     TESTS in two calls. The TP=2 tests skip on one GPU; the SmolLM2 tests need the default
#     model (scripts/default_model_carry.sh).
#   BENCH=1: for each shape in SHAPES, `bench latency` (decode ms per step at BATCHES) and
#     `bench throughput` (the 256-request run, token ids only as vLLM's is measured), of this
#     tree and, when OLD_SRC names another checkout's src/ (for example
#     `git archive REV src | tar -x -C .ab_old`, then carried), of that one, alternating for
#     ROUNDS rounds: figures move between machine starts, so compare within one call only.
#     One shape and two rounds fit a 10-minute call. JSON lands in $OUT; the tables print.
#     BATCHES=none skips the latency, THROUGHPUT=0 the throughput run; WORKLOAD replaces the
#     throughput run's workload options (for example issue 28's chat-like mix, as
#     scripts/gpu_vs_vllm.sh MIXES=1 runs it);
#     ENGINE_ARGS go to both runs (for example --quantization fp8).
#   RUN_TESTS=0 BENCH=1 OLD_SRC=.ab_old/src SHAPES=llama-3.2-3b OUT=$OUT bash scripts/gpu_check.sh
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv \
  | tee "$OUT/gpu.txt"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  # Each test's outcome as it ends (-v): a run stopped at TEST_TIMEOUT (SIGINT; pytest then
  # prints its summary, unless an engine's shutdown swallows the interrupt) still names the
  # tests that failed, printed below with the last lines.
  timeout -s INT "${TEST_TIMEOUT:-560}" python3 -m pytest -v -rf --tb=short -p no:cacheprovider \
    ${TESTS:-tests/engine tests/sample tests/kernels tests/layers tests/executor \
    tests/distributed tests/models tests/entrypoints/test_llm.py} -k "${TESTS_K:-not interpreter}" \
    > "$OUT/pytest_cuda.log" 2>&1
  grep -E "^tests/.* (FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -40
  echo "$(grep -cE "^tests/.* PASSED" "$OUT/pytest_cuda.log") passed (counted as they ended)"
  tail -25 "$OUT/pytest_cuda.log"
fi
if [ "${BENCH:-0}" = 1 ]; then
  for shape in ${SHAPES:-llama-3.2-1b}; do
    for round in $(seq "${ROUNDS:-2}"); do
      for side in ${OLD_SRC:+old} new; do
        src=src; [ "$side" = old ] && src=$OLD_SRC
        # that tree's package, then gpu_env.sh's path after its src
        bench="env PYTHONPATH=$src:${PYTHONPATH#src:} python3 $src/llm_inference/entrypoints/bench.py"
        echo "== $shape round $round $side ($src)"
        [ "${BATCHES:-}" = none ] || timeout 200 $bench latency --model "$shape" \
          ${ENGINE_ARGS:-} --batches "${BATCHES:-1,8,64,256}" \
          --json "$OUT/latency_${shape}_${side}_$round.json" 2>&1 | grep -v "it/s" | tail -7
        [ "${THROUGHPUT:-1}" = 0 ] || timeout 200 $bench throughput --model "$shape" \
          --disable-detokenize ${ENGINE_ARGS:-} ${WORKLOAD:-} \
          --json "$OUT/throughput_${shape}_${side}_$round.json" 2>&1 | tail -2
      done
    done
  done
fi
