#!/usr/bin/env bash
# The eighth session's GPU calls (nvidia-h200-x2), from the repository root. .ab_x/src holds
# the code before the change measured (`git archive REV src | tar -x -C .ab_x`): a154adb for
# PART=ab, b2d3337 for PART=final. $OUT gets JSON and logs; the tables print.
#   PART=ab: the race kernel alone (sampler_race.py), old and new; the throughput run three
#     times in one engine (first_run.py, fresh Triton cache), old and new, alternating.
#   PART=tests: the CUDA tests of this session's changes and the seventh's untested commits.
#   PART=final: the tests of the eager long mixed steps, then bench prefill before and after.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # $OUT, $R, the environment, $B
if [ "${PART:-ab}" = ab ]; then
for tree in .ab_x/src src; do
  tag=$([ $tree = src ] && echo new || echo old)
  PYTHONPATH=$tree timeout 60 python3 benchmarks/sampler_race.py --json "$OUT/race_$tag.json" \
    2>&1 | tail -7 | sed "s/^/$tag /"
done
for tree in .ab_x/src src .ab_x/src src; do
  tag=$([ $tree = src ] && echo new || echo old)
  PYTHONPATH=$tree TRITON_CACHE_DIR=$(mktemp -d) timeout 120 python3 benchmarks/first_run.py \
    --runs 3 2>&1 | grep -v "it/s\|warn" | grep "^run\|engine" | sed "s/^/$tag /"
done
elif [ "$PART" = final ]; then
timeout 170 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_triton_engine.py::test_first_requests_compile_nothing \
  tests/engine/test_mixed_cuda_graphs.py tests/executor/test_mixed_graphs.py 2>&1 | tail -4
for tree in .ab_x/src src; do
  tag=$([ $tree = src ] && echo new || echo old)
  PYTHONPATH=$tree timeout 80 $B prefill --model llama-3.2-1b --max-model-len 8192 2>&1 \
    | grep -v "it/s" | tail -1 | sed "s/^/$tag /"
done
else
timeout 500 python3 -m pytest -q -p no:cacheprovider tests/layers/test_sampler_gpu.py \
  tests/executor/test_pending.py tests/engine/test_triton_engine.py \
  tests/distributed/test_tp_cuda.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda.log"
fi
