"""/health: 200 while the engine steps; 503 with the reason while requests are running and the
core has sent no step for STALL_TIMEOUT_S (here a core process frozen with SIGSTOP), 200 again
once it steps, 503 when the core process is dead."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
from conftest import MODEL_NAME, start_server

from llm_inference.engine import async_llm


def _health_until(url: str, status: int) -> httpx.Response:
    """GET /health until it answers `status` (or 60 s have passed: the last answer)."""
    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(url + "/health", timeout=10)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_health_reports_a_stuck_or_dead_core(tiny_ckpt, monkeypatch):
    srv = start_server(tiny_ckpt, api_key=None)
    pid = srv.llm.core_process.pid
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 300,
            "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            next(lines)  # the request runs
            assert httpx.get(srv.url + "/health").status_code == 200
            monkeypatch.setattr(async_llm, "STALL_TIMEOUT_S", 0.5)
            os.kill(pid, signal.SIGSTOP)  # a hung device or core: alive, but no step comes
            stuck = _health_until(srv.url, 503)
            os.kill(pid, signal.SIGCONT)
            assert stuck.status_code == 503, "a stuck engine reported healthy"
            assert "the engine is stuck: no step for" in stuck.json()["error"]["message"]
            assert _health_until(srv.url, 200).status_code == 200  # it steps again
            last = [json.loads(line[6:]) for line in lines][-1]
        assert last["choices"][0]["finish_reason"] == "length"  # the stream went on to its end
        os.kill(pid, signal.SIGKILL)
        dead = _health_until(srv.url, 503)
        assert dead.status_code == 503
        assert "exited" in dead.json()["error"]["message"]
    finally:
        if srv.llm.core_process.is_alive():
            os.kill(pid, signal.SIGCONT)  # a failed assertion leaves no frozen process
        srv.stop()
