"""Frozen configuration dataclasses, built once and never mutated.

`ModelConfig` comes from a checkpoint's `config.json` (plus the end-of-sequence ids of its
`generation_config.json`), or from GGUF metadata (see models/gguf.py); the others describe the
engine: cache, scheduler, parallelism. Every `ModelConfig` is validated when built (types,
ranges, consistency), so that nothing is sized from an absurd value.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)

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
# JSON side files (config.json, generation_config.json, the safetensors index) larger than
# this are refused before they are read.
MAX_JSON_BYTES = 64 << 20


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be loaded: the message names the problem."""


def is_int(value: Any) -> bool:
    """An integer proper (JSON 2, not 2.0, "2" or true)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_json_file(path: Path, what: str = "") -> Any:
    """The JSON value in `path`; CheckpointError (naming the file) if it is too large, not
    UTF-8 or not JSON."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path} is too large ({size} bytes) for a {what or 'JSON'} file")
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def _token_ids(value: Any, key: str) -> tuple[int, ...]:
    """`eos_token_id` as JSON spells it (null, an id, or a list of ids) as a tuple."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(is_int(i) for i in ids):
        raise CheckpointError(f"{key} must be an integer or a list of integers, not {value!r}")
    return tuple(ids)


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
        problems = _problems(self)
        if problems:
            raise CheckpointError("invalid model configuration: " + "; ".join(problems))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        """The config of a Hugging Face folder: `config.json`, with the `eos_token_id` of
        `generation_config.json` (when present) added to `eos_token_ids` after config.json's
        own, as transformers' generate() and vLLM do (Llama 3 Instruct lists <|eot_id|> only
        there)."""
        folder = Path(path)
        if not folder.exists():
            raise CheckpointError(f"checkpoint path does not exist: {folder}")
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"no config.json in checkpoint folder {folder}")
        data = read_json_file(cfg_file, "config.json")
        if not isinstance(data, dict):
            raise CheckpointError(f"{cfg_file}: config.json must hold a JSON object")
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            gen = read_json_file(gen_file, "generation_config.json")
            if not isinstance(gen, dict):
                raise CheckpointError(f"{gen_file} must hold a JSON object")
            try:
                extra = _token_ids(gen.get("eos_token_id"), "eos_token_id")
            except CheckpointError as e:
                raise CheckpointError(f"{gen_file}: {e}") from None
            if extra:
                try:
                    own = _token_ids(data.get("eos_token_id"), "eos_token_id")
                except CheckpointError as e:
                    raise CheckpointError(f"{cfg_file}: {e}") from None
                merged = list(dict.fromkeys(own + extra))
                data = {**data, "eos_token_id": merged}
        return cls.from_dict(data, source=str(cfg_file))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> ModelConfig:
        """A ModelConfig from a transformers config dict; CheckpointError naming the key for
        any missing, mistyped, out-of-range or inconsistent value."""
        try:
            return cls._from_dict(d, source)
        except CheckpointError as e:
            if str(e).startswith(source):
                raise
            raise CheckpointError(f"{source}: {e}") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any], source: str) -> ModelConfig:
        if not isinstance(d, dict):
            raise CheckpointError(f"the config must be a JSON object, not {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type != "llama":
            raise CheckpointError(
                f"unsupported model_type {model_type!r}; only 'llama' "
                f"({', '.join(SUPPORTED_ARCHITECTURES)}) is supported"
            )
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise CheckpointError(f"{key}=true is not supported (bias-free only)")

        def integer(key: str, default: Any = None) -> int:
            value = d.get(key)
            if value is None:
                if default is None:
                    raise CheckpointError(f"missing required config key {key!r}")
                return default
            if not is_int(value):
                raise CheckpointError(f"{key} must be an integer, not {value!r}")
            return value

        def number(key: str, default: float) -> float:
            value = d.get(key)
            if value is None:
                return default
            if not is_number(value):
                raise CheckpointError(f"{key} must be a number, not {value!r}")
            try:
                return float(value)
            except OverflowError:
                raise CheckpointError(f"{key} is out of range: {value!r}") from None

        hidden = integer("hidden_size")
        heads = integer("num_attention_heads")
        if d.get("head_dim") is None:
            if heads < 1:
                raise CheckpointError(f"num_attention_heads must be at least 1, not {heads}")
            if hidden % heads:
                raise CheckpointError(
                    f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                    "and the config has no head_dim"
                )
        head_dim = integer("head_dim", hidden // max(heads, 1))
        rope_theta, rope_scaling = _parse_rope(d, source)
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise CheckpointError(f"tie_word_embeddings must be true or false, not {tie!r}")
        bos = d.get("bos_token_id")
        if bos is not None and not is_int(bos):
            raise CheckpointError(f"bos_token_id must be an integer or null, not {bos!r}")
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        if not isinstance(dtype, str):
            raise CheckpointError(f"torch_dtype must be a string, not {dtype!r}")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=integer("num_key_value_heads", heads),
            head_dim=head_dim,
            intermediate_size=integer("intermediate_size"),
            vocab_size=integer("vocab_size"),
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=tie,
            max_position_embeddings=integer("max_position_embeddings", 2048),
            bos_token_id=bos,
            eos_token_ids=_token_ids(d.get("eos_token_id"), "eos_token_id"),
            torch_dtype=dtype,
        )


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
    if c.rope_scaling is not None and not isinstance(c.rope_scaling, RopeScaling):
        problems.append(f"rope_scaling must be a RopeScaling, not {c.rope_scaling!r}")
    if not isinstance(c.torch_dtype, str):
        problems.append(f"torch_dtype must be a string, not {c.torch_dtype!r}")
    return problems


def _parse_rope(d: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Read rope_theta and scaling from `rope_scaling` (transformers 4) or `rope_parameters` (5)."""
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise CheckpointError(f"{key} must be an object (or null), not {d[key]!r}")
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or None
    theta = d.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta")
    if theta is None:
        theta = 10000.0
    if not is_number(theta) or not math.isfinite(theta) or theta <= 0:
        raise CheckpointError(f"rope_theta must be a positive finite number, not {theta!r}")
    theta = float(theta)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if not scaling:
        return theta, None
    where = "rope_scaling" if scaling is d.get("rope_scaling") else "rope_parameters"
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if not isinstance(kind, str):
        raise CheckpointError(f"{where}.rope_type must be a string, not {kind!r}")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"unsupported rope scaling type {kind!r}; supported: none, 'llama3'")
    values = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in scaling:
            raise CheckpointError(f"llama3 rope scaling is missing key {key!r}")
        if not is_number(scaling[key]):
            raise CheckpointError(f"{where}.{key} must be a number, not {scaling[key]!r}")
        values[key] = float(scaling[key])
    orig = scaling.get("original_max_position_embeddings")
    if orig is None:
        raise CheckpointError(
            "llama3 rope scaling is missing key 'original_max_position_embeddings'"
        )
    if not is_int(orig):
        raise CheckpointError(
            f"{where}.original_max_position_embeddings must be an integer, not {orig!r}"
        )
    return theta, RopeScaling(original_max_position_embeddings=orig, **values)


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
    # NCCL for every all-reduce: no symmetric-memory all-reduce of small messages on CUDA
    # (distributed/custom_all_reduce.py; vLLM's name).
    disable_custom_all_reduce: bool = False
    # The all-reduce of o_proj and down_proj fused with the residual add and RMSNorm after it
    # for steps of few rows (custom_all_reduce's fused_norm; CUDA, with the custom all-reduce;
    # on with the Triton kernels unless turned off).
    fused_all_reduce_norm: bool = False


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
    # CUDA graphs (Triton kernels on CUDA) unless True (as vLLM's enforce_eager).
    enforce_eager: bool = False
    # Matmuls of at most 16 rows (decode) through the Triton skinny GEMM, the MLP's gate_up
    # fused with SiLU-and-mul (kernels/skinny_gemm.py); on with kernel_backend "triton" unless
    # turned off (create_engine_config's skinny_gemm=False).
    skinny_gemm: bool = False
    # Programmatic dependent launch for the decode step's Triton kernels (kernels/pdl.py);
    # needs kernel_backend "triton" on a GPU of compute capability 9.0 or newer. None: on
    # wherever that holds (the model runner decides, per device); False with other backends.
    pdl: bool | None = False
    # Token counts at which steps with prompt tokens are captured as CUDA graphs, ascending,
    # each at most max_num_batched_tokens; None: the default ladder of executor/cuda_graph.py
    # (`mixed_buckets`); (): none (such steps run eagerly; decode steps still replay graphs).
    mixed_cuda_graph_sizes: tuple[int, ...] | None = None
    seed: int = 0
    # Schedule and launch step n+1 before waiting for step n's tokens (engine/llm_engine.py).
    async_scheduling: bool = True


