"""The cyclic GC and long-lived processes: freeze the startup heap, thaw it at exit.

A full (generation 2) collection walks every tracked object (torch, transformers, the model:
a pause of the step loop, benchmarks/DECISIONS.md). `freeze_startup_heap()` moves everything
alive into the permanent generation, so later collections scan only what the run creates; vLLM
does the same after warm-up (`freeze_gc_heap`). Used by the core process, the server, each
tensor-parallel worker and `LLM` (for its lifetime: `LLM.close()` thaws)."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then move every object alive to the permanent generation.
    Objects made later are collected as usual. Call `thaw_heap()` before the process exits
    (or the owner closes)."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo `freeze_startup_heap`: objects left frozen are never finalized, and native
    extensions (Triton's nanobind bindings) then print pages of leak warnings at exit."""
    gc.unfreeze()
