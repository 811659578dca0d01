"""`llm-inference bench latency|throughput`: the offline workloads engines are compared on.

- `latency`: decode milliseconds per step at batch 1, 8, 64 and 256 from 128-token prompts,
  taken as the difference of a 136-token and an 8-token greedy generation over 128 steps
  (the method of vLLM's comparison script), beside the floor: the bytes of weights and KV
  one step reads, over a device-copy bandwidth measured in the same run.
- `throughput`: N requests (default 256) of a dataset (bench_datasets.py; default: prompt and
  output lengths uniform in [100, 1024], random token ids), temperature 0.6, `ignore_eos`:
  requests/s, output and total tokens/s, and the workload with its mean lengths.

`--model` takes a checkpoint folder or a named shape (`SHAPES`: Llama 3.2 1B and 3B, Llama 3.1
8B, Qwen2.5 7B, Qwen3 8B, Mistral 7B v0.3) written once with random weights (bf16) into a
temporary folder. The engine flags are `EngineArgs`' (engine/arg_utils.py), with bench's own
defaults (`BENCH_DEFAULTS`). Only the public API (`LLM`, `EngineArgs`, `SamplingParams`),
bench_datasets and the model registry are used, so the file also runs as a script
(`python3 .../bench.py latency ...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from llm_inference.engine.arg_utils import EngineArgs, resolve_device
from llm_inference.entrypoints.bench_datasets import Workload, add_workload_args, workload_line
from llm_inference.models.registry import FAMILIES
from llm_inference.sampling_params import SamplingParams

# Each named shape: the transformers class its checkpoint is written with (registry.py's
# family) and its config's arguments, the released config.json's values.
VOCAB = 128256  # Llama 3's vocabulary
_LLAMA3 = dict(model="LlamaForCausalLM", vocab_size=VOCAB, rms_norm_eps=1e-5,
               max_position_embeddings=131072, rope_theta=500000.0, bos_token_id=128000,
               eos_token_id=128001)  # fmt: skip
_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)  # fmt: skip
SHAPES = {
    "llama-3.2-1b": dict(**_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-3.2-3b": dict(**_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-3.1-8b": dict(**_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=False, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
    "qwen2.5-7b": dict(model="Qwen2ForCausalLM", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       head_dim=128, vocab_size=152064, tie_word_embeddings=False,
                       rms_norm_eps=1e-6, max_position_embeddings=131072, rope_theta=1e6,
                       use_sliding_window=False, bos_token_id=151643, eos_token_id=151643),
    "qwen3-8b": dict(model="Qwen3ForCausalLM", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1e6,
                     use_sliding_window=False, bos_token_id=151643, eos_token_id=151645),
    "mistral-7b": dict(model="MistralForCausalLM", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=32768, tie_word_embeddings=False,
                       rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=1e6,
                       sliding_window=None, bos_token_id=1, eos_token_id=2),  # v0.3
}  # fmt: skip
PROMPT_IDS = 10000  # throughput's random prompt ids are in [0, 10000) (the model's if smaller)
BATCHES = (1, 8, 64, 256)
# The engine options bench runs with unless told otherwise: half precision, room for the
# longest throughput request, and no prefix caching (repeated prompts would measure cache hits).
BENCH_DEFAULTS = dict(dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.85,
                      enable_prefix_caching=False)  # fmt: skip
_NO_PROFILE = {"total_ms": 0.0, "kernels": {}}  # subtracted from a profile: the profile itself


def random_checkpoint(shape: str, root: Path | None = None) -> Path:
    """A checkpoint of a named shape: its family's transformers class with random bf16 weights
    and a word-level tokenizer over its whole vocabulary (`w0`, `w1`, ...; transformers 5 reads
    Qwen2's as a Qwen2Tokenizer, which decodes them but cannot encode them: bench sends token
    ids); written once, then reused."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = (root or Path(tempfile.gettempdir()) / "llm_inference_bench") / shape
    if (folder / "config.json").is_file():
        return folder
    s = dict(SHAPES[shape])
    model_class = getattr(transformers, s.pop("model"))
    config = model_class.config_class(**s)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()  # for another process: vllm_throughput.py starts vLLM next
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    tokenizer.save_pretrained(folder)
    return folder


