"""The engine core in a process of its own, for the server (ARCHITECTURE.md, "Serving": the
front end and the core's stepping would otherwise share one GIL).

- `CoreClient` (parent) has the methods of `EngineCore` that the front end calls
  (`add_requests`, `finish_requests`, `stats`, `shutdown`), plus `recv()` for the results of
  the core's steps. It is not thread-safe: one thread (AsyncLLM's) uses it.
- The child (`_core_main`, started with `spawn`) builds an `EngineCore` and reports
  `("ready", (config, stats))` (the core's config: max_model_len as fitted to the cache, which
  the parent's front end reads as `CoreClient.config`) or the error that stopped it. Then it
  loops: apply every pending command (waiting for one when nothing is left to run), run a step,
  hand its results to its sender thread.
- Messages are pickled over one duplex `multiprocessing` pipe; the parent only unpickles what
  its own child wrote. Commands and results keep their order: a request is added before any
  command that finishes it, and steps arrive in the order they ran.
- Once started, neither side writes to the pipe from the thread that reads it: each queues
  its messages for its sender thread (`_sender`), which ships everything waiting as one
  message. The core reads commands only between steps and the front end reads results only
  between its own work, so a reader that wrote could wait on a peer that waits on it: a front
  end sending a request of many prompts while the core steps would stop reading results
  (every stream paused, the core's sender blocked in turn). So each direction always has a
  reader that waits on nothing but the pipe.
- A step's result is `(records, scheduled, start, stats)`: the core's `EngineCoreOutput`s, the
  ids first scheduled in that step and when it started (for queue time), and the core's stats
  after it. Records of requests the front end has already dropped are ignored there. A core
  that runs out of work after a command (an abort) sends a result with no records, for the
  stats (its blocks are free).
- Several front ends (the server's `api_server_count`, each a process of its own): the core
  reads commands from one pipe per front end and sends each its own requests' records, with
  the ids first scheduled and the stats of every step to all of them (a front end whose
  requests all wait still hears the core step). The front ends' request ids must differ (the
  server's are random). The first pipe is `CoreClient`'s; `CoreClient.attach` joins another
  process to the core over one of `front_end_pipes`. The first pipe closing ends the core;
  another's drops that front end and aborts its requests.
- Failure: an error in the child is sent as `("error", traceback, exception)` before it exits
  (the exception when it pickles), and the parent raises that exception (so a bad checkpoint or
  a KV cache too small reads as it does in one process), the child's traceback chained as an
  `EngineCoreError`; a child that dies closes the pipe, and `recv()` raises `EngineCoreError`.
  The child exits when the pipe closes or the parent process is gone. Shutdown: a `stop`
  command, a join with a timeout, then terminate and kill; also run at interpreter exit and
  when the client is collected.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any

from llm_inference import pause_log
from llm_inference.config import EngineConfig
from llm_inference.core.request import Request, RequestStatus
from llm_inference.gc_heap import freeze_startup_heap, thaw_heap

JOIN_TIMEOUT_S = 10.0
# With a pause log (pause_log.py), a step or a batch of commands this long is logged
# (core_step, core_commands): what a front end's core_silent waited for.
SLOW_MS = 50.0


class EngineCoreError(RuntimeError):
    """The engine core process failed or exited."""


# ---- the child ------------------------------------------------------------------------------


def _sender(conn: Connection, items: queue.SimpleQueue, kind: str) -> None:
    """A sender thread: everything waiting in `items` goes out as one message `(kind, [item,
    ...], sent_at)` (its `time.monotonic()`, for the pause log), until None. The threads that
    queue never wait on the pipe (module docstring)."""
    while (item := items.get()) is not None:
        batch = [item]
        while True:
            try:
                item = items.get_nowait()
            except queue.Empty:
                break
            if item is None:
                items.put(None)
                break
            batch.append(item)
        try:
            conn.send((kind, batch, time.monotonic()))
        except (OSError, EOFError):  # the other side is gone: its reader hears of it there
            return


def _portable(e: BaseException) -> Exception | None:
    """`e` if the parent can re-raise it (an Exception that pickles), else None."""
    if not isinstance(e, Exception):
        return None
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return None
    return e


def _core_main(config: EngineConfig, conns: list[Connection], parent_pid: int, setup) -> None:
    """The body of the core process: `conns`, one pipe per front end."""
    from llm_inference.engine.engine_core import EngineCore
    from llm_inference.executor.worker_process import watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        core = EngineCore(config)
        if setup is not None:
            setup(core)
    except BaseException as e:
        for conn in conns:
            conn.send(("error", traceback.format_exc(), _portable(e)))
        return
    freeze_startup_heap()
    results = [queue.SimpleQueue() for _ in conns]  # one sender thread per front end
    senders = [threading.Thread(target=_sender, args=(conn, items, "steps"), daemon=True)
               for conn, items in zip(conns, results)]  # fmt: skip
    owners: dict[str, int] = {}  # request id -> its front end (several front ends only)
    try:
        for conn in conns:
            conn.send(("ready", (core.config, core.stats())))
        for sender in senders:
            sender.start()
        unscheduled: set[str] = set()
        running, log = True, pause_log.get()
        active = list(conns)  # the pipes still open
        while running:
            block = not core.has_unfinished_requests()
            while running and (ready := wait_for(active, None if block else 0)):
                block = False
                start = time.monotonic()
                for conn in ready:
                    k = conns.index(conn)
                    commands = _commands(conn, k, active, results[k], owners)
                    if len(conns) > 1:
                        _note_owners(owners, commands, k)
                    running = _apply(core, commands, unscheduled) and running
                _log_slow(log, "core_commands", start)
            if running and not core.has_unfinished_requests():
                for conn, items in zip(conns, results):  # idle: the stats only
                    if conn in active:
                        items.put(([], [], time.monotonic(), core.stats()))
            elif running:
                start = time.monotonic()
                records = core.step()
                _log_slow(log, "core_step", start)
                scheduled = []
                if unscheduled:
                    waiting = core.waiting_request_ids()
                    scheduled = [i for i in unscheduled if i not in waiting]
                    unscheduled.difference_update(scheduled)
                stats = core.stats()
                if len(conns) == 1:
                    results[0].put((records, scheduled, start, stats))
                else:
                    split = _by_owner(owners, records, scheduled, len(conns))
                    for conn, items, (mine, first) in zip(conns, results, split):
                        if conn in active:
                            items.put((mine, first, start, stats))
    except EOFError:
        pass
    except BaseException as e:
        for items in results:
            items.put(None)
        for conn, sender in zip(conns, senders):
            if sender.is_alive():
                sender.join(JOIN_TIMEOUT_S)  # the steps before the error go out first
            if not sender.is_alive():  # else it is stuck mid-message: the closed pipe tells
                try:
                    conn.send(("error", traceback.format_exc(), _portable(e)))
                except (OSError, EOFError):
                    pass
    finally:
        for items in results:
            items.put(None)
        for sender in senders:
            if sender.is_alive():
                sender.join(JOIN_TIMEOUT_S)
        core.shutdown()
        for conn in conns:
            conn.close()
        thaw_heap()


def _commands(conn: Connection, k: int, active: list, results, owners: dict) -> list[tuple]:
    """Front end k's next message of commands. One that has gone (its pipe closed, or reset
    for our steps left unread in it) is dropped, its requests aborted; the first front end's
    going ends the core (EOFError)."""
    try:
        return conn.recv()[1]
    except (EOFError, OSError):
        if k == 0:
            raise EOFError from None
        active.remove(conn)
        results.put(None)  # its sender ends
        mine = [i for i, owner in owners.items() if owner == k]
        return [("finish", mine, RequestStatus.FINISHED_ABORTED)]


def _note_owners(owners: dict[str, int], commands: list[tuple], front_end: int) -> None:
    """Remember which front end added each request; forget the ones it finishes (an abort:
    the core reports no record for those)."""
    for cmd in commands:
        if cmd[0] == "add":
            owners.update((r.request_id, front_end) for r in cmd[1])
        elif cmd[0] == "finish":
            for request_id in cmd[1]:
                owners.pop(request_id, None)


def _by_owner(owners: dict[str, int], records: list, scheduled: list[str], n: int) -> list:
    """A step's records and first-scheduled ids, split per front end ([(records, ids), ...]);
    a finished request is forgotten, and one its front end aborted is skipped."""
    split = [([], []) for _ in range(n)]
    for request_id in scheduled:
        if request_id in owners:
            split[owners[request_id]][1].append(request_id)
    for record in records:
        k = owners.get(record.request_id)
        if k is not None:
            split[k][0].append(record)
            if record.finished:
                del owners[record.request_id]
    return split


def _log_slow(log, what: str, start: float) -> None:
    """Log `what` to the pause log if it took SLOW_MS or more since `start`."""
    ms = (time.monotonic() - start) * 1e3
    if log is not None and ms >= SLOW_MS:
        log.write(what, ms)


def _apply(core, commands: list[tuple], unscheduled: set[str]) -> bool:
    """Apply a message's commands to the core; False on stop."""
    for cmd in commands:
        if cmd[0] == "add":
            core.add_requests(cmd[1])
            unscheduled.update(r.request_id for r in cmd[1])
        elif cmd[0] == "finish":
            core.finish_requests(cmd[1], cmd[2])
        elif cmd[0] == "stop":
            return False
    return True


