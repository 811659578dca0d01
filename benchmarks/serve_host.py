"""The OpenAI server's own host work at saturation, on any machine: no GPU, no model.

The tiny random checkpoint of the tests (its 320-token BPE tokenizer, 1,024 positions) is
served by our real server (AsyncLLM + FastAPI + uvicorn; the engine core in a process of its
own, or on a thread of the server with `--engine-thread`) on the CPU with the model's forward
replaced by a stub that returns random hidden states (so the LM head and
the sampler still run and greedy decoding yields varied tokens, nearly all with text). What a
request costs is then the engine's host work per step plus the server's per-token path:
output processing, the hand-off to the event loop, the chunks, JSON and the SSE writes.

The server runs in a subprocess (`--serve`, internal) and stays up for all runs; each run is
one `bench serve` (entrypoints/bench_serve.py) in this process: `--num-prompts` streamed
/v1/completions of `--input-len` random tokens and `--output-len` new tokens (greedy,
ignore_eos, usage), all at once (rate inf), over `--num-workers` client processes. Reported
per run: output tok/s, mean ITL, mean TTFT, the engine's steps per second and mean batch
(from the server's step counter), and the server process's CPU time per output token (every
thread of it: the event loop and the front end's output thread; the engine core's process
apart, unless `--engine-thread`), without a profiler; then medians and spreads over `--runs`
runs after one warm-up run. `--profile PATH` runs the server under yappi (CPU time, every
thread) during the measured runs and writes the top functions per thread (engine thread, event
loop) to PATH; yappi's overhead inflates small calls (DECISIONS.md), so read its shares, not
its microseconds.

    PYTHONPATH=src python3 benchmarks/serve_host.py [--runs 3] [--num-prompts 256]
        [--output-len 256] [--num-workers 2] [--profile /tmp/serve_profile.txt]
        [--save-detailed /tmp/detailed.json]

`--save-detailed` keeps the last run's chunk times for `benchmarks/serve_stalls.py`; with
LLM_INFERENCE_PAUSE_LOG set, the server's processes log their GC pauses and compiles there.

Numbers on a 2-core machine are noisy (the client processes compete with the server): run
the same command each time and compare medians.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "src"))


def stub_forward(runner) -> None:
    """The model's forward -> random hidden states (LM head and sampler still run)."""
    import torch

    hidden = runner.model.config.hidden_size
    gen = torch.Generator().manual_seed(0)

    def forward(step):
        return torch.randn(step.num_tokens, hidden, generator=gen)

    runner._forward = forward


def stub_core(core) -> None:
    """AsyncLLM's core_setup (runs where the core runs): the stubbed forward."""
    import torch

    torch.set_num_threads(1)
    stub_forward(core.executor.workers[0].model_runner)


CENSUS_MIN_OBJECTS = 20_000  # young collections this large are the long pauses
CENSUS_COLLECTIONS = 3  # per process


def gc_census(path: str) -> None:
    """Append to `path`, at this process's first CENSUS_COLLECTIONS young-generation
    collections of CENSUS_MIN_OBJECTS objects or more, what those objects are (by type):
    what a long young collection walks."""
    import collections
    import gc
    import multiprocessing

    seen = [0]

    def census(phase: str, info: dict) -> None:
        if phase != "start" or info["generation"] != 0 or seen[0] >= CENSUS_COLLECTIONS:
            return
        young = gc.get_objects(generation=0)
        if len(young) < CENSUS_MIN_OBJECTS:
            return
        seen[0] += 1
        types = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in young)
        top = ", ".join(f"{name} {n}" for name, n in types.most_common(12))
        with open(path, "a") as f:
            f.write(f"{multiprocessing.current_process().name} ({os.getpid()}): {len(young)} "
                    f"objects: {top}\n")  # fmt: skip

    gc.callbacks.append(census)


def stub_core_census(path: str, core) -> None:
    """stub_core, and the core process's young collections counted into `path`."""
    stub_core(core)
    gc_census(path)


