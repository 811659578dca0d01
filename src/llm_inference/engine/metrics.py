"""Serving metrics that AsyncLLM's engine thread gathers: token counters and latency histograms.

Times are `time.monotonic()` seconds. The engine thread writes under `ServingMetrics.lock`;
readers (the server's /metrics) take `snapshot()`, a consistent copy made under the same lock.
A request's time to first token is counted from its arrival (when `generate` was called) to
the end of the step that produced its first token; its queue time, from arrival to the start
of the first step that scheduled it.
"""

from __future__ import annotations

import copy
import threading
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

from llm_inference.outputs import RequestOutput

# Bucket bounds in seconds, close to vLLM's.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip


class Histogram:
    """A Prometheus-style histogram: per-bucket counts (upper bounds inclusive), sum, count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def add(self, other: Histogram) -> None:
        """Add another histogram's observations (same buckets) to this one's."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum += other.sum
        self.count += other.count

    def cumulative(self) -> list[tuple[str, int]]:
        """(le label, cumulative count) for every bucket, ending with ("+Inf", count)."""
        out, total = [], 0
        for bound, n in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class RequestTimes:
    """One request's progress as the engine thread saw it."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    n: int = 1
    reasons: dict[int, str | None] = field(default_factory=dict)  # completion -> finish reason
    aborted: bool = False

    def note(self, out: RequestOutput) -> None:
        """Remember the finish reasons in `out` (a delta names only its step's completions)."""
        for c in out.outputs:
            if c.finish_reason is not None:
                self.reasons[c.index] = c.finish_reason
        self.aborted = self.reasons.get(0) == "abort"


HISTOGRAMS = ("ttft", "itl", "tpot", "e2e", "queue")
COUNTED = ("prompt_tokens", "generation_tokens", "finished", *HISTOGRAMS)


@dataclass
class ServingMetrics:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    engine: dict = field(default_factory=dict)  # the latest LLMEngine.stats()
    replicas: list = field(default_factory=list)  # data parallelism: each replica's stats
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> ServingMetrics:
        with self.lock:
            fields = {k: copy.deepcopy(v) for k, v in vars(self).items() if k != "lock"}
        return ServingMetrics(**fields)

    def counts(self) -> dict:
        """A copy of the counters and histograms (what front ends add up: `add`)."""
        with self.lock:
            return {k: copy.deepcopy(getattr(self, k)) for k in COUNTED}

    def add(self, counts: dict) -> None:
        """Add another front end's `counts()` to these (the server's api_server_count)."""
        with self.lock:
            self.prompt_tokens += counts["prompt_tokens"]
            self.generation_tokens += counts["generation_tokens"]
            self.finished.update(counts["finished"])
            for name in HISTOGRAMS:
                getattr(self, name).add(counts[name])

    def on_scheduled(self, times: RequestTimes, now: float) -> None:
        if times.scheduled is None:
            times.scheduled = now
            with self.lock:
                self.queue.observe(now - times.arrival)

    def on_output(self, times: RequestTimes, out: RequestOutput, now: float) -> None:
        """Count the tokens of `out`, a DELTA output (only what the step added); time them."""
        self.on_outputs([(times, out)], now)

    def on_outputs(self, items: list[tuple[RequestTimes, RequestOutput]], now: float) -> None:
        """`on_output` for each of a step's (times, DELTA output), under one lock."""
        with self.lock:
            for times, out in items:
                outputs = out.outputs
                if len(outputs) == 1:
                    new = len(outputs[0].token_ids)
                else:
                    new = sum(len(c.token_ids) for c in outputs)
                if times.n > 1 or out.finished:
                    times.note(out)
                if new > 0:
                    if times.first_token is None:
                        times.first_token = now
                        self.ttft.observe(now - times.arrival)
                        # each of the n sequences runs the prompt, as vLLM counts it
                        self.prompt_tokens += len(out.prompt_token_ids) * times.n
                    else:
                        self.itl.observe(now - times.last_token)
                    times.last_token = now
                    times.num_generated += new
                    self.generation_tokens += new
                if out.finished:
                    self._on_finished(times, out, now)

    def _on_finished(self, times: RequestTimes, out: RequestOutput, now: float) -> None:
        for j in range(times.n):
            self.finished[times.reasons.get(j) or "abort"] += 1
        if times.aborted:
            return
        self.e2e.observe(now - times.arrival)
        if times.num_generated > 1 and times.first_token is not None:
            per_token = (times.last_token - times.first_token) / (times.num_generated - 1)
            self.tpot.observe(per_token)
