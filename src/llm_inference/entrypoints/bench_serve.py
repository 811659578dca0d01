"""`llm-inference bench serve`: a load generator for any OpenAI-compatible server (ours or
vLLM's), like `vllm bench serve`.

Requests come from the datasets of `bench throughput` (bench_datasets.py), with this bench's
defaults: `uniform` with `--input-len 256 --output-len 128 --range-ratio 0` (fixed lengths),
temperature 0. Synthetic prompts are random token ids decoded to text (with `--tokenizer`,
default `--model` when it is a local folder) or random words; sharegpt's are the conversations'
own text (counted with that tokenizer). Requests stream completions with `ignore_eos` and the
workload's temperature, top-p and top-k; they arrive as a Poisson process at `--request-rate`
(inf: all at once), at most `--max-concurrency` at a time, each at its time from the start (not
after the previous one's wait). `--num-workers N` shares them among N client processes started
together: a server streaming tens of thousands of chunks a second outruns one Python reader,
whose delays would show as inter-token latency. Times are reported in milliseconds (mean,
median, p90, p99, as vLLM's), throughputs per second.

`--multi-turn T` replays chats instead: each of `--num-prompts` conversations sends T requests
one after another, each the whole conversation so far (an optional shared system prompt of
about `--shared-prefix-len` tokens, then every earlier message and reply) plus a new user
message; `--max-concurrency` then bounds the conversations in flight. This is the traffic
prefix caching is for: every turn resends what the last one computed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field

from llm_inference.entrypoints.bench_datasets import Workload, add_workload_args, workload_line

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
    start: float = 0.0  # wall-clock time of the send (time.time(): comparable across workers)
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the completion's text (multi-turn replays feed it back)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    p.add_argument("--endpoint", default="/v1/completions", help="the completions path")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder for random prompts and sharegpt's counts")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    add_workload_args(p, input_len=256, output_len=128, temperature=0.0)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, a Poisson process (inf: all at once)")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token to send (default: $OPENAI_API_KEY)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--save-detailed", action="store_true",
                   help="--json also holds each request's send time, TTFT and inter-token "
                   "latencies (as vLLM's flag of that name)")  # fmt: skip
    p.add_argument(
        "--multi-turn",
        type=int,
        default=0,
        metavar="T",
        help="replay chats of T turns, each resending the conversation (0: off)",
    )
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens (words without a tokenizer) of a system prompt shared by "
                   "every conversation")  # fmt: skip
    p.add_argument("--num-workers", type=int, default=1,
                   help="client processes that share the requests (a busy server streams more "
                   "chunks than one Python process reads on time)")  # fmt: skip


def load_tokenizer(args):
    """The tokenizer that random prompts are drawn from (`--tokenizer`, else `--model` when it
    is a local folder), or None: prompts of plain words."""
    source = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
    if not source:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def _vocabulary(tokenizer):
    """(size, decode): synthetic prompts are ids in [0, size), turned into text as random
    non-special tokens of `tokenizer`, or plain words without one."""
    if tokenizer is None:
        return len(WORDS), lambda ids: " ".join(WORDS[i] for i in ids)
    special = set(tokenizer.all_special_ids)
    tokens = [t for t in range(len(tokenizer)) if t not in special]
    return len(tokens), lambda ids: tokenizer.decode([tokens[i] for i in ids])


def make_prompts(
    workload: Workload, rng: random.Random, n: int, tokenizer, vocabulary
) -> list[tuple[str, int, int]]:
    """(prompt text, approximate prompt tokens, max output tokens) for `n` requests."""
    if workload.dataset == "sharegpt" and tokenizer is None:
        raise ValueError("--dataset sharegpt counts tokens with the model's tokenizer: pass "
                         "--tokenizer (a model folder)")  # fmt: skip
    size, decode = vocabulary
    return [(r.text or decode(r.prompt_ids), len(r.prompt_ids), r.max_tokens)
            for r in workload.requests(size, tokenizer, n, rng)]  # fmt: skip


async def send_request(client, url: str, payload: dict, headers: dict) -> RequestResult:
    """One streamed completion, timed from the send to each text chunk and to [DONE]."""
    result = RequestResult(prompt_len=payload.pop("_prompt_len"), start=time.time())
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
                # A chunk with a choice is a token's arrival, even with no text (a partial
                # character, a special token): timed as vLLM's bench times it.
                if choices := chunk.get("choices"):
                    first = choices[0]
                    result.text += (
                        first.get("text") or (first.get("delta") or {}).get("content") or ""
                    )
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


def _model_name(base_url: str, headers: dict, timeout: float) -> str:
    import httpx

    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout)
    except httpx.TransportError as e:
        raise RuntimeError(f"no server answers at {base_url}: {e}") from None
    if resp.status_code == 401:
        raise RuntimeError(
            f"{base_url} refused the API key (401): pass the server's key with --api-key "
            "or $OPENAI_API_KEY"
        )
    if resp.status_code != 200:
        raise RuntimeError(f"GET {base_url}/v1/models answered {resp.status_code}: {resp.text}")
    return resp.json()["data"][0]["id"]


@dataclass
class _Job:
    """One request (or, with --multi-turn, one conversation's turns), sent `arrival` seconds
    after the start."""

    arrival: float
    turns: list[tuple[str, int, int]]


@dataclass
class _Settings:
    url: str
    headers: dict
    model: str
    prefix: str
    timeout: float
    max_concurrency: int | None
    multi_turn: bool
    sampling: dict  # temperature, top_p and top_k (when on)


async def _drive(jobs: list[_Job], s: _Settings, start: float) -> tuple[list, float]:
    """Send `jobs`, each at wall-clock time `start + arrival` (at most `s.max_concurrency` in
    flight); returns each job's results and the wall-clock time the last one ended."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=s.timeout, limits=limits) as client:
        gate = asyncio.Semaphore(s.max_concurrency or len(jobs) or 1)

        def payload(prompt: str, n_in: int, n_out: int) -> dict:
            return {"model": s.model, "prompt": prompt, "max_tokens": n_out, **s.sampling,
                    "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, "_prompt_len": n_in}  # fmt: skip

        async def one(job: _Job) -> RequestResult:
            async with gate:
                return await send_request(client, s.url, payload(*job.turns[0]), s.headers)

        async def chat(job: _Job) -> list[RequestResult]:
            """One conversation: each turn resends everything so far plus a new message."""
            async with gate:
                history, results = s.prefix + job.turns[0][0], []
                for turn, (text, n_in, n_out) in enumerate(job.turns):
                    if turn:
                        history = f"{history}{results[-1].text}\n{text}"
                    request = payload(history, n_in, n_out)
                    results.append(await send_request(client, s.url, request, s.headers))
                return results

        tasks = []
        for job in jobs:
            delay = start + job.arrival - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(chat(job) if s.multi_turn else one(job)))
        done = await asyncio.gather(*tasks)
    return done, time.time()


def _worker_warm(_: int) -> None:
    import httpx  # noqa: F401 - imported before the start time, not after

    time.sleep(0.1)  # keeps this worker busy so that the others take the other calls


def _worker(jobs: list[_Job], s: _Settings, start: float) -> tuple[list, float]:
    return asyncio.run(_drive(jobs, s, start))


def _run_workers(jobs: list[_Job], s: _Settings, n: int) -> tuple[list, float, float]:
    """`jobs` over `n` client processes (job i to process i % n, the concurrency limit split
    between them), all timed from one wall-clock start: one Python process spends tens of
    microseconds on each streamed chunk, which delays the chunks of a busy server."""
    import dataclasses
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(n) as pool:
        pool.map(_worker_warm, range(n), chunksize=1)
        start = time.time() + 0.5
        calls = []
        for k in range(n):
            limit = s.max_concurrency
            if limit is not None:
                limit = limit // n + (k < limit % n)
            calls.append((jobs[k::n], dataclasses.replace(s, max_concurrency=limit), start))
        parts = pool.starmap(_worker, calls, chunksize=1)
    done: list = [None] * len(jobs)
    for k, (results, _) in enumerate(parts):
        done[k::n] = results
    return done, start, max(end for _, end in parts)


# At an infinite rate, client processes that each sent all their requests at once would have
# them admitted one process's after another's (as they reached the server), and at the end one
# process would read the last wave's streams alone, slower than they come (benchmarks/
# DECISIONS.md): request i leaves i * INF_SPACING_S after the start, so that the processes'
# requests interleave, about as fast as they send them.
INF_SPACING_S = 2e-4


def arrivals(n: int, rate: float, workers: int, rng: random.Random) -> list[float]:
    """Each request's send time after the start: a Poisson process of `rate` per second; at
    an infinite rate all at once, or INF_SPACING_S apart over several client processes."""
    if rate != float("inf"):
        return list(itertools.accumulate(rng.expovariate(rate) if i else 0.0 for i in range(n)))
    return [i * INF_SPACING_S if workers > 1 else 0.0 for i in range(n)]


def run_benchmark(args) -> dict:
    """Send every request (Poisson arrivals, bounded concurrency) and summarize them."""
    rng = random.Random(args.seed)
    turns = max(1, args.multi_turn)
    workload = Workload.from_args(args)
    tokenizer = load_tokenizer(args)
    size, decode = vocabulary = _vocabulary(tokenizer)
    # first turns, then the rest
    prompts = make_prompts(workload, rng, args.num_prompts * turns, tokenizer, vocabulary)
    described = workload.describe([p[1] for p in prompts], [p[2] for p in prompts])
    prompts, later = prompts[: args.num_prompts], prompts[args.num_prompts :]
    n_prefix = args.shared_prefix_len
    prefix = decode([rng.randrange(size) for _ in range(n_prefix)]) + "\n" if n_prefix else ""
    workers = min(
        getattr(args, "num_workers", 1), len(prompts), args.max_concurrency or len(prompts)
    )
    times = arrivals(len(prompts), args.request_rate, workers, rng)
    jobs = [
        _Job(times[i], [p, *later[i * (turns - 1) : (i + 1) * (turns - 1)]])
        for i, p in enumerate(prompts)
    ]
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _model_name(base, headers, args.timeout)
    sampling = {"temperature": workload.temperature, "top_p": workload.top_p}
    if workload.top_k != -1:  # an extension (vLLM's): sent only when asked for
        sampling["top_k"] = workload.top_k
    settings = _Settings(base + args.endpoint, headers, model, prefix, args.timeout,
                         args.max_concurrency, turns > 1, sampling)  # fmt: skip
    if workers > 1:
        done, start, end = _run_workers(jobs, settings, workers)
    else:
        start = time.time()
        done, end = asyncio.run(_drive(jobs, settings, start))
    results = [r for d in done for r in (d if isinstance(d, list) else [d])]
    return summarize(results, end - start, args, model) | {"workload": described}


def _stats(name: str, values: list[float]) -> dict[str, float]:
    import numpy as np

    ms = np.array(values or [0.0]) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p90_{name}_ms": float(np.percentile(ms, 90)),
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
        "num_workers": getattr(args, "num_workers", 1),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }  # fmt: skip
    report |= _stats("ttft", [r.ttft for r in ok]) | _stats("tpot", tpot)
    report |= _stats("itl", [x for r in ok for x in r.itl])
    report |= _stats("e2el", [r.latency for r in ok])
    report["errors"] = sorted({r.error for r in results if r.error})[:10]
    if getattr(args, "save_detailed", False):
        report["requests"] = [
            {"start": r.start, "ttft": r.ttft, "itl": r.itl, "output_len": r.output_len} for r in ok
        ]
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
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {metric.upper()} (ms)",
                         f"{r[f'{stat}_{metric}_ms']:.2f}"))  # fmt: skip
    for label, value in rows:
        print(f"{label:<40}{value:>20}")
    print(workload_line(r["workload"]))
    for err in r["errors"]:
        print(f"error: {err}")
    print("=" * 60)


def main(args) -> int:
    if args.multi_turn < 0 or args.shared_prefix_len < 0:
        raise ValueError("--multi-turn and --shared-prefix-len must be >= 0")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.num_workers < 1:
        raise ValueError(f"--num-workers must be at least 1, got {args.num_workers}")
    report = run_benchmark(args)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["completed"] else 1
