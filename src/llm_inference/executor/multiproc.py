"""Tensor parallelism on one host: one worker process per rank.

The engine's process keeps the scheduler; `MultiprocWorkers` starts N processes with the
`spawn` method (rank r on CUDA device r, or on the CPU), each joined to the parent by its own
`multiprocessing` pipe. A worker joins the process group (NCCL on CUDA, gloo on CPU; rendezvous
on 127.0.0.1 at a port the parent picked free), builds its `Worker` (model shard, rank-local
paged KV cache) and reports ready.

Protocol (every message pickled once, sent as bytes): the parent sends `(seq, method, args)`
to every rank, in rank order, and each rank replies `(seq, ok, result or traceback text)`. The
args are plain dataclasses (a SchedulerOutput per step); no tensor is pickled per step. Only
bytes from these private pipes, written by our own workers, are ever unpickled. Every rank
replies to every call, so the parent sees an error on any rank; `execute_model` takes rank 0's
ModelRunnerOutput (the others return None).

Failure handling: the parent waits for replies in slices of a second and checks each process:
a worker that dies (its pipe reaches EOF, or it is no longer alive) makes the call raise
`WorkerError` at once, naming the rank and its exit code; a worker that raises sends its
traceback, which the parent raises as `WorkerError` after giving the other ranks a short grace
to finish (if they do not, they are stuck in a collective and the workers are unusable: later
calls raise). A call interrupted while waiting (Ctrl-C) leaves the ranks consistent: the next
call first collects the outstanding replies. Interrupted while sending, the ranks may disagree,
so the workers are marked unusable.

Shutdown (`shutdown()`, also run by a weakref finalizer when the executor is collected or at
interpreter exit): a `shutdown` call to the workers (skipped when unusable), then the pipes are
closed, each process joined with a timeout, then terminated, then killed. Workers ignore SIGINT
(the parent handles Ctrl-C and stops them), exit on EOF of their pipe, and a watchdog thread in
each exits it when the parent process is gone. No shared memory is used.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any

import torch

from llm_inference.config import EngineConfig, ModelConfig
from llm_inference.distributed.parallel_state import (
    destroy_distributed,
    free_port,
    init_distributed,
)
from llm_inference.executor.worker import Worker, worker_device

# At most this many CPU ranks per core: gloo ranks on the CPU are for testing and debugging.
CPU_RANKS_PER_CORE = 4
POLL_S = 0.5  # how often the parent checks on waiting workers
ERROR_GRACE_S = 2.0  # after a rank raises, how long the others get to finish the call
SHUTDOWN_TIMEOUT_S = 10.0
JOIN_TIMEOUT_S = 5.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker process raised or died."""


def check_parallel_config(config: EngineConfig) -> None:
    """Raise ValueError when tensor_parallel_size does not fit the model or the machine."""
    n = config.parallel.tensor_parallel_size
    device = torch.device(config.device)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        first = device.index or 0
        if first + n > count:
            raise ValueError(
                f"tensor_parallel_size={n} needs {n} CUDA devices starting at cuda:{first}, "
                f"but only {count} are visible (CUDA_VISIBLE_DEVICES selects them)"
            )
    else:
        cap = CPU_RANKS_PER_CORE * (os.cpu_count() or 1)
        if n > cap:
            raise ValueError(
                f"tensor_parallel_size={n} on the CPU: at most {cap} ranks here "
                f"({CPU_RANKS_PER_CORE} per core, {os.cpu_count()} cores)"
            )
    check_heads_divide(config.model, n)


def check_heads_divide(model: ModelConfig, n: int) -> None:
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    problems = []
    if heads % n:
        problems.append(f"num_attention_heads ({heads}) is not divisible by it")
    if kv_heads % n and n % kv_heads:
        problems.append(
            f"num_key_value_heads ({kv_heads}) and it do not divide one another (KV heads are "
            "split when it divides them, replicated when they divide it)"
        )
    if model.intermediate_size % n:
        problems.append(f"intermediate_size ({model.intermediate_size}) is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={n} does not fit the model: " + "; ".join(problems))


# ---- the worker process ---------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)  # the engine's process is gone: nothing will stop us otherwise


def _send(conn: Connection, seq: int, ok: bool, payload: Any) -> bool:
    try:
        conn.send_bytes(pickle.dumps((seq, ok, payload), protocol=pickle.HIGHEST_PROTOCOL))
        return True
    except (OSError, EOFError):  # the parent is gone
        return False


