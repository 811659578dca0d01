"""Linear methods: how a linear layer stores its weights and computes x @ W^T (vLLM's
quantization interface, reduced to what the engine uses).

A linear layer (layers/linear.py, and the LM head) owns no matmul: at construction it asks
`get_linear_method(quant_config, ops)` for its method, which creates the layer's parameters
(`create_weights`, at shard size, each with the layer's `weight_loader`), may convert them once
the checkpoint is loaded (`process_weights_after_loading`, called by models/loader.py), and
computes the layer's output (`apply`; for the MLP's gate_up, `apply_gate_up_silu`). A
quantization config picks the method for a layer; today the only config is None: unquantized
weights in the model dtype (`UnquantizedLinearMethod`, through the kernel ops' `linear` and
`gate_up_silu`). A quantized format (FP8) adds a `QuantizationConfig` and its method here.
"""

from __future__ import annotations

from llm_inference.kernels import KernelOps
from llm_inference.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from llm_inference.layers.quantization.unquantized import UnquantizedLinearMethod


def get_linear_method(quant_config: QuantizationConfig | None, ops: KernelOps) -> LinearMethodBase:
    """The linear method of a layer under `quant_config` (None: unquantized)."""
    if quant_config is None:
        return UnquantizedLinearMethod(ops)
    return quant_config.get_linear_method(ops)


__all__ = [
    "LinearMethodBase",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "get_linear_method",
]
