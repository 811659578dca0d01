"""A step's sampled tokens on their way to the host.

The model runner launches a step and returns at once: the sampled tokens (and the sampler's
row statuses) are copied to pinned host memory by one non-blocking copy, followed by an event.
`result()` waits for that event only, so the engine can schedule and launch the next step
while this one runs (async scheduling), and read this one's tokens afterwards.

On CUDA the host memory and the event come from `TokenSlots`, a few persistent pinned buffers
used in turn, so that a step allocates neither.
"""

from __future__ import annotations

import threading

import torch

from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.sample.sampler import SamplerOutput, report_status


class TokenSlots:
    """SLOTS persistent pinned int64 buffers of 2 x `rows` (tokens, statuses) with an event
    each, handed out in turn. A slot goes back to work only after the PendingOutput that used
    it last has read it: `take` moves that one's tokens out first if they are still there
    (with async scheduling at most one step is in flight, so it was read steps ago)."""

    SLOTS = 4

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._host = [torch.empty(2 * rows, dtype=torch.long, pin_memory=True)
                      for _ in range(self.SLOTS)]  # fmt: skip
        self._events = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self._owners: list[PendingOutput | None] = [None] * self.SLOTS
        self._next = 0

    def take(self, owner: PendingOutput, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A contiguous pinned [2, n] view (n <= rows) and the slot's event, for `owner`."""
        i = self._next
        self._next = (i + 1) % self.SLOTS
        previous = self._owners[i]
        if previous is not None:
            previous.leave_slot()
        self._owners[i] = owner
        return self._host[i][: 2 * n].view(2, n), self._events[i]


class PendingOutput:
    def __init__(self) -> None:
        self._done: ModelRunnerOutput | None = None
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        self._req_ids: list[str] = []
        self._rows: list[int] = []
        self._logprobs = None
        self.prompt_logprobs: dict | None = None  # ModelRunnerOutput.prompt_logprobs
        # result() may be called by the engine or a TP reply thread (multiproc.py) while
        # TokenSlots.take moves the tokens out of a slot for reuse: one at a time.
        self._lock = threading.Lock()

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> PendingOutput:
        pending = cls()
        pending._done = output
        return pending

    @classmethod
    def launch(
        cls,
        req_ids: list[str],
        rows: list[int],
        out: SamplerOutput,
        slots: TokenSlots | None = None,
    ) -> PendingOutput:
        """Start the copy of `out`'s tokens and statuses for the sample rows `rows` (into one
        of `slots` when given and wide enough, else a fresh pinned buffer)."""
        pending = cls()
        pending._req_ids, pending._rows, pending._logprobs = req_ids, rows, out.logprobs
        both = torch.stack((out.token_ids, out.status))
        if both.device.type == "cuda":
            n = both.shape[1]
            if slots is not None and n <= slots.rows and both.dtype == torch.long:
                pending._host, pending._event = slots.take(pending, n)
            else:
                pending._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
                pending._event = torch.cuda.Event()
            pending._host.copy_(both, non_blocking=True)
            pending._event.record()
        else:
            pending._host = both
        return pending

    def result(self) -> ModelRunnerOutput:
        """Wait for the tokens (once) and return them as a ModelRunnerOutput."""
        if self._done is not None:
            return self._done
        with self._lock:
            if self._done is None:
                self._resolve()
        return self._done

    def _resolve(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        tokens, status = self._host.tolist()
        report_status(status)  # may raise: then the tokens stay, and so does the error
        n = len(self._req_ids)
        logprobs: list[object | None] = [None] * n
        if len(self._rows) == n:  # every request sampled (decodes): rows are 0..n-1
            sampled = [[t] for t in tokens]
        else:
            sampled = [[] for _ in self._req_ids]
            for k, i in enumerate(self._rows):
                sampled[i] = [tokens[k]]
        if self._logprobs is not None:
            for k, i in enumerate(self._rows):
                logprobs[i] = self._logprobs[k]
        self._done = ModelRunnerOutput(self._req_ids, sampled, logprobs, self.prompt_logprobs)
        self._host = self._event = None

    def leave_slot(self) -> None:
        """Move the copied tokens out of their TokenSlots buffer (waiting for the copy), if
        they are still there: the slot is about to be reused."""
        with self._lock:
            if self._done is None and self._event is not None:
                self._event.synchronize()
                self._host, self._event = self._host.clone(), None
