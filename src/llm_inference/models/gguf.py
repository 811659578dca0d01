"""GGUF checkpoints of the registered families as the rest of the package expects a Hugging
Face checkpoint (the file format itself: models/gguf_reader.py). `general.architecture` is
llama (Llama and Mistral files), qwen2 or qwen3 (models/registry.py: GGUF_ARCHITECTURES).

- metadata (`{arch}.*`, `tokenizer.ggml.*`) -> `ModelConfig` (`load_gguf_config`);
- tensors -> Hugging Face names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`,
  `blk.3.attn_q.bias`, `blk.3.attn_q_norm.weight` -> `...self_attn.q_norm.weight`),
  dequantized to float32 and cast to the model dtype, one at a time (`iter_gguf_weights`);
- Q and K projections of llama files: llama.cpp's converter permutes their rows (per head,
  from the "two halves" RoPE layout to interleaved pairs); `_unpermute` restores the Hugging
  Face order (Qwen files keep the two halves: llama.cpp runs them with NeoX RoPE);
- Llama 3.x RoPE scaling, which llama.cpp stores as a `rope_freqs` tensor of per-frequency
  divisors, is recovered as `RopeScaling` (and checked to reproduce that tensor); yarn
  (Qwen's) is metadata: `{arch}.rope.scaling.type`, `.factor`, `.original_context_length`;
- `convert_gguf_to_hf` writes all of it as a Hugging Face folder.

Before any tensor data is read, the tensors' names and shapes are checked against the
`ModelConfig` (models/model_config.py's `check_shapes`): one error lists every problem.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from safetensors.torch import save_file

from llm_inference.config import CheckpointError, ModelConfig, RopeScaling, YarnScaling
from llm_inference.models.gguf_reader import (
    FLOAT_TYPES,
    REQUIRED,
    dequantizable,
    dequantize,
    metadata_value,
    open_gguf,
    release_reader,
)
from llm_inference.models.model_config import check_shapes, hf_config_dict, scaled_positions
from llm_inference.models.registry import FAMILIES, GGUF_ARCHITECTURES

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BIASED = {"attn_q", "attn_k", "attn_v"}  # the layers that may have a bias (Qwen2's)
# Tensors that are not parameters: rope_freqs becomes ModelConfig.rope_scaling.
_NOT_PARAMETERS = {"rope_freqs.weight"}


def _open(path: str | os.PathLike) -> tuple[GGUFReader, str]:
    """The reader of a GGUF file of a supported architecture, and that architecture."""
    p = Path(path)
    reader = open_gguf(p)
    try:
        arch = metadata_value(reader, "general.architecture", None, str)
    except CheckpointError as e:
        raise CheckpointError(f"{p}: {e}") from None
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{p}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(map(repr, GGUF_ARCHITECTURES))} (Llama, Mistral, Qwen2, Qwen3, ...)"
        )
    return reader, arch


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06), as the original config.json most likely spelled it."""
    return float(str(np.float32(value)))


