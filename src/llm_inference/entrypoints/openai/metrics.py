"""/metrics: the Prometheus text format (version 0.0.4), with vLLM's metric names.

Every sample carries `model_name="<served name>"`. Gauges come from the engine's last stats
(one sample per data-parallel replica, labelled `engine="i"`, when there are several);
counters and histograms from `ServingMetrics` (see engine/metrics.py). KV cache usage is a
fraction in [0, 1], as vLLM reports it despite the `_perc` name.
"""

from __future__ import annotations

from llm_inference.engine.metrics import Histogram, ServingMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_HISTOGRAMS = (
    ("time_to_first_token_seconds", "ttft", "Time to first token in seconds."),
    ("inter_token_latency_seconds", "itl", "Time between output tokens in seconds."),
    ("time_per_output_token_seconds", "itl", "Time per output token (same as ITL) in seconds."),
    (
        "request_time_per_output_token_seconds",
        "tpot",
        "Per-request mean time per output token after the first, in seconds.",
    ),  # fmt: skip
    ("e2e_request_latency_seconds", "e2e", "End-to-end request latency in seconds."),
    ("request_queue_time_seconds", "queue", "Time requests spent waiting in seconds."),
)


# The engine's stats shown as they are: (metric, type, help, stats key), in page order.
_ENGINE_STATS = (
    ("num_requests_running", "gauge", "Requests in the running batch.", "num_running_requests"),
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
     "num_waiting_requests"),
    ("num_kv_blocks", "gauge", "KV cache blocks in all.", "num_kv_blocks"),
    ("num_free_kv_blocks", "gauge", "Free KV cache blocks.", "num_free_kv_blocks"),
    ("num_preemptions_total", "counter", "Preemptions (requests sent back to wait).",
     "num_preemptions"),
    ("prefix_cache_queries_total", "counter",
     "Prompt tokens of admitted requests, looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits_total", "counter", "Of those, tokens found in the prefix cache.",
     "prefix_cache_hits"),
)  # fmt: skip


def _usage(stats: dict) -> float:
    total = stats.get("num_kv_blocks", 0)
    return (1 - stats.get("num_free_kv_blocks", 0) / total) if total else 0.0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Writer:
    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self.lines: list[str] = []

    def header(self, name: str, kind: str, help_text: str) -> None:
        self.lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} {kind}"]

    def sample(self, name: str, value: float, extra: str = "") -> None:
        labels = self.labels + (f",{extra}" if extra else "")
        self.lines.append(f"vllm:{name}{{{labels}}} {float(value)!r}")

    def metric(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.header(name, kind, help_text)
        self.sample(name, value)

    def histogram(self, name: str, help_text: str, h: Histogram) -> None:
        self.header(name, "histogram", help_text)
        for le, count in h.cumulative():
            self.sample(f"{name}_bucket", count, f'le="{le}"')
        self.sample(f"{name}_sum", h.sum)
        self.sample(f"{name}_count", h.count)


def render(metrics: ServingMetrics, model_name: str) -> str:
    """The whole /metrics page."""
    m = metrics.snapshot()
    w = _Writer(model_name)
    # The engine's gauges: one sample, or one per data-parallel replica (label engine="i").
    engines = list(enumerate(m.replicas)) if len(m.replicas) > 1 else [(None, m.engine)]

    def engine_metric(name: str, kind: str, help_text: str, value_of) -> None:
        w.header(name, kind, help_text)
        for i, stats in engines:
            w.sample(name, value_of(stats), "" if i is None else f'engine="{i}"')

    for name, kind, help_text, key in _ENGINE_STATS:
        engine_metric(name, kind, help_text, lambda stats, key=key: stats.get(key, 0))
    engine_metric("kv_cache_usage_perc", "gauge", "KV cache usage (1 means 100 percent).", _usage)
    w.metric("prompt_tokens_total", "counter",
             "Prefilled prompt tokens (n per prompt of n sequences).", m.prompt_tokens)  # fmt: skip
    w.metric("generation_tokens_total", "counter", "Generated tokens.", m.generation_tokens)
    w.header("request_success_total", "counter", "Finished requests by finish reason.")
    for reason in sorted(set(m.finished) | {"stop", "length", "abort"}):
        w.sample("request_success_total", m.finished.get(reason, 0),
                 f'finished_reason="{_escape(reason)}"')  # fmt: skip
    for name, attr, help_text in _HISTOGRAMS:
        w.histogram(name, help_text, getattr(m, attr))
    return "\n".join(w.lines) + "\n"
