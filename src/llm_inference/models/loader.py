"""Checkpoint loading: config, weights (safetensors or GGUF) and tokenizer.

Weights are streamed one tensor at a time (safetensors are memory-mapped) and copied straight
into the shard-sized parameters on the target device through each parameter's
`weight_loader`; the whole checkpoint is never held in host memory. Under tensor parallelism
each safetensors tensor reaches the loaders as a `LazySlice`: a rank's loader narrows it to its
own part, and only that part is read from the file (GGUF tensors are dequantized whole, then
narrowed). Before any tensor is read,
the names and shapes in the checkpoint headers are checked against what the config implies,
and every problem is reported in one error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from llm_inference.config import CheckpointError, ModelConfig, read_json_file
from llm_inference.kernels import KernelOps
from llm_inference.models.llama import LlamaForCausalLM

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# Weight dtypes that are loaded (cast to the model dtype); anything else (integers, bools,
# FP8 without its scales) is refused.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_LISTED = 20  # names listed per kind of problem in one error message


def is_gguf(path: str | Path) -> bool:
    """A .gguf file, or any file that starts with the GGUF magic bytes."""
    path = Path(path)
    if path.suffix == ".gguf":
        return True
    if not path.is_file():
        return False
    from llm_inference.models.gguf import is_gguf_file

    return is_gguf_file(path)


def load_model_config(path: str | Path) -> ModelConfig:
    if is_gguf(path):
        from llm_inference.models.gguf import load_gguf_config

        return load_gguf_config(path)
    return ModelConfig.from_pretrained(path)


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and full (unsharded) shapes a checkpoint must hold."""
    h, i = c.hidden_size, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (c.q_size, h),
            p + "self_attn.k_proj.weight": (c.kv_size, h),
            p + "self_attn.v_proj.weight": (c.kv_size, h),
            p + "self_attn.o_proj.weight": (h, c.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def _ignored(name: str, c: ModelConfig) -> bool:
    # Tied checkpoints sometimes still carry lm_head.weight: it equals the embedding.
    return name.endswith("rotary_emb.inv_freq") or (
        c.tie_word_embeddings and name == "lm_head.weight"
    )


def _listing(items: list[str], sep: str = ", ") -> str:
    shown = sep.join(items[:_LISTED])
    return shown if len(items) <= _LISTED else f"{shown}{sep}... ({len(items)} in all)"


def check_shapes(
    found: dict[str, tuple[int, ...]],
    c: ModelConfig,
    source: str,
    other_problems: Iterable[str] = (),
) -> None:
    """Raise one CheckpointError listing every missing, unexpected and wrongly shaped tensor
    (Hugging Face names, full shapes) plus `other_problems`; nothing if all is as `c` says."""
    want = expected_shapes(c)
    missing = sorted(set(want) - set(found))
    unexpected = sorted(n for n in set(found) - set(want) if not _ignored(n, c))
    wrong = sorted(
        f"{n}: checkpoint {tuple(found[n])}, expected {want[n]}"
        for n in set(want) & set(found)
        if tuple(found[n]) != want[n]
    )
    problems = list(other_problems)
    if missing:
        problems.append(f"missing tensors: {_listing([f'{n} {want[n]}' for n in missing])}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if wrong:
        problems.append(f"wrongly shaped tensors: {_listing(wrong, '; ')}")
    if problems:
        raise CheckpointError(f"{source}: " + " | ".join(problems))


def safetensors_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint path does not exist or is not a folder: {folder}")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json_file(index, index.name)
        if not isinstance(data, dict):
            raise CheckpointError(f"{index}: {index.name} must hold a JSON object")
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


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the headers of `files` (no data is read); CheckpointError for
    unreadable headers, non-float dtypes and tensors stored twice."""
    shapes, problems = safetensors_header_check(files)
    if problems:
        raise CheckpointError(f"{files[0].parent}: " + " | ".join(problems))
    return shapes


def safetensors_header_check(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    problems = []
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    part = sf.get_slice(name)
                    dtype = part.get_dtype()
                    if dtype not in FLOAT_DTYPES:
                        problems.append(
                            f"{f.name}: tensor {name} has dtype {dtype}; "
                            f"only {', '.join(FLOAT_DTYPES)} are supported"
                        )
                    if name in where:
                        problems.append(f"tensor {name} is stored twice ({where[name]}, {f.name})")
                    shapes[name] = tuple(part.get_shape())
                    where[name] = f.name
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read safetensors file {f}: {e}") from e
    return shapes, problems


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
        return self._slice[:]


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, LazySlice]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, LazySlice(sf.get_slice(name))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def load_weights(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor | LazySlice]]
) -> None:
    """Copy Hugging Face-named tensors (or lazy slices of them) into the model's (fused,
    sharded) parameters; a sharded parameter's loader reads only its rank's part."""
    params = dict(model.named_parameters())
    for hf_name, tensor in weights:
        if _ignored(hf_name, model.config):
            continue
        name = hf_name.removeprefix("model.")
        shard_id = None
        for ckpt_part, (fused, sid) in model.packed_modules_mapping.items():
            if f".{ckpt_part}." in name:
                name, shard_id = name.replace(ckpt_part, fused), sid
                break
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        if loader is None:  # replicated (norms): read whole
            loader = default_weight_loader
            if isinstance(tensor, LazySlice):
                tensor = tensor.materialize()
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(param.dtype)
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)


def load_model(
    path: str | Path,
    ops: KernelOps,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    config: ModelConfig | None = None,
) -> LlamaForCausalLM:
    """Build our model for the checkpoint at `path` (a folder or a .gguf file) and load it,
    running its kernels through `ops` (see kernels.get_ops)."""
    path = Path(path)
    config = config or load_model_config(path)
    if is_gguf(path):
        from llm_inference.models.gguf import iter_gguf_weights

        weights = iter_gguf_weights(path, dtype, config)  # checks the tensors first
    else:
        files = safetensors_files(path)
        check_shapes(safetensors_shapes(files), config, str(path))
        weights = iter_safetensors(files)
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(config, ops)
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
    from transformers import AutoTokenizer

    path = Path(path)
    if is_gguf(path):
        from llm_inference.models.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path does not exist or is not a folder: {path}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) were found in the checkpoint "
            f"folder {path}"
        )
    return AutoTokenizer.from_pretrained(path)
