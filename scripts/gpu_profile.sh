#!/usr/bin/env bash
# On the GPU machine, from the repository root: kernel profiles (LLM.start_profile on every
# rank) of 3B decode at batch 1 and 256 at TP=1 and TP=2 (PROFILE_TP), and of the 1B prefill of
# one 8,000-token prompt and of 64 x 512 tokens. JSON in $OUT/profiles.tar; the tables print.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
for tp in ${PROFILE_TP:-2 1}; do
  echo "== llama-3.2-3b tp=$tp"
  $B latency --model llama-3.2-3b --tensor-parallel-size "$tp" --batches 1,256 --profile 1,256 \
    ${EXTRA:-} --json "$R/decode_3b_tp${tp}.json" 2>&1 | grep -v "it/s" | tail -40
done
echo "== llama-3.2-1b prefill"
$B prefill --model llama-3.2-1b --max-model-len 8192 --profile 1 ${EXTRA:-} \
  --json "$R/prefill_1b.json" 2>&1 | grep -v "it/s" | tail -34
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/gpu.txt"
tar -cf "$OUT/profiles.tar" -C "$R" .
