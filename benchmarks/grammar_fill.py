"""The host's bitmask fill of a structured-outputs step: ms per step for N constrained rows, a
Python loop of `GrammarMatcher.fill_next_token_bitmask` against xgrammar's
`BatchGrammarMatcher` (one call for all rows) at 1, 2, 4 and 8 threads of xgrammar's own
(structured_output/manager.py's FILL_THREADS), and the rows cut in 2 and 4 parts filled at once
from Python threads (one part on the calling thread); and the step's accepts, one new token per
matcher: a loop of `accept_token` against one `batch_accept_token` (the manager's), on the same
tokens (accepted, rolled back, accepted again).

The JSON schema and the 128,256-id byte-level tokenizer of benchmarks/structured_outputs.py;
N matchers walk seeded random answers (each step every matcher accepts one token its mask
allows, until it may end), so the rows sit at different places of the grammar as a batch's do.
Every variant fills the same states; the table gives each one's median over the steps, and
checks that all variants wrote the same bits. CPU only: run it on the machine whose host
fills the masks.

    PYTHONPATH=src python3 benchmarks/grammar_fill.py [--rows 64,256] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from structured_outputs import SCHEMA, json_checkpoint

VOCAB, BOS, EOS = 128256, 128000, 128001
THREADS = (1, 2, 4, 8)
SPLITS = (2, 4)  # the rows cut in this many parts, filled at once from Python threads


def compiled_schema():
    """SCHEMA compiled compact (as structured_outputs.py asks) for the byte-level tokenizer."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    folder = Path(tempfile.gettempdir()) / "llm_inference_grammar_fill"
    folder.mkdir(exist_ok=True)
    config = {"bos_token_id": BOS, "eos_token_id": EOS, "vocab_size": VOCAB}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(json_checkpoint(folder))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


def measure(grammar, rows: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Median ms per step of each variant over `steps` steps of `rows` matchers."""
    import xgrammar as xgr

    matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
    batch = {t: xgr.BatchGrammarMatcher(max_threads=t) for t in THREADS}
    pools = {k: ThreadPoolExecutor(k - 1) for k in SPLITS}
    fillers = {k: [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(k)] for k in SPLITS}
    words = -(-VOCAB // 32)
    times: dict[str, list[float]] = {"loop": [], **{f"batch_{t}": [] for t in THREADS},
                                     **{f"split_{k}": [] for k in SPLITS},
                                     "accept_loop": [], "accept_batch": []}  # fmt: skip
    rng = random.Random(seed)
    for _ in range(steps):
        masks = {}
        for name in times:
            if name.startswith("accept"):
                continue
            bitmask = np.empty((rows, words), dtype=np.int32)
            t0 = time.perf_counter()
            if name == "loop":
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, i)
            elif name.startswith("batch"):
                batch[int(name.split("_")[1])].batch_fill_next_token_bitmask(matchers, bitmask)
            else:
                k = int(name.split("_")[1])
                split_fill(pools[k], fillers[k], matchers, bitmask)
            times[name].append(time.perf_counter() - t0)
            masks[name] = bitmask
        for name, bitmask in masks.items():
            if not np.array_equal(bitmask, masks["loop"]):
                raise AssertionError(f"{name} filled other bits than the loop")
        accepting, tokens = [], []
        for i, m in enumerate(matchers):  # one allowed token each, EOS only once it must end
            bits = np.unpackbits(masks["loop"][i].view(np.uint8), bitorder="little")[:VOCAB]
            allowed = bits.nonzero()[0]
            if len(allowed) == 1 and allowed[0] == EOS or m.is_terminated():
                m.reset()  # a finished answer makes room for a new one
                continue
            choice = [int(t) for t in allowed if t != EOS] or [EOS]
            accepting.append(m)
            tokens.append(rng.choice(choice))
        # the same tokens accepted one call each, rolled back, then in one batch call
        t0 = time.perf_counter()
        accepted = [m.accept_token(t) for m, t in zip(accepting, tokens)]
        times["accept_loop"].append(time.perf_counter() - t0)
        for m in accepting:
            m.rollback(1)
        t0 = time.perf_counter()
        accepted += xgr.BatchGrammarMatcher.batch_accept_token(accepting, tokens)
        times["accept_batch"].append(time.perf_counter() - t0)
        if not all(accepted):
            raise AssertionError("a matcher rejected a token of its own mask")
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def split_fill(pool: ThreadPoolExecutor, fillers: list, matchers: list, bitmask) -> None:
    """The rows in len(fillers) parts, one filled here and the others on `pool`'s threads at
    the same time (xgrammar releases the GIL while it fills)."""
    k, n = len(fillers), len(matchers)
    bounds = [n * i // k for i in range(k + 1)]
    parts = [(f, matchers[lo:hi], list(range(lo, hi)))
             for f, lo, hi in zip(fillers, bounds, bounds[1:])]  # fmt: skip
    futures = [pool.submit(f.batch_fill_next_token_bitmask, m, bitmask, r) for f, m, r in parts[1:]]
    f, m, r = parts[0]
    f.batch_fill_next_token_bitmask(m, bitmask, r)
    for future in futures:
        future.result()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64,256", help="constrained rows per step")
    p.add_argument("--steps", type=int, default=60, help="steps measured per row count")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args()
    grammar = compiled_schema()
    res = {"cpus": os.cpu_count(), "rows": {}}
    print(f"ms per step to fill the bitmask ({os.cpu_count()} CPUs), medians of {args.steps}")
    print("| rows | loop | " + " | ".join(f"batch, {t} thr" for t in THREADS) + " | "
          + " | ".join(f"{k} parts on threads" for k in SPLITS)
          + " | accept: loop | accept: batch |")  # fmt: skip
    print("|---:|---:|" + "---:|" * (len(THREADS) + len(SPLITS) + 2))
    for rows in map(int, args.rows.split(",")):
        ms = res["rows"][rows] = measure(grammar, rows, args.steps)
        print(f"| {rows} | " + " | ".join(f"{v:.3f}" for v in ms.values()) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
