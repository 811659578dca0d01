#!/usr/bin/env bash
# On the GPU machine, from the repository root: the CUDA tests (TESTS=1), then our benchmarks
# (bench latency with a profile at batch 1 and 64, throughput, prefill) for each shape in
# SHAPES, and transformers' decode ms/step (HF=1). Everything lands in $OUT/results.tar (a call
# brings back at most 8 files) plus the pytest log.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; R=$(mktemp -d); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=src
B="python3 src/llm_inference/entrypoints/bench.py"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider ${TEST_PATHS:-tests/entrypoints/test_llm.py tests/engine \
    tests/kernels tests/layers tests/executor} --ignore=tests/engine/test_smollm2.py \
    -k "not interpreter" 2>&1 | tail -40 > "$OUT/pytest_cuda.log"
  tail -4 "$OUT/pytest_cuda.log"
fi
for s in ${SHAPES:-llama-3.2-1b llama-3.2-3b}; do
  $B latency --model "$s" --profile 1,64 --json "$R/ours_${s}_latency.json" 2>&1 | grep -v "it/s" | tail -9
  $B throughput --model "$s" --json "$R/ours_${s}_throughput.json" 2>&1 | tail -1
  $B prefill --model "$s" --max-model-len 8192 --json "$R/ours_${s}_prefill.json" 2>&1 | tail -1
  [ "${HF:-0}" = 1 ] && python3 benchmarks/hf_decode.py "$s" "$R/hf_${s}.json" 2>&1 | grep bs
done
[ "${HOST_PROFILE:-0}" = 1 ] && python3 benchmarks/host_profile.py llama-3.2-1b 64 25 > "$R/host_profile.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/gpu.txt"
tar -cf "$OUT/results.tar" -C "$R" .
