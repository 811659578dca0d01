"""What pauses a long-lived process, logged to find what stalls served streams.

With envs.LLM_INFERENCE_PAUSE_LOG set to a file, every process that freezes its startup heap
(gc_heap.py: the server, the engine core, the tensor-parallel workers, `LLM`) appends a line
per pause of at least PAUSE_LOG_MIN_MS, "end_time pid what ms process_name", where `what` is:
gc0, gc1 or gc2 (a cyclic GC collection), compile:KERNEL (a Triton compile, a kernel variant
first met mid-run), core_silent (the server's front end got no step from the engine core for
that long while requests ran: a long step, or the core held up; logged with core_gap, the
longest time between the starts of the core's steps across that silence: near it, the core
did not step; far below it, its steps were late on their way; and with reader_idle, how much
of the silence the front end's reading thread waited for data once done with the last steps:
near it, they were late to come (or the thread waited for the GIL once woken); far below it,
the thread was busy; and with core_sent, how long before the thread took the steps the core
had sent them: near 0, the core sent them late; large, they waited in the pipe or for the
thread), core_step and core_commands
(the engine core process took that long, at least core_process.SLOW_MS, for one step or to
apply one message of commands: which of them a core_silent waited for) or loop_lag (the
server's event loop ran that late: the front end held up). benchmarks/serve_stalls.py
`--pause-log` matches them with streams' gaps. Lines are short appends to one file, shared by
the processes.
"""

from __future__ import annotations

import multiprocessing
import os
import time

from llm_inference import envs

PAUSE_LOG_MIN_MS = 1.0
_log: PauseLog | None = None


def get() -> PauseLog | None:
    """This process's pause log, or None when envs.LLM_INFERENCE_PAUSE_LOG is unset."""
    global _log
    path = envs.LLM_INFERENCE_PAUSE_LOG
    if not path:
        return None
    if _log is None or _log.path != path:
        _log = PauseLog(path)
    return _log


class PauseLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self.name = multiprocessing.current_process().name.replace(" ", "_")

    def write(self, what: str, ms: float) -> None:
        """Log a pause of `ms` milliseconds that ends now."""
        if ms >= PAUSE_LOG_MIN_MS:
            with open(self.path, "a") as f:
                f.write(f"{time.time():.6f} {os.getpid()} {what} {ms:.2f} {self.name}\n")
