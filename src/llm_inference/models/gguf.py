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

Before the gguf package's reader sees a file, `scan_gguf_header` walks its header and checks
every count, length and tensor extent against the file size (a tiny file declaring an array of
2**40 elements would otherwise make the reader grow without bound); before any tensor data is
read, the tensors' names and shapes are checked against the metadata's `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import mmap
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

# GGUF value types (gguf.GGUFValueType): fixed sizes of the scalar ones, STRING and ARRAY.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_FLOAT_TYPES = {6, 12}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 3
# The gguf reader makes a few Python objects per array element: more than this many elements
# (8M; vocabularies have a few hundred thousand) is refused, whatever the file size.
_MAX_ARRAY_ITEMS = 1 << 23
_VERSIONS = (2, 3)


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: fastest-varying first
    qtype: int
    offset: int  # from the start of the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """PyTorch order ([out, in] for a matrix)."""
        return tuple(reversed(self.dims))


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    version: int
    keys: tuple[str, ...]
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    data_offset: int


class _Cursor:
    """Bounds-checked little-endian reads from the file's bytes."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def fail(self, what: str):
        raise CheckpointError(f"{self.path}: truncated or corrupt GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            self.fail(
                f"{what} at offset {self.pos} needs {n} bytes, but the file has "
                f"{self.end - self.pos} left (file size {self.end} bytes)"
            )

    def uint(self, size: int, what: str) -> int:
        self.need(size, what)
        value = int.from_bytes(self.buf[self.pos : self.pos + size], "little")
        self.pos += size
        return value

    def string(self, what: str) -> bytes:
        n = self.uint(8, what)
        if n > self.end - self.pos:
            self.fail(
                f"{what}: a string of {n} bytes at offset {self.pos} runs past the end of the "
                f"file ({self.end} bytes)"
            )
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return data

    def text(self, what: str) -> str:
        data = self.string(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8: {data[:40]!r}")

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        """Skip one metadata value of type `vtype`, checking every length on the way."""
        if vtype in _SCALAR_SIZES:
            self.need(_SCALAR_SIZES[vtype], what)
            self.pos += _SCALAR_SIZES[vtype]
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            if depth >= _MAX_ARRAY_DEPTH:
                self.fail(f"{what}: arrays nested more than {_MAX_ARRAY_DEPTH} deep")
            itype = self.uint(4, what)
            count = self.uint(8, what)
            if itype not in _SCALAR_SIZES and itype not in (_STRING, _ARRAY):
                self.fail(f"{what}: an array of unknown value type {itype}")
            least = _SCALAR_SIZES.get(itype, 8 if itype == _STRING else 12)
            if count > _MAX_ARRAY_ITEMS or count * least > self.end - self.pos:
                self.fail(
                    f"{what}: an array of {count} elements (at least {least} bytes each) at "
                    f"offset {self.pos} does not fit in the file ({self.end} bytes) or exceeds "
                    f"{_MAX_ARRAY_ITEMS} elements"
                )
            if itype in _SCALAR_SIZES:
                self.pos += count * least
            else:
                for _ in range(count):
                    self.value(itype, what, depth + 1)
        else:
            self.fail(f"{what} has an unknown value type {vtype}")


def scan_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Walk the GGUF header of `path` without trusting any count: every length is checked
    against the bytes that remain, every tensor's extent against the file size. CheckpointError
    naming the first problem; nothing is allocated in proportion to a declared count."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    p = Path(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise CheckpointError(f"{p}: truncated or corrupt GGUF file: only {size} bytes")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf, p)
            if c.uint(4, "magic") != int.from_bytes(GGUF_MAGIC, "little"):
                c.fail("bad magic")
            version = c.uint(4, "version")
            if version & 0xFFFF == 0:
                raise CheckpointError(f"{p}: big-endian GGUF files are not supported")
            if version not in _VERSIONS:
                raise CheckpointError(
                    f"{p}: GGUF version {version} is not supported (versions 2 and 3 are)"
                )
            n_tensors = c.uint(8, "tensor count")
            n_kv = c.uint(8, "metadata count")
            # A key/value takes at least 13 bytes, a tensor info at least 24.
            if n_kv * 13 > size:
                c.fail(f"metadata count {n_kv} is impossible in a file of {size} bytes")
            if n_tensors * 24 > size:
                c.fail(f"tensor count {n_tensors} is impossible in a file of {size} bytes")
            keys: dict[str, None] = {}
            alignment = 32
            for _ in range(n_kv):
                key = c.text("metadata key")
                if key in keys:
                    c.fail(f"metadata key {key!r} appears twice")
                keys[key] = None
                vtype = c.uint(4, f"metadata {key!r}")
                if key == "general.alignment":
                    if vtype != _UINT32:
                        c.fail(f"general.alignment has value type {vtype}, not uint32")
                    alignment = c.uint(4, "general.alignment")
                    if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                        c.fail(f"general.alignment {alignment} is not a power of two")
                else:
                    c.value(vtype, f"metadata {key!r}")
            infos = []
            for _ in range(n_tensors):
                name = c.text("tensor name")
                n_dims = c.uint(4, f"tensor {name!r}")
                if not 1 <= n_dims <= _MAX_DIMS:
                    c.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
                dims = tuple(c.uint(8, f"tensor {name!r}") for _ in range(n_dims))
                qtype = c.uint(4, f"tensor {name!r}")
                offset = c.uint(8, f"tensor {name!r}")
                infos.append((name, dims, qtype, offset))
            data_offset = -(-c.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, qtype, offset in infos:
        where = f"{p}: GGUF tensor {name!r}"
        if name in names:
            raise CheckpointError(f"{where} appears twice")
        names.add(name)
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise CheckpointError(f"{where} has an unknown type {qtype}") from None
        if min(dims) < 1:
            raise CheckpointError(f"{where} has a zero dimension: {list(dims)}")
        if dims[0] % block:
            raise CheckpointError(
                f"{where}: its first dimension {dims[0]} is not a multiple of the block size "
                f"{block} of type {GGMLQuantizationType(qtype).name}"
            )
        if offset % alignment:
            raise CheckpointError(f"{where}: data offset {offset} is not {alignment}-aligned")
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * type_size
        start = data_offset + offset
        if start + nbytes > size:
            raise CheckpointError(
                f"{p}: truncated or corrupt GGUF file: tensor {name!r} of shape "
                f"{list(reversed(dims))} ({nbytes} bytes at offset {start}) extends beyond "
                f"the end of the file ({size} bytes)"
            )
        tensors.append(GGUFTensorInfo(name, dims, qtype, start, nbytes))
    return GGUFHeader(version, tuple(keys), tuple(tensors), alignment, data_offset)


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

    header = scan_gguf_header(path)  # first: the reader trusts every count it reads
    reader = GGUFReader(path)
    reader.checked_header = header
    return reader


def _open(path: str | os.PathLike):
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"GGUF file does not exist: {p}")
    if not is_gguf_file(p):
        raise CheckpointError(f"{p} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    st = p.stat()
    try:
        reader = _read(str(p.resolve()), st.st_size, st.st_mtime_ns)
    except CheckpointError:
        raise
    except Exception as e:  # the reader fails in numpy (reshape, view, index) on short data
        raise CheckpointError(f"{p}: truncated or corrupt GGUF file ({e})") from e
    try:
        arch = _value(reader, "general.architecture", None, str)
    except CheckpointError as e:
        raise CheckpointError(f"{p}: {e}") from None
    if arch != "llama":
        raise CheckpointError(
            f"{p}: GGUF architecture {arch!r} is not supported; only 'llama' is "
            "(Llama-architecture models: Llama, SmolLM, TinyLlama, ...)"
        )
    return reader


def _value(reader, key: str, default=_MISSING, kind: type = int):
    """A metadata value of `kind` (int, float or str); `default` if absent (required if none
    given). CheckpointError naming the key for an array or a value of another type."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise CheckpointError(f"GGUF metadata lacks the required key {key!r}")
        return default
    vtype = int(field.types[0])
    if vtype == GGUFValueType.ARRAY:
        raise CheckpointError(f"GGUF metadata {key!r} is an array; a single value was expected")
    allowed = {int: _INT_TYPES, float: _INT_TYPES | _FLOAT_TYPES, str: {_STRING}}[kind]
    if vtype not in allowed:
        name = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise CheckpointError(
            f"GGUF metadata {key!r} must be {name}, not a {GGUFValueType(vtype).name.lower()}"
        )
    part = field.parts[field.data[0]]
    if vtype == GGUFValueType.STRING:
        try:
            return bytes(part).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"GGUF metadata {key!r} is not UTF-8") from None
    return kind(part[0].item())


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06), as the original config.json most likely spelled it."""
    return float(str(np.float32(value)))


def load_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig from the `llama.*` and `tokenizer.ggml.*` metadata of a GGUF file."""
    return _config(_open(path), str(path))


def _config(reader, path: str) -> ModelConfig:
    try:
        return _config_unchecked(reader, path)
    except CheckpointError as e:
        if str(e).startswith(path):
            raise
        raise CheckpointError(f"{path}: {e}") from None


def _config_unchecked(reader, path: str) -> ModelConfig:
    def llama(key: str, default=_MISSING, kind: type = int):
        return _value(reader, "llama." + key, default, kind)

    hidden = llama("embedding_length")
    heads = llama("attention.head_count")
    if heads < 1:
        raise CheckpointError(f"llama.attention.head_count must be at least 1, not {heads}")
    kv_heads = llama("attention.head_count_kv", heads)
    head_dim = llama("attention.key_length", None)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(
                f"llama.embedding_length ({hidden}) is not divisible by "
                f"llama.attention.head_count ({heads})"
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
                "the vocabulary size is unknown: no llama.vocab_size, tokenizer.ggml.tokens "
                "or two-dimensional token_embd.weight"
            )
    theta = _f32(llama("rope.freq_base", 10000.0, float))
    eos = _value(reader, "tokenizer.ggml.eos_token_id", None)
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
        rope_scaling=_rope_scaling(reader, tensors, theta, head_dim),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=llama("context_length", 2048),
        bos_token_id=_value(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (eos,),
        torch_dtype="float32",  # what the dequantizer produces, exactly
    )


def _rope_scaling(reader, tensors, theta: float, head_dim: int):
    from gguf import GGMLQuantizationType as Q

    kind = _value(reader, "llama.rope.scaling.type", "none", str)
    factor = _value(reader, "llama.rope.scaling.factor", 1.0, float)
    if kind not in ("none", "") and factor != 1.0:
        raise CheckpointError(f"RoPE scaling {kind!r} is not supported (only llama3)")
    info = tensors.get("rope_freqs.weight")
    if info is None:
        return None
    want = (head_dim // 2,)
    if info.shape != want or info.qtype not in (Q.F32, Q.F16, Q.BF16):
        raise CheckpointError(
            f"GGUF tensor rope_freqs.weight: shape {info.shape} of type "
            f"{Q(info.qtype).name}, expected {want} of a float type"
        )
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    divisors = np.asarray(_dequantize(t, torch.float32), np.float64)
    if not np.all(np.isfinite(divisors)) or divisors.min() <= 0:
        raise CheckpointError(
            "GGUF tensor rope_freqs.weight holds non-positive or non-finite values"
        )
    orig = _value(reader, "llama.rope.scaling.original_context_length", None)
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
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[1] == "weight" and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.weight"
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdecimal()
        and parts[1] == str(int(parts[1]))  # blk.01 would alias blk.1
        and parts[3] == "weight"
        and parts[2] in _LAYER_NAMES
    ):
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


def _dequantizable(qtype: int) -> bool:
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    traits = getattr(quants, "_type_traits", None)
    return qtype in (Q.F32, Q.F16, Q.BF16) or traits is None or Q(qtype) in traits


def check_gguf_tensors(path: str | os.PathLike, config: ModelConfig | None = None) -> None:
    """Check the GGUF file's tensors (Hugging Face names, shapes, types) against `config`
    (default: the file's own metadata) from the header alone: one CheckpointError listing
    every missing, unexpected, wrongly shaped or undequantizable tensor."""
    reader = _open(path)
    _check_tensors(reader, config or _config(reader, str(path)), str(path))


def _check_tensors(reader, config: ModelConfig, path: str) -> None:
    from gguf import GGMLQuantizationType as Q

    from llm_inference.models.loader import check_shapes

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
        if not _dequantizable(t.qtype):
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
    reader = _open(path)
    config = config or _config(reader, str(path))
    _check_tensors(reader, config, str(path))
    return _iter_weights(reader, config, dtype)


def _iter_weights(reader, config: ModelConfig, dtype) -> Iterator[tuple[str, torch.Tensor]]:
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
