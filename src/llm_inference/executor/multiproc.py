"""Tensor parallelism on one host: one worker process per rank (executor/worker_process.py).

The engine's process keeps the scheduler; `MultiprocWorkers` starts N processes with the
`spawn` method, each joined to the parent by two one-way `multiprocessing` pipes (calls in,
replies out), rendezvous on 127.0.0.1 at a port the parent picked free.

Protocol (every message pickled once, sent as bytes): the parent sends `(seq, method, args)`
to every rank, in rank order, and each rank replies `(seq, ok, result or traceback text,
out_of_step)`. The args are plain dataclasses (a SchedulerOutput per step); no tensor is
pickled per step. Only bytes from these private pipes, written by our own workers, are ever
unpickled. Every rank replies to every call, so the parent sees an error on any rank;
`execute_model` takes rank 0's ModelRunnerOutput (the others return None), or, for a step sent
in two calls (its forward, then `sample_tokens`: worker_process.py), `sample_tokens` does.

Calls are pipelined: `submit()` sends a call and returns a `PendingCall` at once; its
`result()` reads the replies later (`collective_rpc` is submit + result). Each rank replies in
the order sent, so the parent may send step n+1 before it reads step n's replies (async
scheduling), and any later call simply reads the earlier replies on its way to its own; a reply
whose handle was dropped is read and discarded. Only rank 0 waits for the tokens before it
replies: every rank holds the sampled tokens on its device (sample/tensor_parallel.py).

Failure handling: the parent waits for replies in slices of a second and checks each process:
a worker that dies (its reply pipe reaches EOF, or it is no longer alive) makes the call raise
`WorkerError` at once, naming the rank and its exit code; a worker that raises sends its
traceback, which the parent raises as `WorkerError` (from the `result()` of that call) after
giving the other ranks a short grace to finish that call (if they do not, they are stuck in a
collective and the workers are unusable: later calls raise). A step that raises inside
`execute_model` or `sample_tokens` also makes them unusable: a later step may already be queued
on the ranks. An error while reporting a step's tokens (rank 0's reply thread: NaN logits)
comes after every collective of the step, so the workers stay usable. A call interrupted while
waiting (Ctrl-C) leaves the ranks consistent: its replies are read by the next call.
Interrupted while sending, the ranks may disagree, so the workers are marked unusable.

Shutdown (`shutdown()`, also run by a weakref finalizer when the executor is collected or at
interpreter exit): a `shutdown` call to the workers (skipped when unusable or when replies are
still owed), then the pipes are closed, each process joined with a timeout, then terminated,
then killed. No shared memory is used.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any

import torch

from llm_inference.config import EngineConfig, ModelConfig
from llm_inference.distributed.parallel_state import free_port
from llm_inference.executor.worker_process import worker_main

# At most this many CPU ranks per core: gloo ranks on the CPU are for testing and debugging.
CPU_RANKS_PER_CORE = 4
POLL_S = 0.5  # how often the parent checks on waiting workers
ERROR_GRACE_S = 2.0  # after a rank raises, how long the others get to finish the call
SHUTDOWN_TIMEOUT_S = 10.0
JOIN_TIMEOUT_S = 5.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker process raised or died."""


def check_usable(closed: bool, unusable: str | None) -> None:
    """The error for a call to tensor-parallel workers (of either executor) that are shut down
    (`closed`) or broken (`unusable`: why)."""
    if closed:
        raise RuntimeError("the tensor-parallel workers have been shut down")
    if unusable is not None:
        raise WorkerError(
            f"the tensor-parallel workers are unusable ({unusable}); close this engine and "
            "create a new one"
        )


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


def exit_text(proc) -> str:
    """How a child process ended (for an error message): its exit code or signal."""
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


def stop_processes(procs: list, conns: list[Connection], timeout: float = JOIN_TIMEOUT_S) -> None:
    """Close the pipes (idle children exit on EOF), join (`timeout` seconds in all), then
    terminate, then kill."""
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass
    deadline = time.monotonic() + timeout
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


class _Call:
    """A call sent to every rank: the ranks that still owe a reply, and what came back."""

    def __init__(self, seq: int, method: str, world_size: int) -> None:
        self.seq, self.method = seq, method
        self.owing = set(range(world_size))
        self.results: list[Any] = [None] * world_size
        self.error: tuple[int, str] | None = None  # the lowest rank that raised, its traceback
        self.out_of_step = False  # a rank raised inside a step: the ranks may disagree
        self.grace_end = 0.0  # after an error: when the other ranks must have replied


class PendingCall:
    """A call sent to every rank; `result()` waits for the replies (the results in rank
    order) or raises the call's WorkerError. It may be called again."""

    def __init__(self, workers: MultiprocWorkers, call: _Call) -> None:
        self._workers, self._call = workers, call

    def result(self, timeout: float | None = None) -> list[Any]:
        return self._workers._wait(self._call, timeout)


