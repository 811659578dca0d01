"""FP8 accuracy as an engine serves it, ours or vLLM: each variant's prompt log-probabilities
against the same engine's unquantized run, on the same text (issue 31, item 6, side by side).

benchmarks/fp8_accuracy.py measures our FP8 exactly, on the CPU's reference paths, from whole
next-token distributions. This one runs the engines themselves (their GPU kernels), so it can
only read what both report: per prompt position the log-probability of the true next token and
the top `TOP_K` = 20 (vLLM's default `max_logprobs`, our MAX_LOGPROBS). Per variant (FP8
weights, FP8 KV cache, both) against the engine's bfloat16 run:

- perplexity of the text (exact);
- top-1 agreement: the two runs' most likely next token is the same (exact);
- KL(bf16 || variant) over the reference's top 20, the rest of the mass as one bucket: a token
  of the reference's top 20 missing from the variant's gets the variant's 20th probability (an
  upper bound on its own), so the figure slightly understates the divergence; the same
  estimate on both engines.

The text is a file (default ARCHITECTURE.md, its sha256 in the report), tokenized with the
model's tokenizer and cut into windows of `--window` tokens, each one prompt (max_tokens 1);
every position but a window's first is scored, at least `--positions` in all. The model is a
Hugging Face folder, e.g. the default model converted on the GPU machine:
`llm-inference convert SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2 --dtype bfloat16`
(scripts/default_model_carry.sh brings it there and converts it).

    PYTHONPATH=src python3 benchmarks/fp8_accuracy_engines.py --engine ours|vllm \
        --model /tmp/smollm2 [--positions 4096] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
from pathlib import Path

TOP_K = 20
VARIANTS = {  # name: (quantization, kv_cache_dtype)
    "bf16": (None, "auto"),
    "fp8 weights": ("fp8", "auto"),
    "fp8 KV cache": (None, "fp8"),
    "fp8 weights + KV cache": ("fp8", "fp8"),
}


def windows(model: str, text: str, window: int, positions: int) -> list[list[int]]:
    """Token-id windows of the text, enough for `positions` scored positions (or all of it)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False).input_ids
    out, scored = [], 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2 or scored >= positions:
            break
        out.append(chunk)
        scored += len(chunk) - 1
    return out


def run_ours(model: str, prompts, quantization, kv_cache_dtype, device) -> list[tuple]:
    """Per scored position: (log-prob of the true token, {token: log-prob} of the top K)."""
    from llm_inference import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=TOP_K)
    with LLM(model, device=device, dtype="bfloat16", quantization=quantization,
             kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
             max_model_len=max(map(len, prompts)) + 1) as llm:  # fmt: skip
        outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    return [(lp.logprob, dict(lp.top)) for o in outs for lp in o.prompt_logprobs[1:]]


def run_vllm(model: str, prompts, quantization, kv_cache_dtype, device) -> list[tuple]:
    import vllm

    # four of these one after the other, so a small share of the GPU each
    llm = vllm.LLM(model, dtype="bfloat16", quantization=quantization,
                   kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
                   max_model_len=max(map(len, prompts)) + 1, gpu_memory_utilization=0.15,
                   seed=0)  # fmt: skip
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    rows = []
    for prompt, o in zip(prompts, outs):
        for token, entry in zip(prompt[1:], o.prompt_logprobs[1:]):
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:TOP_K]
            rows.append((entry[token].logprob, {t: lp.logprob for t, lp in top}))
    del llm  # its engine core process ends with it
    gc.collect()
    return rows


def compare(ref: list[tuple], var: list[tuple]) -> dict:
    """The variant's perplexity, top-1 agreement and top-K KL against the reference."""
    if len(ref) != len(var):
        raise ValueError(f"{len(ref)} reference positions against {len(var)}")
    agree, kl = 0, 0.0
    for (_, p_top), (_, q_top) in zip(ref, var):
        agree += max(p_top, key=p_top.get) == max(q_top, key=q_top.get)
        q_floor = min(q_top.values())
        p_in = q_in = 0.0
        for t, lp in p_top.items():
            lq = q_top.get(t, q_floor)
            kl += math.exp(lp) * (lp - lq)
            p_in, q_in = p_in + math.exp(lp), q_in + math.exp(lq)
        p_rest, q_rest = max(1.0 - p_in, 1e-12), max(1.0 - q_in, 1e-12)
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    n = len(ref)
    return {
        "positions": n,
        "perplexity": math.exp(-sum(lp for lp, _ in var) / n),
        "top1_agreement": agree / n,
        "kl_top_k": kl / n,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["ours", "vllm"], default="ours")
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint folder")
    p.add_argument("--text", default="ARCHITECTURE.md", help="the text file scored")
    p.add_argument("--window", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--positions", type=int, default=4096, help="positions scored, at least")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--device", default="cuda", help="ours: the device (vLLM: its GPU)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    text = Path(args.text).read_text()
    prompts = windows(args.model, text, args.window, args.positions)
    run = run_ours if args.engine == "ours" else run_vllm
    names = ["bf16"] + [n for n in args.variants.split(",") if n != "bf16"]  # bf16: the reference
    rows = {name: run(args.model, prompts, *VARIANTS[name], args.device) for name in names}
    res = {
        "engine": args.engine, "model": args.model, "text": args.text,
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "window": args.window,
        "top_k": TOP_K, "variants": {name: compare(rows["bf16"], rows[name]) for name in names},
    }  # fmt: skip
    print(f"{args.engine}, {args.model}, {res['variants']['bf16']['positions']} positions")
    print("| variant | perplexity | top-1 agreement | KL over the top 20, nats |")
    print("|---|---:|---:|---:|")
    for name, m in res["variants"].items():
        print(f"| {name} | {m['perplexity']:.3f} | {100 * m['top1_agreement']:.1f}% "
              f"| {m['kl_top_k']:.5f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
