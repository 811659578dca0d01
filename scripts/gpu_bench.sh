#!/usr/bin/env bash
# On the GPU machine, from the repository root: the CUDA tests (TESTS=1), then our benchmarks
# (bench latency with a profile at batch 1 and 64, throughput, prefill) for each shape in
# SHAPES, at tensor parallel size TP for each shape in TP_SHAPES, and transformers' decode ms/step
# for each shape in HF_SHAPES. Everything lands in $OUT/results.tar (a call
# brings back at most 8 files) plus the pytest log.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${TESTS:-1}" = 1 ]; then
  # the files with CUDA tests (the rest of the suite is CPU-only and runs in CI)
  python3 -m pytest -q -p no:cacheprovider ${TEST_PATHS:-tests/entrypoints/test_llm.py \
    tests/engine/test_triton_engine.py tests/engine/test_mixed_cuda_graphs.py \
    tests/engine/test_prefix_caching_gpu.py \
    tests/kernels/test_triton_kernels.py tests/kernels/test_unified_attention.py \
    tests/layers/test_sampler_gpu.py tests/distributed/test_tp_cuda.py \
    tests/distributed/test_custom_all_reduce.py tests/kernels/test_skinny_gemm.py \
    tests/engine/test_skinny_gemm_engine.py} \
    -k "not interpreter" 2>&1 | tail -40 > "$OUT/pytest_cuda.log"
  tail -4 "$OUT/pytest_cuda.log"
fi
for s in ${SHAPES-llama-3.2-1b llama-3.2-3b}; do
  $B latency --model "$s" --profile 1,64 --json "$R/ours_${s}_latency.json" 2>&1 | grep -v "it/s" | tail -9
  $B throughput --model "$s" --json "$R/ours_${s}_throughput.json" 2>&1 | tail -1
  [ "${PREFILL:-1}" = 1 ] && $B prefill --model "$s" --max-model-len 8192 --json "$R/ours_${s}_prefill.json" 2>&1 | tail -1
done
if [ -n "${TP_SHAPES:-}" ]; then  # tensor parallel over the machine's GPUs
  for s in $TP_SHAPES; do
    $B latency --model "$s" --tensor-parallel-size "${TP:-2}" --batches "${TP_BATCHES:-1,8,64,256}" \
      --json "$R/ours_${s}_tp${TP:-2}_latency.json" 2>&1 | grep -v "it/s" | tail -7
    $B throughput --model "$s" --tensor-parallel-size "${TP:-2}" \
      --json "$R/ours_${s}_tp${TP:-2}_throughput.json" 2>&1 | tail -1
  done
fi
for s in ${HF_SHAPES:-}; do python3 benchmarks/hf_decode.py "$s" "$R/hf_${s}.json" 2>&1 | grep bs; done
[ "${HOST_PROFILE:-0}" = 1 ] && python3 benchmarks/host_profile.py llama-3.2-1b 64 25 > "$R/host_profile.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/gpu.txt"
tar -cf "$OUT/results.tar" -C "$R" .