DTYPES = ("auto", "float32", "float16", "bfloat16")


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _graph_sizes(sizes: object, max_num_batched_tokens: int) -> tuple[int, ...] | None:
    """mixed_cuda_graph_sizes checked: None, or integers in [2, max_num_batched_tokens] (a step
    with prompt tokens has at least two), returned sorted without repeats."""
    if sizes is None:
        return None
    name = "mixed_cuda_graph_sizes"
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"{name} must be a list of token counts (or None), got {sizes!r}")
    sizes = list(sizes)
    for n in sizes:
        if not is_int(n) or not 2 <= n <= max_num_batched_tokens:
            raise ValueError(
                f"{name}: every size must be an integer in [2, max_num_batched_tokens="
                f"{max_num_batched_tokens}], got {n!r}"
            )
    return tuple(sorted(set(sizes)))


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
    mixed_cuda_graph_sizes: list[int] | tuple[int, ...] | None = None,
    disable_custom_all_reduce: bool = False,
    fused_all_reduce_norm: bool | None = None,
    skinny_gemm: bool | None = None,
    pdl: bool | None = None,
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
    if not isinstance(disable_custom_all_reduce, bool):
        raise ValueError(
            f"disable_custom_all_reduce must be True or False, got {disable_custom_all_reduce!r}"
        )
    if fused_all_reduce_norm is not None and not isinstance(fused_all_reduce_norm, bool):
        raise ValueError(
            f"fused_all_reduce_norm must be True, False or None, got {fused_all_reduce_norm!r}"
        )
    if fused_all_reduce_norm and disable_custom_all_reduce:
        raise ValueError("fused_all_reduce_norm needs the custom all-reduce, which is disabled")
    if pdl is not None and not isinstance(pdl, bool):
        raise ValueError(f"pdl must be True, False or None, got {pdl!r}")
    if skinny_gemm is not None and not isinstance(skinny_gemm, bool):
        raise ValueError(f"skinny_gemm must be True, False or None, got {skinny_gemm!r}")
    budget = max_num_batched_tokens or max(8192, max_num_seqs)
    graph_sizes = _graph_sizes(mixed_cuda_graph_sizes, budget)
    dev = resolve_device(device)
    backend = resolve_backend(kernel_backend, dev.split(":")[0])
    if skinny_gemm and backend != "triton":
        raise ValueError(
            f"skinny_gemm=True needs the Triton kernels on CUDA, not the {backend!r} backend "
            f"on {dev!r}"
        )
    if pdl and backend != "triton":
        raise ValueError(
            f"pdl=True needs the Triton kernels on CUDA, not the {backend!r} backend on {dev!r}"
        )
    if fused_all_reduce_norm is None:  # the fused kernel is Triton's, over the custom all-reduce
        fused_all_reduce_norm = backend == "triton" and not disable_custom_all_reduce
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
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            max_model_len_is_default=max_model_len is None,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size, disable_custom_all_reduce, fused_all_reduce_norm
        ),
        device=dev,
        dtype=resolve_dtype(dtype, model_config.torch_dtype, dev.split(":")[0]),
        kernel_backend=backend,
        enforce_eager=bool(enforce_eager),
        skinny_gemm=backend == "triton" if skinny_gemm is None else skinny_gemm,
        pdl=pdl if backend == "triton" else False,
        mixed_cuda_graph_sizes=graph_sizes,
        seed=seed,
        async_scheduling=bool(async_scheduling),
    )
