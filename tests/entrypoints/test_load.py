"""Load: 64 concurrent streaming clients with different prompts and lengths, a quarter of them
disconnecting mid-stream. Completed streams equal the offline greedy outputs; afterwards every
KV block is free, /metrics counts the requests, and the server still answers."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
from conftest import API_KEY, MODEL_NAME, wait_all_blocks_free

from llm_inference import SamplingParams

NUM_CLIENTS = 64


def _counter(page: str, name: str, labels: str = "") -> float:
    pattern = rf'^vllm:{name}{{model_name="{MODEL_NAME}"{labels}}} (\S+)$'
    return float(re.search(pattern, page, re.M).group(1))


def _finished(page: str) -> dict[str, float]:
    return {
        r: _counter(page, "request_success_total", f',finished_reason="{r}"')
        for r in ("stop", "length", "abort")
    }


async def _client(client, i: int) -> tuple[int, str | None]:
    """Client i streams a completion; every fourth goes away after its first chunk."""
    leaves = i % 4 == 3
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=f"Hello {i} " + "word " * (i % 7),
        temperature=0.0,
        max_tokens=200 if leaves else 3 + i % 9,
        stream=True,
        extra_body={"ignore_eos": True} if leaves else None,
    )
    text = ""
    async with stream:
        async for chunk in stream:
            text += chunk.choices[0].text
            if leaves:
                return i, None  # closing the stream drops the connection
    return i, text


def test_64_streaming_clients_with_disconnects(live_server, offline_llm):
    before = httpx.get(live_server.url + "/metrics").text

    async def main():
        async with openai.AsyncOpenAI(
            base_url=live_server.v1, api_key=API_KEY, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*[_client(client, i) for i in range(NUM_CLIENTS)])

    results = dict(asyncio.run(main()))
    done = {i: t for i, t in results.items() if t is not None}
    assert len(done) == NUM_CLIENTS * 3 // 4
    prompts = [f"Hello {i} " + "word " * (i % 7) for i in done]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i % 9) for i in done]
    want = offline_llm.generate(prompts, params, use_tqdm=False)
    assert list(done.values()) == [w.text for w in want]

    stats = wait_all_blocks_free(live_server.llm)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_unfinished_requests"] == 0
    page = httpx.get(live_server.url + "/metrics").text
    old, new = _finished(before), _finished(page)
    assert new["stop"] + new["length"] - old["stop"] - old["length"] == len(done)
    assert new["abort"] - old["abort"] == NUM_CLIENTS // 4
    assert _counter(page, "num_requests_running") == 0
    assert _counter(page, "kv_cache_usage_perc") == 0
    assert _counter(page, "e2e_request_latency_seconds_count") >= len(done)
    assert _counter(page, "generation_tokens_total") > _counter(before, "generation_tokens_total")
    client = openai.OpenAI(base_url=live_server.v1, api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
