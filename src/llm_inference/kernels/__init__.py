"""Kernels: Triton implementations for CUDA and PyTorch references (reference.py) for any device.

One contract, `KernelOps`: `reference.ReferenceOps` implements it on any device,
`triton_ops.TritonOps` on CUDA, with the same signatures and semantics (those of reference.py;
the Triton methods may take extra keyword arguments). `get_ops(backend, device)` is the only
place that chooses: the engine resolves the backend name once, when its configuration is built
(`resolve_backend`), and passes the ops object down to every layer; no module has a default.

Performance choices are the ops object's, made from the device and the shapes: which matmuls
take the skinny GEMM, whether kernels launch with PDL, the attention kernel's variant, the step
shapes that compile every variant (`warm_up_shapes`). The few switches that turn a choice off
for A/B benchmarking are environment variables (llm_inference/envs.py), never arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from llm_inference.kernels.reference import ReferenceOps

if TYPE_CHECKING:  # kernels/warm_up.py imports Triton
    from llm_inference.kernels.warm_up import StepShape

BACKENDS = ("auto", "triton", "reference")


class KernelOps(Protocol):
    """The kernels every layer calls (the kernel modules have more, for their tests and
    benchmarks: the paged decode alone). Shapes are documented in
    reference.py.

    `fused_sampler`: whether the ops also have the fused sampler of kernels/sampling.py, as
    `sample`, `race_shard` and `warm_up_sampler` (that module's sample, race_shard and
    warm_up); the Triton ops do, the reference ops do not.

    The KV caches are in the model's dtype or FP8 with a scale per layer for K and for V
    (`k_scale`, `v_scale`, which other caches ignore: reference.py)."""

    fused_sampler: bool

    def store_kv_cache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None: ...  # fmt: skip

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def rotary_store_kv(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor: ...  # fmt: skip

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def quantize_rows(
        self, x: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul_quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rms_norm_quant(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...  # fmt: skip

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def skinny_applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `linear` and `gate_up_silu` take a skinny GEMM for x and weight (decode-sized
        steps; the reference ops never do). Where they do, they also take an FP8 weight with
        its float32 scale per row, `weight_scale=`, and x in FP8 too with its scale per row,
        `x_scale=` and `out_dtype=` (layers/fp8.py's decode steps)."""
        ...

    def unified_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
        scale: float, out: torch.Tensor | None = None, max_query_len: int | None = None,
        max_seq_len: int | None = None, seq_order: torch.Tensor | None = None,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor: ...  # fmt: skip

    def warm_up_shapes(
        self, num_kv_heads: int, group: int, head_dim: int, block_size: int,
        max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
    ) -> list[StepShape]:  # fmt: skip
        """Step shapes whose all-padding forwards compile every kernel variant that steps
        within these limits can launch (kernels/warm_up.py); none where nothing compiles."""
        ...


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


def get_ops(backend: str, device: torch.device | str) -> KernelOps:
    """The ops object for a backend name ('auto' resolved for `device`)."""
    device = torch.device(device)
    if resolve_backend(backend, device.type) == "triton":
        from llm_inference.kernels.triton_ops import TritonOps  # imports triton

        return TritonOps(device)
    return ReferenceOps()