def load_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig from the `{arch}.*` and `tokenizer.ggml.*` metadata of a GGUF file."""
    return _config(*_open(path), str(path))


def _config(reader, arch: str, path: str) -> ModelConfig:
    try:
        return _config_unchecked(reader, arch)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _config_unchecked(reader, arch: str) -> ModelConfig:
    def llama(key: str, default=REQUIRED, kind: type = int):  # the arch's key (llama.*, ...)
        return metadata_value(reader, f"{arch}.{key}", default, kind)

    hidden = llama("embedding_length")
    heads = llama("attention.head_count")
    if heads < 1:
        raise CheckpointError(f"{arch}.attention.head_count must be at least 1, not {heads}")
    kv_heads = llama("attention.head_count_kv", heads)
    head_dim = llama("attention.key_length", None)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(
                f"{arch}.embedding_length ({hidden}) is not divisible by "
                f"{arch}.attention.head_count ({heads})"
            )
        head_dim = hidden // heads
    if llama("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError("partial rotary embeddings are not supported")
    tensors = {t.name: t for t in reader.checked_header.tensors}
    vocab = llama("vocab_size", None)
    if vocab is None:  # older files: the vocabulary length, or the embedding's rows
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embedding = tensors.get("token_embd.weight")
        if tokens is not None:
            vocab = len(tokens.data)
        elif embedding is not None and len(embedding.dims) == 2:
            vocab = embedding.dims[1]
        else:
            raise CheckpointError(
                f"the vocabulary size is unknown: no {arch}.vocab_size, tokenizer.ggml.tokens "
                "or two-dimensional token_embd.weight"
            )
    theta = _f32(llama("rope.freq_base", 10000.0, float))
    context = llama("context_length", 2048)
    scaling = _rope_scaling(reader, arch, tensors, theta, head_dim, context)
    eos = metadata_value(reader, "tokenizer.ggml.eos_token_id", None)
    architecture = GGUF_ARCHITECTURES[arch]
    family = FAMILIES[architecture]
    return ModelConfig(
        hidden_size=hidden,
        num_hidden_layers=llama("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=llama("feed_forward_length"),
        vocab_size=vocab,
        rms_norm_eps=_f32(llama("attention.layer_norm_rms_epsilon", 1e-5, float)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=scaled_positions(context, scaling),
        bos_token_id=metadata_value(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (eos,),
        torch_dtype="float32",  # what the dequantizer produces, exactly
        model_type=family.model_type,
        architecture=architecture,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
    )


def _rope_scaling(reader, arch: str, tensors, theta: float, head_dim: int, context: int):
    def key(name: str, default, kind: type = float):
        return metadata_value(reader, f"{arch}.rope.scaling.{name}", default, kind)

    kind, factor = key("type", "none", str), key("factor", 1.0)
    if kind == "yarn":  # as llama.cpp's converter writes Qwen's: type, factor, context
        orig = key("original_context_length", context, int)
        fast, slow = key("yarn_beta_fast", 32.0), key("yarn_beta_slow", 1.0)
        return YarnScaling(_f32(factor), orig, _f32(fast), _f32(slow))
    if kind not in ("none", "") and factor != 1.0:
        raise CheckpointError(f"RoPE scaling {kind!r} is not supported (only llama3 and yarn)")
    info = tensors.get("rope_freqs.weight")
    if info is None:
        return None
    want = (head_dim // 2,)
    if info.shape != want or info.qtype not in FLOAT_TYPES:
        raise CheckpointError(
            f"GGUF tensor rope_freqs.weight: shape {info.shape} of type "
            f"{Q(info.qtype).name}, expected {want} of a float type"
        )
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    divisors = np.asarray(dequantize(t, torch.float32), np.float64)
    if not np.all(np.isfinite(divisors)) or divisors.min() <= 0:
        raise CheckpointError(
            "GGUF tensor rope_freqs.weight holds non-positive or non-finite values"
        )
    orig = key("original_context_length", None, int)
    return _llama3_from_divisors(divisors, theta, head_dim, orig)


def _llama3_divisors(s: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` (per-frequency divisors) for Llama 3 scaling `s`."""
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ratio = s.original_max_position_embeddings * freqs / (2 * np.pi)  # context / wavelength
    smooth = np.clip((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor), 0, 1)
    return 1 / ((1 - smooth) / s.factor + smooth)