def shape_bytes(shape: str) -> int:
    """The bf16 bytes of a named shape's weights (what `random_checkpoint` writes: every
    parameter, norms, Qwen2's q/k/v biases and Qwen3's q/k norms included)."""
    s = SHAPES[shape]
    family = FAMILIES[s["model"]]
    h, hd = s["hidden_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    layer = 2 * h * q + 2 * h * kv + 3 * h * s["intermediate_size"] + 2 * h
    layer += family.qkv_bias * (q + 2 * kv) + family.qk_norm * 2 * hd
    embeddings = s["vocab_size"] * h * (1 if s["tie_word_embeddings"] else 2)
    return 2 * (embeddings + s["num_hidden_layers"] * layer + h)


def copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of `nbytes` random bytes (median of 10): bytes read + written per
    second."""
    import torch

    n = nbytes
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n / statistics.median(times)


def step_bytes(
    config: dict, batch: int, context: int, tp: int = 1, fp8: bool = False, fp8_kv: bool = False
) -> int:
    """Bytes one decode step must read on each GPU: every weight once (bf16; with `fp8`, the
    decoder layers' linear weights FP8 with a float32 scale per row, embeddings and head
    bf16; a tied head once) and each sequence's K and V of `context` tokens (bf16, or FP8 with
    `fp8_kv`); at tensor parallel size `tp`, a rank's share (1/tp of the weights, its KV
    heads: replicated when tp exceeds them)."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    rows = (q + 2 * kv) + h + 2 * i + h  # output rows of qkv, o, gate_up, down
    linear = layers * (per_layer + 4 * rows if fp8 else 2 * per_layer)
    heads = 1 if config.get("tie_word_embeddings") else 2
    weights = linear + 2 * heads * config["vocab_size"] * h
    kv_rank = -(-config["num_key_value_heads"] // tp) * hd
    return weights // tp + batch * context * 2 * layers * kv_rank * (1 if fp8_kv else 2)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _random_prompts(llm, rng: random.Random, n: int, length: int, ids: int | None = None):
    """`n` prompts of `length` ids in [0, ids) (default: the model's vocabulary but its last
    256, which hold special tokens)."""
    ids = ids or max(1, llm.config.model.vocab_size - 256)
    return [[rng.randrange(ids) for _ in range(length)] for _ in range(n)]


def _timed_generate(llm, prompts, params, progress: bool = False) -> float:
    """Seconds for one `generate`; `progress`: a bar of finished requests (tqdm's, updated
    as requests finish: no cost per step)."""
    import torch

    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=progress)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return time.perf_counter() - t


def decode_latency(llm, batches=BATCHES, prompt_len: int = 128, seed: int = 0) -> dict:
    """ms per decode step at each batch size (median of 3 differences of 136 and 8 tokens)."""
    from tqdm.auto import tqdm  # not at the top: the command line's start-up would pay for it

    rng = random.Random(seed)
    out = {}
    for bs in tqdm(batches, desc="latency"):
        prompts = _random_prompts(llm, rng, bs, prompt_len)
        for _ in range(2):
            _timed_generate(llm, prompts, _greedy(8))
        short = statistics.median(_timed_generate(llm, prompts, _greedy(8)) for _ in range(3))
        long = statistics.median(_timed_generate(llm, prompts, _greedy(136)) for _ in range(3))
        out[bs] = (long - short) / 128 * 1e3
    return out


def _kernel_profile(llm, run, trace_dir: str | None = None) -> list[dict]:
    """Each rank's profile (LLM.start_profile) of one call of `run()`."""
    llm.start_profile(trace_dir)
    try:
        run()
    finally:
        ranks = llm.stop_profile()
    return ranks


def _kernel_profile_throughput(llm, prompts, params) -> dict:
    """The throughput workload again (after the unprofiled run: no second warm-up) under each
    rank's profiler: its wall seconds (slower than unprofiled) and per rank the GPU kernel
    seconds and the top kernels, of the timed requests alone."""
    timed = {}
    run = functools.partial(throughput, llm, prompts, params, warmup=False)
    ranks = _kernel_profile(llm, lambda: timed.update(run()))
    # ms / 1000: seconds
    return {"wall_s": timed["seconds"], "ranks": [_per_step(r, _NO_PROFILE, 1000) for r in ranks]}


