"""Checkpoint loading: config, weights (safetensors or GGUF) and tokenizer.

Weights are streamed one tensor at a time (safetensors are memory-mapped) and copied straight
into the shard-sized parameters on the target device through each parameter's
`weight_loader`; the whole checkpoint is never held in host memory. Under tensor parallelism
each safetensors tensor reaches the loaders as a `LazySlice`: a rank's loader narrows it to its
own part, and only that part is read from the file (GGUF tensors are dequantized whole, then
narrowed). Before any tensor is read, the names and shapes in the checkpoint headers are
checked against what the config implies (models/model_config.py's `check_shapes`), and every
problem is reported in one error. A checkpoint's FP8 KV cache scales (`self_attn.k_scale`, ...)
become its attention layers' `k_scale` and `v_scale`, which only an FP8 cache reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from llm_inference.config import CheckpointError, ModelConfig
from llm_inference.kernels import KernelOps
from llm_inference.layers.fp8 import Fp8Config
from llm_inference.models.gguf import iter_gguf_weights, load_gguf_config, load_gguf_tokenizer
from llm_inference.models.gguf_reader import is_gguf
from llm_inference.models.model_config import (
    check_shapes,
    ignored_tensor,
    kv_scale_of,
    load_hf_config,
    read_json_object,
)
from llm_inference.models.registry import model_class

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# Weight dtypes that are loaded (cast to the model dtype); anything else (integers, bools,
# FP8 outside an FP8 checkpoint) is refused.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
FP8_DTYPE = "F8_E4M3"  # the weights of an FP8 checkpoint (config.json's quantization_config)


def load_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint: a .gguf file's metadata or a folder's config.json."""
    if is_gguf(path):
        return load_gguf_config(path)
    return load_hf_config(path)


def safetensors_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint path does not exist or is not a folder: {folder}")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json_object(index)
        if "weight_map" not in data:
            raise CheckpointError(f"{index}: {index.name} has no 'weight_map'")
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"{index}: 'weight_map' must be an object (tensor name -> shard file), "
                f"not {type(weight_map).__name__}"
            )
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise CheckpointError(
                    f"{index}: 'weight_map' entry {name!r}: {shard!r} must be a file name "
                    "in the checkpoint folder"
                )
        files = [folder / f for f in sorted(set(weight_map.values()))]
        if not files:
            raise CheckpointError(f"{index}: 'weight_map' is empty")
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{folder}: shards listed in {index.name} are missing: {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickled:
            raise CheckpointError(
                f"{folder} holds only pickle weights ({', '.join(sorted(pickled))}); they are "
                "never unpickled here: convert the checkpoint to safetensors first"
            )
        raise CheckpointError(f"no *.safetensors weights in checkpoint folder {folder}")
    return files


def safetensors_shapes(
    files: list[Path], dtypes: tuple[str, ...] = FLOAT_DTYPES
) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the headers of `files` (no data is read); CheckpointError for
    unreadable headers, dtypes other than `dtypes` and tensors stored twice."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    problems = []
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    part = sf.get_slice(name)
                    dtype = part.get_dtype()
                    if dtype not in dtypes:
                        problems.append(
                            f"{f.name}: tensor {name} has dtype {dtype}; "
                            f"only {', '.join(dtypes)} are supported"
                        )
                    if name in where:
                        problems.append(f"tensor {name} is stored twice ({where[name]}, {f.name})")
                    shapes[name] = tuple(part.get_shape())
                    where[name] = f.name
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read safetensors file {f}: {e}") from e
    if problems:
        raise CheckpointError(f"{files[0].parent}: " + " | ".join(problems))
    return shapes


class LazySlice:
    """A checkpoint tensor not read yet: `narrow(dim, start, length)` reads only that part
    (through safetensors' `get_slice`), `materialize()` reads it all."""

    def __init__(self, sf_slice) -> None:
        self._slice = sf_slice
        self.shape = tuple(sf_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        if not (0 <= start and start + length <= self.shape[dim]):
            raise IndexError(f"narrow({dim}, {start}, {length}) outside shape {self.shape}")
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def materialize(self) -> torch.Tensor:
        return self._slice[:] if self.shape else self._slice[()]


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, LazySlice]]:
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, LazySlice(sf.get_slice(name))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | LazySlice]]) -> None:
    """Copy Hugging Face-named tensors (or lazy slices of them) into the model's (fused,
    sharded) parameters; a sharded parameter's loader reads only its rank's part of a matrix
    (vectors and scalars, small, are read whole)."""
    params = dict(model.named_parameters())
    for hf_name, tensor in weights:
        if ignored_tensor(hf_name, model.config):
            continue
        kv_scale = kv_scale_of(hf_name)
        if kv_scale is not None:  # a float on the layer, whole on every rank
            layer, kind = kv_scale
            setattr(model.attention_layers()[layer], kind, _kv_scale(hf_name, tensor))
            continue
        name = hf_name.removeprefix("model.")
        shard_id = None
        for ckpt_part, (fused, sid) in model.packed_modules_mapping.items():
            if f".{ckpt_part}." in name:
                name, shard_id = name.replace(ckpt_part, fused), sid
                break
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        loader = loader or default_weight_loader  # replicated (norms): copied whole
        if isinstance(tensor, LazySlice) and len(tensor.shape) < 2:
            tensor = tensor.materialize()
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(param.dtype)
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)


def _kv_scale(name: str, tensor: torch.Tensor | LazySlice) -> float:
    """An FP8 KV cache scale's value (a scalar, or [1]: the header check saw the shape);
    CheckpointError naming the tensor unless it is positive and finite."""
    value = (tensor.materialize() if isinstance(tensor, LazySlice) else tensor).float()
    scale = value.reshape(-1)[0].item()
    if not (math.isfinite(scale) and scale > 0):
        raise CheckpointError(
            f"{name}: an FP8 KV cache scale must be a positive finite number, not {scale}"
        )
    return scale


def load_model(
    path: str | Path,
    ops: KernelOps,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    config: ModelConfig | None = None,
) -> nn.Module:
    """Build the model of the checkpoint's architecture (models/registry.py) for the checkpoint
    at `path` (a folder or a .gguf file) and load it, running its kernels through `ops` (see
    kernels.get_ops)."""
    path = Path(path)
    config = config or load_model_config(path)
    if is_gguf(path):
        weights = iter_gguf_weights(path, dtype, config)  # checks the tensors first
    else:
        files = safetensors_files(path)
        fp8 = config.quantization
        serialized = fp8 is not None and fp8.weight_scale != "online"
        dtypes = FLOAT_DTYPES + (FP8_DTYPE,) if serialized else FLOAT_DTYPES
        check_shapes(safetensors_shapes(files, dtypes), config, str(path))
        weights = iter_safetensors(files)
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            quant_config = None if config.quantization is None else Fp8Config(config.quantization)
            model = model_class(config.architecture)(config, ops, quant_config)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        load_weights(model, weights)
        for module in model.modules():  # the linear methods' conversions (layers/quantization)
            if hasattr(module, "quant_method"):
                module.quant_method.process_weights_after_loading(module)
    return model.eval()


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (and chat template) through transformers."""
    from transformers import AutoTokenizer  # heavy: only the front end needs a tokenizer

    path = Path(path)
    if is_gguf(path):
        return load_gguf_tokenizer(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path does not exist or is not a folder: {path}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) were found in the checkpoint "
            f"folder {path}"
        )
    return AutoTokenizer.from_pretrained(path)
