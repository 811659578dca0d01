#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2), from the repository root: the first call of the session
# after 2026-11-30's fourth (benchmarks/NOTES.md, "For the next GPU session"), ~8 minutes:
#   1. the CUDA tests not run on the final code then (TP, prefix caching) and the new ones
#      (the split sampling race, PDL);
#   2. benchmarks/pdl_chain.py and benchmarks/paged_attention.py --mixed (kernel level);
#   3. 1B bench latency at 1,8,64,256 twice with a profile at batch 1 (the split race,
#      the frozen heap: the spread at 256), then with --pdl once.
# Everything lands in $OUT (pytest log, next.tar); the tables print.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; R=$(mktemp -d); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no multicast
B="python3 src/llm_inference/entrypoints/bench.py"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_tp_cuda.py \
  tests/engine/test_prefix_caching_gpu.py tests/engine/test_pdl_engine.py \
  tests/layers/test_sampler_gpu.py -k "not interpreter" 2>&1 | tail -30 > "$OUT/pytest_next.log"
tail -4 "$OUT/pytest_next.log"
python3 benchmarks/pdl_chain.py 2>&1 | tee "$R/pdl_chain.txt" | tail -6
(cd benchmarks && PYTHONPATH=../src timeout 120 python3 paged_attention.py --mixed \
  --json "$R/paged_mixed.json" 2>&1 | grep -A40 "by split count" > "$R/paged_mixed.txt")
cat "$R/paged_mixed.txt"
for i in 1 2; do
  $B latency --model llama-3.2-1b --profile 1 --json "$R/latency_1b_$i.json" 2>&1 \
    | grep -v "it/s" | grep -E "^\| [0-9]|profile|_kernel" | head -14
done
$B latency --model llama-3.2-1b --pdl --profile 1 --json "$R/latency_1b_pdl.json" 2>&1 \
  | grep -v "it/s" | grep -E "^\| [0-9]|profile|_kernel" | head -14
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/gpu.txt"
tar -cf "$OUT/next.tar" -C "$R" .
