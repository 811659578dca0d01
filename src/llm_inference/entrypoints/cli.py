"""The `llm-inference` command line: generate | chat | convert | serve | bench serve|latency|
throughput|prefill.

The engine flags of generate, chat, serve and bench are `EngineArgs`' (engine/arg_utils.py).
Each subcommand imports what it runs (the engine and torch, the server's fastapi) when it runs:
building the parser, `--help` and `--version` import neither."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from llm_inference import __version__
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.entrypoints import bench, bench_serve
from llm_inference.entrypoints.openai.tool_parser import TOOL_PARSERS
from llm_inference.sampling_params import SamplingParams


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        if action.default == "":
            return text + " (default: none)"
        return super()._get_help_string(action)


def _engine_kwargs(args) -> dict:
    """The engine flags of generate, chat and serve (`EngineArgs.add_cli_args`) as keyword
    arguments of LLM / run_server, `model` included."""
    return dataclasses.asdict(EngineArgs.from_cli_args(args))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this mass")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens; -1: all")


def _llm(args):
    from llm_inference import LLM

    return LLM(**_engine_kwargs(args))


def _params(args):
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

    run_server(host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=args.served_model_name, log_level=args.log_level,
               tool_call_parser=args.tool_call_parser, engine_process=args.engine_process,
               chat_template=args.chat_template, api_server_count=args.api_server_count,
               **_engine_kwargs(args))  # fmt: skip
    return 0


def cmd_bench_offline(args) -> int:
    bench.run_bench(args)
    return 0


def _set_formatter(parser: argparse.ArgumentParser) -> None:
    """_HelpFormatter for `parser` and its subcommands. (An --api-key's help names its default
    itself: a secret taken from the environment is never printed.)"""
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _set_formatter(sub)


def _add_serve_parsers(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: none)"
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: --model, or the default model's folder)",
    )
    s.add_argument("--log-level", default="info", help="uvicorn's log level")
    s.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="HTTP front ends, each a process on the same port and engine core, sharing the "
        "streams' output processing (default: one per 4 CPUs, at most 4, on a GPU; 1 off "
        "Linux, on the CPU, with data parallel cores or --no-engine-process)",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        help="a chat template for chat completions: a Jinja file, or the template itself "
        "(default: the tokenizer's)",
    )
    s.add_argument(
        "--tool-call-parser",
        default="llama3_json",
        choices=list(TOOL_PARSERS),
        help="how chat answers become tool calls: llama3_json (Llama 3's JSON) or hermes "
        "(<tool_call> blocks: Qwen2.5, Qwen3)",
    )
    s.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core (scheduler, model) in a process of its own, beside the "
        "HTTP front end (default: on; --no-engine-process runs it on a thread of the server)",
    )
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bs = b.add_parser("serve", help="load-test an OpenAI-compatible server (as vllm bench serve)")
    bench_serve.add_cli_args(bs)
    bs.set_defaults(func=bench_serve.main)
    kinds = {
        "latency": "decode ms per step at batch 1, 8, 64, 256 beside the floor",
        "throughput": "N requests of a dataset (default: lengths uniform in [100, 1024])",
        "prefill": "time to first token of one 8,000-token prompt and of 64 x 512",
    }
    for kind, text in kinds.items():
        bo = b.add_parser(kind, help=text)
        bench.add_bench_args(bo, kind)
        bo.set_defaults(func=cmd_bench_offline)


DESCRIPTION = (
    "Run a Llama, Mistral or Qwen model: generate text, chat, serve an OpenAI-compatible API, "
    "convert GGUF files and benchmark. Without --model, the bundled SmolLM2-135M-Instruct. "
    "`llm-inference COMMAND --help` lists a command's options."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-inference", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    EngineArgs.add_cli_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat on the terminal (/exit to leave)")
    c.add_argument("--system", default=None, help="a system prompt (default: none)")
    EngineArgs.add_cli_args(c)
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
    _set_formatter(parser)
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


# The `serve` extra's packages, imported only by the server and `bench serve`.
SERVE_PACKAGES = ("fastapi", "starlette", "uvicorn", "httpx")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Errors a user can cause or meet (bad arguments or checkpoints, a
    missing device, files, the OS, the engine's workers: ValueError, RuntimeError, OSError;
    the serve extra not installed) print one `error: ...` line and exit 1; Ctrl-C exits 130;
    usage errors are argparse's (2).
    Anything else (TypeError, AttributeError, ...) is a bug and keeps its traceback, as do all
    errors when LLM_INFERENCE_TRACEBACK=1."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the terminal echoed ^C on
        return 130
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVE_PACKAGES:
            raise
        hint = 'pip install -e ".[serve]" in a clone of the repository'
        print(f"error: {e.name} is not installed: the server and `bench serve` need the serve "
              f"extra ({hint})", file=sys.stderr)  # fmt: skip
        return 1
    except (ValueError, RuntimeError, OSError) as e:
        if os.environ.get("LLM_INFERENCE_TRACEBACK") == "1":
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
