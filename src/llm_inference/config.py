"""Frozen configuration dataclasses, built once and never mutated.

`ModelConfig` comes from a checkpoint's `config.json` (or GGUF metadata, see models/gguf.py);
the others describe the engine: cache, scheduler, parallelism.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be loaded: the message names the problem."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x ("llama3") frequency scaling of RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        folder = Path(path)
        if not folder.exists():
            raise CheckpointError(f"checkpoint path does not exist: {folder}")
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"no config.json in checkpoint folder {folder}")
        try:
            data = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from e
        return cls.from_dict(data, source=str(cfg_file))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> ModelConfig:
        model_type = d.get("model_type")
        if model_type != "llama":
            raise CheckpointError(
                f"{source}: unsupported model_type {model_type!r}; only 'llama' "
                f"({', '.join(SUPPORTED_ARCHITECTURES)}) is supported"
            )
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise CheckpointError(f"{source}: {key}=true is not supported (bias-free only)")

        def req(key: str) -> Any:
            if key not in d or d[key] is None:
                raise CheckpointError(f"{source}: missing required config key {key!r}")
            return d[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = d.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _parse_rope(d, source)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        return cls(
            hidden_size=hidden,
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            intermediate_size=int(req("intermediate_size")),
            vocab_size=int(req("vocab_size")),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=str(dtype),
        )


def _parse_rope(d: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Read rope_theta and scaling from `rope_scaling` (transformers 4) or `rope_parameters` (5)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or None
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(
            f"{source}: unsupported rope scaling type {kind!r}; supported: none, 'llama3'"
        )
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: llama3 rope scaling is missing key {e}") from e


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Share the K/V of full blocks of equal token prefixes across requests (core/prefix_cache.py).
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    # True when max_model_len came from the model, not the user: the engine may then lower it
    # to what the KV cache holds.
    max_model_len_is_default: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    dtype: str = "float32"
    # Resolved kernel backend: "triton" (CUDA) or "reference" (PyTorch, any device).
    kernel_backend: str = "reference"
    # CUDA graphs for decode steps on CUDA unless True (as vLLM's enforce_eager).
    enforce_eager: bool = False
    seed: int = 0
    # Schedule and launch step n+1 before waiting for step n's tokens (engine/llm_engine.py).
    async_scheduling: bool = True


DTYPES = ("auto", "float32", "float16", "bfloat16")


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_device(device: str | None) -> str:
    """None -> 'cuda' when available else 'cpu'; 'cuda' / 'cuda:N' must exist."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPUs here")
    return str(dev)


def resolve_dtype(dtype: object, checkpoint_dtype: str, device_type: str) -> str:
    """'auto': the checkpoint's half-precision type on CUDA (bfloat16 for float32 checkpoints),
    float32 on CPU. Only float32, float16 and bfloat16 are accepted."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if name != "auto":
        return name
    if device_type != "cuda":
        return "float32"
    return "float16" if checkpoint_dtype == "float16" else "bfloat16"


def create_engine_config(
    model: str | os.PathLike | None = None,
    *,
    device: str | None = None,
    dtype: object = "auto",
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    kernel_backend: str = "auto",
    enforce_eager: bool = False,
    async_scheduling: bool = True,
    enable_prefix_caching: bool = True,
) -> EngineConfig:
    """Every engine argument checked and resolved in one place (LLM, the CLI and the server
    call this): the model path (None: the default model), device, dtype, kernel backend and
    the scheduler's defaults. Raises ValueError (CheckpointError for the checkpoint) naming
    the argument."""
    from llm_inference.kernels import resolve_backend
    from llm_inference.models.default_model import resolve_model
    from llm_inference.models.loader import load_model_config

    _positive_int("max_num_seqs", max_num_seqs)
    _positive_int("max_num_batched_tokens", max_num_batched_tokens, allow_none=True)
    _positive_int("max_model_len", max_model_len, allow_none=True)
    _positive_int("block_size", block_size)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    _positive_int("tensor_parallel_size", tensor_parallel_size)
    _positive_int("kv_cache_memory_bytes", kv_cache_memory_bytes, allow_none=True)
    util = gpu_memory_utilization
    if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0 < util <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(
            f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}"
        )
    dev = resolve_device(device)
    backend = resolve_backend(kernel_backend, dev.split(":")[0])
    model_path = str(resolve_model(model))
    model_config = load_model_config(model_path)
    limit = model_config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {limit} positions")
    max_len = max_model_len or limit
    return EngineConfig(
        model_path=model_path,
        model=model_config,
        cache=CacheConfig(
            block_size, kv_cache_memory_bytes, gpu_memory_utilization, enable_prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(8192, max_num_seqs),
            max_model_len=max_len,
            max_model_len_is_default=max_model_len is None,
        ),
        parallel=ParallelConfig(tensor_parallel_size),
        device=dev,
        dtype=resolve_dtype(dtype, model_config.torch_dtype, dev.split(":")[0]),
        kernel_backend=backend,
        enforce_eager=bool(enforce_eager),
        seed=seed,
        # Placeholder tokens live on rank 0's device only: tensor parallel runs synchronously.
        async_scheduling=bool(async_scheduling) and tensor_parallel_size == 1,
    )
