#!/usr/bin/env bash
# On the GPU machine, from the repository root: the CUDA tests, then the end-to-end benchmark.
# Logs and results go to $OUT (or /tmp/gpu_out).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/engine/test_llm.py tests/engine/test_triton_engine.py \
  tests/kernels -k "cuda or triton_engine or not interpreter" 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/e2e_latency.py --shapes "${SHAPES:-1b,3b}" --out "$OUT/e2e_latency.md" 2>&1 \
    | tee "$OUT/e2e.log" | tail -30
fi