def serve(
    ckpt: str, port: int, profile: str | None, engine_process: bool, no_freeze: bool,
    census: str | None = None,
) -> None:  # fmt: skip
    """The server subprocess: our app with a stubbed forward, plus two internal routes."""
    import torch
    import uvicorn

    from llm_inference import AsyncLLM
    from llm_inference.engine.core_process import freeze_startup_heap, thaw_heap
    from llm_inference.entrypoints.openai.api_server import build_app

    torch.set_num_threads(1)
    setup = stub_core if census is None else functools.partial(stub_core_census, census)
    llm = AsyncLLM(ckpt, device="cpu", max_num_seqs=256, kv_cache_memory_bytes=256 << 20,
                   max_num_batched_tokens=8192, max_model_len=1024,
                   engine_process=engine_process, core_setup=setup)  # fmt: skip
    app = build_app(llm, "tiny", shutdown_llm=True)
    if not no_freeze:
        freeze_startup_heap()  # as run_server does
    if census is not None:
        gc_census(census)

    @app.get("/_host/stats")
    async def stats():  # process_time: the CPU of every thread of this (the front end's) process
        return {"time": time.monotonic(), "cpu": time.process_time(), **llm.stats()}

    @app.post("/_host/profile/{action}")
    async def prof(action: str):
        if profile is None:
            return {}
        import yappi

        if action == "start":
            yappi.set_clock_type("cpu")
            yappi.start(profile_threads=True)
        else:
            yappi.stop()
            write_profile(yappi, profile)
        return {}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    thaw_heap()


def write_profile(yappi, path: str) -> None:
    names = {t.id: t.name for t in yappi.get_thread_stats()}
    with open(path, "w") as f:
        for t in yappi.get_thread_stats():
            f.write(f"==== thread {t.name} (id {t.id}): {t.ttot:.2f} s CPU\n")
        for tid, name in names.items():
            stats = yappi.get_func_stats(filter={"ctx_id": tid})
            if not len(stats):
                continue
            for key in ("ttot", "tsub"):
                stats.sort(key, "desc")
                f.write(f"\n==== thread {name}: top by {key}\n")
                f.write(f"{'ncall':>10} {'tsub':>8} {'ttot':>8}  function\n")
                for s in list(stats)[:45]:
                    where = f"{Path(s.module).name}:{s.lineno} {s.name}"
                    f.write(f"{s.ncall:>10} {s.tsub:8.3f} {s.ttot:8.3f}  {where}\n")


def offline_steps(ckpt: Path, args) -> tuple[float, float]:
    """The engine alone (LLM.generate, same prompts' lengths, same stub): (steps/s, tok/s)."""
    import random

    import torch

    from llm_inference import LLM, SamplingParams

    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 300) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(str(ckpt), device="cpu", max_num_seqs=256, kv_cache_memory_bytes=256 << 20,
             max_num_batched_tokens=8192, max_model_len=1024) as llm:  # fmt: skip
        stub_forward(llm.engine.executor.workers[0].model_runner)
        llm.generate(prompts[:16], params, use_tqdm=False)
        before, t = llm.stats()["num_steps"], time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        steps = llm.stats()["num_steps"] - before
    return steps / dt, args.num_prompts * args.output_len / dt


def get(url: str) -> dict:
    import httpx

    return httpx.get(url, timeout=30).json()


