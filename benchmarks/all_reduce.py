"""All-reduce latency on one host: NCCL against the custom (symmetric-memory) all-reduce.

One process per GPU (`--tp`, default 2), bfloat16 messages from 4 KB to 32 MB: [tokens, 3072]
(the hidden size of Llama-3.2-3B) for tokens in 1, 8, 64, 256, 1024, 4096, and a few raw
sizes. For each, the median microseconds per all-reduce of NCCL, one-shot and two-shot (a
CustomAllReduce whose buffer holds the largest message, so that every method is measured at
every size; set up and checked against NCCL as the engine's is):

- graph: a CUDA graph of 50 back-to-back all-reduces of the same tensor, replayed, divided by
  50 (how decode steps run);
- eager: 50 plain calls between CUDA events, divided by 50 (host launch cost included).

Each timed run starts right after a 4-byte NCCL all-reduce on the same stream, so the ranks
start it together on the GPUs; the reported time is the slowest rank's median. "engine" is
the path `parallel_state.all_reduce` takes at that size with the default limits (MAX_BYTES,
ONE_SHOT_MAX_BYTES of custom_all_reduce.py) and "speed-up" its graph time against NCCL's. "max
|diff|" is the largest difference of one-shot and two-shot from NCCL on random data. NVLink
multicast is off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 unless set), as on the target machines.

`--norm` measures instead the all-reduce together with the residual add and RMSNorm after it
(a decoder's o_proj or down_proj output), [tokens, 3072] bfloat16 for tokens in NORM_TOKENS:
the engine's unfused path (its all-reduce, then the RMSNorm kernel) against the fused kernel
(custom_all_reduce's `all_reduce_add_rms_norm`, consecutive calls alternating halves), graph
and eager as above, per pair.

    PYTHONPATH=src python3 benchmarks/all_reduce.py [--tp 2] [--norm] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback

ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
HIDDEN = 3072
TOKENS = [1, 8, 64, 256, 1024, 4096]
RAW_BYTES = [4 << 10, 256 << 10, 3 << 20, 8 << 20, 32 << 20]
CALLS = 50  # all-reduces per timed run
RUNS = 10  # timed runs per (size, method, mode)
METHODS = ["nccl", "one_shot", "two_shot"]
TIMEOUT_S = 240  # the whole run takes well under 90 s; a rank stuck in a collective is killed
NORM_TOKENS = (1, 8, 64, 256, 512)


def messages() -> list[tuple[str, int]]:
    """(label, bfloat16 elements), smallest first."""
    rows = [(f"[{t}, {HIDDEN}]", t * HIDDEN) for t in TOKENS]
    rows += [(_size(b), b // 2) for b in RAW_BYTES]
    return sorted(rows, key=lambda r: r[1])


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _time(run, sync) -> float:
    """Median over RUNS of run()'s GPU time in microseconds per all-reduce; each run starts
    right after `sync()` (a tiny all-reduce: the ranks start together)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(RUNS):
        sync()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def measure(fn, x, sync) -> dict[str, float]:
    """fn(x) back to back: {"graph": us, "eager": us}."""
    import torch

    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()

    def eager():
        for _ in range(CALLS):
            fn(x)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    graph.replay()
    torch.cuda.synchronize()
    return {"graph": _time(graph.replay, sync), "eager": _time(eager, sync)}


def _slowest_rank(rows: list[dict], methods, world: int, rank: int) -> bool:
    """Gather every rank's rows (a collective call); on rank 0 set each time to the slowest
    rank's median and return True, elsewhere return False."""
    import torch.distributed as dist

    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank != 0:
        return False
    for i, row in enumerate(rows):
        for m in methods:
            for mode in ("graph", "eager"):
                row[m][mode] = max(r[i][m][mode] for r in gathered)
    return True


def rank_main(rank: int, world: int, port: int, json_path: str | None, norm: bool) -> None:
    try:
        (_norm_main if norm else _rank_main)(rank, world, port, json_path)
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no destroy_process_group: it can hang after captured NCCL work


