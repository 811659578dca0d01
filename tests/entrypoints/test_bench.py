"""`llm-inference bench latency|throughput|prefill`: the workload functions on the tiny model
(CPU), the floor's byte count, and the command line's wiring."""

from __future__ import annotations

import json

import pytest
import torch

from llm_inference import LLM
from llm_inference.entrypoints import bench
from llm_inference.entrypoints.bench_datasets import Workload
from llm_inference.entrypoints.cli import build_parser

# 5 requests, prompt and output lengths uniform in [3, 9]
SMALL = Workload(num_prompts=5, input_len=6, output_len=6, range_ratio=0.5)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu", enable_prefix_caching=False) as llm:
        yield llm


def test_throughput_counts_every_requested_token(llm):
    prompts, params = bench.throughput_workload(SMALL, ids=300)
    res = bench.throughput(llm, prompts, params)
    assert res["output_tokens"] == sum(p.max_tokens for p in params) >= 5 * 3
    assert res["requests_per_s"] > 0 and res["output_tok_per_s"] > 0
    assert res["total_tok_per_s"] > res["output_tok_per_s"]
    assert llm.stats()["num_free_kv_blocks"] == llm.stats()["num_kv_blocks"]


def test_throughput_without_detokenizing(llm):
    """`--disable-detokenize` (as in vLLM's bench): the same workload, token ids only; the
    tokens are those of the run that makes text."""
    prompts, params = bench.throughput_workload(SMALL, ids=300, detokenize=False)
    same_prompts, with_text = bench.throughput_workload(SMALL, ids=300)
    assert prompts == same_prompts and not any(p.detokenize for p in params)
    assert [p.max_tokens for p in params] == [p.max_tokens for p in with_text]
    ids_only = llm.generate(prompts, params, use_tqdm=False)
    texts = llm.generate(prompts, with_text, use_tqdm=False)
    assert all(o.text == "" for o in ids_only) and any(o.text for o in texts)
    assert [o.token_ids for o in ids_only] == [o.token_ids for o in texts]


def test_throughput_profile_covers_the_timed_requests_only(llm, monkeypatch):
    """`bench throughput --profile`'s second run: no warm-up of its own (one generate call,
    all the requests), each rank's kernel seconds and top operators (on the CPU)."""
    calls = []
    real = bench._timed_generate
    monkeypatch.setattr(
        bench, "_timed_generate", lambda *a, **kw: calls.append(len(a[1])) or real(*a, **kw)
    )
    prof = bench._kernel_profile_throughput(llm, *bench.throughput_workload(SMALL, ids=300))
    assert calls == [5]
    (rank,) = prof["ranks"]
    assert prof["wall_s"] > 0 and rank["gpu_ms_per_step"] > 0 and rank["top_kernels_ms_per_step"]


def _clocked(monkeypatch):
    """`_timed_generate` still generates, but reports a time that is a function of the token
    count (5 ms + 1 ms per token): what the bench computes from it is then exact, whatever the
    machine's load."""
    real = bench._timed_generate

    def timed(llm, prompts, params, progress=False):
        real(llm, prompts, params, progress)
        return 0.005 + 0.001 * params.max_tokens

    monkeypatch.setattr(bench, "_timed_generate", timed)


def test_decode_latency_is_the_per_step_difference_of_two_runs(llm, monkeypatch):
    _clocked(monkeypatch)
    res = bench.decode_latency(llm, batches=(1, 2), prompt_len=4)
    assert res == {1: pytest.approx(1.0), 2: pytest.approx(1.0)}


def test_profile_decode_per_step_kernels(llm, monkeypatch):
    """The per-step kernel profile of the 8 + new minus 8-token runs (on the CPU: operators):
    the wall time per step from the two runs, the ranks' profiles of what ran."""
    _clocked(monkeypatch)
    profiles, real_profile = [], bench._kernel_profile

    def spy(*args, **kwargs):
        profiles.append(real_profile(*args, **kwargs))
        return profiles[-1]

    monkeypatch.setattr(bench, "_kernel_profile", spy)
    res = bench.profile_decode(llm, bs=2, prompt_len=4, new=8)
    assert res["wall_ms_per_step"] == pytest.approx(1.0)
    (rank,) = res["ranks"]
    assert res["gpu_ms_per_step"] == rank["gpu_ms_per_step"]
    (long,) = profiles[-1]  # the 8 + new run, one rank
    assert {"aten::mm", "aten::addmm"} & set(long["kernels"])
    top = rank["top_kernels_ms_per_step"]
    assert 0 < len(top) <= 15 and list(top.values()) == sorted(top.values(), reverse=True)


def test_per_step_subtracts_the_short_run():
    long = {
        "total_ms": 10.0,
        "kernels": {"a": {"ms": 8.0, "calls": 4}, "b": {"ms": 2.0, "calls": 1}},
    }
    short = {"total_ms": 4.0, "kernels": {"a": {"ms": 4.0, "calls": 2}}}
    res = bench._per_step(long, short, steps=2)
    assert res == {"gpu_ms_per_step": 3.0, "top_kernels_ms_per_step": {"a": 2.0, "b": 1.0}}


