"""The command line's contract: --version, help text with defaults on every flag, the engine
flags (a flag per EngineArgs field) the same on generate/chat/serve/bench, and every error path
as one `error: ...` line on stderr with exit status 1 (Ctrl-C: 130), never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llm_inference
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.entrypoints import bench, cli
from llm_inference.entrypoints.cli import main
from llm_inference.executor.multiproc import WorkerError


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"llm-inference {llm_inference.__version__}\n"


def _subparsers(parser: argparse.ArgumentParser, name: str = "llm-inference"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _subparsers(sub, f"{name} {sub_name}")


def test_every_flag_has_help_showing_its_default(monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-from-env")
    names = []
    for name, parser in _subparsers(cli.build_parser()):
        names.append(name)
        formatter = parser.formatter_class(prog=parser.prog)
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            flag = f"{name} {action.option_strings[0]}"
            assert action.help, f"{flag} has no help"
            if action.default is not None:
                assert "default" in formatter._get_help_string(action), flag
        with pytest.raises(SystemExit):
            parser.parse_args(["--help"])
        out = capsys.readouterr().out
        assert "sk-secret-from-env" not in out, name  # an API key from the environment
    assert {"llm-inference generate", "llm-inference chat", "llm-inference serve",
            "llm-inference bench latency", "llm-inference bench serve"} <= set(names)  # fmt: skip


ENGINE_FLAGS = [
    "--model", "m", "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
    "--kv-cache-memory-bytes", "123456", "--no-enable-prefix-caching",
    "--gpu-memory-utilization", "0.5", "--max-num-seqs", "7", "--max-num-batched-tokens", "99",
    "--block-size", "32", "--tensor-parallel-size", "2", "--kernel-backend", "reference",
    "--enforce-eager", "--seed", "11", "--no-async-scheduling", "--disable-custom-all-reduce",
    "--data-parallel-size", "3", "--distributed-executor-backend", "ray", "--quantization", "fp8",
    "--kv-cache-dtype", "fp8", "--long-prefill-token-threshold", "64",
]  # fmt: skip
ENGINE_KWARGS = dict(
    model="m", device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=123456,
    enable_prefix_caching=False, gpu_memory_utilization=0.5, max_num_seqs=7,
    max_num_batched_tokens=99, block_size=32, tensor_parallel_size=2,
    kernel_backend="reference", enforce_eager=True, seed=11, async_scheduling=False,
    disable_custom_all_reduce=True, data_parallel_size=3, distributed_executor_backend="ray",
    quantization="fp8", kv_cache_dtype="fp8", long_prefill_token_threshold=64,
)  # fmt: skip


def test_engine_flags_are_the_same_on_generate_chat_and_serve(monkeypatch):
    # Every EngineArgs field is set above, to a value other than its default.
    defaults = dataclasses.asdict(EngineArgs())
    assert set(ENGINE_KWARGS) == set(defaults)
    assert all(ENGINE_KWARGS[k] != v for k, v in defaults.items())
    seen = {}

    def fake_llm(model, **kw):
        seen["llm"] = (model, kw)
        raise ValueError("stop here")

    def fake_server(model, **kw):
        seen["serve"] = (model, kw)

    monkeypatch.setattr("llm_inference.entrypoints.llm.LLM", fake_llm)
    monkeypatch.setattr("llm_inference.entrypoints.openai.api_server.run_server", fake_server)
    for argv in (["generate", "hi"], ["chat"]):
        seen.clear()
        assert main([*argv, *ENGINE_FLAGS]) == 1
        model, kw = seen["llm"]
        assert {"model": model, **kw} == ENGINE_KWARGS, argv
    assert main(["serve", *ENGINE_FLAGS]) == 0
    model, kw = seen["serve"]
    assert {k: v for k, v in {"model": model, **kw}.items() if k in defaults} == ENGINE_KWARGS
    # bench: the same flags (its own --model: a checkpoint or a named shape) with its defaults
    args = cli.build_parser().parse_args(["bench", "latency", *ENGINE_FLAGS])
    assert dataclasses.asdict(EngineArgs.from_cli_args(args)) == ENGINE_KWARGS
    # No flag: EngineArgs' defaults; bench's own (BENCH_DEFAULTS) where it has them.
    for argv in (["generate", "hi"], ["chat"], ["serve"]):
        args = cli.build_parser().parse_args(argv)
        assert dataclasses.asdict(EngineArgs.from_cli_args(args)) == defaults, argv
    args = cli.build_parser().parse_args(["bench", "throughput"])
    assert dataclasses.asdict(EngineArgs.from_cli_args(args)) == {
        **defaults,
        **bench.BENCH_DEFAULTS,
        "model": None,  # run_bench: llama-3.2-1b on a GPU, the default model on the CPU
    }
    assert not cli.build_parser().parse_args(["bench", "prefill", "--sync"]).async_scheduling


def test_removed_performance_knobs_are_not_options(capsys):
    """skinny_gemm, pdl, fused_all_reduce_norm and mixed_cuda_graph_sizes are the kernels'
    choice: no engine argument, no flag on any subcommand."""
    knobs = ("skinny_gemm", "pdl", "fused_all_reduce_norm", "mixed_cuda_graph_sizes")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert fields.isdisjoint(knobs)
    for name, parser in _subparsers(cli.build_parser()):
        with pytest.raises(SystemExit):
            parser.parse_args(["--help"])
        out = capsys.readouterr().out
        for knob in knobs:
            assert knob.replace("_", "-") not in out, (name, knob)


@pytest.fixture(scope="module")
def bad_ckpts(tiny_ckpt, tmp_path_factory):
    """Broken copies of the tiny checkpoint."""
    root = tmp_path_factory.mktemp("bad")
    out = {}
    for name in ("no_tokenizer", "bad_json", "truncated", "no_weights", "no_config"):
        out[name] = shutil.copytree(tiny_ckpt, root / name)
    for f in out["no_tokenizer"].glob("tokenizer*"):
        f.unlink()
    (out["bad_json"] / "config.json").write_text("{not json")
    with open(out["truncated"] / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    (out["no_weights"] / "model.safetensors").unlink()
    (out["no_config"] / "config.json").unlink()
    out["missing"] = root / "missing"
    return out


ERROR_CASES = [
    (["--dtype", "int8"], r"dtype must be one of"),
    (["--device", "tpu"], r"device 'tpu'"),
    (["--max-num-seqs", "0"], r"max_num_seqs must be a positive integer, got 0"),
    (["--max-num-batched-tokens", "-1"], r"max_num_batched_tokens must be a positive integer"),
    (["--block-size", "12"], r"block_size must be a power of two, got 12"),
    (["--max-model-len", "0"], r"max_model_len must be a positive integer"),
    (["--max-model-len", "100000"], r"max_model_len=100000 exceeds the model's 512 positions"),
    (["--gpu-memory-utilization", "1.5"], r"gpu_memory_utilization must be in \(0, 1\]"),
    (["--kernel-backend", "fast"], r"kernel_backend must be one of"),
    (["--kernel-backend", "triton"], r"kernel_backend='triton' needs a CUDA device"),
    (["--tensor-parallel-size", "3"], r"tensor_parallel_size=3 does not fit the model"),
    (["--kv-cache-memory-bytes", "1000"], r"KV cache too small"),
    (["--kv-cache-memory-bytes", "40000", "--max-model-len", "512"], r"KV cache too small"),
    (["--max-new-tokens", "0"], r"max_tokens must be"),
    (["--model", "missing"], r"does not exist"),
    (["--model", "no_tokenizer"], r"no tokenizer files"),
    (["--model", "bad_json"], r"config.json is not valid JSON"),
    (["--model", "truncated"], r"model.safetensors"),
    (["--model", "no_weights"], r"no \*.safetensors weights"),
    (["--model", "no_config"], r"no config.json"),
]


@pytest.mark.parametrize("extra,match", ERROR_CASES, ids=[" ".join(c[0]) for c in ERROR_CASES])
def test_generate_error_is_one_line_exit_1(tiny_ckpt, bad_ckpts, capsys, extra, match):
    if extra[0] == "--model":
        model, extra = [], ["--model", str(bad_ckpts[extra[1]])]
    else:
        model = ["--model", str(tiny_ckpt)]
    assert main(["generate", "hi", "--device", "cpu", *model, *extra]) == 1
    line = _one_error_line(capsys)
    assert re.search(match, line), line


def test_cuda_asked_for_without_cuda(tiny_ckpt, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["generate", "hi", "--model", str(tiny_ckpt), "--device", "cuda"]) == 1
    assert "CUDA is not available" in _one_error_line(capsys)


@pytest.mark.parametrize("command", [["chat"], ["serve"]])
@pytest.mark.parametrize("extra", [["--dtype", "int8"], ["--max-num-seqs", "0"]])
def test_chat_and_serve_errors_are_one_line(tiny_ckpt, capsys, command, extra):
    assert main([*command, "--model", str(tiny_ckpt), "--device", "cpu", *extra]) == 1
    _one_error_line(capsys)


def test_serve_kv_cache_too_small_is_one_line(tiny_ckpt, capsys):
    """Found in the server's engine core process, reported as in one process."""
    extra = ["--kv-cache-memory-bytes", "40000", "--max-model-len", "512"]
    assert main(["serve", "--model", str(tiny_ckpt), "--device", "cpu", *extra]) == 1
    line = _one_error_line(capsys)
    assert re.search(r"^error: KV cache too small for one request of max_model_len=512", line), line


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc

    return fail