def bench(url: str, ckpt: Path, args, seed: int) -> dict:
    from llm_inference.entrypoints import bench_serve

    p = argparse.ArgumentParser()
    bench_serve.add_cli_args(p)
    argv = ["--base-url", url, "--model", "tiny", "--tokenizer", str(ckpt),
            "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--num-workers", str(args.num_workers),
            "--seed", str(seed)]  # fmt: skip
    if args.save_detailed:
        argv.append("--save-detailed")
    before = get(url + "/_host/stats")
    report = bench_serve.run_benchmark(p.parse_args(argv))
    after = get(url + "/_host/stats")
    steps = after["num_steps"] - before["num_steps"]
    report["steps_per_s"] = steps / (after["time"] - before["time"])
    report["tokens_per_step"] = report["total_output_tokens"] / max(steps, 1)
    tokens = max(report["total_output_tokens"], 1)
    report["server_cpu_us_per_token"] = 1e6 * (after["cpu"] - before["cpu"]) / tokens
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", metavar="CKPT", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--profile", default=None, metavar="PATH")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument(
        "--save-detailed", default=None, metavar="PATH",
        help="the last run's report with each request's chunk times, for serve_stalls.py",
    )  # fmt: skip
    p.add_argument(
        "--offline",
        action="store_true",
        help="also time the engine alone (LLM.generate) with the same stub",
    )
    p.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine on a thread of the server (AsyncLLM engine_process=False)",
    )
    p.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the server's startup heap to the GC (run_server freezes it)",
    )
    p.add_argument(
        "--gc-census",
        default=None,
        metavar="PATH",
        help="append what the server's and the core's large young GC collections walk, by type",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval (s) in the server process",
    )
    args = p.parse_args()
    if args.serve:
        if args.switch_interval is not None:
            sys.setswitchinterval(args.switch_interval)
        return serve(args.serve, args.port, args.profile, not args.engine_thread,
                     args.no_gc_freeze, args.gc_census)  # fmt: skip

    import socket

    from helpers import make_checkpoint

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = make_checkpoint(Path(tempfile.mkdtemp()), max_position_embeddings=1024)
    if args.offline:
        steps, tps = offline_steps(ckpt, args)
        print(f"offline (LLM.generate): {tps:.0f} out tok/s, {steps:.1f} steps/s", flush=True)
    cmd = [sys.executable, __file__, "--serve", str(ckpt), "--port", str(port)]
    if args.switch_interval is not None:
        cmd += ["--switch-interval", str(args.switch_interval)]
    if args.engine_thread:
        cmd += ["--engine-thread"]
    if args.no_gc_freeze:
        cmd += ["--no-gc-freeze"]
    if args.profile:
        cmd += ["--profile", args.profile]
    if args.gc_census:
        cmd += ["--gc-census", args.gc_census]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    server = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                get(url + "/health")
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.5)
        bench(url, ckpt, argparse.Namespace(**{**vars(args), "num_prompts": 64}), seed=99)
        if args.profile:
            import httpx

            httpx.post(url + "/_host/profile/start", timeout=30)
        reports = []
        for run in range(args.runs):
            r = bench(url, ckpt, args, seed=run)
            reports.append(r)
            print(f"run {run}: {r['completed']}/{r['num_prompts']} ok, "
                  f"{r['output_throughput']:.0f} out tok/s, mean ITL {r['mean_itl_ms']:.2f} ms, "
                  f"p99 ITL {r['p99_itl_ms']:.1f} ms, p99 TPOT {r['p99_tpot_ms']:.1f} ms, "
                  f"mean TTFT {r['mean_ttft_ms']:.0f} ms, {r['steps_per_s']:.1f} steps/s, "
                  f"{r['tokens_per_step']:.0f} tok/step, front end "
                  f"{r['server_cpu_us_per_token']:.1f} us CPU/token", flush=True)  # fmt: skip
        if args.profile:
            import httpx

            httpx.post(url + "/_host/profile/stop", timeout=120)
            print(f"profile: {args.profile}")
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    keys = (
        "output_throughput",
        "mean_itl_ms",
        "p99_itl_ms",
        "p99_tpot_ms",
        "mean_ttft_ms",
        "steps_per_s",
        "tokens_per_step",
        "server_cpu_us_per_token",
    )
    summary = {}
    for k in keys:
        values = [r[k] for r in reports]
        summary[k] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        print(f"{k:<20} median {summary[k]['median']:10.2f}   "
              f"[{min(values):.2f} .. {max(values):.2f}]")  # fmt: skip
    if args.save_detailed:
        Path(args.save_detailed).write_text(json.dumps(reports[-1]))
    for r in reports:
        r.pop("requests", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": reports, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