# ---- the parent -----------------------------------------------------------------------------


def _stop(proc, conn: Connection, commands: queue.SimpleQueue, sender: threading.Thread) -> None:
    """Ask the child to stop (after the commands before), then close the pipe, join,
    terminate, kill. A child that reads nothing for JOIN_TIMEOUT_S (stuck in a step) is killed
    first, which fails the sender's write: the pipe is not closed under it."""
    commands.put(("stop",))
    commands.put(None)
    sender.join(JOIN_TIMEOUT_S)
    if sender.is_alive():
        proc.kill()
        sender.join(JOIN_TIMEOUT_S)
    from llm_inference.executor.multiproc import stop_processes

    stop_processes([proc], [conn], JOIN_TIMEOUT_S)


def _detach(_proc, conn: Connection, commands: queue.SimpleQueue, sender) -> None:
    """An attached client's shutdown: its sender stops, its pipe closes (the core ends)."""
    commands.put(None)
    sender.join(JOIN_TIMEOUT_S)
    conn.close()


class CoreClient:
    """An `EngineCore` in a child process (see the module docstring). `setup`: a picklable
    function called in the child with the built core (tests and benchmarks use it);
    `front_ends`: how many front ends the core serves, this one and one per pipe of
    `front_end_pipes` (each for another process's `CoreClient.attach`)."""

    def __init__(self, config: EngineConfig, setup=None, front_ends: int = 1) -> None:
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe(duplex=True) for _ in range(front_ends)]
        # Not a daemon: with tensor parallelism the core starts the worker processes.
        self._proc = ctx.Process(
            target=_core_main,
            args=(config, [child for _, child in pipes], os.getpid(), setup),
            name="llm_inference-core",
            daemon=False,
        )
        self._proc.start()
        for _, child in pipes:
            child.close()
        self.front_end_pipes = [parent for parent, _ in pipes[1:]]
        self._connect(pipes[0][0], _stop)

    @classmethod
    def attach(cls, conn: Connection) -> CoreClient:
        """A client of a core that another process started (one of its `front_end_pipes`):
        the same calls, but it neither stops the core (its pipe closing ends it) nor sees
        the core's process (the pipe tells when it is gone)."""
        client = cls.__new__(cls)
        client._proc, client.front_end_pipes = None, []
        client._connect(conn, _detach)
        return client

    def _connect(self, conn: Connection, stop) -> None:
        """Start the sender thread on `conn` and wait for the core's ready message."""
        self._conn = conn
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # read by `_sender` only
        self._sender = threading.Thread(target=_sender, args=(self._conn, self._commands,
                                        "commands"), name="llm_inference-core-sender",
                                        daemon=True)  # fmt: skip
        self._sender.start()
        stop_args = (self._proc, self._conn, self._commands, self._sender)
        self._finalizer = mp_util.Finalize(self, stop, stop_args, exitpriority=50)
        self._gone = False  # an attached client's pipe has closed
        try:
            kind, payload = self._recv_message()
            if kind != "ready":
                raise EngineCoreError(f"the engine core failed to start:\n{payload}")
        except BaseException:
            self.shutdown()
            raise
        self.config, self._stats = payload
        self.sent_at = 0.0  # when the core sent the last results received (time.monotonic())

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _recv_message(self, timeout: float | None = None) -> tuple[str, Any] | None:
        """The next message, or None after `timeout` seconds. Raises EngineCoreError when the
        child has exited or sent an error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            if self._conn.poll(left):
                break
            if self._proc is not None and not self._proc.is_alive() and not self._conn.poll():
                raise EngineCoreError(f"the engine core process exited ({self._exit_text()})")
            if deadline is not None and time.monotonic() >= deadline:
                return None
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._gone = True
            raise EngineCoreError(f"the engine core process exited ({self._exit_text()})") from None
        if message[0] == "error":  # the child's own exception when it pickled, its traceback
            failure = EngineCoreError(f"the engine core failed:\n{message[1]}")  # the cause
            if message[2] is not None:
                raise message[2] from failure
            raise failure
        return message

    def _exit_text(self) -> str:
        from llm_inference.executor.multiproc import exit_text

        return "its pipe closed" if self._proc is None else exit_text(self._proc)

    # ---- what the front end calls -----------------------------------------------------------

    def add_requests(self, requests: list[Request]) -> None:
        """Queue the requests for the sender thread: returns at once, whatever the pipe holds.
        A core that has died is heard of in `recv()`."""
        self._commands.put(("add", requests))

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        self._commands.put(("finish", list(request_ids), status))

    def stats(self) -> dict[str, int]:
        """The core's stats after the last step received."""
        return dict(self._stats)

    def replica_stats(self) -> list[dict[str, int]]:
        """Each data-parallel replica's stats (DataParallelCore's); one core has none."""
        return []

    def fileno(self) -> int:
        """For `multiprocessing.connection.wait`: readable when results (or an error) came."""
        return self._conn.fileno()

    def readers(self) -> list:
        """What `multiprocessing.connection.wait` waits on for results (DataParallelCore's
        are its replicas)."""
        return [self]

    def recv(self, timeout: float | None = None) -> list[tuple]:
        """The results of the steps run since the last call (waiting up to `timeout` seconds
        for one; [] after it): a list of (records, scheduled ids, step start, stats)."""
        message = self._recv_message(timeout)
        if message is None:
            return []
        steps, self.sent_at = message[1], message[2]
        self._stats = steps[-1][3]
        return steps

    def is_alive(self) -> bool:
        """Whether the core process runs (any thread may ask; attached: its pipe is open)."""
        return not self._gone if self._proc is None else self._proc.is_alive()

    def kill(self) -> None:
        """End the core process now (SIGKILL): a front end stuck in `recv` gets an error. An
        attached client cannot: its process's exit closes its pipe, which ends the core."""
        if self._proc is not None:
            self._proc.kill()

    def shutdown(self) -> None:
        self._finalizer()