WORKER_TRACEBACK = WorkerError(
    "tensor-parallel worker rank 1 raised in execute_model:\n"
    "Traceback (most recent call last):\n"
    '  File "worker.py", line 1, in run\n'
    "torch.OutOfMemoryError: CUDA out of memory"
)


@pytest.mark.parametrize(
    "exc,match",
    [
        (WORKER_TRACEBACK, r"rank 1 raised in execute_model: torch.OutOfMemoryError: CUDA out"),
        (RuntimeError("CUDA error: device-side assert"), r"^error: CUDA error: device-side"),
        (PermissionError(13, "Permission denied", "/m"), r"PermissionError: .*Permission denied"),
        (FileNotFoundError(2, "No such file", "/m"), r"No such file"),
    ],
    ids=["worker", "runtime", "permission", "not_found"],
)
def test_runtime_and_os_errors_are_one_line(monkeypatch, capsys, exc, match):
    monkeypatch.setattr("llm_inference.entrypoints.llm.LLM", _raise(exc))
    assert main(["generate", "hi", "--model", "m"]) == 1
    assert re.search(match, _one_error_line(capsys))


def test_programming_errors_keep_their_traceback(monkeypatch):
    """A TypeError or AttributeError is a bug: it propagates (the console shows a traceback);
    LLM_INFERENCE_TRACEBACK=1 also shows the traceback of the errors normally printed as one
    line."""
    monkeypatch.setattr("llm_inference.entrypoints.llm.LLM", _raise(TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        main(["generate", "hi", "--model", "m"])
    monkeypatch.setattr("llm_inference.entrypoints.llm.LLM", _raise(ValueError("bad")))
    monkeypatch.setenv("LLM_INFERENCE_TRACEBACK", "1")
    with pytest.raises(ValueError, match="bad"):
        main(["generate", "hi", "--model", "m"])


def test_usage_errors_are_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--max-num-seqs", "many"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("llm-inference")
    assert "error: argument --max-num-seqs: invalid int value" in err


def test_ctrl_c_while_generating_exits_130(tiny_ckpt, monkeypatch, capsys):
    from llm_inference.entrypoints.llm import LLM

    monkeypatch.setattr(LLM, "generate", _raise(KeyboardInterrupt))
    assert main(["generate", "hi", "--model", str(tiny_ckpt), "--device", "cpu"]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize(
    "argv,target",
    [
        (["generate", "hi"], "llm_inference.entrypoints.llm.LLM"),
        (["chat"], "llm_inference.entrypoints.llm.LLM"),
        (["serve"], "llm_inference.entrypoints.openai.api_server.run_server"),
        (["convert", "a.gguf", "out"], "llm_inference.models.gguf.convert_gguf_to_hf"),
        (["bench", "latency"], "llm_inference.entrypoints.bench.run_bench"),
        (["bench", "serve"], "llm_inference.entrypoints.bench_serve.main"),
    ],
    ids=["generate", "chat", "serve", "convert", "bench_latency", "bench_serve"],
)
def test_ctrl_c_in_any_subcommand_exits_130(monkeypatch, capsys, argv, target):
    monkeypatch.setattr(target, _raise(KeyboardInterrupt))
    assert main(argv) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_parser_and_help_import_no_torch():
    """The reason the subcommands import the engine when they run: `llm-inference --help` (and
    every parser, EngineArgs' flags included) starts without torch, numpy or transformers."""
    code = (
        "import sys; from llm_inference.entrypoints import cli; cli.build_parser(); "
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'numpy', 'transformers', 'triton')]; assert not heavy, heavy"
    )
    src = Path(__file__).resolve().parents[2] / "src"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=src)


def test_top_level_help_speaks_to_users(capsys):
    """`llm-inference --help`: every command in the usage line, a description for users (no
    source file names, no developer notes), and `bench --help` lists each benchmark."""
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "{generate,chat,convert,serve,bench}" in out
    assert ".py" not in out and "import" not in out
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(kind in out for kind in ("latency", "throughput", "prefill", "serve"))


@pytest.mark.parametrize(
    ("argv", "missing"),
    [(["serve", "--port", "1"], "fastapi"), (["bench", "serve", "--num-prompts", "1"], "httpx")],
)
def test_serve_without_the_serve_extra_is_one_error(monkeypatch, capsys, argv, missing):
    """`pip install -e .` alone has no server packages: `serve` and `bench serve` say which
    is missing and how to install it, in one line, not with an import traceback."""
    for name in ("llm_inference.entrypoints.openai.api_server", missing):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {missing} is not installed: the server and `bench serve` need the serve extra "
        '(pip install -e ".[serve]" in a clone of the repository)'
    ]
