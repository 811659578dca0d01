"""The benches' datasets (entrypoints/bench_datasets.py): each dataset's lengths, ShareGPT's
parsing and filtering, the one-line errors of bad options, and benchmarks/vllm_throughput.py
building the very requests `bench throughput` sends."""

from __future__ import annotations

import json
import math
import random
import re
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import load_script

from llm_inference.entrypoints import bench
from llm_inference.entrypoints.bench_datasets import Workload
from llm_inference.entrypoints.cli import build_parser, main

VLLM_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_throughput.py"


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    from llm_inference.models.loader import load_tokenizer

    return load_tokenizer(tiny_ckpt)


def _lens(requests) -> tuple[list[int], list[int]]:
    return [len(r.prompt_ids) for r in requests], [r.max_tokens for r in requests]


def test_fixed_lengths_are_exact():
    requests = Workload("fixed", num_prompts=5, input_len=7, output_len=3).requests(vocab=50)
    assert _lens(requests) == ([7] * 5, [3] * 5)
    assert all(0 <= t < 50 for r in requests for t in r.prompt_ids)
    assert _lens(Workload("fixed", num_prompts=2).requests(vocab=50)) == ([256] * 2, [128] * 2)


def test_uniform_without_lengths_is_the_first_throughput_workload():
    """The default stays the workload of the results so far: nano-vllm's draw, in its order
    (prompt lengths, then their ids, then output lengths), temperature 0.6."""
    rng = random.Random(0)
    lengths = [rng.randint(100, 1024) for _ in range(20)]
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in lengths]
    outputs = [rng.randint(100, 1024) for _ in range(20)]
    requests = Workload(num_prompts=20).requests(vocab=10000)
    assert [r.prompt_ids for r in requests] == prompts
    assert [r.max_tokens for r in requests] == outputs
    ours, params = bench.throughput_workload()
    assert len(ours) == 256 and {(p.temperature, p.top_p, p.top_k) for p in params} == {
        (0.6, 1.0, -1)
    }


def test_uniform_with_lengths_spans_the_range_ratio():
    w = Workload("uniform", num_prompts=300, input_len=10, output_len=4, range_ratio=0.5)
    ins, outs = _lens(w.requests(vocab=5))
    assert (min(ins), max(ins), min(outs), max(outs)) == (5, 15, 2, 6)
    assert w.describe(ins, outs)["input_range"] == [5, 15]


def test_lognormal_median_spread_and_seed():
    """Lengths centred on the options (sample medians within 10% over 2,000 draws), with the
    log-space spread sigma, clipped to [1, 8 x median]; the same seed draws the same lengths."""
    w = Workload("lognormal", num_prompts=2000, input_len=64, output_len=40, sigma=0.8)
    ins, outs = _lens(w.requests(vocab=2))
    assert statistics.median(ins) == pytest.approx(64, rel=0.1)
    assert statistics.median(outs) == pytest.approx(40, rel=0.1)
    assert statistics.stdev(math.log(n) for n in outs) == pytest.approx(0.8, rel=0.1)
    assert min(ins + outs) >= 1 and max(ins) <= 8 * 64 and max(outs) <= 8 * 40
    assert _lens(w.requests(vocab=2)) == (ins, outs)
    other = Workload("lognormal", num_prompts=2000, input_len=64, output_len=40, sigma=0.8, seed=1)
    assert _lens(other.requests(vocab=2)) != (ins, outs)
    wide = Workload("lognormal", num_prompts=2000, input_len=64, output_len=40, sigma=3.0)
    assert max(_lens(wide.requests(vocab=2))[1]) == 8 * 40  # the cap
    described = w.describe(ins, outs)
    assert (described["input_len"], described["sigma"]) == (64, 0.8)
    assert described["mean_output_len"] == statistics.mean(outs)


def _turn(who: str, text: str) -> dict:
    return {"from": who, "value": text}


