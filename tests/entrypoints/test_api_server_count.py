"""Several front ends on one engine core (`serve --api-server-count N`, front_ends.py): each
front end gets its own requests' outputs, as the offline engine makes them; one that leaves has
its requests aborted and the core serves on; the server's /metrics add up every front end's
requests; a front end that exits stops the server; bad counts are refused by name."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import ENGINE_ARGS, free_port, wait_all_blocks_free, wait_healthy
from helpers import child_processes, make_checkpoint

from llm_inference import AsyncLLM, SamplingParams
from llm_inference.engine.async_llm import EngineDeadError
from llm_inference.entrypoints.openai import front_ends

SRC = Path(__file__).resolve().parents[2] / "src"
PROMPTS = [f"Hello world {i}" for i in range(8)]


async def _text(llm, prompt: str, max_tokens: int, rid: str) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    async for out in llm.generate(prompt, params, rid):
        last = out
    return last.outputs[0].text


def test_two_front_ends_of_one_core_get_their_own_outputs(tiny_ckpt, offline_llm):
    """Requests on both front ends at once, one of them abandoned midway: every other answer
    is the offline engine's, on the front end that asked, and no block stays taken."""
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i) for i in range(8)]
    want = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]
    with AsyncLLM(str(tiny_ckpt), front_ends=2, **ENGINE_ARGS) as first:
        pipe = first.core_process.front_end_pipes[0]
        with AsyncLLM(str(tiny_ckpt), core_pipe=pipe, **ENGINE_ARGS) as second:

            async def abandoned():
                stream = second.generate("abandoned", SamplingParams(max_tokens=400), "gone")
                await anext(stream)
                await stream.aclose()  # aborts it on the core

            async def main():
                front = [first, second]
                runs = [_text(front[i % 2], p, 3 + 2 * i, f"r{i}") for i, p in enumerate(PROMPTS)]
                return await asyncio.gather(*runs, abandoned())

            got = asyncio.run(main())[:-1]
            assert got == want
            for llm in (first, second):  # both hear the core's stats
                stats = wait_all_blocks_free(llm)
                assert stats["num_unfinished_requests"] == 0, stats
                assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats
            tokens = first.metrics.snapshot().generation_tokens
            assert tokens == sum(3 + 2 * i for i in (0, 2, 4, 6))


def test_a_front_end_that_leaves_has_its_requests_aborted(tiny_ckpt, offline_llm):
    """The second front end shuts down in the middle of a long request: the core drops its
    pipe, aborts the request and frees its blocks, and keeps serving the first front end."""
    params = SamplingParams(temperature=0.0, max_tokens=5)
    want = offline_llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].text
    with AsyncLLM(str(tiny_ckpt), front_ends=2, **ENGINE_ARGS) as first:
        pipe = first.core_process.front_end_pipes[0]
        second = AsyncLLM(str(tiny_ckpt), core_pipe=pipe, **ENGINE_ARGS)

        async def leave():
            stream = second.generate("long", SamplingParams(max_tokens=400, ignore_eos=True))
            await anext(stream)
            second.shutdown()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass

        asyncio.run(leave())
        stats = wait_all_blocks_free(first)
        assert stats["num_unfinished_requests"] == 0, stats
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats
        assert asyncio.run(_text(first, PROMPTS[0], 5, "after")) == want
        assert first.error is None


def test_front_ends_refuse_what_they_cannot_share(tiny_ckpt):
    with pytest.raises(ValueError, match="front_ends .*api_server_count.* got 2"):
        AsyncLLM(str(tiny_ckpt), front_ends=2, engine_process=False, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="front_ends .*got 0"):
        AsyncLLM(str(tiny_ckpt), front_ends=0, **ENGINE_ARGS)


