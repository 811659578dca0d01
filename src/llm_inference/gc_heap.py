"""The cyclic GC and long-lived processes: freeze the startup heap, thaw it at exit.

A full (generation 2) collection walks every tracked object (torch, transformers, the model:
a pause of the step loop, benchmarks/DECISIONS.md). `freeze_startup_heap()` moves everything
alive into the permanent generation, so later collections scan only what the run creates; vLLM
does the same after warm-up (`freeze_gc_heap`). Used by the core process, the server, each
tensor-parallel worker and `LLM` (for its lifetime: `LLM.close()` thaws). With
envs.LLM_INFERENCE_GC_LOG set, those processes also log their collections' pauses."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

from llm_inference import envs

# New tracked objects between young-generation collections while serving (Python's: 700).
GC_YOUNG_THRESHOLD = 50_000
_python_thresholds = gc.get_threshold()

# Collections shorter than this are not logged: young generations take microseconds.
GC_LOG_MIN_MS = 1.0


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then move every object alive to the permanent generation.
    Objects made later are collected as usual. Call `thaw_heap()` before the process exits
    (or the owner closes)."""
    gc.collect()
    gc.freeze()
    young = envs.LLM_INFERENCE_GC_YOUNG or GC_YOUNG_THRESHOLD
    gc.set_threshold(young, *_python_thresholds[1:])
    path = envs.LLM_INFERENCE_GC_LOG
    if path and not any(isinstance(cb, _PauseLog) for cb in gc.callbacks):
        gc.callbacks.append(_PauseLog(path))


def thaw_heap() -> None:
    """Undo `freeze_startup_heap`: objects left frozen are never finalized, and native
    extensions (Triton's nanobind bindings) then print pages of leak warnings at exit."""
    gc.unfreeze()
    gc.set_threshold(*_python_thresholds)
    gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, _PauseLog)]


class _PauseLog:
    """A gc callback appending "end_time pid generation ms collected process_name" for each
    collection of at least GC_LOG_MIN_MS to a file shared by the processes (short appends)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = multiprocessing.current_process().name.replace(" ", "_")
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1e3
        if ms >= GC_LOG_MIN_MS:
            gen, collected = info["generation"], info["collected"]
            with open(self.path, "a") as f:
                f.write(f"{time.time():.6f} {os.getpid()} {gen} {ms:.2f} {collected} {self.name}\n")
