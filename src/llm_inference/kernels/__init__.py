"""Kernels: Triton implementations for CUDA and PyTorch references (reference.py) for any device.

`get_ops(use_triton)` returns a namespace with the same functions either way:
paged_attention_decode, unified_attention, store_kv_cache, rms_norm, rotary_embedding,
silu_and_mul.
Their signatures and semantics are those of `reference.py`.
"""

from __future__ import annotations

from types import ModuleType

from llm_inference.kernels import reference


def get_ops(use_triton: bool) -> ModuleType:
    if use_triton:
        from llm_inference.kernels import triton_ops

        return triton_ops
    return reference
