"""Frozen configuration dataclasses, built once and never mutated.

`ModelConfig` describes a checkpoint (models/model_config.py builds it from `config.json`,
models/gguf.py from GGUF metadata); the others describe the engine: cache, scheduler,
parallelism, and `EngineConfig` holding them all (engine/arg_utils.py builds it from the engine
arguments). Every `ModelConfig` is validated when built (types, ranges, consistency), so that
nothing is sized from an absurd value. This module imports only the standard library: every
part of the package may import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Inclusive ranges of the size fields: generous for every released Llama-architecture model
# (Llama 3.1 405B: hidden 16384, intermediate 53248, 126 layers, 128 heads; vocabularies up to
# a few hundred thousand), small enough that no bogus value sizes a huge allocation.
# max_position_embeddings also sizes the rotary cos/sin table ([positions, head_dim] float32).
SIZE_LIMITS = {
    "hidden_size": (1, 1 << 17),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "intermediate_size": (1, 1 << 20),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, 1 << 20),
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be loaded: the message names the problem."""


def is_int(value: Any) -> bool:
    """An integer proper (JSON 2, not 2.0, "2" or true)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x ("llama3") frequency scaling of RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        problems = []
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, key)
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                problems.append(f"{key} must be a positive finite number, not {value!r}")
        if not problems and self.high_freq_factor <= self.low_freq_factor:
            problems.append(
                f"high_freq_factor ({self.high_freq_factor}) must be greater than "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        orig = self.original_max_position_embeddings
        if not is_int(orig) or not 1 <= orig <= SIZE_LIMITS["max_position_embeddings"][1]:
            problems.append(f"original_max_position_embeddings is out of range: {orig!r}")
        if problems:
            raise CheckpointError("invalid llama3 rope scaling: " + "; ".join(problems))


@dataclass(frozen=True)
class YarnScaling:
    """YaRN scaling of RoPE (Qwen's long-context configs), as transformers computes it
    (`_compute_yarn_parameters`): each frequency blends its original value and its value
    divided by `factor`, along a ramp between the dimensions that turn `beta_fast` and
    `beta_slow` times over the original context; cos and sin are multiplied by
    `attention_factor` (None: 0.1 ln(factor) + 1)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True
    rope_type: str = "yarn"

    def __post_init__(self) -> None:
        problems = []
        for key in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, key)
            if key == "attention_factor" and value is None:
                continue
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                problems.append(f"{key} must be a positive finite number, not {value!r}")
        orig = self.original_max_position_embeddings
        if not is_int(orig) or not 1 <= orig <= SIZE_LIMITS["max_position_embeddings"][1]:
            problems.append(f"original_max_position_embeddings is out of range: {orig!r}")
        if not isinstance(self.truncate, bool):
            problems.append(f"truncate must be true or false, not {self.truncate!r}")
        if problems:
            raise CheckpointError("invalid yarn rope scaling: " + "; ".join(problems))

    @property
    def cos_sin_scale(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


FP8_WEIGHT_SCALES = ("online", "tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Format:
    """How the linear layers hold FP8 weights (layers/fp8.py). `weight_scale`: "online" (an
    unquantized checkpoint, quantized at load: --quantization fp8), or the checkpoint's scales:
    "tensor" (one per weight: `weight_scale`), "channel" (one per output row: `weight_scale`
    [out, 1]) or "block" (one per `weight_block_size` block: `weight_scale_inv`).
    `static_input_scale`: the checkpoint has each layer's activation scale (`input_scale`);
    otherwise activations are scaled per token at run time. `kv_cache_scales`: the config
    declares an FP8 KV cache with stored scales (`kv_cache_scheme`), so every attention layer's
    K and V scales must be in the checkpoint (models/model_config.py's `kv_scale_shapes`)."""

    weight_scale: str
    weight_block_size: tuple[int, int] | None = None
    static_input_scale: bool = False
    kv_cache_scales: bool = False

    def __post_init__(self) -> None:
        if self.weight_scale not in FP8_WEIGHT_SCALES:
            raise CheckpointError(
                f"FP8 weight scales must be one of {FP8_WEIGHT_SCALES}: {self.weight_scale!r}"
            )
        block = self.weight_block_size
        if (self.weight_scale == "block") != (block is not None) or (
            block is not None and (len(block) != 2 or not all(is_int(b) and b > 0 for b in block))
        ):
            raise CheckpointError(
                f"weight_block_size must be two positive integers for block scales (only): "
                f"{block!r} with {self.weight_scale!r} scales"
            )
        if self.weight_scale == "online" and (self.static_input_scale or self.kv_cache_scales):
            raise CheckpointError("online FP8 quantization has no static input or KV scales")


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's shapes, RoPE and special tokens, in transformers' names, and its family's
    hooks into the Llama layout (models/registry.py). Validated when built: one CheckpointError
    lists every mistyped, out-of-range or inconsistent field."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | YarnScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"
    model_type: str = "llama"
    architecture: str = "LlamaForCausalLM"  # a name of models/registry.py
    qkv_bias: bool = False  # q, k and v projections with a bias (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3)
    # Mistral's attention window; none is implemented, so a model_len above it is refused.
    sliding_window: int | None = None
    # FP8 linear layers (the LM head and embeddings stay in the model dtype): the checkpoint's
    # format, or "online" when the engine's `quantization="fp8"` quantizes at load.
    quantization: Fp8Format | None = None

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise CheckpointError("invalid model configuration: " + "; ".join(problems))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _problems(c: ModelConfig) -> list[str]:
    """Every type, range and consistency problem of a ModelConfig's fields."""
    problems = []
    for key, (low, high) in SIZE_LIMITS.items():
        value = getattr(c, key)
        if not is_int(value):
            problems.append(f"{key} must be an integer, not {value!r}")
        elif value < low:
            problems.append(f"{key} ({value}) must be at least {low}")
        elif value > high:
            problems.append(f"{key} ({value}) is at most {high} here")
    if not problems:
        if c.head_dim % 2:
            problems.append(f"head_dim ({c.head_dim}) must be even (rotary embeddings)")
        if c.num_attention_heads % c.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({c.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({c.num_key_value_heads})"
            )
    for key in ("rms_norm_eps", "rope_theta"):
        value = getattr(c, key)
        if not is_number(value) or not math.isfinite(value) or value <= 0:
            problems.append(f"{key} must be a positive finite number, not {value!r}")
    if not isinstance(c.tie_word_embeddings, bool):
        problems.append(f"tie_word_embeddings must be true or false: {c.tie_word_embeddings!r}")
    if c.bos_token_id is not None and (not is_int(c.bos_token_id) or c.bos_token_id < 0):
        problems.append(f"bos_token_id must be a non-negative integer, not {c.bos_token_id!r}")
    eos = c.eos_token_ids
    if not isinstance(eos, tuple) or not all(is_int(i) and i >= 0 for i in eos):
        problems.append(f"eos_token_id must be non-negative integers, not {eos!r}")
    if c.rope_scaling is not None and not isinstance(c.rope_scaling, (RopeScaling, YarnScaling)):
        problems.append(f"rope_scaling must be a RopeScaling or YarnScaling: {c.rope_scaling!r}")
    for key in ("torch_dtype", "model_type", "architecture"):
        if not isinstance(getattr(c, key), str):
            problems.append(f"{key} must be a string, not {getattr(c, key)!r}")
    for key in ("qkv_bias", "qk_norm"):
        if not isinstance(getattr(c, key), bool):
            problems.append(f"{key} must be true or false, not {getattr(c, key)!r}")
    window = c.sliding_window
    if window is not None and (not is_int(window) or window < 1):
        problems.append(f"sliding_window must be a positive integer or null, not {window!r}")
    if c.quantization is not None and not isinstance(c.quantization, Fp8Format):
        problems.append(f"quantization must be an Fp8Format or None, not {c.quantization!r}")
    return problems


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Share the K/V of full blocks of equal token prefixes across requests (core/prefix_cache.py).
    enable_prefix_caching: bool = True
    # The K/V caches' torch dtype: EngineConfig.dtype, or "float8_e4m3fn" (kv_cache_dtype="fp8":
    # one scale per layer for K and one for V, the checkpoint's or 1.0; kernels/reference.py).
    kv_cache_dtype: str = "float32"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    # The most prompt tokens one request computes in a step (0: as many as the budget leaves),
    # so that a long prompt's chunks leave room for the other requests (vLLM's name).
    long_prefill_token_threshold: int = 0
    # True when max_model_len came from the model, not the user: the engine may then lower it
    # to what the KV cache holds.
    max_model_len_is_default: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # NCCL for every all-reduce: no symmetric-memory all-reduce of small messages on CUDA
    # (distributed/custom_all_reduce.py; vLLM's name).
    disable_custom_all_reduce: bool = False
    # "mp": worker processes on this host; "ray": Ray actors, across a Ray cluster's nodes.
    distributed_executor_backend: str = "mp"
    # Engine cores, each with its own tensor-parallel group, behind one front end.
    data_parallel_size: int = 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from, resolved (engine/arg_utils.py's
    `EngineArgs.create_engine_config`): no field is "auto" or None-for-default except
    `cache.kv_cache_memory_bytes` (None: sized from the device's free memory)."""

    model_path: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    dtype: str = "float32"
    # Resolved kernel backend: "triton" (CUDA) or "reference" (PyTorch, any device).
    kernel_backend: str = "reference"
    # CUDA graphs (Triton kernels on CUDA) unless True (as vLLM's enforce_eager).
    enforce_eager: bool = False
    seed: int = 0
    # Schedule and launch step n+1 before waiting for step n's tokens (engine/llm_engine.py).
    async_scheduling: bool = True
