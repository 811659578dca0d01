"""gc_heap: the pause log of envs.LLM_INFERENCE_PAUSE_LOG."""

import gc
import os
import types

import pytest

from llm_inference import gc_heap, pause_log


def test_pause_log_records_collections_until_thawed(tmp_path, monkeypatch):
    log = tmp_path / "gc.log"
    monkeypatch.setenv("LLM_INFERENCE_PAUSE_LOG", str(log))
    monkeypatch.setattr(pause_log, "PAUSE_LOG_MIN_MS", 0.0)
    gc.disable()  # no automatic collection takes the cycle first
    try:
        gc_heap.freeze_startup_heap()
        gc_heap.freeze_startup_heap()  # a second freeze adds no second logger
        assert sum(isinstance(cb, gc_heap._Pauses) for cb in gc.callbacks) == 1
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        gc_heap.thaw_heap()
        gc.enable()
    lines = log.read_text().splitlines()
    end, pid, what, ms, name = lines[-1].split()
    assert name == "MainProcess" and int(pid) == os.getpid() and what == "gc2"
    assert float(ms) >= 0 and float(end) > 0
    gc.collect()
    assert log.read_text().splitlines() == lines  # thawed: no longer logging


def test_no_log_without_the_variable(monkeypatch):
    monkeypatch.delenv("LLM_INFERENCE_PAUSE_LOG", raising=False)
    try:
        gc_heap.freeze_startup_heap()
        assert not any(isinstance(cb, gc_heap._Pauses) for cb in gc.callbacks)
    finally:
        gc_heap.thaw_heap()


def test_young_threshold_while_frozen(monkeypatch):
    """Frozen: the young generation's threshold is GC_YOUNG_THRESHOLD, or the variable's;
    thawed: Python's again."""
    before = gc.get_threshold()
    monkeypatch.delenv("LLM_INFERENCE_GC_YOUNG", raising=False)
    try:
        gc_heap.freeze_startup_heap()
        assert gc.get_threshold() == (gc_heap.GC_YOUNG_THRESHOLD, *before[1:])
        monkeypatch.setenv("LLM_INFERENCE_GC_YOUNG", "700")
        gc_heap.freeze_startup_heap()
        assert gc.get_threshold() == (700, *before[1:])
    finally:
        gc_heap.thaw_heap()
    assert gc.get_threshold() == before


def test_pause_log_hooks_triton_compiles(tmp_path, monkeypatch):
    """Where Triton is imported, its compile hooks log each compile (the cache hook lets the
    compile go on); thawing takes them off."""
    knobs = pytest.importorskip("triton").knobs
    log = tmp_path / "pauses.log"
    monkeypatch.setenv("LLM_INFERENCE_PAUSE_LOG", str(log))
    monkeypatch.setattr(pause_log, "PAUSE_LOG_MIN_MS", 0.0)
    try:
        gc_heap.freeze_startup_heap()
        assert knobs.runtime.jit_cache_hook(fn=None) is None  # None: Triton compiles
        knobs.runtime.jit_post_compile_hook(fn=types.SimpleNamespace(name="_merge_kernel"))
        # with Triton's repr of the variant, that (one word: the log splits on spaces)
        variant = "_merge_kernel[num_warps=4](x_ptr: *bf16, BLOCK: constexpr=64)"
        knobs.runtime.jit_post_compile_hook(fn=types.SimpleNamespace(name="_merge_kernel"),
                                            repr=variant)  # fmt: skip
    finally:
        gc_heap.thaw_heap()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
    logged = [line.split()[2] for line in log.read_text().splitlines()]
    assert [what for what in logged if what.startswith("compile:")] == [
        "compile:_merge_kernel",
        "compile:_merge_kernel[num_warps=4](x_ptr:*bf16,BLOCK:constexpr=64)",
    ]
