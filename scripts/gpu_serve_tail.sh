#!/usr/bin/env bash
# On the GPU machine, from the repository root (after the vLLM carry calls of
# ../shared/vllm/README.md when VLLM=1): served streams' tail latency at saturation (issue 28,
# item 4). Our server once per front-end count in API_SERVERS (its --api-server-count; default
# 1), then vLLM's, each with PROMPTS streamed requests at once (INPUT_LEN in, OUTPUT_LEN out;
# benchmarks/serve_compare.py, both servers with its shared settings), every chunk's time saved;
# then benchmarks/serve_stalls.py on each run, with our processes' pause log (pause_log.py).
# Folders serve_ours_n$N and serve_vllm in $OUT.
#   API_SERVERS="1 2 4" OUT=$OUT bash scripts/gpu_serve_tail.sh
# OURS=0: vLLM's alone. OURS_ARGS: more options for our server.
# SERVE_ARGS: more serve_compare options (a CPU flow check: VLLM=0 PROMPTS=6 INPUT_LEN=16
# OUTPUT_LEN=8 SERVE_ARGS="--device cpu --dtype float32 --model TINY_CKPT --max-model-len 256").
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, the environment
common="--rates inf --inf-prompts ${PROMPTS:-800} --input-len ${INPUT_LEN:-512}
  --output-len ${OUTPUT_LEN:-256} --save-detailed ${SERVE_ARGS:-}"
for n in $([ "${OURS:-1}" = 1 ] && echo "${API_SERVERS:-1}"); do
  d=$OUT/serve_ours_n$n; mkdir -p "$d"
  echo "== ours, --api-server-count $n"
  timeout 240 python3 benchmarks/serve_compare.py --out "$d" --engines ours $common \
    --ours-env "LLM_INFERENCE_PAUSE_LOG=$d/pauses.log" \
    --ours-args="--api-server-count $n ${OURS_ARGS:-}" --time-budget 220 2>&1 \
    | grep "^| inf\|error"
  python3 benchmarks/serve_stalls.py "$d/detailed_ours_inf.json" --pause-log "$d/pauses.log" \
    --png "$d/gaps.png" 2>&1 | tee "$d/stalls.md" | head -24
done
if [ "${VLLM:-1}" = 1 ]; then
  d=$OUT/serve_vllm; echo "== vLLM"
  timeout 320 python3 benchmarks/serve_compare.py --out "$d" --engines vllm $common \
    --time-budget 300 2>&1 | grep "^| inf\|error"
  python3 benchmarks/serve_stalls.py "$d/detailed_vllm_inf.json" --png "$d/gaps.png" 2>&1 \
    | tee "$d/stalls.md" | head -16
fi
