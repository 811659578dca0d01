"""End-to-end latency on the GPU: this engine (Triton kernels, and its PyTorch reference path)
against transformers' generate, with random weights in the real Llama 3.2 1B / 3B shapes.

Workloads (whole-batch latency, tokenization and detokenization included; 3 warm-ups, median of
10): batch 1 x 32 new tokens, batch 4 x 32, batch 4 x 128. Also ms per decode step at batch 1
(difference of a 136- and an 8-token generation over 128), the number vLLM is quoted with, and
the floor: bytes of weights and KV read per step over the measured copy bandwidth.

    PYTHONPATH=src python3 benchmarks/e2e_latency.py [--shapes 1b,3b] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from llm_inference.entrypoints.bench import copy_bandwidth

SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
COMMON = dict(
    vocab_size=128256,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    bos_token_id=128000,
    eos_token_id=128001,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
WORKLOADS = [(1, 32), (4, 32), (4, 128)]
PROMPT = (
    "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22 w23 w24 "
    "w25 w26 w27 w28 w29 w30 w31 w32"
)


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer covering the whole vocabulary (no hub access on the GPU box)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(folder)


def make_checkpoint(shape: str, root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = root / f"llama-3.2-{shape}"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], **COMMON)).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    make_tokenizer(folder, COMMON["vocab_size"])
    return folder


def timed(fn, warmup=3, reps=10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_engine(folder: Path, kernel_backend: str, warmup: int = 3, reps: int = 10) -> dict:
    from llm_inference import LLM, SamplingParams

    res = {}
    with LLM(
        str(folder),
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.45,
        kernel_backend=kernel_backend,
    ) as llm:
        for bs, n in WORKLOADS:
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            res[(bs, n)] = timed(
                lambda bs=bs, sp=sp: llm.generate([PROMPT] * bs, sp, use_tqdm=False)
            )
        ids = [list(range(1000, 1128))]

        def gen(k):
            sp = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
            return lambda: llm.generate(ids, sp, use_tqdm=False)

        res["step"] = (timed(gen(136), 1, min(reps, 5)) - timed(gen(8), 1, min(reps, 5))) / 128
    torch.cuda.empty_cache()
    return res


def bench_hf(folder: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    res = {}
    for bs, n in WORKLOADS:

        def run(bs=bs, n=n, model=model):
            enc = tok([PROMPT] * bs, return_tensors="pt").to("cuda")
            out = model.generate(
                **enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
            tok.batch_decode(out[:, enc.input_ids.shape[1] :])

        res[(bs, n)] = timed(run)
    del model
    torch.cuda.empty_cache()
    return res


def floor_ms(shape: str, bs: int, n: int, prompt_len: int, bw: float) -> float:
    """Weights read once per step plus each sequence's KV read, over the copy bandwidth."""
    s = {**SHAPES[shape], **COMMON}
    h, i, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    layer = h * (q + 2 * kv) + q * h + 3 * h * i
    weight_bytes = 2 * (L * layer + s["vocab_size"] * h)  # bf16; the tied LM head read once
    kv_per_token = 2 * L * 2 * kv
    total = 0.0
    for step in range(n):
        total += weight_bytes + bs * kv_per_token * (prompt_len + step)
    return total / bw * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1b,3b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    lines = [
        f"# End-to-end latency, {datetime.date.today()}, {gpu}",
        "",
        f"Command: `PYTHONPATH=src python3 benchmarks/e2e_latency.py --shapes {args.shapes}`",
        f"torch {torch.__version__}; measured copy bandwidth {bw / 1e12:.2f} TB/s (read+write).",
        "Random weights, bf16, greedy, ignore_eos. Whole-batch latency in ms (median of 10 after"
        " 3 warm-ups; the PyTorch reference path: median of 3 after 1), tokenization and"
        " detokenization included. Engine (Triton) runs decode steps as CUDA graphs."
        " Floor: weight and KV bytes per step over the copy bandwidth (decode steps only).",
        "",
        "| shape | batch | new tokens | engine (Triton) ms | engine (PyTorch ref) ms |"
        " HF generate ms | floor ms | engine tok/s | vs HF |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    steps = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            folder = make_checkpoint(shape, Path(tmp))
            ours = bench_engine(folder, "auto")
            ref = bench_engine(folder, "reference", warmup=1, reps=3)  # slow: fewer runs
            hf = bench_hf(folder)
            prompt_len = len(PROMPT.split())
            for bs, n in WORKLOADS:
                fl = floor_ms(shape, bs, n, prompt_len, bw)
                t = ours[(bs, n)]
                lines.append(
                    f"| {shape} | {bs} | {n} | {t:.1f} | {ref[(bs, n)]:.1f} | "
                    f"{hf[(bs, n)]:.1f} | {fl:.1f} | {bs * n / t * 1e3:.0f} | "
                    f"{hf[(bs, n)] / t:.2f}x |"
                )
            fl1 = floor_ms(shape, 1, 1, 128, bw)
            steps.append(f"| {shape} | {ours['step']:.2f} | {ref['step']:.2f} | {fl1:.2f} |")
            print("\n".join(lines[-3:]), flush=True)
    lines += [
        "",
        "Decode step at batch 1 (128-token prompt): ms per step, from the difference of a 136-"
        " and an 8-token generation.",
        "",
        "| shape | engine (Triton) | engine (PyTorch ref) | floor |",
        "|---|---|---|---|",
        *steps,
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
