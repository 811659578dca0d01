#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2), from the repository root: the next session's first calls
# (benchmarks/NOTES.md, seventh session, "For the next GPU session"), each under 10 minutes.
#   PART=1: where the 1B throughput run's time goes. `bench throughput --profile 1` gives the
#     kernel time against the wall: 3.2 s measured against a 2.1 s floor, with decode steps
#     1.4-1.7x faster than vLLM's. host_step.py --throughput counts 1,027 steps, 18 with prompt
#     tokens. decode_gaps.py --throughput: the same run's idle GPU time, slice by slice.
#     Then the host's own speed on this machine: host_step.py --phases and
#     --throughput, the model stubbed, on the GPU host's CPU. Then decode_gaps.py at batch 128,
#     the mean decode batch of the run.
#   PART=2: TP=2 at batch 64, where vLLM's step was faster (2.722 against 2.838 ms): our step
#     profile at TP=2, batch 64 (`bench latency --profile 64`), to set beside vLLM's
#     (`profile_decode.py vllm llama-3.2-3b 64` with TP=2, after the four vLLM carry calls).
# The seventh session's calls (CUDA tests, the partial-sums A/B, the race A/B) are recorded in
# benchmarks/results/session7_2026-11-30_h200x2/README.md with their commands.
# Everything lands in $OUT; the tables print.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${PART:-1}" = 1 ]; then
timeout 150 $B throughput --model llama-3.2-1b --profile 1 --disable-detokenize \
  --json "$OUT/thr_1b_profile.json" 2>&1 | grep -v "it/s" | tail -18
timeout 200 python3 benchmarks/decode_gaps.py --throughput --slices 25 \
  --json "$OUT/gaps_1b_throughput.json" 2>&1 | grep -v "it/s\|warn" | tail -14
PYTHONPATH=src:tests timeout 150 python3 benchmarks/host_step.py --phases 2>&1 | tail -4 \
  | tee "$OUT/host_step_phases.txt"
PYTHONPATH=src:tests timeout 120 python3 benchmarks/host_step.py --throughput 2>&1 | tail -10 \
  | tee "$OUT/host_step_throughput.txt"
timeout 90 python3 benchmarks/decode_gaps.py --model llama-3.2-1b --batch 128 \
  --json "$OUT/gaps_1b_bs128.json" 2>&1 | grep -v "it/s\|warn" | tail -6
else
timeout 200 $B latency --model llama-3.2-3b --tensor-parallel-size 2 --batches 64 \
  --profile 64 --json "$OUT/tp2_3b_bs64_profile.json" 2>&1 | grep -v "it/s" | tail -12
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
