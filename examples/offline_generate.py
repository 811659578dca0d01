"""Offline batched generation with the default model (or a checkpoint given on the command line).

python examples/offline_generate.py [MODEL_DIR_OR_GGUF]
"""

import sys

from llm_inference import LLM, SamplingParams

prompts = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
]

with LLM(sys.argv[1] if len(sys.argv) > 1 else None) as llm:
    for out in llm.generate(prompts, max_new_tokens=32):
        print(f"{out.prompt!r} -> {out.text!r}")

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=48)
    chat = llm.chat(
        [{"role": "user", "content": "Give me three tips for learning Python."}], params
    )
    print(chat[0].text)
    print(llm.stats())