def _per_step(long: dict, short: dict, steps: int, top: int = 15) -> dict:
    """Kernel ms per step from the difference of two profiles: total and the `top` kernels."""
    diff = {
        name: (k["ms"] - short["kernels"].get(name, {"ms": 0.0})["ms"]) / steps
        for name, k in long["kernels"].items()
    }
    ranked = sorted(diff.items(), key=lambda kv: -kv[1])[:top]
    return {
        "gpu_ms_per_step": (long["total_ms"] - short["total_ms"]) / steps,
        "top_kernels_ms_per_step": {name: ms for name, ms in ranked},
    }


def profile_decode(llm, bs: int, prompt_len: int = 128, new: int = 64, seed: int = 0) -> dict:
    """Wall and GPU-kernel milliseconds per decode step at batch `bs`, each from the difference
    of runs of 8 + `new` and 8 tokens: wall time unprofiled (median of 3), kernel time from
    each rank's profiler (after a profiled warm-up), with the kernels that take the most.
    Wall minus kernel time is host time the GPU waits for."""
    rng = random.Random(seed)
    prompts = _random_prompts(llm, rng, bs, prompt_len)
    wall = {n: statistics.median(_timed_generate(llm, prompts, _greedy(n)) for _ in range(3))
            for n in (8, 8 + new)}  # fmt: skip
    prof = {}
    for n in (8, 8, 8 + new):  # the first run warms the profiler up
        prof[n] = _kernel_profile(llm, functools.partial(_timed_generate, llm, prompts, _greedy(n)))
    ranks = [_per_step(long, short, new) for long, short in zip(prof[8 + new], prof[8])]
    return {
        "wall_ms_per_step": (wall[8 + new] - wall[8]) * 1e3 / new,
        "gpu_ms_per_step": ranks[0]["gpu_ms_per_step"],
        "ranks": ranks,
    }


def prefill(llm, seed: int = 0, profile: bool = False, trace_dir: str | None = None) -> dict:
    """ms to prefill one 8,000-token prompt, 64 prompts of 512 tokens (as vLLM's comparison
    script) and one 3,000-token prompt (between the mixed-graph ladder and the budget), each
    generating one token: median of 5 after 2 warm-ups. With `profile`, also each case's GPU
    kernel time and top kernels (rank 0), and with `trace_dir` a Chrome trace of each case."""
    rng = random.Random(seed)
    cases = {f"{n}x{length}": _random_prompts(llm, rng, n, length, 10000)
             for n, length in ((1, 8000), (64, 512), (1, 3000))}  # fmt: skip
    sp = _greedy(1)
    out = {}
    for name, prompts in cases.items():
        for _ in range(2):
            _timed_generate(llm, prompts, sp)
        out[f"prefill_{name}_ms"] = 1e3 * statistics.median(
            _timed_generate(llm, prompts, sp) for _ in range(5)
        )
        if profile:
            trace = f"{trace_dir}/prefill_{name}" if trace_dir else None
            run = functools.partial(_timed_generate, llm, prompts, sp)
            rank0 = _kernel_profile(llm, run, trace)[0]
            out[f"profile_{name}"] = _per_step(rank0, _NO_PROFILE, 1)
    return out


def throughput_workload(
    workload: Workload | None = None, ids: int = PROMPT_IDS, detokenize: bool = True,
    tokenizer=None,
):  # fmt: skip
    """(prompts, params) of the throughput benchmark: `workload`'s requests (default: 256 of
    `uniform`; random prompt ids in [0, ids), sharegpt's tokenized by `tokenizer`), sampled as it
    says, `ignore_eos`, request i seeded with i; `detokenize=False`: token ids only (vLLM's
    `--disable-detokenize`)."""
    workload = workload or Workload()
    requests = workload.requests(ids, tokenizer)
    params = [
        SamplingParams(
            temperature=workload.temperature,
            top_p=workload.top_p,
            top_k=workload.top_k,
            ignore_eos=True,
            max_tokens=r.max_tokens,
            seed=i,
            detokenize=detokenize,
        )
        for i, r in enumerate(requests)
    ]
    return [r.prompt_ids for r in requests], params


def throughput_requests(workload: Workload, model: str | None, folder, detokenize: bool = True):
    """`throughput_workload` for the model `--model` names, resolved to `folder`: prompt ids
    below its vocabulary size, sharegpt's tokens counted by its tokenizer, or for a named shape
    (whose random tokenizer knows no words) by the default model's."""
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    tokenizer = None
    if workload.dataset == "sharegpt":
        from llm_inference.models.default_model import resolve_model
        from llm_inference.models.loader import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(None) if model in SHAPES else folder)
    return throughput_workload(workload, min(PROMPT_IDS, vocab), detokenize, tokenizer)


