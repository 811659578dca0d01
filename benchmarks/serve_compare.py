"""Our OpenAI server against vLLM's, in one call on the GPU machine; and prefix caching on/off.

    PYTHONPATH=src python3 benchmarks/serve_compare.py --out $OUT [--mode compare|prefix|both]

`compare` (the default, about 6-8 minutes): one random-weight checkpoint of the Llama-3.2-1B
shape (bf16; its word-level tokenizer loads through transformers' AutoTokenizer, as vLLM
loads it), then for each engine of `--engines`, ours first: start its server on a free port,
wait for /health, warm up (64 requests), run `bench serve` (entrypoints/bench_serve.py) at
each of `--rates` (req/s, Poisson arrivals; inf: all at once) with random 256-token prompts
and 256 output tokens (greedy, ignore_eos, streamed /v1/completions with usage), rate x
`--duration` requests per rate, then stop the server. Both get the same dtype,
max_model_len (4096), GPU memory utilization (0.85), max_num_seqs (256) and token budget
(8192); prefix caching stays at each engine's default, on for both (ours; vLLM's V1 engine,
read back from its log). Each rate has its own prompt seed, so no run hits the prefix cache
of an earlier one, and both engines get the same prompts and arrival times.

`prefix` (issue 13, about 2 minutes): our server only, with --enable-prefix-caching, then
--no-enable-prefix-caching: `bench serve --multi-turn` chat replays (128 conversations of 4
turns, 32 at a time, behind one 2,000-token system prompt); throughput, TTFT and the share of
prompt tokens found cached, for each.

Into `--out`, rewritten after every run (a run cut short leaves what was done):
serve_compare.json (everything), serve_compare.md (tables), serve_compare.png (output tok/s and
inter-token latency against request rate, both engines) and server_logs.txt (each server's
log, last lines).

vLLM runs as `python3 -m vllm.entrypoints.openai.api_server` with `--vllm-site` (/tmp/site)
first on PYTHONPATH and VLLM_USE_FLASHINFER_SAMPLER=0; our server runs without that folder. The
GPU machine's image lacks fastapi, uvicorn and pydantic: when they do not import, our server's
PYTHONPATH gets a folder of links to only those packages (their few needs, and gguf, which the
package imports and the image lacks) in `--vllm-site`, never vLLM. Without vLLM, carry the web
stack alone as wheels and install them into a folder given as `--vllm-site` (fastapi 0.115.12
and starlette 0.46.2: fastapi 0.165 imports opentelemetry; session9_2026-12-01_h200/README.md
lists the fourteen). Servers are stopped
(SIGTERM, then SIGKILL to them and every process they started) after their runs, on errors,
SIGTERM and Ctrl-C; a server's first process dies with this script even on SIGKILL
(PR_SET_PDEATHSIG), and what a killed run left behind is killed at the next start (the pids are
kept in a file). `--time-budget` (seconds, from this script's start) skips the runs that would
not fit, keeping the time later engines need.

A flow check on the CPU: --engines ours --device cpu --dtype float32 --model TINY_CKPT
--rates 2,4,inf --num-prompts 6 --input-len 16 --output-len 8 --max-model-len 256.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
SHAPES = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")
# Our server's web stack, taken from --vllm-site when the machine lacks it: module or
# distribution names (a dist-info's name up to its first '-').
SERVE_DEPS = tuple(
    "fastapi starlette pydantic pydantic_core annotated_types typing_inspection uvicorn "
    "annotated_doc typing_extensions anyio sniffio idna h11 click uvloop httptools gguf".split()
)
SERVE_IMPORTS = "import fastapi, pydantic, starlette, uvicorn"
PIDFILE = Path(tempfile.gettempdir()) / "serve_compare_pids.json"
FILES = ("serve_compare.json", "serve_compare.md", "serve_compare.png", "server_logs.txt")
METRICS = tuple(
    "num_preemptions_total prompt_tokens_total generation_tokens_total "
    "prefix_cache_queries_total prefix_cache_hits_total".split()
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--mode", default="compare", choices=["compare", "prefix", "both"])
    p.add_argument("--engines", default="ours,vllm", help="comma-separated: ours, vllm")
    p.add_argument(
        "--model",
        default="llama-3.2-1b",
        help=f"checkpoint folder, or a shape written with random weights: {SHAPES}",
    )
    p.add_argument("--served-model-name", default="bench-model")
    p.add_argument("--rates", default="8,16,32,64,inf", help="request rates (req/s; inf)")
    p.add_argument(
        "--duration",
        type=float,
        default=12.0,
        help="seconds of Poisson arrivals per finite rate: num_prompts = rate x this",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per rate (overrides --duration and --inf-prompts)",
    )
    p.add_argument("--inf-prompts", type=int, default=512, help="requests at rate inf")
    p.add_argument("--min-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    # 4 client processes were the bound of our saturated server (benchmarks/DECISIONS.md)
    p.add_argument("--num-workers", type=int, default=12, help="bench serve client processes")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    # engine settings, the same for both servers
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--device", default=None, help="our server's --device (cpu for a flow check)")
    p.add_argument("--ours-args", default="", help="more arguments for our server (one string)")
    p.add_argument(
        "--ours-env",
        default="",
        help="environment variables for our server: NAME=VALUE, space-separated",
    )
    p.add_argument("--save-detailed", action="store_true",
                   help="each run's chunk times into detailed_ENGINE_RATE.json "
                        "(for benchmarks/serve_stalls.py)")  # fmt: skip
    p.add_argument("--py-spy", action="store_true",
                   help="record which thread holds each server process's GIL during each run "
                        "(py-spy on PATH or in --vllm-site/bin): pyspy_ENGINE_RATE.txt and its "
                        "summary by benchmarks/gil_profile.py, .md")  # fmt: skip
    p.add_argument("--vllm-args", default="", help="more arguments for vLLM's server")
    p.add_argument("--vllm-site", default="/tmp/site", help="where vLLM is installed")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=240.0,
        help="seconds for our server to answer /health",
    )
    p.add_argument(
        "--vllm-startup-timeout",
        type=float,
        default=420.0,
        help="seconds for vLLM's server to answer /health (compiles, captures)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=480.0,
        help="seconds for the whole script: runs that would not fit are skipped",
    )
    # prefix mode
    p.add_argument("--prefix-conversations", type=int, default=128)
    p.add_argument("--prefix-turns", type=int, default=4)
    p.add_argument("--prefix-concurrency", type=int, default=32)
    p.add_argument(
        "--prefix-shared-len",
        type=int,
        default=2000,
        help="tokens of the system prompt every conversation starts with",
    )
    p.add_argument("--prefix-input-len", type=int, default=200, help="tokens per user message")
    p.add_argument("--prefix-output-len", type=int, default=100, help="tokens per reply")
    args = p.parse_args(argv)
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = set(args.engine_list) - {"ours", "vllm"}
    if bad or not args.engine_list:
        p.error(f"--engines takes ours and/or vllm, got {args.engines!r}")
    args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    if not args.rate_list or any(r <= 0 for r in args.rate_list):
        p.error("--rates must be positive numbers or inf")
    return args


# ---- processes ----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """Every live process under `pid`, as (pid, start time)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st:
                children.setdefault(st[0], []).append((int(name), st[1]))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child[0])
    return out