def test_profiler_start_stop_errors(llm):
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    assert llm.stop_profile()[0]["rank"] == 0


def test_step_bytes_counts_weights_once_and_kv_per_token():
    c = dict(hidden_size=4, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2)
    c |= dict(num_key_value_heads=1, head_dim=2, vocab_size=10, tie_word_embeddings=True)
    per_layer = 4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8  # qkv, o, gate/up/down
    weights = 2 * (2 * per_layer + 10 * 4)  # bf16; the tied head counted once
    assert bench.step_bytes(c, batch=3, context=5) == weights + 3 * 5 * 2 * 2 * 2 * 2
    assert bench.step_bytes({**c, "tie_word_embeddings": False}, 1, 0) == weights + 2 * 10 * 4
    # a rank's share: 1/tp of the weights; the one KV head is replicated, every rank reads it
    kv = 3 * 5 * 2 * 2 * 2 * 2
    assert bench.step_bytes(c, batch=3, context=5, tp=2) == weights // 2 + kv
    assert bench.step_bytes(c, batch=3, context=5, tp=4) == weights // 4 + kv
    # with 4 KV heads, two ranks read two heads each: half the KV bytes
    c4 = {**c, "num_attention_heads": 4, "num_key_value_heads": 4}
    assert bench.step_bytes(c4, 3, 5, tp=2) - bench.step_bytes(c4, 3, 0, tp=2) == 2 * kv
    # FP8: the layers' linear weights one byte each and a float32 scale per output row (qkv
    # 8, o 4, gate_up 16, down 4); FP8 KV: one byte per element
    fp8 = 2 * (per_layer + 4 * (8 + 4 + 16 + 4)) + 2 * 10 * 4
    assert bench.step_bytes(c, batch=3, context=5, fp8=True) == fp8 + 3 * 5 * 2 * 2 * 2 * 2
    assert bench.step_bytes(c, 3, 5, fp8=True, fp8_kv=True) == fp8 + 3 * 5 * 2 * 2 * 2


@pytest.mark.parametrize("kind", ["latency", "throughput", "prefill"])
def test_cli_wires_each_kind(kind):
    args = build_parser().parse_args(["bench", kind, "--model", "llama-3.2-3b", "--sync"])
    assert (args.kind, args.model, args.async_scheduling) == (kind, "llama-3.2-3b", False)
    assert args.func.__name__ == "cmd_bench_offline"


def test_run_bench_passes_the_engine_flags_with_bench_defaults(tiny_ckpt, monkeypatch):
    """`bench latency|throughput|prefill` builds its LLM from EngineArgs' flags: bench's own
    defaults (BENCH_DEFAULTS) unless a flag says otherwise, the model folder for --model."""
    seen = {}

    def fake_llm(**kw):
        seen.update(kw)
        raise KeyboardInterrupt  # stop before any work

    monkeypatch.setattr("llm_inference.entrypoints.llm.LLM", fake_llm)
    argv = ["bench", "latency", "--model", str(tiny_ckpt), "--sync", "--max-num-seqs", "4"]
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(build_parser().parse_args(argv))
    assert seen["model"] == str(tiny_ckpt) and seen["max_num_seqs"] == 4
    assert seen["async_scheduling"] is False
    assert {k: seen[k] for k in bench.BENCH_DEFAULTS} == bench.BENCH_DEFAULTS
    assert "pdl" not in seen and "skinny_gemm" not in seen


