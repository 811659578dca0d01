"""Several HTTP front ends for one engine core: `serve --api-server-count N` (vLLM's option).

One front end (the server's process: event loop, tokenizer, output processing, streams) can
fall behind the core: 800 streams of the 1B shape on an H200, 33,500 tokens a second, went out
about four tokens a chunk, late (benchmarks/results/serve_tail_vs_vllm_2026-12-02_h200.md).
With N, the server's process and N - 1 processes it starts each run the
whole HTTP app on the same port, each with its own `AsyncLLM` on one pipe of the same engine
core process (`AsyncLLM(front_ends=N)` in the first, `AsyncLLM(core_pipe=...)` in the others;
core_process.py routes each request's records to the front end that added it).

- Connections: each front end listens on a socket of its own, all bound to the port with
  SO_REUSEPORT, so the kernel spreads new connections over them evenly (by a hash of their
  addresses). On one shared socket, whichever loop wakes first accepts every connection
  waiting: 800 at once went 309 / 205 / 164 / 122 to four uvicorn processes (this CPU), and on
  the H200 one front end's pauses then stalled most streams (DECISIONS.md). Where the platform
  has no SO_REUSEPORT (or does not balance with it: not Linux), they share one socket.

- /metrics: counters and histograms add up over the front ends: each writes its own to a
  shared folder every METRICS_SHARE_S (`SharedMetrics`), and the one that answers adds the
  others' latest to its own (theirs up to METRICS_SHARE_S old); the engine's gauges come from
  the core, the same in all.
- Lifetime: the first process starts the others after the core is ready and watches them: one
  that exits stops the server (exit status 1), as a dead core does (the core drops its pipe and
  aborts its requests meanwhile); each of the others exits when the first is gone
  (`watch_parent`) or the core is. A signal to the first stops the others first, then itself
  (each aborts its running requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import socket
import sys
import threading
from pathlib import Path

from llm_inference.engine.arg_utils import resolve_device
from llm_inference.engine.metrics import ServingMetrics

METRICS_SHARE_S = 1.0
MAX_DEFAULT_COUNT = 4
CPUS_PER_FRONT_END = 4


def default_count(engine_args: dict) -> int:
    """`serve`'s front ends when --api-server-count is not given: one per CPUS_PER_FRONT_END
    CPUs this process may run on, at most MAX_DEFAULT_COUNT (measured on a 16-CPU host:
    benchmarks/DECISIONS.md, "`serve` defaults to one front end per four CPUs"); one where the
    sockets cannot be balanced (not Linux), with data parallel cores or without an engine
    process (those take one), and on the CPU, whose forward wants the cores a front end would
    take."""
    if (
        not _own_sockets()
        or engine_args.get("data_parallel_size", 1) > 1
        or not engine_args.get("engine_process", True)
        or resolve_device(engine_args.get("device")) == "cpu"
    ):
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_DEFAULT_COUNT, (cpus or 1) // CPUS_PER_FRONT_END))


def _own_sockets() -> bool:
    """Whether each front end can listen on a socket of its own that the kernel balances."""
    return sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


class SharedMetrics:
    """Front end `index` of `count`: its counts written to `folder`/<index>.pkl (`publish`),
    and every front end's added up (`gather`)."""

    def __init__(self, folder: str, index: int, count: int) -> None:
        self.folder, self.index, self.count = Path(folder), index, count

    def publish(self, metrics: ServingMetrics) -> None:
        path = self.folder / f"{self.index}.pkl"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(metrics.counts()))
        os.replace(tmp, path)  # a reader sees the last whole file

    def gather(self, own: ServingMetrics) -> ServingMetrics:
        """A snapshot of `own` with the other front ends' latest counts added."""
        total = own.snapshot()
        for k in range(self.count):
            if k != self.index:
                with contextlib.suppress(FileNotFoundError):  # not yet written
                    total.add(pickle.loads((self.folder / f"{k}.pkl").read_bytes()))
        return total

    async def run(self, metrics: ServingMetrics) -> None:
        """Publish every METRICS_SHARE_S until cancelled (the app's lifespan)."""
        while True:
            self.publish(metrics)
            await asyncio.sleep(METRICS_SHARE_S)


def listen(host: str, port: int, count: int) -> list[socket.socket]:
    """The listening sockets of `count` front ends, one each, on `port` (0: one the system
    picks, the same for all); the same socket `count` times where the kernel cannot balance
    them (see the module docstring). A port another server listens on is refused
    (EADDRINUSE), even one whose sockets have SO_REUSEPORT, which ours would join."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    own = _own_sockets()

    def bound(reuse_port: bool) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        return sock

    if own and port:
        bound(False).close()  # a plain bind fails where any socket listens
    socks = []
    for _ in range(count if own else 1):
        socks.append(bound(own))
        port = socks[-1].getsockname()[1]
        socks[-1].listen(2048)
    return socks if own else socks * count


def start_others(target, pipes: list, socks: list[socket.socket], folder: str, *args) -> list:
    """Front ends 1..N-1, a process each running `target(pipe, sock, shared, *args)` (the
    server's) on one of the core's `front_end_pipes` and one of `socks[1:]` (`listen`'s;
    socks[0] is the first front end's). Each pipe, and each socket that is not also the
    first's, is theirs then (closed here: a front end that exits closes its pipe, and the core
    drops it; its socket, and the kernel hands the port's connections to the others)."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for index, (pipe, sock) in enumerate(zip(pipes, socks[1:], strict=True), start=1):
        shared = SharedMetrics(folder, index, len(pipes) + 1)
        proc = ctx.Process(target=_other, args=(os.getpid(), target, pipe, sock, shared, *args),
                           name=f"llm_inference-api-{index}")  # fmt: skip
        proc.start()
        pipe.close()
        if sock is not socks[0]:
            sock.close()
        procs.append(proc)
    return procs


def _other(parent_pid: int, target, *args) -> None:
    """The body of another front end's process: `target(*args)`, ended with its parent."""
    from llm_inference.executor.worker_process import watch_parent

    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    target(*args)
