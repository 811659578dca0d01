"""What `MaskStaging.build` spends a constrained step's host time on (issue 29): the grammar
mask of `--rows` constrained rows in a step of `--num-rows` sample rows, the bitmask filled in
place (as the engine core does where the worker is in its process) or packed, with the device
idle or busy (a `torch.cuda._sleep` kernel queued before each build, as a step's forward is).
Each part of `build` is timed with perf_counter around it, `--iters` times after a warm-up;
medians in microseconds.

    PYTHONPATH=src python3 benchmarks/mask_staging.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

from llm_inference.sample.grammar import GrammarMask, MaskStaging


def timed_build(staging: MaskStaging, bitmask, rows, num_rows, t: dict) -> GrammarMask:
    """MaskStaging.build, its parts timed into `t` (name -> list of seconds)."""

    def lap(name, start):
        now = time.perf_counter()
        t.setdefault(name, []).append(now - start)
        return now

    s0 = s = time.perf_counter()
    m, words = bitmask.shape
    start, size = staging._layout(m, words, num_rows)
    in_place = staging.host is not None and bitmask.ctypes.data == staging.host.data_ptr()
    s = lap("layout and in-place check", s)
    ready = in_place and staging.host.numel() >= size
    flat = staging.host.numpy() if ready else staging._ready(size)
    s = lap("_ready (event sync; packed only)", s)
    if not in_place:
        flat[: m * words] = bitmask.reshape(-1)
    s = lap("bitmask packed", s)
    index, sample_rows = flat[start : start + num_rows], flat[start + num_rows : size]
    sample_rows[:] = rows
    index.fill(-1)
    index[sample_rows] = np.arange(m, dtype=np.int32)
    s = lap("row index and rows", s)
    dev = staging.host[:size].to(staging.device, non_blocking=True, copy=True)
    s = lap("copy launch (.to)", s)
    staging.copied.record()
    s = lap("event record", s)
    mask = GrammarMask(
        bitmask=dev[: m * words].view(m, words),
        rows=dev[start + num_rows :],
        row_index=dev[start : start + num_rows],
    )
    s = lap("views", s)
    lap("build, all", s0)
    return mask


def run(rows: int, num_rows: int, words: int, iters: int, in_place: bool, busy: bool) -> dict:
    staging = MaskStaging(torch.device("cuda"))
    own = np.full((rows, words), -1, dtype=np.int32)
    sample_rows = sorted(random.Random(0).sample(range(num_rows), rows))
    t: dict[str, list[float]] = {}
    whole = []
    for i in range(iters + 20):
        if busy:
            torch.cuda._sleep(200_000)  # ~0.1 ms of device work ahead of the copy
        bitmask = staging.bitmask_buffer(rows, words, num_rows) if in_place else own
        bitmask[:] = -1
        s = time.perf_counter()
        timed_build(staging, bitmask, sample_rows, num_rows, t if i >= 20 else {})
        if i >= 20:
            whole.append(time.perf_counter() - s)
        torch.cuda.synchronize()
    out = {k: 1e6 * statistics.median(v) for k, v in t.items()}
    plain = MaskStaging(torch.device("cuda"))
    plain_t = []
    for i in range(iters + 20):
        if busy:
            torch.cuda._sleep(200_000)
        bitmask = plain.bitmask_buffer(rows, words, num_rows) if in_place else own
        s = time.perf_counter()
        plain.build(bitmask, sample_rows, num_rows)
        if i >= 20:
            plain_t.append(time.perf_counter() - s)
        torch.cuda.synchronize()
    out["MaskStaging.build itself"] = 1e6 * statistics.median(plain_t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--num-rows", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    words = -(-args.vocab // 32)
    results = {}
    for in_place in (True, False):
        for busy in (False, True):
            name = f"{'in place' if in_place else 'packed'}, device {'busy' if busy else 'idle'}"
            results[name] = run(args.rows, args.num_rows, words, args.iters, in_place, busy)
    parts = list(next(iter(results.values())))
    print(f"{args.rows} constrained rows of {words} words, {args.num_rows} sample rows; "
          f"median us of {args.iters} builds; {torch.cuda.get_device_name()}")  # fmt: skip
    print("| part | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for part in parts:
        print(f"| {part} | " + " | ".join(f"{r[part]:.1f}" for r in results.values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
