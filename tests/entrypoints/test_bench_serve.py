"""`llm-inference bench serve` against the live test server: report fields and counts."""

from __future__ import annotations

import json
import statistics

import pytest
from conftest import API_KEY, MODEL_NAME

from llm_inference.entrypoints import bench_serve
from llm_inference.entrypoints.cli import main

FIELDS = ["completed", "failed", "duration_s", "request_throughput", "output_throughput",
          "total_token_throughput", "total_input_tokens", "total_output_tokens"] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
    for s in ("mean", "median", "p90", "p99")
]  # fmt: skip


def _bench(live_server, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--base-url", live_server.url, "--api-key", API_KEY,
            "--num-prompts", "6", "--input-len", "10", "--output-len", "5", "--json", str(out),
            *extra]  # fmt: skip
    rc = main(argv)
    return rc, json.loads(out.read_text())


def test_bench_serve_all_at_once(live_server, tmp_path, tiny_ckpt, capsys):
    rc, r = _bench(live_server, tmp_path, "--model", MODEL_NAME, "--tokenizer", str(tiny_ckpt))
    assert rc == 0 and all(k in r for k in FIELDS)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (6, 0, 30)
    assert r["total_input_tokens"] > 0 and r["mean_ttft_ms"] > 0 and r["mean_itl_ms"] > 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert "requests" not in r  # only with --save-detailed


def test_bench_serve_save_detailed(live_server, tmp_path):
    """--save-detailed: each request's send time, TTFT and its gaps between chunks (at most
    one fewer than its tokens: a chunk may carry several), the summary's ITL samples."""
    rc, r = _bench(live_server, tmp_path, "--save-detailed")
    assert rc == 0 and len(r["requests"]) == 6
    for req in r["requests"]:
        assert req["start"] > 1e9 and req["ttft"] > 0 and len(req["itl"]) < req["output_len"]
    gaps = [x * 1e3 for req in r["requests"] for x in req["itl"]]
    assert statistics.median(gaps) == pytest.approx(r["median_itl_ms"])


def test_bench_serve_poisson_concurrency_and_failures(live_server, tmp_path):
    rc, r = _bench(live_server, tmp_path, "--request-rate", "50", "--max-concurrency", "2",
                   "--range-ratio", "0.5")  # fmt: skip
    assert rc == 0 and r["model"] == MODEL_NAME and r["completed"] == 6
    assert 6 * 2 <= r["total_output_tokens"] <= 6 * 7
    rc, r = _bench(live_server, tmp_path, "--model", "no-such-model")
    assert rc == 1 and (r["completed"], r["failed"]) == (0, 6)
    assert "HTTP 404" in r["errors"][0]


def test_bench_serve_multi_turn_resends_the_conversation(live_server, tmp_path):
    """3 conversations of 3 turns, 2 at a time, behind a shared 30-word system prompt: 9
    requests, and each turn's prompt holds the previous turn's prompt and reply."""
    rc, r = _bench(live_server, tmp_path, "--num-prompts", "3", "--multi-turn", "3",
                   "--max-concurrency", "2", "--shared-prefix-len", "30")  # fmt: skip
    assert rc == 0 and (r["completed"], r["failed"]) == (9, 0)
    assert (r["multi_turn"], r["shared_prefix_len"]) == (3, 30)
    assert r["total_output_tokens"] == 9 * 5
    rc, single = _bench(live_server, tmp_path, "--num-prompts", "3", "--shared-prefix-len", "30")
    # Turn k resends turns 1..k-1: far more prompt tokens than three times a first turn.
    assert r["total_input_tokens"] > 3 * single["total_input_tokens"] + 2 * 3 * 5


def test_bench_serve_worker_processes(live_server, tmp_path):
    """Requests (and conversations) shared among 2 client processes, the concurrency limit
    split between them: every request is counted once."""
    rc, r = _bench(live_server, tmp_path, "--num-workers", "2", "--request-rate", "100",
                   "--max-concurrency", "3")  # fmt: skip
    assert rc == 0 and (r["completed"], r["failed"], r["num_workers"]) == (6, 0, 2)
    assert r["total_output_tokens"] == 6 * 5 and r["duration_s"] > 0
    rc, r = _bench(live_server, tmp_path, "--num-workers", "2", "--num-prompts", "3",
                   "--multi-turn", "2", "--max-concurrency", "2")  # fmt: skip
    assert rc == 0 and (r["completed"], r["failed"]) == (6, 0)


