"""A step's sampled tokens on their way to the host.

The model runner launches a step and returns at once: the sampled tokens (and the sampler's
row statuses) are copied to pinned host memory by one non-blocking copy, followed by an event.
`result()` waits for that event only, so the engine can schedule and launch the next step
while this one runs (async scheduling), and read this one's tokens afterwards.
"""

from __future__ import annotations

import torch

from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.layers.sampler import SamplerOutput, report_status


class PendingOutput:
    def __init__(self) -> None:
        self._done: ModelRunnerOutput | None = None
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        self._req_ids: list[str] = []
        self._rows: list[int] = []
        self._logprobs = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> PendingOutput:
        pending = cls()
        pending._done = output
        return pending

    @classmethod
    def launch(cls, req_ids: list[str], rows: list[int], out: SamplerOutput) -> PendingOutput:
        """Start the copy of `out`'s tokens and statuses for the sample rows `rows`."""
        pending = cls()
        pending._req_ids, pending._rows, pending._logprobs = req_ids, rows, out.logprobs
        both = torch.stack((out.token_ids, out.status))
        if both.device.type == "cuda":
            pending._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            pending._host.copy_(both, non_blocking=True)
            pending._event = torch.cuda.Event()
            pending._event.record()
        else:
            pending._host = both
        return pending

    def result(self) -> ModelRunnerOutput:
        """Wait for the tokens (once) and return them as a ModelRunnerOutput."""
        if self._done is None:
            if self._event is not None:
                self._event.synchronize()
            tokens, status = self._host.tolist()
            report_status(status)
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
            self._done = ModelRunnerOutput(self._req_ids, sampled, logprobs)
            self._host = self._event = None
        return self._done
