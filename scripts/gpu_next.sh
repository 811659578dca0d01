#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2), from the repository root: the next session's first calls
# (benchmarks/NOTES.md, ninth and tenth sessions, "For the next GPU session"), each under 10
# minutes. Neither the ninth nor the tenth session had a two-GPU machine, so the TP=2 items of
# the eighth are still open (the tenth's eager warm-up also runs at TP > 1: its all-padding
# forwards all-reduce on every rank in the same order; untested on GPUs).
#   PART=1: first the CUDA tests (the TP=2 engine tests have not run on GPUs since the
#     eighth session's slice race, logit_bias and prompt logprobs at TP=2; the single-GPU
#     ones passed in the ninth); then TP=2 at batch 64, where vLLM's step was faster (2.722
#     against 2.838 ms, seventh session): our step profile at TP=2, batch 64
#     (`bench latency --profile 64`), to set beside vLLM's (`profile_decode.py vllm
#     llama-3.2-3b 64` with TP=2, after the four vLLM carry calls); then the TP=2 throughput
#     run's kernels, rank 0 (all-reduces 1.1 s per rank in the sixth session's profile).
#   PART=2: decode attention over the throughput run's mixed contexts by split count
#     (`paged_attention.py --mixed`; the ninth session's `--tiles` found the tiles optimal).
# Then the TP=2 pair with vLLM: `TP=2 SHAPE=llama-3.2-3b bash scripts/gpu_vs_vllm.sh`.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${PART:-1}" = 1 ]; then
# CUDA tests of the eighth session's later commits (prompt logprobs from the graphs' hidden
# states; logit_bias/allowed_token_ids and prompt logprobs at TP=2 ran on the CPU only)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_triton_engine.py \
  tests/distributed/test_tp_cuda.py 2>&1 | tail -4
timeout 200 $B latency --model llama-3.2-3b --tensor-parallel-size 2 --batches 64 \
  --profile 64 --json "$OUT/tp2_3b_bs64_profile.json" 2>&1 | grep -v "it/s" | tail -12
timeout 200 $B throughput --model llama-3.2-3b --tensor-parallel-size 2 --profile 1 \
  --disable-detokenize --json "$OUT/tp2_3b_thr_profile.json" 2>&1 | grep -v "it/s" | tail -18
else
timeout 400 python3 benchmarks/paged_attention.py --mixed --json "$OUT/attention_mixed.json" \
  2>&1 | grep "^|" | tail -60
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