def throughput(llm, prompts, params, warmup: bool = True) -> dict:
    """`prompts` (`throughput_workload`) timed in one generate call, after a warm-up on the
    first 8 (unless `warmup` is False: a run right after another)."""
    if warmup:
        _timed_generate(llm, prompts[:8], params[:8])
    dt = _timed_generate(llm, prompts, params, progress=True)
    n_out = sum(p.max_tokens for p in params)
    n_in = sum(map(len, prompts))
    return {
        "seconds": dt,
        "requests_per_s": len(prompts) / dt,
        "output_tok_per_s": n_out / dt,
        "total_tok_per_s": (n_in + n_out) / dt,
        "output_tokens": n_out,
    }


def add_bench_args(p: argparse.ArgumentParser, kind: str | None = None) -> None:
    """The options of `bench latency|throughput|prefill` (`kind` fixed by the subcommand, else
    an argument as when this file runs as a script): the workload's (throughput's dataset and
    sampling: bench_datasets), then the engine's (`EngineArgs`, with BENCH_DEFAULTS; `--seed`
    also draws the throughput workload)."""
    if kind is None:
        p.add_argument("kind", choices=["latency", "throughput", "prefill"])
    else:
        p.set_defaults(kind=kind)
    p.add_argument(
        "--model", default=None,
        help="a checkpoint folder, or a named shape ("
        + ", ".join(f"{s}: {shape_bytes(s) / 1e9:.1f} GB" for s in SHAPES)
        + f"; random bf16 weights, written once under {tempfile.gettempdir()}/llm_inference_bench/)"
        " (default: llama-3.2-1b on a GPU, the default model on the CPU)",
    )  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=256, help="throughput requests")
    add_workload_args(p)
    p.add_argument(
        "--disable-detokenize", action="store_true",
        help="throughput: token ids only, no text (as vLLM's flag of that name)",
    )  # fmt: skip
    p.add_argument(
        "--batches", default=None, help="latency batch sizes (default: 1,8,64,256; CPU: 1,8)"
    )
    p.add_argument(
        "--profile", default="",
        help="latency: also profile these batch sizes (e.g. 1,64); prefill: any value profiles",
    )  # fmt: skip
    p.add_argument("--trace-dir", default=None, help="prefill --profile: Chrome traces here")
    p.add_argument("--json", default=None, help="also write the results to this file")
    EngineArgs.add_cli_args(p, defaults=BENCH_DEFAULTS, skip=("model",))
    p.add_argument("--sync", dest="async_scheduling", action="store_false",
                   help="one step at a time, as --no-async-scheduling (default: off)")  # fmt: skip


