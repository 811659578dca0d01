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
#   SHAPE=qwen3-8b OUT=$OUT bash scripts/gpu_vs_vllm.sh                (also qwen2.5-7b, mistral-7b)
# vllm_bench.py knows the Llama 3.2 shapes only: for the others vLLM runs the same two workloads
# through benchmarks/vllm_throughput.py --latency (one vLLM start, the same JSON names).
# MIXES=1 runs instead the realistic mixes of issue 28 on both engines (one call per shape):
# chat-like (600 lognormal requests, temperature 0.8, top-p 0.95), prefill-heavy (256 prompts of
# 2,000 tokens, 8 new) and long (16 prompts of 12,000 tokens, 256 new), at max_model_len 16,384,
# 256 sequences, prefix caching off, unseeded vLLM requests (benchmarks/vllm_throughput.py);
# JSON as {ours,vllm}_SHAPE_mix_{chat,prefill,long}.json. PROFILE=1 adds each engine's GPU
# kernel seconds by kernel (a second, profiled run; vLLM's engine core then runs in-process, so
# take that run's speed figures from a call without PROFILE). MIX_LIST picks the mixes.
# QUANT=fp8 gives both engines `--quantization fp8` (vLLM's decode then goes through
# benchmarks/vllm_throughput.py --latency for every shape; JSON names as without it).
# OTHER_SRC (another checkout's src/, carried, as gpu_check.sh's OLD_SRC) runs that tree's
# bench after ours on the same workloads: on each mix (other_SHAPE_mix_*.json), or its decode
# and throughput (other_SHAPE[_tp2]_{latency,throughput}.json): a branch against main and vLLM.
# JSON lands in $OUT under the names benchmarks/side_by_side.py reads
# (vllm_SHAPE[_tp2].json, ours_SHAPE[_tp2]_{latency,throughput}.json, vllm_prefill_SHAPE.txt,
# hf_SHAPE.json); `python3 benchmarks/side_by_side.py $OUT table.md plot.png` makes the table.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, the environment, $B
SHAPE=${SHAPE:-llama-3.2-1b}; TP=${TP:-1}
SUFFIX=$([ "$TP" = 1 ] || echo "_tp$TP")
Q=${QUANT:+--quantization $QUANT}
VC=/tmp/vc/call4
ours_and_other() {  # NAME ARGS...: our bench, then OTHER_SRC's (each cut at 540 s: a hang)
  local name=$1; shift
  timeout 540 $B "$@" --json "$OUT/ours_$name.json" 2>&1 | grep -v "it/s" | tail -7
  if [ -n "${OTHER_SRC:-}" ]; then
    echo "== $OTHER_SRC"
    PYTHONPATH=$OTHER_SRC:${PYTHONPATH#src:} timeout 540 \
      python3 "$OTHER_SRC/llm_inference/entrypoints/bench.py" "$@" \
      --json "$OUT/other_$name.json" 2>&1 | grep -v "it/s" | tail -7
  fi
}
if [ "${MIXES:-0}" = 1 ]; then
  common="--model $SHAPE --max-model-len 16384 $Q"  # vLLM's side: token ids only, always
  declare -A MIX=(
    [chat]="--dataset lognormal --num-prompts 600 --temperature 0.8 --top-p 0.95"
    [prefill]="--dataset fixed --num-prompts 256 --input-len 2000 --output-len 8"
    [long]="--dataset fixed --num-prompts 16 --input-len 12000 --output-len 256"
  )
  for mix in ${MIX_LIST:-chat prefill long}; do
    (export PYTHONPATH=src:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0
     timeout 300 python3 benchmarks/vllm_throughput.py $common ${MIX[$mix]} ${PROFILE:+--profile} \
       --json "$OUT/vllm_${SHAPE}_mix_$mix.json" 2>&1 | grep -v "it/s\|WARN\|INFO" | tail -1)
    # shellcheck disable=SC2086  # one option per word
    ours_and_other "${SHAPE}_mix_$mix" throughput $common --disable-detokenize ${MIX[$mix]} \
      ${PROFILE:+--profile 1}
  done
  exit
fi
if [ "${HF:-0}" = 1 ]; then
  timeout 540 python3 benchmarks/hf_decode.py "$SHAPE" "$OUT/hf_$SHAPE.json" 2>&1 | grep bs
  exit
fi
case ${QUANT:+quant}$SHAPE in
  llama-3.2-1b|llama-3.2-3b)
    (export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0
     TP=$TP OUT=$OUT timeout 280 python3 $VC/vllm_bench.py "$SHAPE" 2>&1 \
       | grep -v "it/s\|WARN\|INFO" | tail -2
     if [ "${PREFILL:-0}" = 1 ]; then
       timeout 150 python3 $VC/prefill_bench.py vllm "${SHAPE#llama-3.2-}" 2>&1 \
         | grep "prefill" | tee "$OUT/vllm_prefill_$SHAPE.txt"
     fi) ;;
  *)  # writes the random checkpoint our bench then reads
    (export PYTHONPATH=src:/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0
     timeout 360 python3 benchmarks/vllm_throughput.py --model "$SHAPE" --latency $Q \
       --tensor-parallel-size "$TP" --json "$OUT/vllm_${SHAPE}${SUFFIX}.json" 2>&1 \
       | grep -v "it/s\|WARN\|INFO" | tail -9) ;;
esac
ours_and_other "${SHAPE}${SUFFIX}_latency" latency --model "$SHAPE" --tensor-parallel-size "$TP" $Q
# Token ids only, as vllm_bench.py asks of vLLM (detokenize=False).
ours_and_other "${SHAPE}${SUFFIX}_throughput" throughput --model "$SHAPE" \
  --tensor-parallel-size "$TP" --disable-detokenize $Q
if [ "${PREFILL:-0}" = 1 ]; then
  $B prefill --model "$SHAPE" --max-model-len 8192 \
    --json "$OUT/ours_${SHAPE}_prefill.json" 2>&1 | grep -v "it/s" | tail -2
fi
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