def _serve(ckpt, port: int, tmp: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "llm_inference.entrypoints.cli", "serve", "--model", str(ckpt),
           "--device", "cpu", "--port", str(port), "--served-model-name", "m",
           "--kv-cache-memory-bytes", str(2 << 20), "--log-level", "warning", *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start_time(pid: int) -> int:
    """When the process started (clock ticks since boot: /proc/PID/stat's 22nd field)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _successes(port: int) -> float:
    page = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("vllm:request_success_total"))  # fmt: skip


def _counts(folder: Path) -> list[int]:
    """Each front end's generated tokens as it last shared them (front_ends.SharedMetrics)."""
    return [pickle.loads(p.read_bytes())["generation_tokens"] for p in sorted(folder.glob("*.pkl"))]


def test_a_server_of_two_front_ends(tmp_path, offline_llm):
    """Waves of 8 requests at once, half streamed, until both front ends have served some (the
    kernel hands each connection to one of them): every answer is the offline engine's; the
    counts each front end shares add up to them, and /metrics, from either, counts them all.
    Then one front end is killed: the server stops, exit status 1, naming it."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    port = free_port()
    proc = _serve(ckpt, port, tmp_path, "--api-server-count", "2")
    try:
        wait_healthy(proc, port)
        (folder,) = tmp_path.glob("llm_inference_metrics_*")
        deadline = time.monotonic() + 90
        while len(_counts(folder)) < 2:  # the other front end is up once it shares its counts
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)

        async def one(client, i: int) -> str:
            kw = dict(model="m", prompt=PROMPTS[i % 8], max_tokens=6, temperature=0.0)
            if i % 2 == 0:
                return (await client.completions.create(**kw)).choices[0].text
            chunks = await client.completions.create(**kw, stream=True)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        async def wave():  # a client per event loop (asyncio.run)
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                          api_key="none") as client:  # fmt: skip
                return await asyncio.gather(*(one(client, i) for i in range(8)))

        params = SamplingParams(temperature=0.0, max_tokens=6)
        want = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]
        waves = 0
        while min(_counts(folder)) == 0:
            assert time.monotonic() < deadline, _counts(folder)
            assert asyncio.run(wave()) == want
            waves += 1
            time.sleep(1.5)  # for the counts to be shared
        # Every front end shares its counts every second (later on a loaded machine).
        shared = time.monotonic() + 30
        while (sum(_counts(folder)), _successes(port)) != (6 * 8 * waves, 8 * waves):
            assert time.monotonic() < shared, (_counts(folder), _successes(port), waves)
            time.sleep(0.2)

        # The server's children: the engine core, then (started once it is ready) the other
        # front end.
        children = sorted(pid for pid, _ in child_processes(proc.pid))
        assert len(children) == 2, child_processes(proc.pid)
        os.kill(max(children, key=_start_time), signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "front end llm_inference-api-1 exited" in err, err


def _accept_all(sock: socket.socket) -> int:
    """How many connections wait on `sock` (each accepted and closed)."""
    sock.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


@pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT balances on Linux")
def test_each_front_end_listens_on_its_own_socket_of_one_port():
    """Four sockets on the port the first one got: 64 connections, made before any accept,
    spread over all four (on one shared socket, the first loop to wake takes them all)."""
    socks = front_ends.listen("127.0.0.1", 0, 4)
    clients = []
    try:
        assert len({s.fileno() for s in socks}) == 4
        port = socks[0].getsockname()[1]
        assert {s.getsockname()[1] for s in socks} == {port}
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
        accepted = [0] * 4
        deadline = time.monotonic() + 30  # the kernel queues each one as its handshake ends
        while sum(accepted) < 64 and time.monotonic() < deadline:
            accepted = [n + _accept_all(s) for n, s in zip(accepted, socks)]
        assert sum(accepted) == 64 and min(accepted) > 0, accepted
    finally:
        for s in socks + clients:
            s.close()


@pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT balances on Linux")
def test_front_ends_refuse_a_port_another_server_listens_on():
    """Even one listening with SO_REUSEPORT, whose connections ours would otherwise share."""
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    try:
        with pytest.raises(OSError, match="in use"):
            front_ends.listen("127.0.0.1", port, 2)
    finally:
        other.close()
    socks = front_ends.listen("127.0.0.1", port, 2)  # free again
    for s in socks:
        s.close()


def test_front_ends_share_one_socket_where_the_kernel_cannot_balance(monkeypatch):
    monkeypatch.setattr(front_ends.sys, "platform", "darwin")
    socks = front_ends.listen("127.0.0.1", 0, 3)
    try:
        assert len(socks) == 3 and socks[0] is socks[1] is socks[2]
    finally:
        socks[0].close()


@pytest.mark.parametrize(
    "cpus, engine_args, want",
    [(2, {}, 1), (7, {}, 1), (8, {}, 2), (16, {}, 4), (64, {}, 4),
     (16, {"data_parallel_size": 2}, 1), (16, {"engine_process": False}, 1),
     (16, {"device": "cpu"}, 1)],
)  # fmt: skip
def test_default_front_ends_follow_the_cpus(monkeypatch, cpus, engine_args, want):
    """One front end per four CPUs the server may use, at most four, on a GPU; one with data
    parallel cores or the core on a thread (they take one) and on the CPU (its forward takes
    the cores)."""
    monkeypatch.setattr(front_ends.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(front_ends, "resolve_device", lambda device: device or "cuda")
    assert front_ends.default_count(engine_args) == want


def test_default_front_ends_are_one_where_sockets_cannot_be_balanced(monkeypatch):
    monkeypatch.setattr(front_ends.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(front_ends, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(front_ends.sys, "platform", "darwin")
    assert front_ends.default_count({}) == 1


def test_serve_without_a_count_takes_the_default(monkeypatch):
    """run_server with no api_server_count asks default_count, with the engine's arguments
    (here a count of 0 from it, refused before any model loads)."""
    from llm_inference.entrypoints.openai import api_server

    seen = {}

    def count(engine_args):
        seen.update(engine_args)
        return 0

    monkeypatch.setattr(front_ends, "default_count", count)
    with pytest.raises(ValueError, match="api_server_count must be at least 1, got 0"):
        api_server.run_server("no-model", data_parallel_size=3)
    assert seen == {"data_parallel_size": 3}


def test_api_server_count_below_one_is_refused(tmp_path):
    proc = _serve(make_checkpoint(tmp_path / "ckpt"), free_port(), tmp_path,
                  "--api-server-count", "0")  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "api_server_count must be at least 1, got 0" in err, err