def test_bench_serve_without_the_key_is_one_error_line(live_server, monkeypatch, capsys):
    """The server wants an API key and none was given: `error:` naming the 401 and --api-key,
    exit 1, no traceback; a server that is not there: `error:` naming the address."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["bench", "serve", "--base-url", live_server.url, "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "401" in err and "--api-key" in err, err
    assert "Traceback" not in err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "127.0.0.1:9" in err, err


def test_bench_serve_sends_the_dataset_and_its_sampling(
    live_server, tmp_path, tiny_ckpt, monkeypatch
):
    """`--dataset sharegpt`: the conversations' own prompts, each with its reply's token count
    as max_tokens, and the sampling options in every request; by default temperature 0 and no
    top_k (an extension not every server takes)."""
    from llm_inference.models.loader import load_tokenizer

    sent, real = [], bench_serve.send_request

    async def spy(client, url, payload, headers):
        sent.append(dict(payload))
        return await real(client, url, payload, headers)

    monkeypatch.setattr(bench_serve, "send_request", spy)
    replies = {f"Question {i}: where is Paris?": "In France, dear." * (i + 1) for i in range(3)}
    data = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            for q, a in replies.items()]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    rc, r = _bench(live_server, tmp_path, "--dataset", "sharegpt", "--dataset-path", str(path),
                   "--tokenizer", str(tiny_ckpt), "--temperature", "0.8", "--top-p", "0.9",
                   "--top-k", "5")  # fmt: skip
    assert rc == 0 and (r["completed"], r["workload"]["dataset"]) == (6, "sharegpt")
    tok = load_tokenizer(tiny_ckpt)
    assert {p["prompt"] for p in sent} == set(replies)
    for p in sent:
        assert p["max_tokens"] == len(tok(replies[p["prompt"]], add_special_tokens=False).input_ids)
        assert (p["temperature"], p["top_p"], p["top_k"]) == (0.8, 0.9, 5)
    assert r["total_output_tokens"] == sum(p["max_tokens"] for p in sent)
    sent.clear()
    rc, r = _bench(live_server, tmp_path, "--num-prompts", "2")
    assert rc == 0 and r["workload"]["input_range"] == [10, 10]
    assert [(p["temperature"], p["top_p"], "top_k" in p) for p in sent] == [(0.0, 1.0, False)] * 2


def test_a_token_without_text_still_arrives():
    """Tokens that decode to no text yet (a partial character) come as chunks with an empty
    text: timed as arrivals (as vLLM's bench does), so such a request is a success."""
    import asyncio

    import httpx

    events = [{"choices": [{"index": 0, "text": "", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]  # fmt: skip
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            payload = {"prompt": "hi", "_prompt_len": 1}
            return await bench_serve.send_request(client, "http://x/v1/completions", payload, {})

    result = asyncio.run(run())
    assert result.success and not result.error and result.ttft > 0 and len(result.itl) == 1
    assert (result.prompt_len, result.output_len, result.text) == (3, 2, "")


def test_arrivals_interleave_client_processes_at_an_infinite_rate():
    """All at once from one process; spaced in request order over several, so that the server
    admits the processes' requests interleaved; a Poisson process at a finite rate."""
    import random

    from llm_inference.entrypoints.bench_serve import INF_SPACING_S, arrivals

    inf = float("inf")
    assert arrivals(5, inf, 1, random.Random(0)) == [0.0] * 5
    assert arrivals(5, inf, 4, random.Random(0)) == [i * INF_SPACING_S for i in range(5)]
    poisson = arrivals(2000, 100.0, 4, random.Random(0))
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert poisson[0] == 0.0 and min(gaps) > 0 and abs(sum(gaps) / len(gaps) - 0.01) < 0.001
