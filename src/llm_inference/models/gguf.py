"""GGUF checkpoints (llama.cpp's format) for Llama-architecture models.

A GGUF file holds metadata (`llama.*` hyperparameters, `tokenizer.*` vocabulary and chat
template) and tensors, most of them block-quantized. Here they become what the rest of the
package expects from a Hugging Face checkpoint:

- metadata -> `ModelConfig`;
- tensors -> Hugging Face names (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`),
  dequantized by the gguf package to float32 and cast to the model dtype, one at a time;
- Q and K projections: llama.cpp's converter permutes their rows (per head, from the
  "two halves" RoPE layout to interleaved pairs); `_unpermute` restores the Hugging Face order;
- Llama 3.x RoPE scaling, which llama.cpp stores as a `rope_freqs` tensor of per-frequency
  divisors, is recovered as `RopeScaling` (and checked to reproduce that tensor).

Shapes: GGUF lists dimensions fastest-first (`[in, out]`); tensors here are `[out, in]`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from llm_inference.config import CheckpointError, ModelConfig, RopeScaling

GGUF_MAGIC = b"GGUF"

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
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that are not parameters: rope_freqs becomes ModelConfig.rope_scaling.
_NOT_PARAMETERS = {"rope_freqs.weight"}
_MISSING = object()


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True if `path` is a file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def _read(path: str, size: int, mtime_ns: int):
    # Parsing the header (tens of thousands of vocabulary strings) takes seconds and ~150 MB of
    # Python objects: the config and weights steps of one load share one parse, which
    # iter_gguf_weights drops when it is done. Keyed by size and mtime.
    from gguf import GGUFReader

    return GGUFReader(path)


def _open(path: str | os.PathLike):
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"GGUF file does not exist: {p}")
    if not is_gguf_file(p):
        raise CheckpointError(f"{p} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    st = p.stat()
    try:
        reader = _read(str(p.resolve()), st.st_size, st.st_mtime_ns)
    except Exception as e:  # the reader fails in numpy (reshape, view, index) on short data
        raise CheckpointError(f"{p}: truncated or corrupt GGUF file ({e})") from e
    arch = _value(reader, "general.architecture", None)
    if arch != "llama":
        raise CheckpointError(
            f"{p}: GGUF architecture {arch!r} is not supported; only 'llama' is "
            "(Llama-architecture models: Llama, SmolLM, TinyLlama, ...)"
        )
    return reader


def _value(reader, key: str, default=_MISSING):
    """A scalar or string metadata value; `default` if absent (required if none given)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise CheckpointError(f"GGUF metadata lacks the required key {key!r}")
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        raise CheckpointError(f"GGUF metadata {key!r} is an array; a single value was expected")
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06), as the original config.json most likely spelled it."""
    return float(str(np.float32(value)))


def load_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig from the `llama.*` and `tokenizer.ggml.*` metadata of a GGUF file."""
    return _config(_open(path), str(path))


