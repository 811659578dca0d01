#!/usr/bin/env bash
# On the GPU machine, from the repository root: an A/B of one engine flag, back to back on one
# machine start. For each shape in SHAPES (and at TP=2 for each shape in TP_SHAPES, on a
# machine with two GPUs), `bench latency` and `bench throughput` without, then with, FLAG
# (default --skinny-gemm). JSON lands in $OUT/ab.tar; the tables print.
#   FLAG=--skinny-gemm SHAPES="llama-3.2-1b llama-3.2-3b" TP_SHAPES=llama-3.2-3b \
#     OUT=$OUT bash scripts/gpu_ab.sh
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
FLAG=${FLAG:---skinny-gemm}
TAG=$(echo "$FLAG" | tr -dc 'a-z0-9')
run() {  # shape, tp, name suffix, extra args
  local s=$1 tp=$2 tag=$3; shift 3
  echo "== $s tp=$tp ${tag:-base}"
  $B latency --model "$s" --tensor-parallel-size "$tp" --batches "${BATCHES:-1,8,16,64,256}" \
    --json "$R/${s}_tp${tp}_${tag:-base}_latency.json" "$@" 2>&1 | grep -v "it/s" | tail -8
  $B throughput --model "$s" --tensor-parallel-size "$tp" \
    --json "$R/${s}_tp${tp}_${tag:-base}_throughput.json" "$@" 2>&1 | tail -1
}
for s in ${SHAPES-llama-3.2-1b llama-3.2-3b}; do run "$s" 1 ""; run "$s" 1 "$TAG" $FLAG; done
for s in ${TP_SHAPES:-}; do run "$s" 2 ""; run "$s" 2 "$TAG" $FLAG; done
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/gpu.txt"
tar -cf "$OUT/ab.tar" -C "$R" .
