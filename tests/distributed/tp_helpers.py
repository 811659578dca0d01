"""Helpers of the tensor-parallel tests: rank processes (the process table is in helpers.py)."""

from __future__ import annotations

import multiprocessing
import pickle
import time


def run_ranks(target, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run `target(rank, world_size, port, *args)` in `world_size` spawned processes joined by
    gloo; return what each returned (sent back over a pipe), in rank order."""
    return spawn_ranks(_rank_main, world_size, (target, args), timeout)


def spawn_ranks(main, world_size: int, main_args: tuple, timeout: float) -> list:
    """Start `main(rank, world_size, port, conn, *main_args)` in `world_size` spawned processes
    (`port` free for their rendezvous); each sends `(ok, result or traceback)` pickled over
    `conn`. Returns the results in rank order; raises AssertionError for a rank that raised,
    died or timed out."""
    from llm_inference.distributed.parallel_state import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=main, args=(rank, world_size, port, child, *main_args))
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results = []
    try:
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(conns):
            while not conn.poll(0.2):
                if time.monotonic() > deadline or not procs[rank].is_alive():
                    raise AssertionError(f"rank {rank} died or timed out")
            ok, value = pickle.loads(conn.recv_bytes())  # plain pickle: no shared memory
            if not ok:
                raise AssertionError(f"rank {rank} raised:\n{value}")
            results.append(value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def _rank_main(rank, world_size, port, conn, target, args):
    import traceback

    from llm_inference.distributed.parallel_state import destroy_distributed, init_distributed

    try:
        init_distributed(rank, world_size, port, "cpu")
        conn.send_bytes(pickle.dumps((True, target(rank, world_size, *args))))
    except BaseException:
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    finally:
        destroy_distributed()