def worker_main(
    config: EngineConfig, rank: int, world_size: int, port: int, conn: Connection, parent_pid: int
) -> None:
    """The body of a worker process (started with `spawn`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        device = worker_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        init_distributed(rank, world_size, port, device)
        worker = Worker(config, rank)
    except BaseException:
        _send(conn, 0, False, traceback.format_exc())
        try:
            destroy_distributed()
        except Exception:
            pass
        return
    if not _send(conn, 0, True, os.getpid()):
        return
    exit_code = 1  # unless the loop ends normally
    try:
        while True:
            try:
                if not conn.poll(1.0):
                    continue
                seq, method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the parent closed the pipe or died
            try:
                ok, result = True, getattr(worker, method)(*args)
            except Exception:
                ok, result = False, traceback.format_exc()
            if not _send(conn, seq, ok, result) or method == "shutdown":
                break
        exit_code = 0
    finally:
        conn.close()
        if device.type == "cuda":
            # destroy_process_group can hang after NCCL work was captured in CUDA graphs
            # (pytorch#115388): leave the communicators to the process exit.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code)
        destroy_distributed()


# ---- the parent -----------------------------------------------------------------------------


def _exit_text(proc) -> str:
    proc.join(0.5)
    code = proc.exitcode
    if code is None:
        return "its pipe closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop_workers(procs: list, conns: list[Connection]) -> None:
    """Close the pipes (idle workers exit on EOF), join, then terminate, then kill."""
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    conns.clear()
    procs.clear()


class MultiprocWorkers:
    """N worker processes, one per rank; `collective_rpc` calls a Worker method on all."""

    def __init__(self, config: EngineConfig) -> None:
        import multiprocessing

        check_parallel_config(config)
        self.world_size = n = config.parallel.tensor_parallel_size
        self._procs: list = []
        self._conns: list[Connection] = []
        self._seq = 0
        self._outstanding: set[int] = set()  # ranks still owing a reply to call `_seq`
        self._outstanding_method = ""
        self._unusable: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        try:
            for rank in range(n):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=worker_main,
                    args=(config, rank, n, port, child_conn, os.getpid()),
                    name=f"llm_inference-tp{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
            self._outstanding = set(range(n))
            self._outstanding_method = "start-up"
            self.pids = self._collect(0, "start-up")
        except BaseException:
            self._unusable = "start-up failed"
            self.shutdown()
            raise

    # ---- calls ----------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call `method(*args)` on every rank's Worker; the results in rank order."""
        if self._closed:
            raise RuntimeError("the tensor-parallel workers have been shut down")
        if self._unusable is not None:
            raise WorkerError(
                f"the tensor-parallel workers are unusable ({self._unusable}); close this "
                "engine and create a new one"
            )
        if self._outstanding:  # an earlier call was interrupted while waiting
            self._collect(self._seq, self._outstanding_method)
        self._seq += 1
        data = pickle.dumps((self._seq, method, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._outstanding = set(range(self.world_size))
        self._outstanding_method = method
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(data)
                except OSError:
                    self._died(rank, method)
        except BaseException:
            if self._unusable is None:
                self._unusable = f"{method} was interrupted while being sent to the ranks"
            raise
        return self._collect(self._seq, method, timeout)

    def _died(self, rank: int, method: str) -> None:
        proc = self._procs[rank]
        self._unusable = f"worker rank {rank} died"
        raise WorkerError(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) died during {method} "
            f"({_exit_text(proc)}); the engine cannot continue"
        )

    def _collect(self, seq: int, method: str, timeout: float | None = None) -> list[Any]:
        """Wait for every outstanding rank's reply to call `seq`, checking on the processes."""
        results: list[Any] = [None] * self.world_size
        error: tuple[int, str] | None = None
        give_up = None if timeout is None else time.monotonic() + timeout
        while self._outstanding:
            waiting = {self._conns[r]: r for r in self._outstanding}
            for conn in wait_connections(list(waiting), POLL_S):
                rank = waiting[conn]
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    self._died(rank, method)
                except BaseException:  # interrupted inside a message: the stream is lost
                    self._unusable = f"reading the reply to {method} was interrupted"
                    raise
                reply_seq, ok, payload = pickle.loads(data)
                if reply_seq != seq:
                    continue  # cannot happen: replies come in order, one per call
                self._outstanding.discard(rank)
                if ok:
                    results[rank] = payload
                elif error is None:
                    error = (rank, payload)
                    grace = time.monotonic() + ERROR_GRACE_S
                    give_up = grace if give_up is None else min(give_up, grace)
            for rank in sorted(self._outstanding):
                if not self._procs[rank].is_alive():
                    self._died(rank, method)
            if self._outstanding and give_up is not None and time.monotonic() > give_up:
                if error is None:
                    self._unusable = f"{method} timed out"
                    raise WorkerError(
                        f"tensor-parallel workers {sorted(self._outstanding)} did not answer "
                        f"{method} within {timeout} s"
                    )
                self._unusable = f"rank {error[0]} raised and the others did not finish"
                break
        if error is not None:
            rank, text = error
            raise WorkerError(f"tensor-parallel worker rank {rank} raised in {method}:\n{text}")
        return results

    # ---- shutdown -------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def shutdown(self) -> None:
        """Stop every worker process; safe to call more than once."""
        if self._closed:
            return
        try:
            # Workers also exit when their pipe closes: the call only releases their memory
            # first, so it is skipped when they are unusable or still owe a reply.
            if self._unusable is None and not self._outstanding and self._procs:
                try:
                    self.collective_rpc("shutdown", timeout=SHUTDOWN_TIMEOUT_S)
                except Exception:
                    pass  # the processes are stopped below whatever happened
        finally:
            self._closed = True
            self._finalizer()