def run_bench(args) -> dict:
    from llm_inference import LLM  # not at the top: torch, only when an engine is made
    from llm_inference.models.default_model import DEFAULT_MODEL_NAME, resolve_model

    cuda = resolve_device(args.device).startswith("cuda")  # the engine's own choice
    model = args.model or ("llama-3.2-1b" if cuda else None)
    if model in SHAPES and not cuda:
        raise ValueError(
            f"the named shape {model} ({shape_bytes(model) / 1e9:.1f} GB of random weights) is "
            "for a GPU, and none is in use here: on the CPU, give --model a checkpoint folder "
            "or leave it out for the default model"
        )
    workload = Workload.from_args(args) if args.kind == "throughput" else None
    folder = random_checkpoint(model) if model in SHAPES else resolve_model(model)
    config = json.loads((Path(folder) / "config.json").read_text())
    res: dict = {"model": model or DEFAULT_MODEL_NAME, "kind": args.kind,
                 "tp": args.tensor_parallel_size}  # fmt: skip
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), model=str(folder))
    if engine_args.disable_custom_all_reduce:
        res["disable_custom_all_reduce"] = True
    if workload:  # drawn before the engine starts: a bad dataset fails at once
        detok = not args.disable_detokenize
        prompts, params = throughput_requests(workload, model, folder, detok)
        longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
        if longest > args.max_model_len:
            raise ValueError(
                f"the workload's longest request is {longest} tokens (prompt + output), over "
                f"--max-model-len {args.max_model_len}: raise it or shorten the lengths"
            )
    with LLM(**dataclasses.asdict(engine_args)) as llm:
        if workload:
            res.update(throughput(llm, prompts, params))
            res["workload"] = workload.describe(list(map(len, prompts)),
                                                [p.max_tokens for p in params])  # fmt: skip
            if args.disable_detokenize:
                res["detokenize"] = False
            if args.profile:  # a second run, profiled: each rank's kernel time against the wall
                res["profile"] = _kernel_profile_throughput(llm, prompts, params)
        elif args.kind == "prefill":
            res.update(prefill(llm, profile=bool(args.profile), trace_dir=args.trace_dir))
        else:
            bw = copy_bandwidth() if cuda else None  # the floor is the GPU's
            if bw:
                res["copy_bandwidth_TBps"] = bw / 1e12
            sizes = args.batches or ",".join(map(str, BATCHES if cuda else BATCHES[:2]))
            batches = [int(b) for b in sizes.split(",")]
            for bs, ms in decode_latency(llm, batches).items():
                res[f"bs{bs}"] = {"ms_per_step": ms}
                if bw:
                    step = step_bytes(
                        config, bs, 128 + 72, args.tensor_parallel_size,
                        fp8=engine_args.quantization == "fp8" or "quantization_config" in config,
                        fp8_kv=engine_args.kv_cache_dtype == "fp8",
                    )  # fmt: skip
                    res[f"bs{bs}"]["floor_ms"] = step / bw * 1e3
            for bs in [int(b) for b in args.profile.split(",") if b]:
                res[f"profile_bs{bs}"] = profile_decode(llm, bs)
    print(format_result(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


def format_result(res: dict) -> str:
    if res["kind"] == "prefill":
        lines = [f"{res['model']}: " + ", ".join(
            f"{k.removeprefix('prefill_').removesuffix('_ms')} {v:.1f} ms"
            for k, v in res.items()
            if k.startswith("prefill_")
        )]  # fmt: skip
        for key, v in res.items():
            if key.startswith("profile_"):
                lines.append(f"profile {key[8:]}: GPU kernels {v['gpu_ms_per_step']:.2f} ms")
                lines += _kernel_lines(v)
        return "\n".join(lines)
    if res["kind"] == "throughput":
        lines = [
            f"{res['model']}: {res['requests_per_s']:.2f} requests/s, "
            f"{res['output_tok_per_s']:,.0f} output tok/s, {res['total_tok_per_s']:,.0f} "
            f"total tok/s ({res['output_tokens']} output tokens in {res['seconds']:.2f} s)",
            workload_line(res["workload"]),
        ]
        if prof := res.get("profile"):
            ranks = ", ".join(f"{r['gpu_ms_per_step']:.3f}" for r in prof["ranks"])
            lines.append(
                f"profiled run: wall {prof['wall_s']:.3f} s, GPU kernels {ranks} s (per rank)"
            )
            lines += [ln.replace(" ms ", " s  ") for ln in _kernel_lines(prof["ranks"][0])]
        return "\n".join(lines)
    copy = f" (copy {res['copy_bandwidth_TBps']:.2f} TB/s)" if "copy_bandwidth_TBps" in res else ""
    lines = [f"{res['model']}: decode ms per step{copy}", "| batch | ms/step | floor ms |",
             "|---|---|---|"]  # fmt: skip
    for key, v in res.items():
        if key.startswith("bs"):
            floor = f"{v['floor_ms']:.3f}" if "floor_ms" in v else "-"
            lines.append(f"| {key[2:]} | {v['ms_per_step']:.3f} | {floor} |")
        elif key.startswith("profile_bs"):
            ranks = ", ".join(f"{r['gpu_ms_per_step']:.3f}" for r in v["ranks"])
            lines.append(
                f"profile batch {key[10:]}: wall {v['wall_ms_per_step']:.3f} ms/step, GPU "
                f"kernels {ranks} ms/step (per rank)"
            )
            lines += _kernel_lines(v["ranks"][0])
    return "\n".join(lines)


def _kernel_lines(prof: dict, width: int = 90) -> list[str]:
    return [
        f"    {ms:8.4f} ms  {name[:width]}" for name, ms in prof["top_kernels_ms_per_step"].items()
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_bench_args(parser)
    run_bench(parser.parse_args())
