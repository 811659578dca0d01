"""`TritonOps`: the KernelOps of the Triton kernels, with the signatures and semantics of
reference.py (see get_ops), and the performance choices made from the device and the shapes.

Each launcher checks shapes, dtypes, strides and devices and raises ValueError. Extras beyond
the reference signatures are optional: `max_seq_len` for paged attention (sets the split count
without a host sync) and keyword `out=` buffers for rms_norm and silu_and_mul. unified_attention
(mixed prefill chunks and decodes in one launch) takes the same bounds as its reference.

Decided once, for the device: `flash_prompts` (prompt chunks through FlashAttention 4 where
the flash-attn-4 package runs: kernels/flash_attention.py), `pdl` (programmatic dependent
launch for every launcher that takes it; kernels/pdl.py, envs.LLM_INFERENCE_PDL),
`skinny_rows` (up to how many rows `linear` and `gate_up_silu` take the skinny GEMM, 0: never;
envs.LLM_INFERENCE_SKINNY_GEMM and LLM_INFERENCE_SKINNY_ROWS) and `skinny_fp8`
(whether it may read FP8 weights: Triton converts e4m3 from compute capability 8.9).
Decided per call, from the shapes: the skinny GEMM where it applies (`skinny_applies`: decode
batches; inside a CUDA graph, once per graph), else F.linear (cuBLAS); the attention kernel's
variant (unified_attention.plan). FP8 weights (layers/fp8.py) come with `weight_scale=` and
only where the skinny GEMM applies: the FP8 linear method asks first.

The ops also carry the fused sampler (kernels/sampling.py: `sample`, `race_shard`,
`warm_up_sampler`; `fused_sampler` True).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm_inference import envs
from llm_inference.kernels import flash_attention, pdl, sampling
from llm_inference.kernels import skinny_gemm as sg
from llm_inference.kernels.activation import silu_and_mul
from llm_inference.kernels.device import num_sms
from llm_inference.kernels.fp8_quant import quantize_rows, silu_and_mul_quant
from llm_inference.kernels.kv_cache import store_kv_cache
from llm_inference.kernels.paged_attention import paged_attention_decode
from llm_inference.kernels.rms_norm import rms_norm, rms_norm_quant
from llm_inference.kernels.rotary import rotary_embedding, rotary_store_kv
from llm_inference.kernels.unified_attention import unified_attention
from llm_inference.kernels.warm_up import StepShape, warm_up_shapes

SKINNY_DTYPES = (torch.float16, torch.bfloat16)

# The module is also the Triton launchers' namespace, with the names of reference.py (tests
# and benchmarks call them one by one); the engine uses TritonOps.
__all__ = [
    "TritonOps", "paged_attention_decode", "quantize_rows", "rms_norm", "rms_norm_quant",
    "rotary_embedding", "rotary_store_kv", "silu_and_mul", "silu_and_mul_quant",
    "store_kv_cache", "unified_attention",
]  # fmt: skip


class TritonOps:
    """The Triton kernels on `device` (CUDA; the CPU only under Triton's interpreter, in
    tests)."""

    fused_sampler = True
    sample = staticmethod(sampling.sample)
    race_shard = staticmethod(sampling.race_shard)
    warm_up_sampler = staticmethod(sampling.warm_up)
    store_kv_cache = staticmethod(store_kv_cache)  # no choice to make
    rotary_embedding = staticmethod(rotary_embedding)
    silu_and_mul = staticmethod(silu_and_mul)
    quantize_rows = staticmethod(quantize_rows)  # FP8 activations (layers/fp8.py)
    silu_and_mul_quant = staticmethod(silu_and_mul_quant)

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pdl = pdl.resolve(envs.LLM_INFERENCE_PDL, self.device)
        self.skinny_rows = envs.LLM_INFERENCE_SKINNY_ROWS if envs.LLM_INFERENCE_SKINNY_GEMM else 0
        cuda = self.device.type == "cuda"
        self.skinny_fp8 = not cuda or torch.cuda.get_device_capability(self.device) >= (8, 9)
        self.flash_prompts = flash_attention.available(self.device)

    # ---- linear layers --------------------------------------------------------------------

    def skinny_applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the skinny GEMM computes x @ weight^T: 2-D x of 1 to `skinny_rows` rows on this
        device type, float16 or bfloat16 with the weight of the same dtype or FP8 (`skinny_fp8`),
        or both FP8, both contiguous in their last dim."""
        fp8_weight = weight.dtype == sg.FP8 and self.skinny_fp8
        return (
            x.device.type == self.device.type
            and x.dim() == 2
            and 1 <= x.shape[0] <= self.skinny_rows
            and (
                (x.dtype in SKINNY_DTYPES and (weight.dtype == x.dtype or fp8_weight))
                or (x.dtype == sg.FP8 and fp8_weight)
            )
            and x.stride(-1) == 1
            and weight.stride(-1) == 1
        )

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
        x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`weight_scale`: weight is FP8 with that float32 scale per row; `x_scale`: x is FP8
        too, with that scale per row, and the result in `out_dtype` (both only where
        `skinny_applies`)."""
        if self.skinny_applies(x, weight):
            return sg.skinny_gemm(
                x, weight, weight_scale=weight_scale, x_scale=x_scale, out_dtype=out_dtype,
                pdl=self.pdl,
            )  # fmt: skip
        return F.linear(x, weight)

    def gate_up_silu(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
        x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Where the skinny GEMM applies, gate_up and SiLU-and-mul in one kernel (no [T, 2I]
        intermediate); else F.linear, then silu_and_mul. The scales as in `linear`."""
        if self.skinny_applies(x, weight):
            return sg.skinny_gemm_silu(
                x, weight, weight_scale=weight_scale, x_scale=x_scale, out_dtype=out_dtype,
                pdl=self.pdl,
            )  # fmt: skip
        return silu_and_mul(F.linear(x, weight))

    # ---- the kernels that launch with PDL ------------------------------------------------

    def rms_norm(self, x, weight, eps: float, residual=None, *, out=None):
        return rms_norm(x, weight, eps, residual, out=out, pdl=self.pdl)

    def rms_norm_quant(self, x, weight, eps: float, residual=None):
        return rms_norm_quant(x, weight, eps, residual, pdl=self.pdl)

    def rotary_store_kv(
        self, positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:  # fmt: skip
        return rotary_store_kv(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            pdl=self.pdl,
        )  # fmt: skip

    def unified_attention(
        self, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale: float, out=None,
        max_query_len: int | None = None, max_seq_len: int | None = None, seq_order=None,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> torch.Tensor:  # fmt: skip
        """With `flash_prompts`, a step's prompt chunks go to FlashAttention 4 and its decodes
        to the decode kernel, into the same output (kernels/flash_attention.py)."""
        chunks = max_query_len is None or max_query_len > 1
        if chunks and self.flash_prompts and flash_attention.applies(q, k_cache):
            max_query_len = q.shape[0] if max_query_len is None else max_query_len
            max_seq_len = max_seq_len or block_table.shape[1] * k_cache.shape[1]
            flash = flash_attention.prompt_attention(
                q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale,
                max_query_len, max_seq_len,
            )  # fmt: skip
            out = flash if out is None else out.copy_(flash)
            # what is left: the decodes, in batch order as in any step with chunks
            max_query_len, seq_order = 1, None
        return unified_attention(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, out, max_query_len,
            max_seq_len, seq_order, k_scale, v_scale, pdl=self.pdl,
        )  # fmt: skip

    def warm_up_shapes(
        self, num_kv_heads: int, group: int, head_dim: int, block_size: int,
        max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
    ) -> list[StepShape]:  # fmt: skip
        return warm_up_shapes(
            num_kv_heads, group, head_dim, block_size, max_num_seqs, max_model_len,
            max_num_batched_tokens, num_sms(self.device), self.skinny_rows,
        )  # fmt: skip
