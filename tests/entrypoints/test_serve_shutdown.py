"""`llm-inference serve` in a subprocess: SIGINT aborts the running stream (it ends with
finish_reason "abort" and [DONE]) and the server exits 130 without a traceback. One front end
each (the default count follows the machine's CPUs; test_api_server_count.py has several)."""

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
from conftest import free_port, wait_healthy
from helpers import make_checkpoint

from llm_inference.entrypoints.openai.api_server import served_name
from llm_inference.models.default_model import DEFAULT_MODEL_NAME

SERVE = [sys.executable, "-m", "llm_inference.entrypoints.cli", "serve", "--api-server-count", "1"]
SRC = Path(__file__).resolve().parents[2] / "src"


def test_sigint_aborts_running_requests_and_exits_cleanly(tmp_path):
    """The request asks for 60,000 tokens (a long context and a KV cache that holds it): it is
    still running when the signal comes, however loaded the machine."""
    ckpt = make_checkpoint(tmp_path, max_position_embeddings=1 << 16)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    cmd = [*SERVE, "--model", str(ckpt), "--device", "cpu", "--port", str(port),
           "--served-model-name", "m", "--kv-cache-memory-bytes", str(64 << 20),
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, port)
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
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    # What it serves, said at start (as vLLM logs it)
    assert f"serving 'm' from {ckpt}" in out and "cpu, float32, reference kernels" in out, out
    assert "max_model_len 65536, KV cache " in out and f"http://127.0.0.1:{port}/v1" in out
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: ") :])["choices"][0]["finish_reason"] == "abort"


def test_served_name_is_stable_for_the_default_model():
    """Without --model the id is the default model's name, not its cache folder's (which ends
    in a hash); a given model is served under the argument as given, as vLLM does."""
    assert served_name(None, None) == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert served_name(None, "/ckpt/Llama-3.2-1B") == "/ckpt/Llama-3.2-1B"
    assert served_name("m", "/ckpt/Llama-3.2-1B") == "m"


def _spawned_children(pid: int) -> list[int]:
    """Processes that `pid` started with multiprocessing's spawn (from /proc; not its resource
    tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone since the listing
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_a_killed_engine_core_stops_the_server_with_an_error(tiny_ckpt):
    """kill -9 of the engine core process: the server says so and exits non-zero within
    seconds (a supervisor restarts it), instead of answering 503 for ever."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    cmd = [*SERVE, "--model", str(tiny_ckpt), "--device", "cpu", "--port", str(port),
           "--log-level", "warning", "--kv-cache-memory-bytes", str(1 << 20)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port)
        (core,) = _spawned_children(proc.pid)
        os.kill(core, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "the engine stopped" in err and "error: the engine stopped" in err, err
    assert "Traceback" not in err, err


def test_a_second_ctrl_c_does_not_end_in_a_traceback(tiny_ckpt):
    """Two SIGINTs (an impatient Ctrl-C, or a signal sent to a process group as well as to the
    server): the second repeats the first instead of forcing uvicorn's exit, whose cancelled
    lifespan logs a traceback; the server still exits with 130 and leaves no process."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    cmd = [*SERVE, "--model", str(tiny_ckpt), "--device", "cpu", "--port", str(port),
           "--kv-cache-memory-bytes", str(1 << 20)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port)
        (core,) = _spawned_children(proc.pid)
        proc.send_signal(signal.SIGINT)
        seen = []  # the second signal once the first is handled (two pending SIGINTs are one)
        for line in proc.stderr:
            seen.append(line)
            if "Shutting down" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        err = "".join(seen) + err
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "Waiting for application shutdown" in err  # the lifespan ran: the engine shut down
    deadline = time.monotonic() + 10
    while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{core}").exists()
