"""FP8 accuracy: how far online FP8 quantization of the weights (`quantization="fp8"`), the FP8
KV cache (`kv_cache_dtype="fp8"`) and both move the default model's next-token distributions,
on the CPU (the reference FP8 paths: weights, activations and K/V rounded to e4m3 exactly as
on the GPU, the products in float32).

The text is this repository's ARCHITECTURE.md (English prose) as of commit 1e67b03, read
from git so that it stays fixed, cut into windows of `--window` tokens; each window runs as
one prompt through a paged KV cache (written, then read, as in the engine), and every
position of a window but the last predicts the next token. Per position: KL(float32 || the
variant) of the next-token distributions, whether the argmax agrees, and the log-likelihood of
the true next token (perplexity); the bfloat16 model (no quantization, a bfloat16 cache) is
measured the same way, for scale. Prints a markdown report.

    PYTHONPATH=src python benchmarks/fp8_accuracy.py [--positions 4096] [--window 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import subprocess
from pathlib import Path

import torch

from llm_inference.config import Fp8Format
from llm_inference.kernels.reference import FP8, ReferenceOps
from llm_inference.layers.attention import AttentionMetadata
from llm_inference.models.default_model import resolve_model
from llm_inference.models.loader import load_model, load_model_config, load_tokenizer

TEXT = "1e67b03:ARCHITECTURE.md"  # a git object: the text never changes
BLOCK = 16


def window_logprobs(model, ids: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Next-token log-probabilities at each position of `ids`, run as one prompt through a
    fresh paged KV cache of `cache_dtype` (the layers' scales: 1.0)."""
    n, blocks = len(ids), -(-len(ids) // BLOCK)
    for attn in model.attention_layers():
        shape = (blocks, BLOCK, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=cache_dtype)
        attn.v_cache = torch.zeros(shape, dtype=cache_dtype)
    md = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.arange(blocks, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.no_grad():
        hidden = model(ids, torch.arange(n), md)
        return model.compute_logits(hidden).float().log_softmax(-1)


def git(*args: str) -> str:
    repo = Path(__file__).resolve().parents[1]
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=4096, help="positions scored, at least")
    p.add_argument("--window", type=int, default=1024)
    args = p.parse_args()

    path = resolve_model(None)
    config = load_model_config(path)
    fp8 = dataclasses.replace(config, quantization=Fp8Format("online"))
    ref = load_model(path, ReferenceOps())
    fp8_weights = load_model(path, ReferenceOps(), config=fp8)
    variants = {  # (model, KV cache dtype), compared with the float32 model; bfloat16 for scale
        'FP8 weights (`quantization="fp8"`)': (fp8_weights, torch.float32),
        'FP8 KV cache (`kv_cache_dtype="fp8"`)': (ref, FP8),
        "both FP8": (fp8_weights, FP8),
        "bfloat16 (no quantization)": (
            load_model(path, ReferenceOps(), dtype=torch.bfloat16),
            torch.bfloat16,
        ),
    }
    ids = load_tokenizer(path)(git("show", TEXT), add_special_tokens=False).input_ids
    windows = [torch.tensor(ids[i : i + args.window]) for i in range(0, len(ids) - 1, args.window)]
    windows = windows[: -(-args.positions // (args.window - 1))]
    nll = {"float32": []} | {name: [] for name in variants}
    kl, agree = {name: [] for name in variants}, {name: [] for name in variants}
    for w in windows:
        lp_ref = window_logprobs(ref, w, torch.float32)[:-1]
        nll["float32"].append(-lp_ref.gather(1, w[1:, None]).squeeze(1))
        for name, (model, cache_dtype) in variants.items():
            lp = window_logprobs(model, w, cache_dtype)[:-1]
            kl[name].append((lp_ref.exp() * (lp_ref - lp)).sum(-1))
            agree[name].append((lp_ref.argmax(-1) == lp.argmax(-1)).float())
            nll[name].append(-lp.gather(1, w[1:, None]).squeeze(1))
    positions = sum(len(w) - 1 for w in windows)
    ppl = {name: torch.cat(v).mean().exp().item() for name, v in nll.items()}
    print(f"- model: {Path(path).name} ({path}); the float32 model is the reference")
    print(f"- text: `git show {TEXT}`, {len(ids)} tokens; "
          f"{positions} positions in windows of {args.window} tokens")  # fmt: skip
    print(f"- machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          "CPU (FP8: the reference paths, operands and K/V rounded as on the GPU)")  # fmt: skip
    print(f"- perplexity of the float32 model: {ppl['float32']:.3f}")
    print()
    print("| against float32 | mean KL, nats | median | p99 | max | top-1 agreement | perplexity |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in variants:
        k, a = torch.cat(kl[name]), torch.cat(agree[name])
        print(f"| {name} | {k.mean():.5f} | {k.median():.5f} | {k.quantile(0.99):.4f} | "
              f"{k.max():.4f} | {a.mean():.2%} | {ppl[name]:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
