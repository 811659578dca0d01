"""The Triton ops, with the signatures and semantics of reference.py (see get_ops).

Each launcher checks shapes, dtypes, strides and devices and raises ValueError. Extras beyond
the reference signatures are optional: `max_seq_len` for paged attention (sets the split count
without a host sync) and keyword `out=` buffers for rms_norm and silu_and_mul. unified_attention
(mixed prefill chunks and decodes in one launch) takes the same bounds as its reference.
"""

from __future__ import annotations

from llm_inference.kernels.activation import silu_and_mul
from llm_inference.kernels.kv_cache import store_kv_cache
from llm_inference.kernels.paged_attention import paged_attention_decode
from llm_inference.kernels.rms_norm import rms_norm
from llm_inference.kernels.rotary import rotary_embedding, rotary_store_kv
from llm_inference.kernels.sampling import race_shard, sample
from llm_inference.kernels.sampling import warm_up as warm_up_sampler
from llm_inference.kernels.unified_attention import unified_attention

# The sampler's last step is `sample` (and, under tensor parallelism, `race_shard`), not the
# PyTorch reference of sample/sampler.py.
fused_sampler = True

__all__ = [
    "fused_sampler",
    "paged_attention_decode",
    "race_shard",
    "rms_norm",
    "rotary_embedding",
    "rotary_store_kv",
    "sample",
    "silu_and_mul",
    "store_kv_cache",
    "unified_attention",
    "warm_up_sampler",
]
