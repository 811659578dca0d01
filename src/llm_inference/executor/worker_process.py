"""A tensor-parallel worker process (started by executor/multiproc.py with `spawn`).

It takes its device (rank r on CUDA device r, or CPU threads), joins the process group (NCCL on
CUDA, with the custom all-reduce of distributed/custom_all_reduce.py unless
`disable_custom_all_reduce`; gloo on CPU), builds its `Worker` (model shard, rank-local paged KV
cache) and replies `(0, True, pid)`, or its traceback.

Then it runs the parent's calls `(seq, method, args)` one at a time in the order sent and
replies `(seq, ok, result or traceback text, out_of_step)` in that order, every message pickled
once. A reader thread drains the call pipe at once (a send from the parent never waits on a busy
worker) and a reply thread sends the replies: for a step, rank 0's reply thread waits for the
tokens to reach the host (`PendingOutput`) while the main thread already launches the next step.
A step is one `execute_model` call, or two (`STEP_METHODS`): its forward
(`execute_model(sample=False)`), then `sample_tokens` with the grammar bitmask the parent filled
meanwhile (structured outputs under async scheduling). After a step raised here, later steps
are answered with an error instead of being run (ranks that disagree on which step they run
would pair up the wrong collectives); `out_of_step` tells the parent so.

The worker ignores SIGINT (the parent handles Ctrl-C and stops it), exits on EOF of its call
pipe or after a `shutdown` call, and a watchdog thread exits it when the parent process is gone.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from llm_inference.config import EngineConfig
from llm_inference.distributed.parallel_state import destroy_distributed, init_distributed
from llm_inference.executor.pending import PendingOutput
from llm_inference.executor.worker import Worker, worker_device
from llm_inference.gc_heap import freeze_startup_heap, thaw_heap

JOIN_TIMEOUT_S = 5.0  # how long the last replies get to go out at exit
# A step's calls: every rank runs them in the same order, collectives inside.
STEP_METHODS = ("execute_model", "sample_tokens")


def watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)  # the engine's process is gone: nothing will stop us otherwise


def _send(conn: Connection, seq: int, ok: bool, payload: Any, out_of_step: bool = False) -> bool:
    try:
        data = pickle.dumps((seq, ok, payload, out_of_step), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # a result that does not pickle: report it instead of never replying
        data = pickle.dumps((seq, False, traceback.format_exc(), out_of_step))
    try:
        conn.send_bytes(data)
        return True
    except (OSError, EOFError):  # the parent is gone
        return False


def _read_calls(conn: Connection, calls: queue.SimpleQueue) -> None:
    """Reader thread: every call from the parent into `calls`; None once the pipe ends."""
    try:
        while True:
            calls.put(pickle.loads(conn.recv_bytes()))
    except BaseException:  # EOF: the parent closed the pipe or died
        pass
    finally:
        calls.put(None)


def _send_replies(conn: Connection, replies: queue.SimpleQueue, calls: queue.SimpleQueue) -> None:
    """Reply thread: sends the replies in order; a PendingOutput is waited for here."""
    try:
        while (reply := replies.get()) is not None:
            seq, ok, result, out_of_step = reply
            if isinstance(result, PendingOutput):
                try:
                    result = result.result()
                except Exception:  # reporting the tokens: the step itself ran on every rank
                    ok, result = False, traceback.format_exc()
            if not _send(conn, seq, ok, result, out_of_step):
                break
    finally:
        calls.put(None)  # the parent is gone (or this thread failed): stop the main loop


def join_group(config: EngineConfig, rank: int, world_size: int, port: int) -> torch.device:
    """Take rank `rank`'s device (or CPU threads) and join the process group; returns the
    device."""
    device = worker_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_distributed(
        rank, world_size, port, device,
        use_custom_all_reduce=not config.parallel.disable_custom_all_reduce,
        kernel_backend=config.kernel_backend,
    )  # fmt: skip
    return device


def worker_main(
    config: EngineConfig,
    rank: int,
    world_size: int,
    port: int,
    calls_conn: Connection,
    replies_conn: Connection,
    parent_pid: int,
) -> None:
    """The body of a worker process (started with `spawn`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        device = join_group(config, rank, world_size, port)
        worker = Worker(config, rank)
    except BaseException:
        _send(replies_conn, 0, False, traceback.format_exc())
        try:
            destroy_distributed()
        except Exception:
            pass
        return
    if not _send(replies_conn, 0, True, os.getpid()):
        return
    freeze_startup_heap()  # full GC collections would walk torch's objects mid-step
    calls: queue.SimpleQueue = queue.SimpleQueue()
    replies: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_calls, args=(calls_conn, calls), daemon=True).start()
    replier = threading.Thread(
        target=_send_replies, args=(replies_conn, replies, calls), daemon=True
    )
    replier.start()
    exit_code = 1  # unless the loop ends normally
    failed = False  # a step raised here: later steps could pair up the wrong collectives
    try:
        while (call := calls.get()) is not None:
            seq, method, args = call
            step = method in STEP_METHODS
            if step and failed:
                text = f"rank {rank} did not run this step: an earlier step raised on it"
                replies.put((seq, False, text, True))
                continue
            try:
                ok, result = True, getattr(worker, method)(*args)
            except Exception:
                ok, result = False, traceback.format_exc()
                failed = failed or step
            replies.put((seq, ok, result, step and not ok))
            if method == "shutdown":
                break
        exit_code = 0
    finally:
        replies.put(None)
        replier.join(JOIN_TIMEOUT_S)  # the last replies (the shutdown's) go out first
        if not replier.is_alive():  # else the process exit closes it under the blocked send
            replies_conn.close()  # (the call pipe stays with the reader thread until then)
        if device.type == "cuda":
            # destroy_process_group can hang after NCCL work was captured in CUDA graphs
            # (pytorch#115388): leave the communicators to the process exit.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)
        destroy_distributed()
        thaw_heap()
