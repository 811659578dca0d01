#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2), from the repository root, ~5 minutes: the decode
# attention dispatched longest context first (seq_order). 1. its CUDA tests (the paged decode
# kernel in random orders, the unified decode path, the engine's tokens with and without);
# 2. benchmarks/paged_attention.py --mixed (each split count in batch order and longest first);
# 3. benchmarks/seq_order_ab.py (3B throughput, batch order then longest first); 4. 3B TP=2
# bench throughput. Output in $OUT (pytest log, order.tar); the tables print.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py \
  tests/kernels/test_unified_attention.py tests/engine/test_seq_order_gpu.py \
  tests/engine/test_pdl_engine.py -k "(paged or decode or seq_order or pdl) and not interpreter" 2>&1 | tail -25 \
  > "$OUT/pytest_order.log"
tail -3 "$OUT/pytest_order.log"
(cd benchmarks && PYTHONPATH=../src timeout 150 python3 paged_attention.py --mixed \
  --json "$R/paged_mixed_order.json" 2>&1 | grep -A80 "by split count" > "$R/paged_mixed_order.txt")
cat "$R/paged_mixed_order.txt"
timeout 200 python3 benchmarks/seq_order_ab.py --json "$R/seq_order_ab.json" 2>&1 | grep "^|\|llama"
timeout 120 python3 src/llm_inference/entrypoints/bench.py throughput --model llama-3.2-3b \
  --tensor-parallel-size 2 --json "$R/tp2_throughput.json" 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/gpu.txt"
tar -cf "$OUT/order.tar" -C "$R" .