def _config(reader, path: str) -> ModelConfig:
    def llama(key: str, default=_MISSING):
        return _value(reader, "llama." + key, default)

    hidden = int(llama("embedding_length"))
    heads = int(llama("attention.head_count"))
    kv_heads = int(llama("attention.head_count_kv", heads))
    head_dim = int(llama("attention.key_length", hidden // heads))
    if int(llama("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: partial rotary embeddings are not supported")
    tensors = {t.name: t for t in reader.tensors}
    vocab = llama("vocab_size", None)
    if vocab is None:  # older files: the vocabulary length, or the embedding's rows
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens else int(tensors["token_embd.weight"].shape[1])
    theta = _f32(llama("rope.freq_base", 10000.0))
    eos = _value(reader, "tokenizer.ggml.eos_token_id", None)
    return ModelConfig(
        hidden_size=hidden,
        num_hidden_layers=int(llama("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(llama("feed_forward_length")),
        vocab_size=int(vocab),
        rms_norm_eps=_f32(llama("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, tensors, theta, head_dim, str(path)),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(llama("context_length", 2048)),
        bos_token_id=_value(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (int(eos),),
        torch_dtype="float32",  # what the dequantizer produces, exactly
    )


def _rope_scaling(reader, tensors, theta: float, head_dim: int, source: str):
    kind = _value(reader, "llama.rope.scaling.type", "none")
    factor = float(_value(reader, "llama.rope.scaling.factor", 1.0))
    if kind not in ("none", "") and factor != 1.0:
        raise CheckpointError(f"{source}: RoPE scaling {kind!r} is not supported (only llama3)")
    if "rope_freqs.weight" not in tensors:
        return None
    divisors = np.asarray(_dequantize(tensors["rope_freqs.weight"], torch.float32), np.float64)
    orig = _value(reader, "llama.rope.scaling.original_context_length", None)
    return _llama3_from_divisors(divisors, theta, head_dim, orig, source)


def _llama3_divisors(s: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` (per-frequency divisors) for Llama 3 scaling `s`."""
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ratio = s.original_max_position_embeddings * freqs / (2 * np.pi)  # context / wavelength
    smooth = np.clip((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor), 0, 1)
    return 1 / ((1 - smooth) / s.factor + smooth)


def _llama3_from_divisors(d: np.ndarray, theta, head_dim, orig, source) -> RopeScaling | None:
    """Recover Llama 3 scaling from llama.cpp's divisors, assuming low_freq_factor = 1 (as in
    every Llama 3.x release) and solving the smooth region for high_freq_factor and the
    original context; the result must reproduce the divisors, else the file is refused."""
    factor = round(float(d.max()), 4)  # divisors are float32
    if factor == 1.0:
        return None
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (d > 1 + 1e-6) & (d < factor * (1 - 1e-6))
    smooth = (1 / d[mid] - 1 / factor) / (1 - 1 / factor)
    if mid.sum() >= 2:  # smooth * (high - 1) + 1 = orig * freq / (2 pi): linear in (high, orig)
        a = np.stack([smooth, -freqs[mid] / (2 * np.pi)], axis=1)
        high, orig = np.linalg.lstsq(a, smooth - 1, rcond=None)[0]
        candidate = RopeScaling(factor, 1.0, round(float(high), 4), round(float(orig)))
    else:  # too little smooth region to solve: Llama 3's own values
        candidate = RopeScaling(factor, 1.0, 4.0, int(orig or 8192))
    if not np.allclose(_llama3_divisors(candidate, theta, head_dim), d, rtol=1e-4):
        raise CheckpointError(f"{source}: rope_freqs does not match Llama 3 RoPE scaling")
    return candidate


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors that are not parameters."""
    if gguf_name in _NOT_PARAMETERS:
        return None
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[1] == "weight" and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    raise CheckpointError(
        f"unexpected GGUF tensor {gguf_name!r}: only bias-free Llama tensors are supported"
    )


def _dequantize(t, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a `[out, in]` CPU tensor of `dtype`."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type == Q.F16:  # no float32 detour for 16-bit floats
        out = torch.from_numpy(t.data.view(np.float16).reshape(shape).copy())
    elif t.tensor_type == Q.BF16:
        bits = np.ascontiguousarray(t.data).view(np.int16).reshape(shape).copy()
        out = torch.from_numpy(bits).view(torch.bfloat16)
    else:
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"GGUF tensor {t.name}: type {t.tensor_type.name} is not supported by the "
                "installed gguf package's dequantizer"
            ) from e
        arr = arr.reshape(shape)
        out = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return out.to(dtype)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows were reordered from
    [first halves..., second halves...] to interleaved pairs (x0, x_half, x1, ...)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def iter_gguf_weights(
    path: str | os.PathLike, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, tensor) for each parameter in the file, dequantized to `dtype`
    on CPU, one at a time (the file is memory-mapped). `lm_head.weight` only if the file has
    `output.weight` (otherwise the embedding is tied)."""
    reader = _open(path)
    config = _config(reader, str(path))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        w = _dequantize(t, dtype)
        proj = name.split(".")[-2]
        if proj in heads:
            w = _unpermute(w, heads[proj])
        yield name, w
    _read.cache_clear()


def load_gguf_tokenizer(path: str | os.PathLike):
    """The file's tokenizer, built by transformers from the GGUF vocabulary, chat template
    included."""
    from transformers import AutoTokenizer

    p = Path(path)
    _open(p)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


_COPIED_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
)  # fmt: skip


def hf_config_dict(config: ModelConfig, dtype: str) -> dict:
    """A transformers `config.json` for `config` (LlamaForCausalLM, bias-free, SiLU)."""
    eos = list(config.eos_token_ids)
    scaling = config.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        **{key: getattr(config, key) for key in _COPIED_KEYS},
        # rope_theta + rope_scaling: read by transformers 4.x and 5.x (and by ModelConfig)
        "rope_scaling": None if scaling is None else dataclasses.asdict(scaling),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype,
    }


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16"
) -> Path:
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer files with the
    chat template) for a GGUF file; return the folder. Holds the weights in memory once."""
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype, None)
    if dtype not in ("float32", "float16", "bfloat16") or torch_dtype is None:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    config = load_gguf_config(gguf_path)
    tokenizer = load_gguf_tokenizer(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: w.contiguous() for name, w in iter_gguf_weights(gguf_path, torch_dtype)}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=2) + "\n")
    tokenizer.save_pretrained(out)
    return out