def _sharegpt_file(tmp_path, tokenizer) -> tuple[Path, dict[str, str]]:
    """A ShareGPT file of usable pairs and of every kind vLLM's filter skips; returns it and the
    usable prompts with their replies."""
    long = "The quick brown fox jumps over the lazy dog. " * 80
    assert len(tokenizer(long).input_ids) > 1024
    half = "Paris is the capital of France. " * 60
    assert 2048 < 3 * len(tokenizer(half).input_ids) and len(tokenizer(half).input_ids) <= 1024
    good = {f"Question {i}: where is Paris, and why?": f"Answer {i}: in France, dear." * (i + 1)
            for i in range(5)}  # fmt: skip
    data = [{"id": i, "conversations": [_turn("human", q), _turn("gpt", a)]}
            for i, (q, a) in enumerate(good.items())]  # fmt: skip
    # the first human turn, after a system message, and the gpt turn after it
    opening = "Hello world! How are you today?"
    good[opening] = "I am fine, thank you."
    data.append({"conversations": [_turn("system", "be brief"), _turn("gpt", "hi"),
                                   _turn("human", opening), _turn("human", "again"),
                                   _turn("gpt", good[opening]), _turn("gpt", "more")]})  # fmt: skip
    data += [
        {"conversations": [_turn("human", "Hi"), _turn("gpt", "A fine long reply, thanks.")]},
        {"conversations": [_turn("human", "Where is Paris, then?"), _turn("gpt", "Ok")]},
        {"conversations": [_turn("human", long), _turn("gpt", "Too long a question.")]},
        {"conversations": [_turn("human", half), _turn("gpt", half + half)]},  # > 2,048 in all
        {"conversations": [_turn("human", "No reply to this question.")]},
        {"conversations": [_turn("human", "A reply that is not text:"), _turn("gpt", 42)]},
        {"no conversations": []},
        "not a conversation",
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path, good


def test_sharegpt_parsing_and_filtering(tmp_path, tokenizer):
    path, good = _sharegpt_file(tmp_path, tokenizer)
    w = Workload("sharegpt", num_prompts=6, dataset_path=str(path), seed=3)
    requests = w.requests(vocab=0, tokenizer=tokenizer)
    assert sorted(r.text for r in requests) == sorted(good)
    for r in requests:
        assert r.prompt_ids == tokenizer(r.text).input_ids
        assert r.max_tokens == len(tokenizer(good[r.text], add_special_tokens=False).input_ids)
    again = w.requests(vocab=0, tokenizer=tokenizer)
    assert [r.text for r in again] == [r.text for r in requests]  # the seed decides the order
    # more prompts than usable pairs: they repeat, in the same order
    many = Workload("sharegpt", num_prompts=14, dataset_path=str(path), seed=3)
    texts = [r.text for r in many.requests(vocab=0, tokenizer=tokenizer)]
    assert texts == [r.text for r in requests] * 2 + [r.text for r in requests[:2]]
    assert w.describe(*_lens(requests))["dataset_path"] == str(path)


def _vllm_script():
    """benchmarks/vllm_throughput.py as a module (it imports vLLM only in main)."""
    return load_script(VLLM_SCRIPT)


def test_vllm_script_builds_the_requests_bench_throughput_sends(tiny_ckpt, tmp_path, tokenizer):
    """benchmarks/vllm_throughput.py (importable without vLLM): for the same options, the same
    prompt ids and max_tokens as `bench throughput`, and vLLM sampling arguments that match."""
    script = _vllm_script()
    path, _ = _sharegpt_file(tmp_path, tokenizer)
    vocab = json.loads((tiny_ckpt / "config.json").read_text())["vocab_size"]
    cases = [
        ["--dataset", "lognormal", "--input-len", "20", "--output-len", "9", "--sigma", "0.5"],
        ["--dataset", "sharegpt", "--dataset-path", str(path), "--top-k", "5", "--top-p", "0.9"],
        ["--dataset", "uniform", "--temperature", "0"],
    ]
    for flags, seeded in zip(cases, (False, True, False)):
        flags = ["--model", str(tiny_ckpt), "--num-prompts", "7", "--seed", "4", *flags]
        own = ["--seed-requests"] if seeded else []  # the script's flag: ours always seeds
        workload, prompts, kwargs = script.build_requests(
            script.build_parser().parse_args(flags + own), tiny_ckpt
        )
        args = build_parser().parse_args(["bench", "throughput", *flags])
        ours, params = bench.throughput_requests(Workload.from_args(args), args.model, tiny_ckpt)
        assert workload == Workload.from_args(args) and prompts == ours, flags
        assert kwargs == [
            dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
                 ignore_eos=True, detokenize=False, seed=i if seeded else None)
            for i, p in enumerate(params)
        ]  # fmt: skip
        assert max(t for p in prompts for t in p) < vocab  # the model's ids, not 10,000's


def test_vllm_script_latency_flags():
    """`--latency` with `--batches` (default bench latency's 1,8,64,256); a batch size that is
    not a positive integer is a usage error."""
    parse = _vllm_script().build_parser().parse_args
    assert (parse([]).latency, parse([]).batches) == (False, [1, 8, 64, 256])
    args = parse(["--model", "qwen3-8b", "--latency", "--batches", "1,8"])
    assert (args.model, args.latency, args.batches) == ("qwen3-8b", True, [1, 8])
    for bad in ("0", "1,x", ""):
        with pytest.raises(SystemExit):
            parse(["--latency", "--batches", bad])


def test_vllm_script_profile_reports_as_bench_does():
    """`--profile`: the timed call again under our profiler (here on the CPU, its operators),
    under bench throughput's profile keys, the wall time being the call's."""
    import torch

    script = _vllm_script()
    assert script.build_parser().parse_args(["--profile"]).profile
    x = torch.randn(64, 64)

    def timed(n: int) -> float:
        for _ in range(n):
            x @ x
        return 1.25

    res = script.profile_run(timed, 3, device="cpu")
    assert res["wall_s"] == 1.25
    (rank,) = res["ranks"]
    assert any("mm" in name for name in rank["top_kernels_ms_per_step"])
    assert rank["gpu_ms_per_step"] >= max(rank["top_kernels_ms_per_step"].values()) > 0


