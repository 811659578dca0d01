#!/usr/bin/env bash
# On the GPU machine, after the four vLLM carry calls of ../shared/vllm/README.md (the fourth
# installs vLLM into /tmp/site): vLLM 0.26.0 and this engine back to back, per shape, the same
# workloads (decode ms per step at batch 1/8/64/256, the 256-request throughput); with
# PREFILL=1 also the 1B prefill of both. HF=1 runs instead transformers' decode on the same
# workload (benchmarks/hf_decode.py, a call of its own). One call per shape fits the 10-minute
# limit:
#   SHAPE=llama-3.2-1b PREFILL=1 OUT=$OUT bash scripts/gpu_vs_vllm.sh
#   SHAPE=llama-3.2-3b OUT=$OUT bash scripts/gpu_vs_vllm.sh
#   SHAPE=llama-3.2-3b TP=2 OUT=$OUT bash scripts/gpu_vs_vllm.sh     (two GPUs)
# JSON lands in $OUT under the names benchmarks/side_by_side.py reads
# (vllm_SHAPE[_tp2].json, ours_SHAPE[_tp2]_{latency,throughput}.json, vllm_prefill_SHAPE.txt,
# hf_SHAPE.json); `python3 benchmarks/side_by_side.py $OUT table.md plot.png` makes the table.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, the environment, $B
SHAPE=${SHAPE:-llama-3.2-1b}; TP=${TP:-1}
SUFFIX=$([ "$TP" = 1 ] || echo "_tp$TP")
VC=/tmp/vc/call4
if [ "${HF:-0}" = 1 ]; then
  timeout 540 python3 benchmarks/hf_decode.py "$SHAPE" "$OUT/hf_$SHAPE.json" 2>&1 | grep bs
  exit
fi
(export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0
 TP=$TP OUT=$OUT timeout 280 python3 $VC/vllm_bench.py "$SHAPE" 2>&1 \
   | grep -v "it/s\|WARN\|INFO" | tail -2
 if [ "${PREFILL:-0}" = 1 ]; then
   timeout 150 python3 $VC/prefill_bench.py vllm "${SHAPE#llama-3.2-}" 2>&1 \
     | grep "prefill" | tee "$OUT/vllm_prefill_$SHAPE.txt"
 fi)
$B latency --model "$SHAPE" --tensor-parallel-size "$TP" \
  --json "$OUT/ours_${SHAPE}${SUFFIX}_latency.json" 2>&1 | grep -v "it/s" | tail -7
# Token ids only, as vllm_bench.py asks of vLLM (detokenize=False).
$B throughput --model "$SHAPE" --tensor-parallel-size "$TP" --disable-detokenize \
  --json "$OUT/ours_${SHAPE}${SUFFIX}_throughput.json" 2>&1 | tail -1
if [ "${PREFILL:-0}" = 1 ]; then
  $B prefill --model "$SHAPE" --max-model-len 8192 \
    --json "$OUT/ours_${SHAPE}_prefill.json" 2>&1 | grep -v "it/s" | tail -2
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