class MultiprocWorkers:
    """N worker processes, one per rank; `collective_rpc` calls a Worker method on all,
    `submit` sends such a call without waiting for it."""

    def __init__(self, config: EngineConfig) -> None:
        import multiprocessing

        check_parallel_config(config)
        self.world_size = n = config.parallel.tensor_parallel_size
        self._procs: list = []
        self._conns: list[Connection] = []  # every pipe end the parent holds (to close)
        self._to: list[Connection] = []  # per rank: calls
        self._from: list[Connection] = []  # per rank: replies
        self._seq = 0
        self._calls: dict[int, _Call] = {}  # calls still owed a reply, oldest first
        self._unusable: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, stop_processes, self._procs, self._conns)
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        try:
            for rank in range(n):
                calls_in, calls_out = ctx.Pipe(duplex=False)
                replies_in, replies_out = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main,
                    args=(config, rank, n, port, calls_in, replies_out, os.getpid()),
                    name=f"llm_inference-tp{rank}",
                    daemon=True,
                )
                proc.start()
                calls_in.close()
                replies_out.close()
                self._procs.append(proc)
                self._to.append(calls_out)
                self._from.append(replies_in)
                self._conns += [calls_out, replies_in]
            start = self._calls[0] = _Call(0, "start-up", n)
            self.pids = self._wait(start)
        except BaseException:
            self._unusable = "start-up failed"
            self.shutdown()
            raise

    # ---- calls ----------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call `method(*args)` on every rank's Worker; the results in rank order."""
        return self.submit(method, *args).result(timeout)

    def submit(self, method: str, *args: Any) -> PendingCall:
        """Send `method(*args)` to every rank and return at once; the ranks run it after the
        calls sent before (whose replies may still be unread)."""
        check_usable(self._closed, self._unusable)
        data = pickle.dumps((self._seq + 1, method, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._seq += 1
        call = self._calls[self._seq] = _Call(self._seq, method, self.world_size)
        try:
            for rank, conn in enumerate(self._to):
                try:
                    conn.send_bytes(data)
                except OSError:
                    self._died(rank)
        except BaseException:
            if self._unusable is None:
                self._unusable = f"{method} was interrupted while being sent to the ranks"
            raise
        return PendingCall(self, call)

    def _died(self, rank: int) -> None:
        proc = self._procs[rank]
        method = next((c.method for c in self._calls.values() if rank in c.owing), "a call")
        self._unusable = f"worker rank {rank} died"
        raise WorkerError(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) died during {method} "
            f"({exit_text(proc)}); the engine cannot continue"
        )

    def _read_reply(self, rank: int) -> None:
        """Read rank's next reply (to the oldest call it owes) into that call."""
        try:
            seq, ok, payload, out_of_step = pickle.loads(self._from[rank].recv_bytes())
        except (EOFError, OSError):
            self._died(rank)
        except BaseException:  # interrupted inside a message: the stream is lost
            self._unusable = "reading a reply from the ranks was interrupted"
            raise
        call = next((c for c in self._calls.values() if rank in c.owing), None)
        if call is None or call.seq != seq:  # cannot happen: a rank replies in order
            self._unusable = f"rank {rank} replied out of order"
            raise WorkerError(f"tensor-parallel worker rank {rank} replied out of order ({seq})")
        call.owing.discard(rank)
        if ok:
            call.results[rank] = payload
        else:
            if call.error is None:
                call.grace_end = time.monotonic() + ERROR_GRACE_S
            if call.error is None or rank < call.error[0]:
                call.error = (rank, payload)  # the lowest rank's, whatever the reply order
            call.out_of_step |= out_of_step
        if not call.owing:
            del self._calls[seq]
            if call.out_of_step:  # later steps may already be queued on the ranks
                self._unusable = f"rank {call.error[0]} raised inside {call.method}"
                raise self._raised(call)

    def _wait(self, call: _Call, timeout: float | None = None) -> list[Any]:
        """Read replies (the earlier calls' first: each rank replies in order) until every
        rank answered `call`, checking on the processes; its results or its WorkerError."""
        give_up = None if timeout is None else time.monotonic() + timeout
        while call.owing:
            check_usable(self._closed, self._unusable)
            waiting = {self._from[r]: r for r in call.owing}
            for conn in wait_connections(list(waiting), POLL_S):
                self._read_reply(waiting[conn])
            for rank in sorted(call.owing):
                if not self._procs[rank].is_alive():
                    self._died(rank)
            now = time.monotonic()
            for owed in list(self._calls.values()):
                if owed.error is not None and now > owed.grace_end:
                    self._unusable = f"rank {owed.error[0]} raised and the others did not finish"
                    raise self._raised(owed)
            if call.owing and give_up is not None and now > give_up:
                self._unusable = f"{call.method} timed out"
                raise WorkerError(
                    f"tensor-parallel workers {sorted(call.owing)} did not answer "
                    f"{call.method} within {timeout} s"
                )
        if call.error is not None:
            raise self._raised(call)
        return call.results

    @staticmethod
    def _raised(call: _Call) -> WorkerError:
        rank, text = call.error
        return WorkerError(f"tensor-parallel worker rank {rank} raised in {call.method}:\n{text}")

    # ---- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker process; safe to call more than once."""
        if self._closed:
            return
        try:
            # Workers also exit when their pipe closes: the call only releases their memory
            # first, so it is skipped when they are unusable or still owe a reply.
            if self._unusable is None and not self._calls and self._procs:
                try:
                    self.collective_rpc("shutdown", timeout=SHUTDOWN_TIMEOUT_S)
                except Exception:
                    pass  # the processes are stopped below whatever happened
        finally:
            self._closed = True
            self._finalizer()
