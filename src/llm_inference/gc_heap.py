"""The cyclic GC and long-lived processes: freeze the startup heap, thaw it at exit.

A full (generation 2) collection walks every tracked object (torch, transformers, the model:
a pause of the step loop, benchmarks/DECISIONS.md). `freeze_startup_heap()` moves everything
alive into the permanent generation, so later collections scan only what the run creates; vLLM
does the same after warm-up (`freeze_gc_heap`). Used by the core process, the server, each
tensor-parallel worker and `LLM` (for its lifetime: `LLM.close()` thaws). With a pause log
(pause_log.py) they also log each GC collection and Triton compile."""

from __future__ import annotations

import gc
import sys
import time

from llm_inference import envs, pause_log

# New tracked objects between young-generation collections while serving (Python's: 700).
GC_YOUNG_THRESHOLD = 50_000
_python_thresholds = gc.get_threshold()


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then move every object alive to the permanent generation.
    Objects made later are collected as usual. Call `thaw_heap()` before the process exits
    (or the owner closes)."""
    gc.collect()
    gc.freeze()
    young = envs.LLM_INFERENCE_GC_YOUNG or GC_YOUNG_THRESHOLD
    gc.set_threshold(young, *_python_thresholds[1:])
    log = pause_log.get()
    if log is not None and not any(isinstance(cb, _Pauses) for cb in gc.callbacks):
        log = _Pauses(log)
        gc.callbacks.append(log)
        if "triton" in sys.modules:  # this process launches kernels (the front end does not)
            from triton import knobs

            knobs.runtime.jit_cache_hook = log.compile_starts
            knobs.runtime.jit_post_compile_hook = log.compile_ends


def thaw_heap() -> None:
    """Undo `freeze_startup_heap`: objects left frozen are never finalized, and native
    extensions (Triton's nanobind bindings) then print pages of leak warnings at exit."""
    gc.unfreeze()
    gc.set_threshold(*_python_thresholds)
    logs = [cb for cb in gc.callbacks if isinstance(cb, _Pauses)]
    gc.callbacks[:] = [cb for cb in gc.callbacks if cb not in logs]
    if logs and "triton" in sys.modules:
        from triton import knobs

        if knobs.runtime.jit_post_compile_hook == logs[0].compile_ends:
            knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


class _Pauses:
    """The gc callback and Triton's compile hooks, timing what they bracket into the log."""

    def __init__(self, log: pause_log.PauseLog) -> None:
        self.log = log
        self.started = self.compile_started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.log.write(f"gc{info['generation']}", (time.perf_counter() - self.started) * 1e3)

    def compile_starts(self, **kw) -> None:  # returns None: Triton goes on to compile
        self.compile_started = time.perf_counter()

    def compile_ends(self, **kw) -> None:
        """Logs the kernel with its specialization (Triton's `repr` of the variant: options,
        each argument's type, alignment and constexpr value), which says what a launch met
        that no earlier one had; one word, as the log's fields are split on spaces."""
        ms = (time.perf_counter() - self.compile_started) * 1e3
        variant = kw.get("repr") or kw["fn"].name
        self.log.write(f"compile:{variant.replace(' ', '')}", ms)
