"""AsyncLLM: the engine's step loop on a background thread, driven from asyncio.

Invariants:

- The engine is not thread-safe, so only the engine thread calls it. Requests, aborts and
  stop cross over through `_inbox` (a thread-safe queue); outputs come back with one
  `loop.call_soon_threadsafe` per step and event loop, whose callback appends each request's
  output to its stream's pending list and wakes its consumer, so the event loop never blocks
  on a step.
- The engine makes DELTA outputs (only what each step added; no per-step copies of a request's
  tokens or text). A consumer that lags finds several pending and gets them merged into one
  (`outputs.merge_deltas`): fewer, larger outputs under load, nothing dropped. `generate`
  hands them out as deltas, or folds them into cumulative outputs, as the caller asks. So
  does the front end of a core process that finds several steps waiting: their records are
  joined per request (`core.outputs.merge_steps`) and processed once.
- Requests join the running batch at the next step: the thread takes every pending command
  between steps, and blocks on the inbox only when the engine has nothing to run.
- A request ends when its stream yields a finished output or an exception. A consumer that goes
  away early (GeneratorExit, CancelledError) aborts its request; the engine thread frees its
  KV blocks before its next step.
- Validation errors (prompt too long, bad params, duplicate id) go to that request only; an
  error of the step loop goes to every waiting request and ends the engine (EngineDeadError
  for later calls).
- With `engine_process=True` (the default) the engine core runs in a process of its own
  (core_process.py) and the thread is the front end: it waits on the core's pipe and on a
  wake-up socket for the inbox, and never on a send (`CoreClient` hands commands to its
  sender thread), so outputs keep flowing while a request of many prompts goes to the core. A
  core process that dies or fails ends the engine like an error of the step loop. With
  `engine_process=False` the thread runs the whole engine.
- `health()` says why the engine cannot serve: stopped, its core process gone, or requests
  running and no step back for STALL_TIMEOUT_S (the server's /health answers 503).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for

from llm_inference import pause_log
from llm_inference.config import EngineConfig
from llm_inference.core.outputs import merge_steps
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.engine.core_process import CoreClient
from llm_inference.engine.data_parallel import DataParallelCore
from llm_inference.engine.llm_engine import LLMEngine
from llm_inference.engine.metrics import RequestTimes, ServingMetrics
from llm_inference.engine.output_processor import child_id
from llm_inference.outputs import (
    RequestOutput,
    RequestOutputKind,
    accumulate,
    copy_output,
    merge_deltas,
)
from llm_inference.sampling_params import SamplingParams

# How long shutdown() waits for the engine thread before it kills the core process.
SHUTDOWN_TIMEOUT_S = 10.0
# Requests running and no step back for this long: health() reports the engine stuck. A step
# takes milliseconds to seconds (a full token budget of prompt on a CPU); a minute is a hang.
STALL_TIMEOUT_S = 60.0
# With a pause log (pause_log.py), a core silent this long while requests run is logged.
CORE_SILENT_S = 0.05


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (an error in a step, or shutdown)."""


