"""GGUF files (llama.cpp's format), read safely: header checks, metadata, tensor data.

A GGUF file is a header (magic, version, metadata key/values, tensor infos) followed by
aligned tensor data, most of it block-quantized. Shapes in the file list dimensions
fastest-first (`[in, out]`); `GGUFTensorInfo.shape` and `dequantize` give PyTorch's `[out, in]`.

Invariants:
- Before the gguf package's reader sees a file, `scan_gguf_header` walks its header and checks
  every count, length and tensor extent against the file size (a tiny file declaring an array
  of 2**40 elements would otherwise make the reader grow without bound); the checked header
  rides along as `reader.checked_header`.
- One parse per file and load: `open_gguf` keeps the last reader (keyed by path, size and
  mtime) until `release_reader()`.
- Every problem is a CheckpointError naming the file and what is wrong with it.

What the metadata and tensors mean for a model is models/gguf.py's business.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, quants

from llm_inference.config import CheckpointError

GGUF_MAGIC = b"GGUF"
REQUIRED = object()  # metadata_value's default: the key must be present

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
        self.need(n, f"{what}: a string of {n} bytes")
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
        nbytes = math.prod(dims) // block * type_size
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


def is_gguf(path: str | os.PathLike) -> bool:
    """A .gguf path (whether or not it exists), or any file that starts with the GGUF magic."""
    path = Path(path)
    return path.suffix == ".gguf" or (path.is_file() and is_gguf_file(path))


@functools.lru_cache(maxsize=1)
def _read(path: str, size: int, mtime_ns: int) -> GGUFReader:
    """One parse (slow: tens of thousands of vocabulary strings) per file and load."""
    header = scan_gguf_header(path)  # first: the reader trusts every count it reads
    reader = GGUFReader(path)
    reader.checked_header = header
    return reader


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """The gguf package's reader of `path`, its header checked first (`reader.checked_header`:
    the GGUFHeader); CheckpointError for a missing, foreign, truncated or corrupt file."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"GGUF file does not exist: {p}")
    if not is_gguf_file(p):
        raise CheckpointError(f"{p} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    st = p.stat()
    try:
        return _read(str(p.resolve()), st.st_size, st.st_mtime_ns)
    except CheckpointError:
        raise
    except Exception as e:  # the reader fails in numpy (reshape, view, index) on short data
        raise CheckpointError(f"{p}: truncated or corrupt GGUF file ({e})") from e


def release_reader() -> None:
    """Drop the reader open_gguf keeps (its parsed header and memory map)."""
    _read.cache_clear()


def metadata_value(reader: GGUFReader, key: str, default=REQUIRED, kind: type = int):
    """A metadata value of `kind` (int, float or str); `default` if absent (REQUIRED: an
    error). CheckpointError naming the key for an array or a value of another type."""
    field = reader.fields.get(key)
    if field is None:
        if default is REQUIRED:
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


FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def dequantizable(qtype: int) -> bool:
    """Whether `dequantize` handles tensors of GGML type `qtype` (the float types, and the
    quantized ones the installed gguf package implements)."""
    traits = getattr(quants, "_type_traits", None)
    return qtype in FLOAT_TYPES or traits is None or GGMLQuantizationType(qtype) in traits


def dequantize(t, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of the reader (`reader.tensors`) as a `[out, in]` CPU tensor of `dtype`."""
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type == GGMLQuantizationType.F16:  # no float32 detour for 16-bit floats
        out = torch.from_numpy(t.data.view(np.float16).reshape(shape).copy())
    elif t.tensor_type == GGMLQuantizationType.BF16:
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
