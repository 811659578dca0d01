#!/usr/bin/env bash
# On the GPU machine, from the repository root: every CUDA test, then (BENCH=1) the decode
# latency of this tree and, when OLD_SRC names another checkout's src/ (carried), of that one,
# back to back on one machine. Logs and results go to $OUT (or /tmp/gpu_out).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
PYTHONPATH=src python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/entrypoints/test_llm.py \
  tests/engine/test_triton_engine.py tests/kernels tests/layers tests/executor} \
  -k "${TESTS_K:-not interpreter}" 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
if [ "${BENCH:-1}" = 1 ]; then
  for shape in ${SHAPES:-llama-3.2-1b}; do
    if [ -n "${OLD_SRC:-}" ]; then
      PYTHONPATH="$OLD_SRC" python3 src/llm_inference/entrypoints/bench.py latency \
        --model "$shape" --batches "${BATCHES:-1,8,64,256}" --json "$OUT/latency_old_$shape.json" \
        2>&1 | grep -v "it/s\]" | tail -8
    fi
    PYTHONPATH=src python3 src/llm_inference/entrypoints/bench.py latency --model "$shape" \
      --batches "${BATCHES:-1,8,64,256}" --json "$OUT/latency_new_$shape.json" 2>&1 \
      | grep -v "it/s\]" | tail -8
  done
fi
