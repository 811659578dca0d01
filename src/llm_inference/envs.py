"""Internal switches for A/B benchmarking and measurement, read from environment variables, all
in this module.

They are not engine options: the defaults are the engine's choices (benchmarks/DECISIONS.md
says why), and a switch only turns a choice off to measure what it brings. Each is read when
it is used (`envs.LLM_INFERENCE_PDL`, through the module `__getattr__`), so a test can
`monkeypatch.setenv` it; worker processes inherit the parent's environment. A malformed value
raises ValueError naming the variable.

LLM_INFERENCE_SKINNY_GEMM
    "1" (default): matmuls of at most 32 (LLM_INFERENCE_SKINNY_ROWS) half-precision rows on
    CUDA (decode steps) run the Triton skinny GEMM, the MLP's gate_up fused with SiLU-and-mul
    (kernels/skinny_gemm.py); "0": always F.linear (cuBLAS).
LLM_INFERENCE_SKINNY_ROWS
    "32" (default), "16" or "64": the most rows (decode batch) the skinny GEMM takes; a launch
    pads its rows to 16, 32 or 64 for the dot (kernels/skinny_gemm.py). At 64 rows it lost to
    cuBLAS and _scaled_mm (benchmarks/results/skinny_rows_2026-12-02_h200.md).
LLM_INFERENCE_PDL
    "auto" (default): programmatic dependent launch for the decode step's Triton kernels
    wherever it is supported (compute capability 9.0+ and a Triton with gdc_wait;
    kernels/pdl.py); "0": off; "1": on, and an error where it is not supported.
LLM_INFERENCE_FP8_DOT
    "1" (default): the skinny GEMM on FP8 weights (decode steps) quantizes the activations per
    tile to FP8 for an FP8 x FP8 dot (kernels/skinny_gemm.py); "0": it converts the weight
    tiles to the activations' dtype instead (W8A16).
LLM_INFERENCE_FUSED_ALL_REDUCE_NORM
    "1" (default): under tensor parallelism on CUDA with the Triton kernels and the custom
    all-reduce, the all-reduce of o_proj and down_proj fused with the residual add and RMSNorm
    after it, for steps of few rows (distributed/all_reduce_norm.py); "0": off.
LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES
    Unset (default): the token buckets of mixed-step CUDA graphs are the ladder of
    executor/cuda_graph.py (`mixed_buckets`). A comma-separated list of token counts (each at
    least 2 and at most max_num_batched_tokens) replaces it; empty: no mixed-step graphs
    (decode steps still replay theirs).
LLM_INFERENCE_GC_YOUNG
    Unset (default): the processes that freeze their startup heap (gc_heap.py) collect the
    young generation every GC_YOUNG_THRESHOLD new objects; a number: that threshold instead
    (700: Python's own).
LLM_INFERENCE_PAUSE_LOG
    Unset (default): nothing. A file path: the long-lived processes log what pauses them (GC
    collections, Triton compiles, an engine core silent or an event loop late), one line per
    pause of at least 1 ms (pause_log.py), for benchmarks/serve_stalls.py `--pause-log`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _pdl() -> bool | None:
    """None: wherever supported; False: off; True: required."""
    name = "LLM_INFERENCE_PDL"
    value = os.environ.get(name, "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{name} must be auto, 0 or 1, got {value!r}")
    return None if value == "auto" else value == "1"


def _graph_sizes() -> tuple[int, ...] | None:
    """None: the default ladder; else the sizes, ascending, without repeats."""
    name = "LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES"
    value = os.environ.get(name)
    if value is None:
        return None
    sizes = set()
    for part in value.split(","):
        part = part.strip()
        if not part and not value.strip():
            continue  # the empty list
        if not part.isdigit() or int(part) < 2:
            raise ValueError(f"{name} must be token counts of at least 2, comma-separated; "
                             f"got {value!r}")  # fmt: skip
        sizes.add(int(part))
    return tuple(sorted(sizes))


def _positive_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _skinny_rows() -> int:
    value = os.environ.get("LLM_INFERENCE_SKINNY_ROWS", "32")
    if value not in ("16", "32", "64"):
        raise ValueError(f"LLM_INFERENCE_SKINNY_ROWS must be 16, 32 or 64, got {value!r}")
    return int(value)


environment_variables: dict[str, Callable[[], Any]] = {
    "LLM_INFERENCE_SKINNY_GEMM": lambda: _flag("LLM_INFERENCE_SKINNY_GEMM", True),
    "LLM_INFERENCE_SKINNY_ROWS": _skinny_rows,
    "LLM_INFERENCE_PDL": _pdl,
    "LLM_INFERENCE_FP8_DOT": lambda: _flag("LLM_INFERENCE_FP8_DOT", True),
    "LLM_INFERENCE_FUSED_ALL_REDUCE_NORM": lambda: _flag(
        "LLM_INFERENCE_FUSED_ALL_REDUCE_NORM", True
    ),
    "LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES": _graph_sizes,
    "LLM_INFERENCE_GC_YOUNG": lambda: _positive_int("LLM_INFERENCE_GC_YOUNG"),
    "LLM_INFERENCE_PAUSE_LOG": lambda: os.environ.get("LLM_INFERENCE_PAUSE_LOG") or None,
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