def test_vllm_script_latency_times_bench_latencys_prompts(monkeypatch):
    """`--latency` gives vLLM the prompts `bench latency` gives ours (here in Mistral's vocabulary
    of 32,768) and times them as vllm_bench.py: per batch two warm-ups of 8 greedy tokens, then 3
    runs of 8 and 3 of 136, ms per step = the difference of their medians over 128 steps (a fake
    clock advancing 1 ms per generated step, 2 ms more per run's prefill)."""
    script = _vllm_script()
    ours = []
    monkeypatch.setattr(bench, "_timed_generate", lambda llm, p, sp: ours.append(p) or 0.0)
    fake_llm = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(vocab_size=32768)))
    bench.decode_latency(fake_llm, [1, 8])
    prompts = script.latency_prompts(32768, [1, 8])
    assert prompts == {1: ours[0], 8: ours[8]} and len(ours) == 16
    assert all(len(p) == 128 and max(p) < 32768 - 256 for batch in prompts.values() for p in batch)

    clock, runs = [0.0], []

    def generate(inputs, sp, use_tqdm):
        runs.append((len(inputs), sp["max_tokens"]))
        assert sp == dict(temperature=0, max_tokens=sp["max_tokens"], ignore_eos=True,
                          detokenize=False)  # fmt: skip
        assert not use_tqdm and [i["prompt_token_ids"] for i in inputs] == prompts[len(inputs)]
        clock[0] += (2 + sp["max_tokens"]) / 1e3

    monkeypatch.setattr(script, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    vllm = SimpleNamespace(SamplingParams=lambda **kw: kw)
    ms = script.decode_latency(SimpleNamespace(generate=generate), vllm, prompts)
    assert ms == {1: 1.0, 8: 1.0}
    assert runs == [(bs, n) for bs in (1, 8) for n in [8] * 5 + [136] * 3]


BAD_OPTIONS = [
    (["--dataset", "lognormal", "--sigma", "-1"], r"--sigma .* must be > 0, got -1.0"),
    (["--dataset", "lognormal", "--sigma", "nan"], r"--sigma"),
    (["--input-len", "0"], r"--input-len must be at least 1, got 0"),
    (["--range-ratio", "1"], r"--range-ratio must be in \[0, 1\), got 1.0"),
    (["--top-k", "0"], r"--top-k must be -1 \(off\) or at least 1"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\], got 0.0"),
    (["--temperature", "-1"], r"--temperature must be >= 0, got -1.0"),
    (["--num-prompts", "0"], r"--num-prompts must be at least 1"),
    (["--dataset", "sharegpt"], r"--dataset sharegpt needs --dataset-path"),
    (["--dataset-path", "x.json"], r"--dataset-path is read by --dataset sharegpt, not uniform"),
    (["--dataset", "sharegpt", "--dataset-path", "MISSING"], r"--dataset-path .*: no such file"),
    (["--dataset", "sharegpt", "--dataset-path", "BAD_JSON"], r"is not valid JSON"),
    (["--dataset", "sharegpt", "--dataset-path", "NOT_A_LIST"], r"a ShareGPT file is a list"),
    (["--dataset", "sharegpt", "--dataset-path", "UNUSABLE"], r"no usable conversation among 2"),
]


@pytest.mark.parametrize("flags,match", BAD_OPTIONS, ids=[" ".join(f) for f, _ in BAD_OPTIONS])
def test_bad_options_are_one_error_line(tiny_ckpt, tmp_path, capsys, flags, match):
    """`bench throughput` stops before the engine starts, `bench serve` before it sends a
    request (no server is asked: the address is closed), with one `error:` line naming the
    option."""
    files = {name: tmp_path / f"{name}.json" for name in ("MISSING", "BAD_JSON", "NOT_A_LIST",
                                                          "UNUSABLE")}  # fmt: skip
    files["BAD_JSON"].write_text('[{"conversations": ')
    files["NOT_A_LIST"].write_text('{"conversations": []}')
    short = {"conversations": [_turn("human", "Hi"), _turn("gpt", "Ok")]}
    files["UNUSABLE"].write_text(json.dumps([short, {"conversations": []}]))
    flags = [str(files.get(f, f)) for f in flags]
    offline = ["bench", "throughput", "--model", str(tiny_ckpt), "--device", "cpu"]
    serve = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", str(tiny_ckpt)]
    for argv in (offline, serve):
        assert main([*argv, *flags]) == 1
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
        assert re.search(match, lines[0]), lines[0]


def test_bench_serve_sharegpt_needs_a_tokenizer(tmp_path, tiny_ckpt, tokenizer, capsys):
    path, _ = _sharegpt_file(tmp_path, tokenizer)
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", "sharegpt",
            "--dataset-path", str(path)]  # fmt: skip
    assert main(argv) == 1
    assert capsys.readouterr().err.startswith("error: --dataset sharegpt counts tokens with")
