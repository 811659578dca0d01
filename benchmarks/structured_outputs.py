"""64 concurrent JSON-schema requests against 64 unconstrained ones, in this engine or in vLLM
(xgrammar backend), one engine per process (issue 29, item 5).

Every request gets a prompt of 128 token ids (seeded random ids, then a short instruction),
temperature 1.0 and its index as its seed (vLLM draws a seeded row's noise row by row, a cost
it pays for both kinds alike). The constrained requests follow `SCHEMA` (an order record:
nested object, array of objects, enum, bounded integers, a boolean, required and optional
fields), compact (no whitespace between JSON tokens: vLLM's xgrammar backend takes that only
from its engine config), and end on EOS once the JSON closes, or at `--max-tokens`. Each
unconstrained request is asked (ignore_eos) for exactly as many tokens as its constrained twin
wrote in the warm-up: both kinds then generate the same tokens per request, the batch shrinks
alike, and the difference in wall time is the grammar's cost (bitmasks, and the sampling that
waits for them). Unconstrained answers of a fixed 256 tokens would
compare different work: constrained answers are shorter and uneven, their tail runs at smaller
batches, and ms per token would charge the longest answer's time to the mean one.

Order: a warm-up of each kind (unconstrained first, at `--max-tokens`), then `--rounds` rounds
of unconstrained then constrained. Measured per timed `generate` call (all requests at once):
output tok/s (generated tokens / wall time) and ms per output token (wall time / mean output
tokens per request, prefill included); the table shows each kind's median-time round. The
first constrained call's extra time over the median one is reported as the compile cost
(xgrammar and the tokenizer loaded, the tokenizer's vocabulary indexed, the schema compiled;
then cached). A constrained answer that ended by stop must parse with `json.loads` and
validate with `jsonschema`; answers cut by max_tokens are counted apart.

`--phases` (ours only): after the rounds, one more call of each kind with the engine's host
phases timed (`perf_counter` around the engine core's call, the scheduler, the input batch, the
bitmask fill, the launches, the wait for a step's tokens): per phase the calls and the median ms
per call. A kind whose step waits for its tokens is bound by the device; one that never waits,
by the host (`structured_outputs_host_2026-12-02_h200.md`).

A named shape is bench's random-weight checkpoint with another tokenizer: its word-level one
(`w0` .. `w128255`) has no token for `{` or `"`, so every JSON grammar would mask the whole
vocabulary (`json_checkpoint`). A folder is used as it is, its own tokenizer included.

    PYTHONPATH=src python3 benchmarks/structured_outputs.py --engine ours --json OUT.json [--phases]
    PYTHONPATH=src:/tmp/site python3 benchmarks/structured_outputs.py --engine vllm --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import inspect
import json
import random
import statistics
import string
import time
from pathlib import Path

from llm_inference.entrypoints import bench

PROMPT_LEN = 128
INSTRUCTION = "\nThe order, as JSON:"
# Free text is bounded by patterns: xgrammar 0.2.9 lets raw control characters into a string
# with minLength/maxLength, which json.loads refuses; a random model writes one often.
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11} [A-Z][a-z]{1,11}$"},
                "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)$"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z0-9]{8}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price_cents": {"type": "integer", "minimum": 0, "maximum": 1000000},
                },
                "required": ["sku", "quantity", "unit_price_cents"],
                "additionalProperties": False,
            },
        },
        "notes": {"type": "string", "pattern": "^[A-Za-z0-9 ,.!?]{0,40}$"},
    },
    "required": ["order_id", "customer", "status", "items"],
    "additionalProperties": False,
}
KINDS = ("unconstrained", "json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["ours", "vllm"], default="ours")
    shapes = ", ".join(bench.SHAPES)
    p.add_argument("--model", default="llama-3.2-1b", help=f"a folder or a named shape ({shapes})")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256, help="a constrained answer's limit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--phases", action="store_true", help="ours: time the host's phases too")
    p.add_argument("--device", default=None, help="ours only (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16")
    return p


def json_checkpoint(folder: Path) -> Path:
    """`folder`'s weights (linked) with a tokenizer that can write JSON, in a sibling folder
    written once. Byte-level BPE as Llama 3's, over the config's vocabulary: the 256 bytes,
    every pair of printable ASCII characters, the numbers 0-999, then seeded random words (some
    capitalized, half with a leading space) up to the first special token; bos and eos where
    the config puts them. Only ids are ever decoded, so it needs no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = folder.with_name(folder.name + "-json")
    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")) and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    bos, eos, size = config["bos_token_id"], config["eos_token_id"], config["vocab_size"]
    ascii_ = [c.replace(" ", "\u0120") for c in string.printable[:95]]  # as byte-level spells it
    pieces = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a in ascii_ for b in ascii_]
    pieces = list(dict.fromkeys(pieces + [str(i) for i in range(1000)]))
    known, rng = set(pieces), random.Random(0)
    while len(pieces) < min(bos, eos):
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        word = rng.choice(("", "\u0120")) + (word.title() if rng.random() < 0.25 else word)
        if word not in known:
            known.add(word)
            pieces.append(word)
    names = {bos: "<|begin_of_text|>", eos: "<|end_of_text|>"}
    specials = [names.get(i, f"<|reserved_special_token_{i}|>") for i in range(len(pieces), size)]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces + specials)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=names[bos], eos_token=names[eos])
    fast.save_pretrained(out)
    return out


