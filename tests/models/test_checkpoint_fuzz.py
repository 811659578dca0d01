"""Fuzzing of checkpoint loading: mutated GGUF headers, safetensors headers and config.json
files of small checkpoints. Every case must end, within 10 s and under an address-space limit
(bounded.LOAD_ADDRESS_SPACE beyond the worker's imports), in either a model whose every tensor
was loaded with exactly the expected shape, or one CheckpointError whose message names the file
or folder.

Loads run in a long-lived bounded subprocess (bounded.LoadWorker): a crash, a timeout or a
MemoryError fails the example, and hypothesis shrinks it."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from bounded import LoadWorker
from gguf import GGUFReader
from gguf_testfiles import write_llama_gguf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)),  # more for a deeper local run
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Integers that break naive size arithmetic.
INTERESTING = [0, 1, 2, 3, 7, 8, 63, 64, 65, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32]
INTERESTING += [2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def worker():
    w = LoadWorker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def assert_sound(result: dict, where: Path) -> None:
    event(result["outcome"])  # pytest --hypothesis-show-statistics: how the cases ended
    assert result["outcome"] in ("loaded", "CheckpointError"), result
    assert result["seconds"] < 10, result
    if result["outcome"] == "CheckpointError":
        message = result["detail"]
        assert where.name in message, f"the message does not name {where}: {message}"


# ---- GGUF ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_base(tiny_ckpt, scratch):
    """The tiny GGUF's bytes and the (offset, size) of every header part: counts, key and
    string lengths, metadata values, tensor names, dimension counts, dims, types, offsets."""
    path = write_llama_gguf(scratch / "base.gguf", tiny_ckpt)
    reader = GGUFReader(path)
    base = reader.data.ctypes.data
    parts = []
    for field in list(reader.fields.values()) + [t.field for t in reader.tensors]:
        for part in field.parts:
            if part.nbytes and part.nbytes <= 64:  # not the vocabulary's token texts
                parts.append((part.ctypes.data - base, part.nbytes))
    return path.read_bytes(), sorted(set(parts)), reader.data_offset


def _uint(draw, size: int) -> int:
    top = 2 ** (8 * size) - 1
    return draw(st.one_of(st.sampled_from([n & top for n in INTERESTING]), st.integers(0, top)))


@st.composite
def gguf_mutations(draw, base):
    data, parts, data_offset = base
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["part", "part", "part", "bytes", "truncate"]))
        if len(data) < data_offset:  # truncated already: stop there
            break
        if how == "part":  # a count, length, value, dim, type or offset
            offset, size = draw(st.sampled_from(parts))
            if size in (1, 2, 4, 8):
                data[offset : offset + size] = _uint(draw, size).to_bytes(size, "little")
            else:
                data[offset : offset + size] = draw(st.binary(min_size=size, max_size=size))
        elif how == "bytes":  # random bytes anywhere in the header
            offset = draw(st.integers(0, data_offset - 1))
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[offset : offset + len(chunk)] = chunk
        else:
            data = data[: draw(st.integers(0, len(data) - 1))]
    return bytes(data)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_header(worker, scratch, gguf_base, data):
    mutated = data.draw(gguf_mutations(gguf_base))
    folder = Path(tempfile.mkdtemp(dir=scratch))
    path = folder / "m.gguf"
    path.write_bytes(mutated)
    try:
        assert_sound(worker.check("model", path), path)
    finally:
        shutil.rmtree(folder)


# ---- safetensors -----------------------------------------------------------------------------

DTYPES = ["F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL", "F8_E4M3", "XX", ""]


@pytest.fixture(scope="module")
def st_base(tiny_ckpt):
    raw = (tiny_ckpt / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _dims(draw):
    small = st.integers(0, 300)
    return draw(
        st.lists(st.one_of(small, st.sampled_from(INTERESTING), st.integers(-5, -1)), max_size=4)
    )


@st.composite
def safetensors_mutations(draw, base):
    header, payload = json.loads(json.dumps(base[0])), base[1]
    names = sorted(k for k in header if k != "__metadata__")
    raw_header = None
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        how = draw(
            st.sampled_from(["shape", "dtype", "offsets", "drop", "rename", "json", "garbage"])
        )
        entry = header.get(name)
        if how == "shape" and entry:
            entry["shape"] = _dims(draw)
        elif how == "dtype" and entry:
            entry["dtype"] = draw(st.sampled_from(DTYPES))
        elif how == "offsets" and entry:
            ints = st.one_of(st.integers(0, len(payload) + 16), st.sampled_from(INTERESTING))
            entry["data_offsets"] = [draw(ints), draw(ints)]
        elif how == "drop":
            header.pop(name, None)
        elif how == "rename" and entry:
            header[draw(st.sampled_from(["model.layers.7.mlp.up_proj.weight", "x", ""]))] = (
                header.pop(name)
            )
        elif how == "json" and entry:
            entry[draw(st.sampled_from(["shape", "dtype", "data_offsets"]))] = draw(
                st.one_of(st.none(), st.text(max_size=3), st.integers(), st.lists(st.none()))
            )
        elif how == "garbage":
            raw_header = draw(st.binary(max_size=64))
    body = json.dumps(header).encode() if raw_header is None else raw_header
    length = len(body)
    if draw(st.booleans()):  # a lying header length
        length = _uint(draw, 8)
    data = struct.pack("<Q", length) + body + payload
    if draw(st.integers(0, 4)) == 0:
        data = data[: draw(st.integers(0, len(data)))]
    return data


def _folder_with(scratch: Path, tiny_ckpt: Path, **files: bytes) -> Path:
    folder = Path(tempfile.mkdtemp(dir=scratch))
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes(
            files.get(name.replace(".", "_")) or (tiny_ckpt / name).read_bytes()
        )
    return folder


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header(worker, scratch, tiny_ckpt, st_base, data):
    mutated = data.draw(safetensors_mutations(st_base))
    folder = _folder_with(scratch, tiny_ckpt, model_safetensors=mutated)
    try:
        assert_sound(worker.check("model", folder), folder)
    finally:
        shutil.rmtree(folder)


# ---- config.json -----------------------------------------------------------------------------

CONFIG_KEYS = [
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "max_position_embeddings", "bos_token_id",
    "eos_token_id", "model_type", "torch_dtype", "attention_bias",
]  # fmt: skip

JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(INTERESTING + [-1, -(2**63), 10**30, 32, 16, 4, 2, 128]),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([1e-5, 0.5, 64.0, 2.0, math.inf, -math.inf]),
        st.text(max_size=8),
        st.sampled_from(["llama", "llama3", "linear", "float16", "bfloat16"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                ["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings", "rope_theta"]
            ),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=6,
)  # fmt: skip


@st.composite
def config_mutations(draw, base: dict):
    cfg = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(CONFIG_KEYS))
        if draw(st.integers(0, 5)) == 0:
            cfg.pop(key, None)
        else:
            cfg[key] = draw(JSON_VALUES)
    return json.dumps(cfg, allow_nan=True).encode()


@FUZZ
@given(data=st.data())
def test_fuzz_config_json(worker, scratch, tiny_ckpt, data):
    base = json.loads((tiny_ckpt / "config.json").read_text())
    mutated = data.draw(config_mutations(base))
    folder = _folder_with(scratch, tiny_ckpt, config_json=mutated)
    try:
        assert_sound(worker.check("model", folder), folder)
    finally:
        shutil.rmtree(folder)


def test_unmutated_files_load(worker, scratch, tiny_ckpt, gguf_base):
    """The fuzzers' starting points load (so the oracle can tell a load from an error)."""
    path = scratch / "ok.gguf"
    path.write_bytes(gguf_base[0])
    assert worker.check("model", path)["outcome"] == "loaded"
    assert worker.check("model", tiny_ckpt)["outcome"] == "loaded"
    assert len(gguf_base[1]) > 100