def kill_exact(procs: list[tuple[int, int]], sig: int = signal.SIGKILL) -> None:
    """Signal each (pid, start time) that is still that same process."""
    for pid, start in procs:
        st = _stat(pid)
        if st and st[1] == start:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def _alive(procs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(pid, start) for pid, start in procs if (_stat(pid) or (0, -1))[1] == start]


def _remember(procs: list[tuple[int, int]]) -> None:
    try:
        PIDFILE.write_text(json.dumps(procs))
    except OSError:
        pass


def kill_leftovers() -> list[int]:
    """Kill the server processes a killed earlier run of this script left behind."""
    try:
        procs = [tuple(p) for p in json.loads(PIDFILE.read_text())]
    except (OSError, ValueError):
        return []
    alive = _alive(procs)
    kill_exact(alive)
    PIDFILE.unlink(missing_ok=True)
    return [pid for pid, _ in alive]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The server's first process dies with this script, even on SIGKILL (PR_SET_PDEATHSIG = 1).
_LAUNCH = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])"
)


class Server:
    """One server process: started with its output in `log`, ready when /health answers 200,
    stopped with SIGTERM, then SIGKILL to it and to every process it started."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path) -> None:
        self.name, self.cmd, self.env, self.port, self.log = name, cmd, env, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.known: list[tuple[int, int]] = []
        self.startup_s: float | None = None

    def start(self, timeout: float) -> None:
        import httpx

        t0 = time.monotonic()
        launch = [sys.executable, "-c", _LAUNCH, str(os.getpid()), *self.cmd]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                launch,
                env=self.env,
                cwd=REPO,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        st = _stat(self.proc.pid)
        self.known = [(self.proc.pid, st[1])] if st else []
        _remember(self.known)
        while True:
            self._track()
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} server exited ({self.proc.returncode}) while "
                    f"starting:\n{tail(self.log, 30)}"
                )
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(
                    f"{self.name} server: no /health after {timeout:.0f} s:\n{tail(self.log, 30)}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.startup_s = time.monotonic() - t0

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} server exited ({code}):\n{tail(self.log, 30)}")

    def _track(self) -> None:
        if self.proc is not None:
            new = [p for p in descendants(self.proc.pid) if p not in self.known]
            if new:
                self.known += new
                _remember(self.known)

    def stop(self, grace: float = 30.0) -> dict:
        """Stop it; returns how (exit code, seconds, processes that had to be killed)."""
        if self.proc is None:
            return {}
        t0 = time.monotonic()
        self._track()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        leftover = _alive(self.known)
        kill_exact(leftover)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 15
        while _alive(self.known) and time.monotonic() < deadline:
            time.sleep(0.2)
        info = {
            "returncode": self.proc.returncode,
            "stop_s": round(time.monotonic() - t0, 1),
            "killed": [pid for pid, _ in leftover],
            "still_alive": _alive(self.known),
        }
        self.proc = None
        PIDFILE.unlink(missing_ok=True)
        return info


def tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def scrape_metrics(url: str) -> dict[str, float]:
    """A few vllm:* counters from /metrics (both servers use vLLM's names), summed over
    labels."""
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line[5:].split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def gpu_info() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        q = "--query-gpu=name,memory.used,memory.total"
        r = subprocess.run(
            ["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- environments and commands ------------------------------------------------------------


def _imports(pythonpath: list[str], code: str) -> bool:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    return r.returncode == 0


def link_serve_deps(site: Path, folder: Path) -> list[str]:
    """Links in `folder` to the SERVE_DEPS modules and dist-infos found in `site`."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    linked = []
    for entry in sorted(site.iterdir()):
        base = entry.name.split("-", 1)[0]
        base = base[:-3] if base.endswith(".py") else base
        if base.lower() in SERVE_DEPS:
            (folder / entry.name).symlink_to(entry)
            linked.append(entry.name)
    return linked


def ours_pythonpath(args, notes: dict) -> list[str]:
    """PYTHONPATH for our server: src, plus the links of link_serve_deps when the machine
    lacks the web stack."""
    if _imports([str(SRC)], SERVE_IMPORTS):
        notes["ours_web_stack"] = "the machine's own"
        return [str(SRC)]
    site = Path(args.vllm_site)
    if not site.is_dir():
        raise RuntimeError(
            f"our server needs fastapi, uvicorn, pydantic: not importable, and "
            f"no {site} to take them from"
        )
    folder = Path(tempfile.gettempdir()) / "serve_compare_deps"
    linked = link_serve_deps(site, folder)
    if not _imports([str(SRC), str(folder)], SERVE_IMPORTS):  # they need more: all of site
        if not _imports([str(SRC), str(site)], SERVE_IMPORTS):
            raise RuntimeError(f"fastapi/uvicorn/pydantic do not import even from {site}")
        notes["ours_web_stack"] = f"all of {site} (its links alone did not import)"
        return [str(SRC), str(site)]
    notes["ours_web_stack"] = f"linked from {site}: " + ", ".join(linked)
    return [str(SRC), str(folder)]


def _base_env(pythonpath: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=os.pathsep.join(pythonpath),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def engine_flags(args, ckpt: Path, port: int) -> list[str]:
    """The flags both servers take, spelled the same by both."""
    flags = {"model": ckpt, "host": "127.0.0.1", "port": port,
             "served-model-name": args.served_model_name, "dtype": args.dtype,
             "max-model-len": args.max_model_len,
             "gpu-memory-utilization": args.gpu_memory_utilization,
             "max-num-seqs": args.max_num_seqs,
             "max-num-batched-tokens": args.max_num_batched_tokens}  # fmt: skip
    return [x for key, value in flags.items() for x in (f"--{key}", str(value))]


def ours_server(args, ckpt: Path, port: int, log: Path, pythonpath: list[str],
                prefix_caching: bool | None = None) -> Server:  # fmt: skip
    cmd = [sys.executable, "-m", "llm_inference.entrypoints.cli", "serve",
           *engine_flags(args, ckpt, port), "--log-level", "warning"]  # fmt: skip
    if args.device:
        cmd += ["--device", args.device]
    if prefix_caching is not None:
        cmd.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    cmd += args.ours_args.split()
    env = _base_env(pythonpath)
    env.update(item.split("=", 1) for item in args.ours_env.split())
    return Server("ours", cmd, env, port, log)


def vllm_server(args, ckpt: Path, port: int, log: Path) -> Server:
    site = args.vllm_site
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           *engine_flags(args, ckpt, port), "--uvicorn-log-level", "warning"]  # fmt: skip
    cmd += args.vllm_args.split()
    env = _base_env([site, str(SRC)])
    env.update(PATH=f"{site}/bin{os.pathsep}{env.get('PATH', '')}",
               VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1")  # fmt: skip
    return Server("vllm", cmd, env, port, log)


def vllm_version(site: str) -> str | None:
    found = sorted(Path(site).glob("vllm-*.dist-info"))
    return found[0].name[len("vllm-") : -len(".dist-info")] if found else None


def prepare_checkpoint(model: str) -> Path:
    """The checkpoint folder: `model` itself, or a random-weight one of that shape written in a
    subprocess (so that this process never holds GPU memory)."""
    if model not in SHAPES:
        return Path(model)
    code = (
        "import sys; from llm_inference.entrypoints.bench import random_checkpoint; "
        "print(random_checkpoint(sys.argv[1]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, model],
        env=_base_env([str(SRC)]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        raise RuntimeError(f"random_checkpoint({model!r}) failed:\n{r.stderr[-3000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def check_tokenizer(ckpt: Path) -> dict:
    """AutoTokenizer (what vLLM loads) must read the checkpoint's tokenizer and round-trip a
    random prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = list(range(1000, 1016))
    again = tok(tok.decode(ids), add_special_tokens=False).input_ids
    cfg = json.loads((ckpt / "config.json").read_text())
    return {
        "class": type(tok).__name__,
        "len": len(tok),
        "vocab_size": cfg.get("vocab_size"),
        "round_trip": again == ids,
    }


# ---- runs ---------------------------------------------------------------------------------


def bench(url: str, args, ckpt: Path, **options) -> dict:
    """One `llm-inference bench serve` run in this process (`options`: its flags, with
    underscores); its report."""
    from llm_inference.entrypoints import bench_serve
    from llm_inference.entrypoints.cli import build_parser

    options = {"base_url": url, "model": args.served_model_name, "tokenizer": ckpt,
               "timeout": args.request_timeout, "num_workers": args.num_workers,
               **options}  # fmt: skip
    argv = ["bench", "serve"]
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        argv += [flag] if value is True else [flag, str(value)]
    return bench_serve.run_benchmark(build_parser().parse_args(argv))


def check_warmup(server: Server, report: dict) -> None:
    """A server that answered no warm-up request will not answer the runs either."""
    if not report["completed"]:
        raise RuntimeError(f"{server.name} server: no warm-up request completed: "
                           f"{report['errors']}\n{tail(server.log, 30)}")  # fmt: skip


def measured(server: Server, args, ckpt: Path, **options) -> dict:
    """bench(), with the change in the server's counters over the run."""
    before = scrape_metrics(server.url)
    report = bench(server.url, args, ckpt, **options)
    after = scrape_metrics(server.url)
    report["server_counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
    return report


PY_SPY_RATE = 200  # samples a second


def start_py_spy(server: Server, path: Path, site: str) -> subprocess.Popen | None:
    """py-spy recording the GIL holders of the server's processes into `path` (gil_profile.py)."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=f"{site}/bin")
    if exe is None or server.proc is None:
        print("py-spy not found: no GIL record", flush=True)
        return None
    cmd = [exe, "record", "--pid", str(server.proc.pid), "--subprocesses", "--gil",
           "--threads", "--nonblocking", "--rate", str(PY_SPY_RATE), "--format", "raw",
           "-o", str(path)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def stop_py_spy(recorder: subprocess.Popen, path: Path, seconds: float) -> None:
    """Stop the recording (py-spy writes its file on SIGINT) and write its summary beside it."""
    recorder.send_signal(signal.SIGINT)
    try:
        recorder.wait(60)
    except subprocess.TimeoutExpired:
        recorder.kill()
    if not path.exists():
        print(f"py-spy wrote no {path.name}", flush=True)
        return
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gil_profile import summarize

    text = summarize(str(path), seconds, PY_SPY_RATE, top=25)
    path.with_suffix(".md").write_text(text + "\n")
    print("\n".join(line for line in text.splitlines() if "GIL held" in line), flush=True)


def prompts_for(args, rate: float) -> int:
    if args.num_prompts:
        return args.num_prompts
    if math.isinf(rate):
        return args.inf_prompts
    return max(args.min_prompts, round(rate * args.duration))


def estimate_run(args, rate: float, n: int) -> float:
    """Rough seconds for one run (arrivals, then the last requests' decode)."""
    if math.isinf(rate):
        return 5 + n * args.output_len / 10000
    return n / rate + 3 + args.output_len * 0.02


# Rough seconds, for --time-budget: to answer /health (vLLM compiles and captures graphs),
# to stop a server, and one prefix-mode server's start, warm-up, run and stop.
STARTUP_ESTIMATE = {"ours": 45.0, "vllm": 150.0}
STOP_ESTIMATE = 15.0
PREFIX_ESTIMATE = 90.0


def first_run_estimate(args, engine: str) -> float:
    """Seconds to start an engine, run the first rate and stop it."""
    rate = args.rate_list[0]
    return STARTUP_ESTIMATE[engine] + estimate_run(args, rate, prompts_for(args, rate)) + 25


def engine_estimate(args, engine: str) -> float:
    runs = sum(estimate_run(args, r, prompts_for(args, r)) for r in args.rate_list)
    return STARTUP_ESTIMATE[engine] + 10 + runs + STOP_ESTIMATE


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _clean(obj):
    """JSON-safe: infinities become "inf"."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


class Session:
    """The results so far, written to the output folder after every change."""

    def __init__(self, args) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.time_budget
        self.logdir = Path(tempfile.mkdtemp(prefix="serve_compare_logs_"))
        self.logs: list[Path] = []
        self.data: dict = {
            "meta": {"argv": sys.argv[1:], "started": time.strftime("%F %T"), "notes": {}},
            "engines": {},
            "runs": [],
            "prefix": [],
        }

    @property
    def notes(self) -> dict:
        return self.data["meta"]["notes"]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log_path(self, name: str) -> Path:
        path = self.logdir / f"{len(self.logs)}_{name}.log"
        self.logs.append(path)
        return path

    def write(self) -> None:
        self.data["meta"]["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / FILES[0]).write_text(json.dumps(_clean(self.data), indent=1, allow_nan=False))
        (self.out / FILES[1]).write_text(markdown(self.data))
        if any(r.get("result") for r in self.data["runs"]):
            try:
                plot(self.data, self.out / FILES[2])
            except Exception as e:  # noqa: BLE001 - the tables matter more than the figure
                self.notes["plot_error"] = f"{type(e).__name__}: {e}"
        parts = [f"==== {p.name} (last 200 lines) ====\n{tail(p, 200)}\n" for p in self.logs]
        (self.out / FILES[3]).write_text("\n".join(parts))


def run_engine(
    s: Session, engine: str, ckpt: Path, pythonpath: list[str] | None, reserve_after: float
) -> None:
    """Start `engine`'s server, warm it up, run every rate, stop it."""
    args = s.args
    plan = [(r, prompts_for(args, r)) for r in args.rate_list]
    info = s.data["engines"].setdefault(engine, {})
    if s.left() - reserve_after < first_run_estimate(args, engine):
        info["skipped"] = (
            f"not started: {s.left():.0f} s left, {reserve_after:.0f} s kept for later"
        )
        print(f"[{engine}] {info['skipped']}", flush=True)
        return
    port = free_port()
    if engine == "ours":
        server = ours_server(args, ckpt, port, s.log_path("ours"), pythonpath or [str(SRC)])
        timeout = args.startup_timeout
    else:
        server = vllm_server(args, ckpt, port, s.log_path("vllm"))
        info["version"] = vllm_version(args.vllm_site)
        timeout = args.vllm_startup_timeout
    info["command"] = " ".join(server.cmd)
    info["gpu_before"] = gpu_info()
    print(f"[{engine}] starting: {info['command']}", flush=True)
    try:
        server.start(min(timeout, max(30.0, s.left() - reserve_after)))
        info["startup_s"] = round(server.startup_s, 1)
        print(f"[{engine}] ready in {server.startup_s:.1f} s", flush=True)
        if engine == "vllm":
            for line in tail(server.log, 400).splitlines():
                if "enable_prefix_caching=" in line:
                    info["prefix_caching"] = line.split("enable_prefix_caching=", 1)[1][:5]
                    break
        t = time.monotonic()
        warm = bench(server.url, args, ckpt, request_rate="inf", num_prompts=64, seed=10_000,
                     input_len=args.input_len, output_len=32)  # fmt: skip
        info["warmup_s"] = round(time.monotonic() - t, 1)
        check_warmup(server, warm)
        for i, (rate, n) in enumerate(plan):
            server.check_alive()
            run = {"engine": engine, "rate": rate, "num_prompts": n}
            need = estimate_run(args, rate, n) + STOP_ESTIMATE
            if s.left() - reserve_after < need:
                run["skipped"] = f"{s.left():.0f} s left, {need:.0f} s needed"
                s.data["runs"].append(run)
                print(f"[{engine}] rate {rate_label(rate)}: skipped ({run['skipped']})", flush=True)
                continue
            # Seed i + 1: every rate its own prompts (no prefix cache hits across runs), the
            # same for both engines.
            spy = s.out / f"pyspy_{engine}_{rate_label(rate)}.txt"
            recorder = start_py_spy(server, spy, args.vllm_site) if args.py_spy else None
            t = time.monotonic()
            r = measured(server, args, ckpt, request_rate=rate, num_prompts=n, seed=i + 1,
                         input_len=args.input_len, output_len=args.output_len,
                         **({"save_detailed": True} if args.save_detailed else {}))  # fmt: skip
            if recorder is not None:
                stop_py_spy(recorder, spy, time.monotonic() - t)
            if "requests" in r:  # each request's chunk times: a file of their own
                detailed = s.out / f"detailed_{engine}_{rate_label(rate)}.json"
                detailed.write_text(json.dumps({"requests": r.pop("requests")}))
            run["result"] = r
            s.data["runs"].append(run)
            print(f"[{engine}] rate {rate_label(rate)}: {summary_line(r)}", flush=True)
            s.write()
    except Exception as e:
        info["error"] = f"{type(e).__name__}: {e}"
        print(f"[{engine}] error: {info['error']}", flush=True)
    finally:
        info["stop"] = server.stop()
        info["gpu_after"] = gpu_info()
        s.write()


def run_prefix(s: Session, ckpt: Path, pythonpath: list[str]) -> None:
    """Our server with prefix caching on, then off: the same multi-turn replay."""
    args = s.args
    for caching in (True, False):
        entry = {
            "prefix_caching": caching,
            "conversations": args.prefix_conversations,
            "turns": args.prefix_turns,
            "concurrency": args.prefix_concurrency,
            "shared_prefix_len": args.prefix_shared_len,
            "input_len": args.prefix_input_len,
            "output_len": args.prefix_output_len,
        }
        s.data["prefix"].append(entry)
        reserve = PREFIX_ESTIMATE if caching else 0.0  # for the run with caching off
        if s.left() - reserve < PREFIX_ESTIMATE:
            entry["skipped"] = f"{s.left():.0f} s left"
            print(f"[prefix caching {caching}] skipped: {entry['skipped']}", flush=True)
            continue
        log = s.log_path(f"ours_prefix_{'on' if caching else 'off'}")
        server = ours_server(args, ckpt, free_port(), log, pythonpath, prefix_caching=caching)
        entry["command"] = " ".join(server.cmd)
        print(f"[prefix caching {caching}] starting: {entry['command']}", flush=True)
        try:
            server.start(min(args.startup_timeout, max(30.0, s.left())))
            entry["startup_s"] = round(server.startup_s, 1)
            warm = bench(server.url, args, ckpt, request_rate="inf", num_prompts=32,
                         seed=20_000, input_len=args.prefix_input_len, output_len=16)  # fmt: skip
            check_warmup(server, warm)
            r = measured(server, args, ckpt, request_rate="inf",
                         num_prompts=args.prefix_conversations, seed=7,
                         input_len=args.prefix_input_len, output_len=args.prefix_output_len,
                         multi_turn=args.prefix_turns, max_concurrency=args.prefix_concurrency,
                         shared_prefix_len=args.prefix_shared_len)  # fmt: skip
            entry["result"] = r
            print(f"[prefix caching {caching}] {summary_line(r)}", flush=True)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"[prefix caching {caching}] error: {entry['error']}", flush=True)
        finally:
            entry["stop"] = server.stop()
            s.write()


# ---- report -------------------------------------------------------------------------------


def summary_line(r: dict) -> str:
    return (
        f"{r['completed']}/{r['num_prompts']} ok, "
        f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:,.0f} out tok/s, "
        f"TTFT p99 {r['p99_ttft_ms']:.1f} ms, ITL p99 {r['p99_itl_ms']:.2f} ms, "
        f"TPOT mean {r['mean_tpot_ms']:.2f} ms"
    )


def _triple(r: dict, metric: str) -> str:
    return " / ".join(f"{r[f'{s}_{metric}_ms']:.1f}" for s in ("mean", "median", "p99"))


def _rate_value(rate) -> float:
    return float("inf") if rate == "inf" else float(rate)


def markdown(data: dict) -> str:
    meta, lines = data["meta"], []
    lines.append("# Serving benchmark: our server and vLLM's\n")
    lines.append(
        f"Started {meta.get('started')}, {meta.get('elapsed_s')} s; arguments: "
        f"`{' '.join(meta.get('argv', []))}`\n"
    )
    setup = ("gpu", "model", "checkpoint", "tokenizer", "workload", "engine_settings",
             "prefix_caching", "num_workers")  # fmt: skip
    for key in setup:
        if meta.get(key) is not None:
            lines.append(f"- {key}: {meta[key]}")
    for key, value in meta.get("notes", {}).items():
        lines.append(f"- {key}: {value}")
    for name, info in data.get("engines", {}).items():
        keys = ("version", "startup_s", "warmup_s", "prefix_caching", "skipped", "error")
        shown = ", ".join(
            f"{k} {str(info[k]).splitlines()[0]}" for k in keys if info.get(k) is not None
        )
        lines.append(f"- engine {name}: {shown}")
        if info.get("command"):
            lines.append(f"  - `{info['command']}`")
    runs = data.get("runs", [])
    if runs:
        lines.append(
            "\nTimes in ms as mean / median / p99. TPOT: per request, (latency - TTFT) "
            "/ (tokens - 1); ITL: between streamed chunks.\n"
        )
        lines.append(
            "| rate (req/s) | engine | ok / failed | req/s | output tok/s | TTFT | TPOT "
            "| ITL | E2E |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        order = sorted(runs, key=lambda r: (_rate_value(r["rate"]), r["engine"] != "ours"))
        for run in order:
            label = rate_label(_rate_value(run["rate"]))
            r = run.get("result")
            if not r:
                lines.append(
                    f"| {label} | {run['engine']} | skipped: {run.get('skipped', '')} | | | | | | |"
                )
                continue
            lines.append(
                f"| {label} | {run['engine']} | {r['completed']} / {r['failed']} | "
                f"{r['request_throughput']:.2f} | {r['output_throughput']:,.0f} | "
                f"{_triple(r, 'ttft')} | {_triple(r, 'tpot')} | {_triple(r, 'itl')} | "
                f"{_triple(r, 'e2el')} |"
            )
        ratios = ratio_lines(runs)
        if ratios:
            lines.append("\nOurs / vLLM at each rate (output tok/s; p99 ITL; mean TPOT):\n")
            lines += ratios
    prefix = data.get("prefix", [])
    if prefix:
        lines.append("\n## Prefix caching, our server: multi-turn chat replay\n")
        p0 = prefix[0]
        lines.append(
            f"{p0['conversations']} conversations of {p0['turns']} turns, "
            f"{p0['concurrency']} at a time, each behind the same "
            f"~{p0['shared_prefix_len']}-token system prompt; user messages "
            f"{p0['input_len']} tokens, replies {p0['output_len']} tokens (greedy, "
            "ignore_eos); each turn resends the whole conversation.\n"
        )
        lines.append(
            "| prefix caching | ok / failed | duration s | req/s | output tok/s | "
            "total tok/s | TTFT | E2E | prompt tokens found cached |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for p in prefix:
            r = p.get("result")
            state = "on" if p["prefix_caching"] else "off"
            if not r:
                why = p.get("skipped") or p.get("error", "")
                lines.append(f"| {state} | {why[:200]} | | | | | | | |")
                continue
            counters = r.get("server_counters", {})
            hits, queries = (counters.get(f"prefix_cache_{k}_total") for k in ("hits", "queries"))
            cached = (
                f"{hits / queries:.1%} of {queries:,.0f}" if hits is not None and queries else "-"
            )
            lines.append(
                f"| {state} | {r['completed']} / {r['failed']} | {r['duration_s']:.2f} | "
                f"{r['request_throughput']:.2f} | {r['output_throughput']:,.0f} | "
                f"{r['total_token_throughput']:,.0f} | {_triple(r, 'ttft')} | "
                f"{_triple(r, 'e2el')} | {cached} |"
            )
    errors = [
        (r["engine"], rate_label(_rate_value(r["rate"])), e)
        for r in runs
        for e in (r.get("result") or {}).get("errors", [])
    ]
    errors += [(n, "-", i["error"]) for n, i in data.get("engines", {}).items() if i.get("error")]
    if errors:
        lines.append("\n## Errors\n")
        for engine, rate, msg in errors:
            lines.append(f"- {engine} (rate {rate}):\n\n    " + msg[-3000:].replace("\n", "\n    "))
    return "\n".join(lines) + "\n"


def ratio_lines(runs: list[dict]) -> list[str]:
    by = {(r["engine"], _rate_value(r["rate"])): r["result"] for r in runs if r.get("result")}
    out = []
    for rate in sorted({k[1] for k in by}):
        a, b = by.get(("ours", rate)), by.get(("vllm", rate))
        if a and b and b["output_throughput"] and b["p99_itl_ms"] and b["mean_tpot_ms"]:
            tput = a["output_throughput"] / b["output_throughput"]
            itl, tpot = a["p99_itl_ms"] / b["p99_itl_ms"], a["mean_tpot_ms"] / b["mean_tpot_ms"]
            out.append(f"- rate {rate_label(rate)}: {tput:.2f}x; {itl:.2f}x; {tpot:.2f}x")
    return out


def plot(data: dict, path: Path) -> None:
    """Output tok/s and p99 ITL against the offered request rate, one line per engine (inf is
    plotted one step right of the highest finite rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data["runs"] if r.get("result")]
    rates = sorted({_rate_value(r["rate"]) for r in runs})
    xs = {rate: i for i, rate in enumerate(rates)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    style = {"ours": ("tab:blue", "o"), "vllm": ("tab:orange", "s")}
    for engine in sorted({r["engine"] for r in runs}):
        mine = sorted(
            (r for r in runs if r["engine"] == engine), key=lambda r: _rate_value(r["rate"])
        )
        x = [xs[_rate_value(r["rate"])] for r in mine]
        color, marker = style.get(engine, ("tab:gray", "^"))
        label = {"ours": "llm_inference", "vllm": "vLLM"}.get(engine, engine)
        axes[0].plot(
            x,
            [r["result"]["output_throughput"] for r in mine],
            marker=marker,
            color=color,
            label=label,
        )
        axes[1].plot(
            x,
            [r["result"]["p99_itl_ms"] for r in mine],
            marker=marker,
            color=color,
            label=f"{label} p99",
        )
        axes[1].plot(
            x,
            [r["result"]["median_itl_ms"] for r in mine],
            marker=marker,
            color=color,
            linestyle=":",
            alpha=0.6,
            label=f"{label} median",
        )
    for ax, title in zip(axes, ("output throughput (tok/s)", "inter-token latency (ms)")):
        ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
        ax.set_xlabel("request rate (req/s, Poisson; inf: all at once)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend()
    meta = data["meta"]
    fig.suptitle(f"{meta.get('model', '')}: {meta.get('workload', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)

    def terminate(signum, frame):
        # Once: a second signal must not cut short the servers' shutdown.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    s = Session(args)
    meta = s.data["meta"]
    killed = kill_leftovers()
    if killed:
        s.notes["killed_leftovers"] = killed
    meta["gpu"] = gpu_info()
    meta["model"] = args.model
    meta["workload"] = (
        f"random {args.input_len}-token prompts, {args.output_len} output tokens "
        "(ignore_eos, greedy, streamed /v1/completions)"
    )
    meta["engine_settings"] = {
        k: getattr(args, k)
        for k in (
            "dtype",
            "max_model_len",
            "gpu_memory_utilization",
            "max_num_seqs",
            "max_num_batched_tokens",
        )
    }
    if args.mode != "prefix":
        meta["prefix_caching"] = "each engine's default (on for both)"
    meta["num_workers"] = args.num_workers
    status = 0
    try:
        t = time.monotonic()
        ckpt = prepare_checkpoint(args.model)
        meta["checkpoint"] = str(ckpt)
        meta["checkpoint_s"] = round(time.monotonic() - t, 1)
        meta["tokenizer"] = check_tokenizer(ckpt)
        print(
            f"checkpoint {ckpt} ({meta['checkpoint_s']} s), tokenizer {meta['tokenizer']}",
            flush=True,
        )
        pythonpath = None
        if "ours" in args.engine_list or args.mode != "compare":
            pythonpath = ours_pythonpath(args, s.notes)
            fast = _imports(pythonpath, "import uvloop, httptools")  # uvicorn's "auto" choice
            s.notes["ours_event_loop"] = "uvloop, httptools" if fast else "asyncio, h11"
        s.write()
        if args.mode in ("compare", "both"):
            for i, engine in enumerate(args.engine_list):
                later = args.engine_list[i + 1 :]
                reserve = sum(engine_estimate(args, e) for e in later)
                reserve += 2 * PREFIX_ESTIMATE if args.mode == "both" else 0.0
                mine = first_run_estimate(args, engine)
                if s.left() - reserve < mine:
                    # Not all fits: keep for each later engine its start and first rate only,
                    # or nothing when even that leaves this one no room.
                    reserve = sum(first_run_estimate(args, e) for e in later)
                    reserve = reserve if s.left() - reserve >= mine else 0.0
                run_engine(s, engine, ckpt, pythonpath, reserve)
        if args.mode in ("prefix", "both"):
            run_prefix(s, ckpt, pythonpath)
    except KeyboardInterrupt as e:
        s.notes["interrupted"] = str(e) or "KeyboardInterrupt"
        status = 130
    except Exception as e:
        s.notes["error"] = f"{type(e).__name__}: {e}"
        print(f"error: {s.notes['error']}", flush=True)
        status = 1
    finally:
        s.write()
    print((s.out / FILES[1]).read_text(), flush=True)
    failed = [i for i in s.data["engines"].values() if i.get("error")]
    failed += [p for p in s.data["prefix"] if p.get("error")]
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
