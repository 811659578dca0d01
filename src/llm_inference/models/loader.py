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

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from llm_inference.config import CheckpointError, ModelConfig
from llm_inference.kernels import KernelOps
from llm_inference.models.llama import LlamaForCausalLM

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


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


def check_shapes(found: dict[str, tuple[int, ...]], c: ModelConfig, source: str) -> None:
    want = expected_shapes(c)
    missing = sorted(set(want) - set(found))
    unexpected = sorted(n for n in set(found) - set(want) if not _ignored(n, c))
    wrong = sorted(
        f"{n}: checkpoint {tuple(found[n])}, expected {want[n]}"
        for n in set(want) & set(found)
        if tuple(found[n]) != want[n]
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if wrong:
        problems.append(f"wrongly shaped tensors: {'; '.join(wrong)}")
    if problems:
        raise CheckpointError(f"{source}: " + " | ".join(problems))


def safetensors_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint path does not exist or is not a folder: {folder}")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
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
    from safetensors import safe_open

    shapes = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    shapes[name] = tuple(sf.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read safetensors file {f}: {e}") from e
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

        weights = iter_gguf_weights(path, dtype)
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
    return model.eval()


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (and chat template) through transformers."""
    from transformers import AutoTokenizer

    path = Path(path)
    if is_gguf(path):
        from llm_inference.models.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)
