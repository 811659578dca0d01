"""`llm-inference bench serve`: a load generator for any OpenAI-compatible server (ours or
vLLM's), like `vllm bench serve` with its random dataset.

Prompts are random token ids decoded to text (with `--tokenizer`, default `--model` when it is
a local folder) or random words; lengths are `--input-len` / `--output-len`, or drawn uniformly
from [len * (1 - r), len * (1 + r)] with `--range-ratio r`. Requests stream completions with
`ignore_eos`; they arrive as a Poisson process at `--request-rate` (inf: all at once), at most
`--max-concurrency` at a time. Times are reported in milliseconds, throughputs per second.

`--multi-turn T` replays chats instead: each of `--num-prompts` conversations sends T requests
one after another, each the whole conversation so far (an optional shared system prompt of
`--shared-prefix-len` words, then every earlier message and reply) plus a new user message;
`--max-concurrency` then bounds the conversations in flight. This is the traffic prefix
caching is for: every turn resends what the last one computed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

_WORD_LIST = """the of and to in is that it was for on are as with his they at be this from have
or by one had not but what all were when we there can an your which their said if do will each
about how up out them then she many some so these would other into has more her two like him see
time could no make than first been its who now"""
WORDS = tuple(_WORD_LIST.split())


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the completion's text (multi-turn replays feed it back)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for random prompts")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", "--random-input-len", type=int, default=256)
    p.add_argument("--output-len", "--random-output-len", type=int, default=128)
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument(
        "--multi-turn",
        type=int,
        default=0,
        metavar="T",
        help="replay chats of T turns, each resending the conversation (0: off)",
    )
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="words of a system prompt shared by every conversation")  # fmt: skip


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    if not 0 <= ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_prompts(args, rng: random.Random, n: int | None = None) -> list[tuple[str, int, int]]:
    """(prompt text, approximate prompt tokens, max output tokens) for `n` requests (default
    `--num-prompts`)."""
    n = args.num_prompts if n is None else n
    tokenizer = None
    source = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
    if source:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
    ins = _lengths(args.input_len, args.range_ratio, n, rng)
    outs = _lengths(args.output_len, args.range_ratio, n, rng)
    prompts = []
    if tokenizer is not None:
        special = set(tokenizer.all_special_ids)
        ids = [t for t in range(len(tokenizer)) if t not in special]
    for n_in, n_out in zip(ins, outs):
        if tokenizer is not None:
            text = tokenizer.decode([rng.choice(ids) for _ in range(n_in)])
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(n_in))
        prompts.append((text, n_in, n_out))
    return prompts


async def send_request(client, url: str, payload: dict, headers: dict) -> RequestResult:
    """One streamed completion, timed from the send to each text chunk and to [DONE]."""
    result = RequestResult(prompt_len=payload.pop("_prompt_len"))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                choices = chunk.get("choices") or []
                first = choices[0] if choices else {}
                piece = first.get("text") or (first.get("delta") or {}).get("content")
                if piece:
                    result.text += piece
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "no output"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _model_name(client, base_url: str, headers: dict) -> str:
    resp = await client.get(f"{base_url}/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_benchmark(args) -> dict:
    """Send every request (Poisson arrivals, bounded concurrency) and summarize them."""
    import httpx

    rng = random.Random(args.seed)
    turns = max(1, args.multi_turn)
    prompts = make_prompts(args, rng, args.num_prompts * turns)  # first turns, then the rest
    prompts, later = prompts[: args.num_prompts], prompts[args.num_prompts :]
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = args.model or await _model_name(client, base, headers)
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)

        async def one(text: str, n_in: int, n_out: int) -> RequestResult:
            payload = {"model": model, "prompt": text, "max_tokens": n_out, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True, "_prompt_len": n_in}  # fmt: skip
            async with gate:
                return await send_request(client, base + args.endpoint, payload, headers)

        async def chat(first: tuple[str, int, int], follow_ups) -> list[RequestResult]:
            """One conversation: each turn resends everything so far plus a new message."""
            async with gate:
                history, results = prefix + first[0], []
                for turn, (text, n_in, n_out) in enumerate([first, *follow_ups]):
                    if turn:
                        history = f"{history}{results[-1].text}\n{text}"
                    payload = {"model": model, "prompt": history, "max_tokens": n_out,
                               "temperature": 0.0, "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True},
                               "_prompt_len": n_in}  # fmt: skip
                    results.append(await send_request(client, base + args.endpoint, payload,
                                                      headers))  # fmt: skip
                return results

        prefix = " ".join(rng.choice(WORDS) for _ in range(args.shared_prefix_len))
        prefix = prefix + "\n" if prefix else ""
        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            if i and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            if turns == 1:
                tasks.append(asyncio.create_task(one(*p)))
            else:
                follow = later[i * (turns - 1) : (i + 1) * (turns - 1)]
                tasks.append(asyncio.create_task(chat(p, follow)))
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    results = [r for d in done for r in (d if isinstance(d, list) else [d])]
    return summarize(results, duration, args, model)


def _stats(name: str, values: list[float]) -> dict[str, float]:
    import numpy as np

    ms = np.array(values or [0.0]) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}  # fmt: skip


def summarize(results: list[RequestResult], duration: float, args, model: str) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    report = {
        "model": model, "num_prompts": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "duration_s": duration,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "multi_turn": args.multi_turn, "shared_prefix_len": args.shared_prefix_len,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }  # fmt: skip
    report |= _stats("ttft", [r.ttft for r in ok]) | _stats("tpot", tpot)
    report |= _stats("itl", [x for r in ok for x in r.itl])
    report |= _stats("e2el", [r.latency for r in ok])
    report["errors"] = sorted({r.error for r in results if r.error})[:10]
    return report


def print_report(r: dict) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    rows = [("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
            ("Benchmark duration (s)", f"{r['duration_s']:.2f}"),
            ("Total input tokens", r["total_input_tokens"]),
            ("Total generated tokens", r["total_output_tokens"]),
            ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.2f}")]  # fmt: skip
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {metric.upper()} (ms)",
                         f"{r[f'{stat}_{metric}_ms']:.2f}"))  # fmt: skip
    for label, value in rows:
        print(f"{label:<40}{value:>20}")
    for err in r["errors"]:
        print(f"error: {err}")
    print("=" * 60)


def main(args) -> int:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.multi_turn < 0 or args.shared_prefix_len < 0:
        raise ValueError("--multi-turn and --shared-prefix-len must be >= 0")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    report = asyncio.run(run_benchmark(args))
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["completed"] else 1