def _rank_main(rank: int, world: int, port: int, json_path: str | None) -> None:
    import torch
    import torch.distributed as dist

    from llm_inference.distributed import custom_all_reduce as car
    from llm_inference.distributed.parallel_state import init_distributed

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_distributed(rank, world, port, device, use_custom_all_reduce=False)
    rows = messages()
    largest = max(n for _, n in rows) * 2
    impl = functools.partial(car.CustomAllReduce, max_bytes=largest, one_shot_max_bytes=largest)
    comm = car.create(device, impl)  # the engine's set-up check, at every size here
    methods = METHODS if comm is not None else ["nccl"]
    ping = torch.zeros(1, device=device)
    sync = functools.partial(dist.all_reduce, ping)
    fns = {
        "nccl": dist.all_reduce,
        "one_shot": functools.partial(comm.all_reduce, algo=car.ONE_SHOT) if comm else None,
        "two_shot": functools.partial(comm.all_reduce, algo=car.TWO_SHOT) if comm else None,
    }
    limits = car.MAX_BYTES.get(world, 0), car.ONE_SHOT_MAX_BYTES.get(world, 0)
    results = []
    g = torch.Generator(device=device).manual_seed(rank)
    for label, n in rows:
        x = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
        engine = car.algorithm(x, *limits) if comm is not None else car.NCCL
        row = {"message": label, "bytes": 2 * n, "engine": engine}
        ref = x.clone()
        dist.all_reduce(ref)
        diff = 0.0
        for m in methods[1:]:
            y = x.clone()
            fns[m](y)
            diff = max(diff, (y.float() - ref.float()).abs().max().item())
        row["max_abs_diff"] = diff if len(methods) > 1 else None
        for m in methods:
            row[m] = measure(fns[m], x.clone(), sync)
        results.append(row)
    if not _slowest_rank(results, methods, world, rank):
        return
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "world_size": world,
        "torch": torch.__version__,
        "env": {k: os.environ.get(k) for k in ENV},
        "custom_all_reduce": comm is not None,
        "limits": {"max_bytes": limits[0], "one_shot_max_bytes": limits[1]},
        "calls_per_run": CALLS,
        "runs": RUNS,
        "rows": results,
    }
    print(table(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)


def _unfused_norm(x, residual, weight):
    from llm_inference.distributed import parallel_state as ps
    from llm_inference.kernels.rms_norm import rms_norm

    return rms_norm(ps.all_reduce(x), weight, 1e-5, residual)


def _fused_norm(comm, x, residual, weight, calls):
    return comm.all_reduce_add_rms_norm(x, residual, weight, 1e-5, next(calls))


def _norm_main(rank: int, world: int, port: int, json_path: str | None) -> None:
    """--norm: all-reduce + residual add + RMSNorm, unfused (the engine's path) and fused."""
    import torch
    import torch.distributed as dist

    from llm_inference.distributed import parallel_state as ps

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    os.environ["LLM_INFERENCE_FUSED_ALL_REDUCE_NORM"] = "1"
    ps.init_distributed(rank, world, port, device, kernel_backend="triton")
    comm = ps.get_custom_all_reduce()
    if comm is None or not comm.fused_norm:
        raise RuntimeError("the fused all-reduce + RMSNorm did not pass its set-up check")
    sync = functools.partial(dist.all_reduce, torch.zeros(1, device=device))
    g = torch.Generator(device=device).manual_seed(0)  # the same weight and residual
    weight = torch.randn(HIDDEN, generator=g, device=device).to(torch.bfloat16)
    rows = []
    for tokens in NORM_TOKENS:
        residual = torch.randn(tokens, HIDDEN, generator=g, device=device).to(torch.bfloat16)
        x = torch.randn(tokens, HIDDEN, device=device).to(torch.bfloat16)
        calls = itertools.count()
        unfused = functools.partial(_unfused_norm, residual=residual, weight=weight)
        fused = functools.partial(_fused_norm, comm, residual=residual, weight=weight, calls=calls)
        row = {"tokens": tokens, "engine all-reduce": comm.algorithm(x)}
        for name, fn in (("unfused", unfused), ("fused", fused)):
            row[name] = measure(fn, x.clone(), sync)
        rows.append(row)
    if not _slowest_rank(rows, ("unfused", "fused"), world, rank):
        return
    print(f"{torch.cuda.get_device_name(device)} x {world}, torch {torch.__version__}, bfloat16 "
          f"[tokens, {HIDDEN}], median us per all-reduce + residual add + RMSNorm\n")  # fmt: skip
    print("| tokens | engine all-reduce | unfused graph | fused graph | speed-up | unfused eager "
          "| fused eager |\n|---:|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        u, f = r["unfused"], r["fused"]
        speedup = u["graph"] / f["graph"]
        cells = [u["graph"], f["graph"], speedup, u["eager"], f["eager"]]
        print(f"| {r['tokens']} | {r['engine all-reduce']} | "
              + " | ".join(f"{c:.2f}" for c in cells) + " |")  # fmt: skip
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(device), "world_size": world,
                       "torch": torch.__version__, "rows": rows}, fh, indent=1)  # fmt: skip


def table(report: dict) -> str:
    def us(row, m, mode):
        return f"{row[m][mode]:.1f}" if m in row else "-"

    lines = [
        f"{report['device']} x {report['world_size']}, torch {report['torch']}, bfloat16, "
        f"median us per all-reduce (graph: {report['calls_per_run']} per replay; eager: plain "
        f"calls); custom all-reduce {'on' if report['custom_all_reduce'] else 'OFF'}",
        "",
        "| message | bytes | engine | speed-up | NCCL graph | one-shot graph | two-shot graph "
        "| NCCL eager | one-shot eager | two-shot eager | max abs diff |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        speedup = row["nccl"]["graph"] / row[row["engine"]]["graph"]
        diff = "-" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.3g}"
        cells = [us(row, m, mode) for mode in ("graph", "eager") for m in METHODS]
        lines.append(
            f"| {row['message']} | {row['bytes']:,} | {row['engine']} | {speedup:.2f}x | "
            + " | ".join(cells)
            + f" | {diff} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="GPUs (one process each)")
    p.add_argument("--norm", action="store_true", help="all-reduce + RMSNorm, unfused and fused")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args()
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import torch

    from llm_inference.distributed.parallel_state import free_port

    if torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} CUDA GPUs, {torch.cuda.device_count()} here", file=sys.stderr)
        return 1
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, args.tp, port, args.json, args.norm))
        for r in range(args.tp)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            print(f"{proc.name} still running after {TIMEOUT_S} s: killed", file=sys.stderr)
            proc.kill()
            proc.join()
    return max(abs(proc.exitcode or 0) for proc in procs)


if __name__ == "__main__":
    sys.exit(main())