@dataclass(eq=False)
class _Stream:
    """A request as the engine thread tracks it: where its outputs go, and its timing."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    n: int
    times: RequestTimes
    pending: list = field(default_factory=list)  # outputs and errors not yet taken (loop)
    waiter: asyncio.Future | None = None  # the consumer waiting for `pending` (loop)


_STOP = object()


class AsyncLLM:
    """An engine for concurrent requests from asyncio code (the OpenAI server, chat).

    Arguments: see `arg_utils.EngineArgs`; `engine_process`: run the engine core in a
    process of its own (the default; see the module docstring); `core_setup`: a picklable
    function called with the built `EngineCore` (where it runs), for tests and benchmarks;
    `front_ends`: how many front ends its core process serves, this one and one per pipe of
    `core_process.front_end_pipes`, each for another AsyncLLM made with `core_pipe=` that
    pipe (the server's `api_server_count`: one per process, core_process.py). The
    core process is started with `spawn` (it re-imports the caller's main module): a script
    creating an AsyncLLM needs the `if __name__ == "__main__":` guard. Use `generate` from a
    running event loop; `shutdown()` (or the context manager) stops the
    thread and the core process and releases the engine.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        engine_process: bool = True,
        core_setup=None,
        front_ends: int = 1,
        core_pipe=None,
        **engine_args,
    ) -> None:
        from llm_inference.models.loader import load_tokenizer

        config = EngineArgs(model=model, **engine_args).create_engine_config()
        self.tokenizer = load_tokenizer(config.model_path)
        dp = config.parallel.data_parallel_size
        if dp > 1 and not engine_process:
            raise ValueError("data_parallel_size > 1 runs engine cores in processes of their own: "
                             "engine_process=False is for one core")  # fmt: skip
        if front_ends < 1 or (front_ends > 1 and (dp > 1 or not engine_process)):
            raise ValueError(
                f"front_ends (the server's api_server_count) must be 1, or more for one engine "
                f"core in a process of its own; got {front_ends} with data_parallel_size {dp}, "
                f"engine_process {engine_process}"
            )
        self.core_process = None
        if core_pipe is not None:  # another front end of a core started elsewhere
            self.core_process = CoreClient.attach(core_pipe)
        elif dp > 1:
            self.core_process = DataParallelCore(config, core_setup)
        elif engine_process:
            self.core_process = CoreClient(config, core_setup, front_ends)
        try:
            self.engine = LLMEngine(config, self.tokenizer, core=self.core_process)
            if core_setup is not None and self.core_process is None:
                core_setup(self.engine.core)
        except BaseException:
            if self.core_process is not None:
                self.core_process.shutdown()
            raise
        self.metrics = ServingMetrics()
        self._refresh_stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}  # running requests; changed by the thread only
        self._progress_at = time.monotonic()  # the last step received, or an idle spell's end
        self._last_start = self._progress_at  # the start of the last step received (pause log)
        self._done_at = self._progress_at  # when the thread was done with the last steps received
        # of those, not yet scheduled, by the core id of their first completion
        self._unscheduled: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # orders "add" against the thread's final drain
        self._closed = False
        self._wake_r = self._wake_w = None  # engine_process: wakes the thread for the inbox
        if self.core_process is not None:
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def config(self) -> EngineConfig:
        """The engine core's config (max_model_len as fitted to the KV cache at start)."""
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> dict[str, int]:
        """The engine's stats() as of the end of the engine thread's last loop."""
        return dict(self.metrics.snapshot().engine)

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped, if it failed (its core process died, a step raised); None
        while it runs and after a clean shutdown."""
        return self._error

    @property
    def is_running(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def health(self) -> str | None:
        """Why the engine cannot serve now, or None: it has stopped, its core process has
        exited, or requests are running and no step has come back for STALL_TIMEOUT_S (a hung
        device or core: is_running says nothing of it, and they would wait forever)."""
        if self._error is not None:
            return f"the engine has stopped: {self._error}"
        if not self.is_running:
            return "the engine has been shut down"
        if self.core_process is not None and not self.core_process.is_alive():
            return "the engine core process has exited"
        running = len(self._streams)  # before the clock: _add restarts it, then adds
        silent = time.monotonic() - self._progress_at
        if running and silent > STALL_TIMEOUT_S:
            return (f"the engine is stuck: no step for {silent:.0f} s with {running} requests "
                    "running")  # fmt: skip
        return None

    # ---- asyncio side ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as it advances; the last has finished=True.

        `output_kind`: CUMULATIVE (the default) yields everything so far each time (each output
        its own copy); DELTA yields only what is new since the previous output: the new text,
        token ids and logprobs of the completions that advanced (`CompletionOutput.index`
        says which), with their finish reasons; concatenating a completion's deltas gives its
        cumulative output. FINAL_ONLY yields one cumulative output, when the request finishes.
        When several outputs are waiting (a consumer that lags), they are merged into one.
        Raises ValueError (TypeError for sampling_params of another type) for a request the
        engine refuses or ends (a grammar that failed to compile: the error names the spec),
        EngineDeadError if the engine stopped."""
        self._check_alive()
        params = SamplingParams(temperature=0.0) if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):  # as LLMEngine.validate_request says it
            raise TypeError(f"sampling_params must be SamplingParams, not {type(params).__name__}")
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        ids = prompt if isinstance(prompt, list) else self.tokenizer(prompt).input_ids
        text = prompt if isinstance(prompt, str) else None
        loop = asyncio.get_running_loop()
        stream = _Stream(rid, loop, params.n, RequestTimes(arrival=time.monotonic(), n=params.n))
        with self._lock:
            self._check_alive()
            self._command(("add", stream, list(ids), params, text))
        done = False
        total: RequestOutput | None = None
        try:
            while not done:
                if not stream.pending:
                    stream.waiter = loop.create_future()
                    await stream.waiter
                items, stream.pending = stream.pending, []
                for item in items:
                    if isinstance(item, BaseException):
                        done = True
                        raise item
                delta = merge_deltas(items)
                done = delta.finished
                error = next((c.stop_reason for c in delta.outputs
                              if c.finish_reason == "abort" and c.stop_reason), None)  # fmt: skip
                if error is not None:  # the engine ended it: its grammar failed to compile
                    raise ValueError(error)
                if output_kind is RequestOutputKind.DELTA:
                    yield delta
                    continue
                total = accumulate(total, delta, params.n)
                if done or output_kind is RequestOutputKind.CUMULATIVE:
                    yield copy_output(total)
        finally:
            if not done:
                self._command(("abort", rid))

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason "abort" (if still running)."""
        self._command(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every running request (thread-safe; for shutdown on a signal)."""
        self._command(("abort_all",))

    def shutdown(self) -> None:
        """Stop the engine thread (running requests get EngineDeadError) and free the engine.
        A thread that has not stopped after SHUTDOWN_TIMEOUT_S (stuck reading a message that a
        frozen core left half-written) gets its core process killed, which breaks the pipe."""
        if self._thread.is_alive():
            self._command((_STOP,))
            self._thread.join(SHUTDOWN_TIMEOUT_S)
            if self._thread.is_alive() and self.core_process is not None:
                self.core_process.kill()
                self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._wake_w is not None:
            self._wake_w.close()  # a later _command's send fails quietly
            self._wake_r.close()

    def _command(self, cmd: tuple) -> None:
        """Hand a command to the engine thread (thread-safe)."""
        self._inbox.put(cmd)
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"!")
            except OSError:  # full of wake-ups (the thread will look), or shut down
                pass

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine has stopped: {self._error!r}") from self._error
        if self._closed or not self._thread.is_alive():
            raise EngineDeadError("the engine has been shut down")

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        streams = self._streams
        message = "the engine has been shut down"
        try:
            if self.core_process is None:
                self._step_loop(streams)
            else:
                self._front_loop(streams)
        except BaseException as e:  # noqa: BLE001 - every waiting request must hear of it
            self._error = e
            message = f"the engine loop failed: {e!r}"
        finally:
            with self._lock:
                self._closed = True
                while not self._inbox.empty():  # requests that never reached the engine
                    cmd = self._inbox.get()
                    if cmd[0] == "add":
                        streams[cmd[1].request_id] = cmd[1]
            self._send([(s, _dead(message, self._error)) for s in streams.values()])
            streams.clear()
            self.engine.shutdown()

    def _step_loop(self, streams: dict[str, _Stream]) -> None:
        """The whole engine in this thread: commands, then a step, until stopped."""
        while self._take_commands(streams, block=not self.engine.has_unfinished_requests()):
            if self.engine.has_unfinished_requests():
                start = time.monotonic()
                outputs = self.engine.step()
                self._progress_at = time.monotonic()
                self._note_scheduled(start)
                self._dispatch(streams, outputs, time.monotonic())
            self._refresh_stats()

    def _front_loop(self, streams: dict[str, _Stream]) -> None:
        """The front end of a core process: commands and step results as they come."""
        core = self.core_process
        readers = core.readers()
        log = pause_log.get()
        while True:
            ready = wait_for([*readers, self._wake_r])
            if self._wake_r in ready:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                if not self._take_commands(streams, block=False):
                    return
            if len(ready) > (self._wake_r in ready):
                steps = core.recv(timeout=0)
                now = time.monotonic()
                if log is not None and streams and now - self._progress_at >= CORE_SILENT_S:
                    log.write("core_silent", (now - self._progress_at) * 1e3)
                    # the core's own gap: between the starts of the steps before and in it
                    starts = [self._last_start, *(step[2] for step in steps)]
                    gap = max((b - a for a, b in zip(starts, starts[1:])), default=0.0)
                    log.write("core_gap", gap * 1e3)
                    # and how much of it this thread waited for data, its last message done
                    log.write("reader_idle", (now - max(self._done_at, self._progress_at)) * 1e3)
                    if (sent := getattr(core, "sent_at", None)) is not None:  # one core
                        log.write("core_sent", (now - sent) * 1e3)  # how long ago the core sent
                self._progress_at = now
                for _, scheduled, start, _ in steps:
                    self._note_scheduled(start, scheduled)
                if steps:  # several waiting (this thread lagged): one output per request
                    self._last_start = steps[-1][2]
                    records = merge_steps([step[0] for step in steps])
                    outputs = self.engine.process_core_outputs(records)
                    self._dispatch(streams, outputs, time.monotonic())
                self._refresh_stats()
                self._done_at = time.monotonic()

    def _take_commands(self, streams: dict[str, _Stream], block: bool) -> bool:
        """Apply every pending command (waiting for one if `block`); False on stop."""
        while True:
            try:
                cmd = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd[0] is _STOP:
                return False
            if cmd[0] == "add":
                self._add(streams, *cmd[1:])
            elif cmd[0] == "abort":
                self._abort(streams, [cmd[1]])
            elif cmd[0] == "abort_all":
                self._abort(streams, list(streams))
            self._refresh_stats()

    def _add(self, streams, stream: _Stream, ids: list[int], params, text) -> None:
        try:
            core_ids = self.engine.add_request(stream.request_id, ids, params, prompt=text,
                                               output_kind=RequestOutputKind.DELTA)  # fmt: skip
        except (ValueError, TypeError) as e:
            self._send([(stream, e)])
            return
        except BaseException:  # the engine itself broke: this request hears of it too
            streams[stream.request_id] = stream
            raise
        if not streams:  # the stall clock of health() starts now
            self._progress_at = self._last_start = time.monotonic()
        streams[stream.request_id] = stream
        self._unscheduled[core_ids[0]] = stream

    def _abort(self, streams: dict[str, _Stream], request_ids: list[str]) -> None:
        now = time.monotonic()
        for out in self.engine.abort_request(request_ids):
            stream = streams.pop(out.request_id)
            self._unscheduled.pop(child_id(stream.request_id, 0, stream.n), None)
            self.metrics.on_output(stream.times, out, now)
            self._send([(stream, out)])

    def _note_scheduled(self, step_start: float, scheduled: list[str] | None = None) -> None:
        """Requests scheduled for the first time in the step started at `step_start`: those
        in `scheduled` (core ids), or by default those the engine no longer has waiting."""
        if not self._unscheduled:
            return
        if scheduled is None:
            waiting = self.engine.waiting_request_ids()
            scheduled = [cid for cid in self._unscheduled if cid not in waiting]
        for cid in scheduled:
            s = self._unscheduled.pop(cid, None)
            if s is not None:
                self.metrics.on_scheduled(s.times, step_start)

    def _dispatch(self, streams, outputs: list[RequestOutput], now: float) -> None:
        items = []  # a list: a step with synchronous requests reports one request twice
        for out in outputs:
            stream = streams[out.request_id]
            if out.finished:
                del streams[out.request_id]
            items.append((stream, out))
        self.metrics.on_outputs([(s.times, out) for s, out in items], now)
        self._send(items)

    def _send(self, items: list[tuple[_Stream, object]]) -> None:
        """Hand each item to its stream: one thread-safe call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, object]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody listens any more
                gone = {s.request_id: s for s, _ in items if s.loop is loop}
                for rid, s in gone.items():
                    self._streams.pop(rid, None)
                    self._unscheduled.pop(child_id(rid, 0, s.n), None)
                now = time.monotonic()
                for out in self.engine.abort_request(list(gone)):
                    self.metrics.on_output(gone[out.request_id].times, out, now)

    def _refresh_stats(self) -> None:
        stats = self.engine.stats()
        replicas = self.core_process.replica_stats() if self.core_process is not None else []
        with self.metrics.lock:
            self.metrics.engine = stats
            self.metrics.replicas = replicas


def _dead(message: str, cause: BaseException | None) -> EngineDeadError:
    err = EngineDeadError(message)
    err.__cause__ = cause
    return err


def _deliver(batch: list[tuple[_Stream, object]]) -> None:
    """(On the event loop.) Append each item to its stream and wake its consumer."""
    for stream, item in batch:
        stream.pending.append(item)
        waiter = stream.waiter
        if waiter is not None:
            stream.waiter = None
            if not waiter.done():
                waiter.set_result(None)