def test_a_named_shape_on_the_cpu_is_one_error_before_any_work(monkeypatch, capsys):
    """`bench latency --model llama-3.2-1b` without a GPU: one `error:` line naming the shape,
    its size and what to do, before a byte of the random checkpoint is written."""
    from llm_inference.entrypoints import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "random_checkpoint", lambda *a: pytest.fail("wrote a checkpoint"))
    assert cli.main(["bench", "latency", "--model", "llama-3.2-1b"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the named shape llama-3.2-1b (2.5 GB") and "--model" in err
    assert bench.shape_bytes("llama-3.1-8b") == 2 * 8_030_261_248  # Llama-3.1-8B's parameters


def test_latency_on_the_cpu_has_no_floor(tiny_ckpt, capsys):
    """Without a GPU there is no copy bandwidth to measure: the table says '-' for the floor."""
    from llm_inference.entrypoints import cli

    argv = ["bench", "latency", "--model", str(tiny_ckpt), "--device", "cpu", "--batches", "1",
            "--dtype", "float32", "--max-model-len", "512"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "decode ms per step\n" in out and "| 1 | " in out and out.rstrip().endswith("| - |")


def test_latency_on_the_cpu_defaults_to_small_batches(tiny_ckpt, monkeypatch, capsys):
    """Batches of 64 and 256 on a CPU take most of an hour: its default is 1 and 8."""
    from llm_inference.entrypoints import bench, cli

    seen = []
    monkeypatch.setattr(bench, "decode_latency", lambda llm, b: seen.append(b) or {})
    argv = ["bench", "latency", "--model", str(tiny_ckpt), "--device", "cpu", "--dtype",
            "float32", "--max-model-len", "512"]  # fmt: skip
    assert cli.main(argv) == 0 and seen == [[1, 8]]


def test_throughput_cli_with_a_dataset(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """`bench throughput --dataset fixed --disable-detokenize` end to end on the CPU: the mix it
    ran (mean lengths, sampling) beside today's figures, in the printout and under `--json`'s
    `workload`; every request (the warm-up's too) asks for token ids only; a progress bar."""
    from llm_inference.entrypoints import cli

    sent, real = [], bench._timed_generate
    monkeypatch.setattr(
        bench, "_timed_generate", lambda *a, **kw: sent.extend(a[2]) or real(*a, **kw)
    )
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(tiny_ckpt), "--device", "cpu", "--dtype",
            "float32", "--max-model-len", "64", "--dataset", "fixed", "--num-prompts", "2",
            "--input-len", "12", "--output-len", "5", "--top-k", "20", "--disable-detokenize",
            "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    assert len(sent) == 2 + 2 and not any(p.detokenize for p in sent)
    res = json.loads(out.read_text())
    today = {"model", "kind", "tp", "seconds", "requests_per_s", "output_tok_per_s",
             "total_tok_per_s", "output_tokens"}  # fmt: skip
    assert set(res) == today | {"workload", "detokenize"} and res["detokenize"] is False
    assert res["output_tokens"] == 2 * 5
    assert res["workload"] == {
        "dataset": "fixed", "num_prompts": 2, "seed": 0, "input_len": 12, "output_len": 5,
        "temperature": 0.6, "top_p": 1.0, "top_k": 20, "mean_prompt_len": 12.0,
        "mean_output_len": 5.0,
    }  # fmt: skip
    printed = capsys.readouterr()
    assert (
        "workload: fixed, 2 requests, mean prompt 12 and output 5 tokens, temperature 0.6, "
        "top-p 1.0, top-k 20" in printed.out
    )
    assert "Generating: 100%" in printed.err  # the timed run shows its progress


def test_throughput_requests_longer_than_max_model_len_are_one_error(tiny_ckpt, capsys):
    """A workload whose longest request does not fit `--max-model-len` stops before the engine
    starts, naming both."""
    from llm_inference.entrypoints import cli

    argv = ["bench", "throughput", "--model", str(tiny_ckpt), "--device", "cpu",
            "--dataset", "fixed", "--input-len", "40", "--output-len", "30",
            "--max-model-len", "64"]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the workload's longest request is 70 tokens") and (
        "--max-model-len 64" in err
    )


@pytest.mark.parametrize(
    "shape,model_type",
    [("llama-3.1-8b", "llama"), ("qwen2.5-7b", "qwen2"), ("qwen3-8b", "qwen3"),
     ("mistral-7b", "mistral")],
)  # fmt: skip
def test_named_shapes_write_their_family_and_vocabulary(shape, model_type, tmp_path, monkeypatch):
    """Each family's named shape, shrunk to two small layers (the real ones are 15 GB), keeps the
    rest: `random_checkpoint` writes its transformers class with its vocabulary, bos and eos ids
    inside it and a word-level tokenizer over all of it; transformers reads it back as its
    family, `shape_bytes` counts every parameter written (biases and q/k norms too), and our
    engine loads it and runs bench's throughput requests on it."""
    from safetensors import safe_open
    from transformers import AutoConfig

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    monkeypatch.setitem(bench.SHAPES, shape, {**bench.SHAPES[shape], **small})
    folder = bench.random_checkpoint(shape, root=tmp_path)
    vocab = bench.SHAPES[shape]["vocab_size"]
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == model_type and config.vocab_size == vocab
    assert config.architectures == [bench.SHAPES[shape]["model"]]
    assert 0 <= config.bos_token_id < vocab and 0 <= config.eos_token_id < vocab
    with safe_open(folder / "model.safetensors", "pt") as f:
        numel = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    assert bench.shape_bytes(shape) == 2 * numel

    prompts, params = bench.throughput_requests(SMALL, shape, folder)
    with LLM(str(folder), device="cpu", dtype="float32", max_model_len=64) as llm:
        assert llm.config.model.model_type == model_type
        # every id is a word (transformers 5 loads Qwen2's as a Qwen2Tokenizer, which keeps
        # the vocabulary but cannot split text into these words: bench sends ids, not text)
        words = llm.get_tokenizer().convert_ids_to_tokens([1, vocab - 1])
        assert words == ["w1", f"w{vocab - 1}"]
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