def make_prompts(folder: Path, n: int) -> list[dict]:
    """`n` prompts of PROMPT_LEN token ids: seeded random ids (below bench's PROMPT_IDS), then
    `INSTRUCTION`. The prompt then ends on whole characters: random byte tokens may leave a
    UTF-8 sequence open, and the detokenizer would start the answer's text with it."""
    from transformers import AutoTokenizer

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tail = AutoTokenizer.from_pretrained(folder).encode(INSTRUCTION, add_special_tokens=False)
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(min(bench.PROMPT_IDS, vocab))
                                  for _ in range(PROMPT_LEN - len(tail))] + tail}
            for _ in range(n)]  # fmt: skip


def start(args, folder: Path):
    """(the engine `--engine` names, its version, its SamplingParams for (request index, max
    tokens, kind))."""
    config = json.loads((folder / "config.json").read_text())
    common = dict(dtype=args.dtype, max_model_len=min(4096, config["max_position_embeddings"]),
                  gpu_memory_utilization=0.85, max_num_seqs=256, enable_prefix_caching=False,
                  seed=0)  # fmt: skip
    if args.engine == "vllm":
        import vllm
        from vllm.sampling_params import StructuredOutputsParams

        so_config = {"backend": "xgrammar", "disable_any_whitespace": True}
        if "structured_outputs_config" in inspect.signature(vllm.LLM.__init__).parameters:
            common["structured_outputs_config"] = so_config
        llm = vllm.LLM(str(folder), **common)
        version, params_type = vllm.__version__, vllm.SamplingParams
    else:
        import llm_inference
        from llm_inference import LLM, SamplingParams, StructuredOutputsParams

        llm = LLM(str(folder), device=args.device, **common)
        version, params_type = llm_inference.__version__, SamplingParams
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)

    def params(i: int, max_tokens: int, kind: str):
        extra = {"structured_outputs": spec} if kind == "json" else {"ignore_eos": True}
        return params_type(temperature=1.0, seed=i, max_tokens=max_tokens, **extra)

    return llm, version, params


def check_answers(outputs) -> dict:
    """Constrained answers: how many ended by stop, how many of those validate, how many were
    cut by max_tokens, and the first invalid ones."""
    import jsonschema

    stop = [text for _, text, reason in outputs if reason == "stop"]
    invalid = []
    for text in stop:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            invalid.append(f"{e}: {text!r}")
    return {"stop": len(stop), "valid": len(stop) - len(invalid),
            "cut": sum(reason == "length" for _, _, reason in outputs),
            "invalid": invalid[:3]}  # fmt: skip