def _llama3_from_divisors(d: np.ndarray, theta, head_dim, orig) -> RopeScaling | None:
    """Recover Llama 3 scaling from llama.cpp's divisors, assuming low_freq_factor = 1 (as in
    every Llama 3.x release) and solving the smooth region for high_freq_factor and the
    original context; the result must reproduce the divisors, else the file is refused."""
    factor = round(float(d.max()), 4)  # divisors are float32
    if factor == 1.0:
        return None
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (d > 1 + 1e-6) & (d < factor * (1 - 1e-6))
    smooth = (1 / d[mid] - 1 / factor) / (1 - 1 / factor)
    mismatch = CheckpointError("rope_freqs does not match Llama 3 RoPE scaling")
    try:
        if mid.sum() >= 2:  # smooth * (high - 1) + 1 = orig * freq / (2 pi): linear in (high, orig)
            a = np.stack([smooth, -freqs[mid] / (2 * np.pi)], axis=1)
            high, orig = np.linalg.lstsq(a, smooth - 1, rcond=None)[0]
            candidate = RopeScaling(factor, 1.0, round(float(high), 4), round(float(orig)))
        else:  # too little smooth region to solve: Llama 3's own values
            candidate = RopeScaling(factor, 1.0, 4.0, int(orig or 8192))
    except (CheckpointError, ValueError, OverflowError, np.linalg.LinAlgError):
        raise mismatch from None
    if not np.allclose(_llama3_divisors(candidate, theta, head_dim), d, rtol=1e-4):
        raise mismatch
    return candidate


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors that are not parameters."""
    if gguf_name in _NOT_PARAMETERS:
        return None
    base = gguf_name.removesuffix(".weight")
    if base != gguf_name and base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.weight"
    layer = re.fullmatch(r"blk\.(0|[1-9][0-9]*)\.([a-z_]+)\.(weight|bias)", gguf_name)  # not blk.01
    if layer and layer[2] in _LAYER_NAMES and (layer[3] == "weight" or layer[2] in _BIASED):
        return f"model.layers.{layer[1]}.{_LAYER_NAMES[layer[2]]}.{layer[3]}"
    raise CheckpointError(
        f"unexpected GGUF tensor {gguf_name!r}: not a tensor of the supported architectures"
    )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows were reordered from
    [first halves..., second halves...] to interleaved pairs (x0, x_half, x1, ...)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def _check_tensors(reader, config: ModelConfig, path: str) -> None:
    found: dict[str, tuple[int, ...]] = {}
    problems = []
    for t in reader.checked_header.tensors:
        try:
            name = hf_tensor_name(t.name)
        except CheckpointError:
            name = t.name  # listed as unexpected
        if name is None:
            continue
        if name in found:
            problems.append(f"tensor {t.name} maps to {name}, which is already present")
        found[name] = t.shape
        if not dequantizable(t.qtype):
            problems.append(f"tensor {t.name} has type {Q(t.qtype).name}, which is not supported")
    check_shapes(found, config, path, problems)


def iter_gguf_weights(
    path: str | os.PathLike, dtype: torch.dtype, config: ModelConfig | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for each parameter in the file, dequantized to `dtype` on
    CPU, one at a time (the file is memory-mapped). `lm_head.weight` only if the file has
    `output.weight` (otherwise the embedding is tied).

    The tensors are checked against `config` (default: the file's metadata) when this is
    called, before any data is read: CheckpointError for any missing or misshaped one."""
    reader, arch = _open(path)
    config = config or _config(reader, arch, str(path))
    _check_tensors(reader, config, str(path))
    return _iter_weights(reader, config, dtype, permuted=arch == "llama")


def _iter_weights(
    reader, config: ModelConfig, dtype, permuted: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        w = dequantize(t, dtype)
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            w = _unpermute(w, heads[proj])
        yield name, w
    release_reader()


def load_gguf_tokenizer(path: str | os.PathLike):
    """The file's tokenizer, built by transformers from the GGUF vocabulary, chat template
    included."""
    from transformers import AutoTokenizer  # heavy: only the front end needs a tokenizer

    p = Path(path)
    reader, _ = _open(p)
    tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    # The special tokens from the file's ids: transformers 5.17 takes the BOS token for EOS.
    for role in ("bos", "eos"):
        i = metadata_value(reader, f"tokenizer.ggml.{role}_token_id", None)
        if i is not None and 0 <= i < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(i))
    return tokenizer


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16"
) -> Path:
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer files with the
    chat template) for a GGUF file; return the folder. Holds the weights in memory once."""
    torch_dtype = getattr(torch, dtype, None)
    if dtype not in ("float32", "float16", "bfloat16") or torch_dtype is None:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    config = load_gguf_config(gguf_path)
    tokenizer = load_gguf_tokenizer(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: w.contiguous() for name, w in iter_gguf_weights(gguf_path, torch_dtype)}
    config_file = out / "config.json"
    config_file.write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")
    weights = out / "model.safetensors"
    save_file(tensors, weights, metadata={"format": "pt"})
    weights.chmod(config_file.stat().st_mode & 0o777)  # safetensors makes it 0600, not the umask's
    tokenizer.save_pretrained(out)
    return out
