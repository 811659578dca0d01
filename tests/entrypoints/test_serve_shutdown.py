"""`llm-inference serve` in a subprocess: SIGINT aborts the running stream (it ends with
finish_reason "abort" and [DONE]) and the server exits 130 without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from conftest import free_port
from helpers import make_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"


def test_sigint_aborts_running_requests_and_exits_cleanly(tmp_path):
    """The request asks for 60,000 tokens (a long context and a KV cache that holds it): it is
    still running when the signal comes, however loaded the machine."""
    ckpt = make_checkpoint(tmp_path, max_position_embeddings=1 << 16)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "llm_inference.entrypoints.cli", "serve", "--model",
           str(ckpt), "--device", "cpu", "--port", str(port), "--served-model-name", "m",
           "--kv-cache-memory-bytes", str(64 << 20), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.1)
        lines: list[str] = []
        body = {"model": "m", "prompt": "Hi", "max_tokens": 60_000, "stream": True,
                "ignore_eos": True}  # fmt: skip

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        while len(lines) < 2 and reader.is_alive():
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        reader.join(timeout=20)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: ") :])["choices"][0]["finish_reason"] == "abort"