def measure(llm, params, prompts: list[dict], args) -> tuple[dict, dict, list[dict]]:
    """The warm-up calls (unconstrained, then the first constrained one) and the rounds, each
    call's figures (the module docstring's order)."""
    import torch

    def call(kind: str, lengths: list[int]) -> tuple[dict, list[tuple]]:
        ps = [params(i, n, kind) for i, n in enumerate(lengths)]
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t = time.perf_counter()
        outs = llm.generate(prompts, ps, use_tqdm=False)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        seconds = time.perf_counter() - t
        answers = [(len(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
                   for o in outs]  # fmt: skip
        tokens = sum(a[0] for a in answers)
        res = {"kind": kind, "requests": len(outs), "output_tokens": tokens, "seconds": seconds,
               "out_tok_per_s": tokens / seconds,
               "ms_per_output_token": 1e3 * seconds * len(outs) / tokens}  # fmt: skip
        return res | (check_answers(answers) if kind == "json" else {}), answers

    limit = [args.max_tokens] * args.num_requests
    warm_plain, _ = call("unconstrained", limit)
    first_json, answers = call("json", limit)
    lengths = [a[0] for a in answers]  # each unconstrained request as long as its twin
    runs = []
    for r in range(args.rounds):
        runs += [call(kind, lengths if kind == "unconstrained" else limit)[0] | {"round": r}
                 for kind in KINDS]  # fmt: skip
    phases = {}
    for kind in KINDS if args.phases else ():
        with timed_phases() as times:
            call(kind, lengths if kind == "unconstrained" else limit)
        phases[kind] = {name: {"calls": len(ts), "median_ms": 1e3 * statistics.median(ts)}
                        for name, ts in times.items()}  # fmt: skip
    return warm_plain, first_json, runs, phases


# (module, class, method, label): what `--phases` times, per call
PHASES = (
    ("engine.engine_core", "EngineCore", "step", "engine core call (a step)"),
    ("executor.pending", "PendingOutput", "result", "waiting for a step's tokens"),
    ("structured_output.manager", "StructuredOutputManager", "fill_bitmask", "bitmask fill"),
    ("executor.executor", "Executor", "sample_tokens", "sampling launch (constrained)"),
    ("executor.executor", "Executor", "execute_model", "step launch"),
    ("executor.model_runner", "ModelRunner", "_forward", "forward launch (model_runner._forward)"),
    ("executor.model_runner", "ModelRunner", "_grammar_mask", "mask to the device (_grammar_mask)"),
    ("sample.grammar", "MaskStaging", "build", "- its packing and copy (MaskStaging.build)"),
    ("executor.model_runner", "ModelRunner", "sampling_metadata", "sampling_metadata"),
    ("sample.sampler", "Sampler", "forward", "sampler launch (Sampler.forward)"),
    ("executor.model_runner", "ModelRunner", "_keep_sampled", "tokens' copy (_keep_sampled)"),
    ("executor.input_batch", "InputBatch", "prepare", "inputs (input_batch.prepare)"),
    ("executor.input_batch", "InputBatch", "apply", "input_batch.apply"),
    ("core.scheduler", "Scheduler", "schedule", "schedule"),
    ("core.scheduler", "Scheduler", "update_from_output", "update_from_output"),
    ("engine.llm_engine", "LLMEngine", "process_core_outputs", "caller's output processing"),
)


@contextlib.contextmanager
def timed_phases():
    """Within: each PHASES method's call times (seconds), by label; the methods restored after."""
    import importlib

    times: dict[str, list[float]] = {label: [] for *_, label in PHASES}
    saved = []
    for module, cls_name, method, label in PHASES:
        cls = getattr(importlib.import_module(f"llm_inference.{module}"), cls_name)
        real = getattr(cls, method)

        def timed(*a, _real=real, _out=times[label], **kw):
            t = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                _out.append(time.perf_counter() - t)

        saved.append((cls, method, real))
        setattr(cls, method, timed)
    try:
        yield times
    finally:
        for cls, method, real in saved:
            setattr(cls, method, real)
    for label in [label for label, ts in times.items() if not ts]:
        del times[label]


def run(args) -> dict:
    """Start the engine, measure; the results (the JSON)."""
    folder = bench.random_checkpoint(args.model) if args.model in bench.SHAPES else Path(args.model)
    if args.model in bench.SHAPES:
        folder = json_checkpoint(folder)
    prompts = make_prompts(folder, args.num_requests)
    llm, version, params = start(args, folder)
    try:
        warm_plain, first_json, runs, phases = measure(llm, params, prompts, args)
    finally:
        if args.engine == "ours":
            llm.close()
    summary = {}
    for kind in KINDS:  # each kind's median-time round
        xs = sorted((x for x in runs if x["kind"] == kind), key=lambda x: x["seconds"])
        summary[kind] = xs[(len(xs) - 1) // 2]
    json_runs = [x for x in runs if x["kind"] == "json"]
    return {
        "engine": args.engine, "version": version,
        "xgrammar": importlib.metadata.version("xgrammar"), "model": args.model,
        "dtype": args.dtype, "requests": args.num_requests, "prompt_len": PROMPT_LEN,
        "max_tokens": args.max_tokens, "rounds": args.rounds,
        "warm_up_s": {"unconstrained": warm_plain["seconds"], "json": first_json["seconds"]},
        "compile_s": first_json["seconds"] - summary["json"]["seconds"],
        "json_vs_unconstrained": summary["json"]["out_tok_per_s"]
        / summary["unconstrained"]["out_tok_per_s"],
        "answers": {k: sum(x[k] for x in json_runs) for k in ("stop", "valid", "cut")},
        "summary": summary, "runs": runs, "phases": phases, "schema": SCHEMA,
    }  # fmt: skip


def format_table(res: dict) -> str:
    lines = ["| engine | kind | requests | output tokens | seconds | out tok/s | "
             "ms per output token | valid JSON |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind in KINDS:
        r = res["summary"][kind]
        valid = f"{r['valid']}/{r['stop']} ({r['cut']} cut)" if kind == "json" else "-"
        lines.append(f"| {res['engine']} {res['version']} | {kind} | {r['requests']} | "
                     f"{r['output_tokens']:,} | {r['seconds']:.3f} | {r['out_tok_per_s']:,.0f} | "
                     f"{r['ms_per_output_token']:.2f} | {valid} |")  # fmt: skip
    a = res["answers"]
    lines.append(f"\njson / unconstrained output tok/s: {res['json_vs_unconstrained']:.3f} "
                 f"(median rounds of {res['rounds']}); first json call: +{res['compile_s']:.2f} s "
                 f"(compile cost); all json rounds: {a['valid']}/{a['stop']} ended by stop valid, "
                 f"{a['cut']} cut by max_tokens; xgrammar {res['xgrammar']}")  # fmt: skip
    if res["phases"]:
        kinds = list(res["phases"])
        lines += ["", "host phases, median ms per call (calls):", "| phase | " +
                  " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]  # fmt: skip
        for label in dict.fromkeys(k for ph in res["phases"].values() for k in ph):
            cells = [res["phases"][k].get(label) for k in kinds]
            lines.append(
                f"| {label} | "
                + " | ".join(
                    "-" if c is None else f"{c['median_ms']:.3f} ({c['calls']})" for c in cells
                )
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.phases and args.engine != "ours":
        p.error("--phases times our engine's host phases: --engine ours")
    res = run(args)
    print(format_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
