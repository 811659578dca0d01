"""A live OpenAI-compatible server on 127.0.0.1 (a free port), run by uvicorn in a thread on the
tiny checkpoint, shared by the module's tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import pytest

API_KEY = "sk-test-key"
MODEL_NAME = "tiny-llama"
ENGINE_ARGS = dict(device="cpu", kv_cache_memory_bytes=2 << 20, max_num_seqs=64)


@dataclass
class LiveServer:
    url: str
    llm: object  # AsyncLLM
    server: object  # uvicorn.Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.llm.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt, api_key: str | None = API_KEY, **overrides) -> LiveServer:
    import uvicorn

    from llm_inference import AsyncLLM
    from llm_inference.entrypoints.openai.api_server import build_app

    llm = AsyncLLM(str(ckpt), **{**ENGINE_ARGS, **overrides})
    app = build_app(llm, MODEL_NAME, api_key=api_key)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", llm, server, thread)


@pytest.fixture(scope="module")
def live_server(tiny_ckpt):
    srv = start_server(tiny_ckpt)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline_llm(tiny_ckpt):
    """The offline engine on the same checkpoint: the reference for greedy outputs."""
    from llm_inference import LLM

    with LLM(str(tiny_ckpt), device="cpu") as llm:
        yield llm


@pytest.fixture
def client(live_server):
    import openai

    with openai.OpenAI(base_url=live_server.v1, api_key=API_KEY, max_retries=0) as c:
        yield c


def wait_healthy(proc, port: int, timeout: float = 90.0) -> None:
    """Until the server process `proc` on `port` answers /health with 200 (its stderr if it
    dies or the timeout passes first)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)


def wait_all_blocks_free(llm, timeout: float = 10.0) -> dict:
    """The engine's stats once no request runs and every KV block is free (aborts land
    between steps), or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats()
        idle = stats["num_unfinished_requests"] == 0
        if idle and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


@contextlib.contextmanager
def serving(app):
    """`app` (api_server.build_app's) served by uvicorn in a thread on a port of its own: its
    base URL; stopped on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
