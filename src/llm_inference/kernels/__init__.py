"""Kernels: Triton implementations for CUDA and PyTorch references (reference.py) for any device.

One contract, `KernelOps`: the module `reference` implements it on any device, the module
`triton_ops` on CUDA, with the same signatures and semantics (those of reference.py; the Triton
launchers may take extra keyword arguments). `get_ops(backend, device)` is the only place that
chooses: the engine resolves the backend name once, when its configuration is built
(`resolve_backend`), and passes the ops object down to every layer; no module has a default.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch

BACKENDS = ("auto", "triton", "reference")


class KernelOps(Protocol):
    """The kernels every layer calls. Shapes are documented in reference.py."""

    def store_kv_cache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...  # fmt: skip

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def rotary_store_kv(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor: ...  # fmt: skip

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def paged_attention_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
        out: torch.Tensor | None = None, max_seq_len: int | None = None,
    ) -> torch.Tensor: ...  # fmt: skip

    def unified_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
        scale: float, out: torch.Tensor | None = None, max_query_len: int | None = None,
        max_seq_len: int | None = None, seq_order: torch.Tensor | None = None,
    ) -> torch.Tensor: ...  # fmt: skip


def resolve_backend(backend: str, device_type: str) -> str:
    """'auto' -> 'triton' on CUDA, 'reference' elsewhere; unknown names and Triton without
    CUDA are errors that say what is allowed."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        return "triton" if device_type == "cuda" else "reference"
    if backend == "triton" and device_type != "cuda":
        raise ValueError(f"kernel_backend='triton' needs a CUDA device, not {device_type!r}")
    return backend


def get_ops(backend: str, device: torch.device | str) -> KernelOps | ModuleType:
    """The ops object for a backend name ('auto' resolved for `device`)."""
    name = resolve_backend(backend, torch.device(device).type)
    if name == "triton":
        from llm_inference.kernels import triton_ops

        return triton_ops
    from llm_inference.kernels import reference

    return reference
