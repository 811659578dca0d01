"""GGUF files whose tensors do not match their metadata, and malformed GGUF headers: one
CheckpointError naming the problem, from the header alone, with bounded memory."""

from __future__ import annotations

import re

import numpy as np
import pytest
from bounded import run_bounded
from gguf import GGMLQuantizationType as Q
from gguf_testfiles import (
    gguf_str,
    kv_array,
    kv_string,
    raw_gguf,
    tensor_info,
    u32,
    write_llama_gguf,
)

from llm_inference.config import CheckpointError
from llm_inference.kernels import reference
from llm_inference.models import loader
from llm_inference.models.gguf import iter_gguf_weights, load_gguf_config
from llm_inference.models.loader import load_model


@pytest.fixture
def no_allocation(monkeypatch):
    """load_model must fail before it builds the model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was checked")

    monkeypatch.setattr(loader, "model_class", lambda architecture: refuse)


def test_gguf_missing_misshaped_and_extra_tensors_are_one_error(tmp_path, tiny_ckpt, no_allocation):
    path = write_llama_gguf(
        tmp_path / "bad.gguf",
        tiny_ckpt,
        drop=("model.layers.1.mlp.up_proj.weight",),
        raw={"model.norm.weight": (np.ones(1, np.float32), Q.F32)},
        extra_tensors={"blk.2.attn_q.weight": np.zeros((64, 64), np.float32)},
    )
    with pytest.raises(CheckpointError) as e:
        load_model(path, reference)
    message = str(e.value)
    assert str(path) in message
    assert "missing tensors: model.layers.1.mlp.up_proj.weight (128, 64)" in message
    assert "unexpected tensors: model.layers.2.self_attn.q_proj.weight" in message
    assert "model.norm.weight: checkpoint (1,), expected (64,)" in message
    with pytest.raises(CheckpointError, match="missing tensors"):
        iter_gguf_weights(path, None)  # checked when called, before any tensor is read


@pytest.mark.parametrize(
    "name, message",
    [
        ("blk.x.attn_q.weight", r"unexpected tensors: blk\.x\.attn_q\.weight"),
        ("blk.0.attn_output.bias", r"unexpected tensors: blk\.0\.attn_output\.bias"),
        # a bias Qwen2 has: named as the checkpoint tensor it is, which llama does not have
        ("blk.0.attn_q.bias", r"unexpected tensors: model\.layers\.0\.self_attn\.q_proj\.bias"),
        ("output.weight.extra", r"unexpected tensors: output\.weight\.extra"),
    ],
)
def test_gguf_unknown_tensor_names(tmp_path, tiny_ckpt, no_allocation, name, message):
    extra = {name: np.zeros(64, np.float32)}
    path = write_llama_gguf(tmp_path / "x.gguf", tiny_ckpt, extra_tensors=extra)
    with pytest.raises(CheckpointError, match=message):
        load_model(path, reference)


def test_gguf_misshaped_rope_freqs(tmp_path, tiny_ckpt):
    extra = {"rope_freqs.weight": np.ones(3, np.float32)}
    path = write_llama_gguf(tmp_path / "r.gguf", tiny_ckpt, extra_tensors=extra)
    with pytest.raises(CheckpointError, match=r"rope_freqs\.weight.*\(3,\).*expected \(8,\)"):
        load_gguf_config(path)


def test_gguf_metadata_of_the_wrong_type(tmp_path, tiny_ckpt):
    from gguf import GGUFValueType

    meta = {"tokenizer.ggml.eos_token_id": ("two", GGUFValueType.STRING)}
    path = write_llama_gguf(tmp_path / "m.gguf", tiny_ckpt, metadata=meta, tokenizer=False)
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.eos_token_id.*an integer"):
        load_gguf_config(path)


ARCH = kv_string("general.architecture", "llama")
HUGE = 2**40


MALFORMED = [
    (raw_gguf([ARCH, kv_array("x", 0, HUGE)]), r"'x'.*1099511627776 elements"),
    (raw_gguf([ARCH, kv_array("x", 8, HUGE)]), r"'x'.*1099511627776 elements"),
    (raw_gguf([ARCH, kv_array("x", 9, HUGE)]), r"'x'.*1099511627776 elements"),
    (raw_gguf([ARCH, kv_array("x", 9, 2, u32(0) + (2**40).to_bytes(8, "little"))]), "'x'"),
    (
        raw_gguf([ARCH, kv_array("x", 8, 3, gguf_str("a") + (2**60).to_bytes(8, "little"))]),
        "'x'",
    ),
    (raw_gguf([ARCH, b"\xff" * 8 + u32(8)]), r"string of 18446744073709551615 bytes"),
    (raw_gguf([ARCH, gguf_str("x") + u32(8) + (2**50).to_bytes(8, "little")]), "'x'"),
    (raw_gguf([ARCH], tensor_count=HUGE), r"tensor count 1099511627776"),
    (raw_gguf([ARCH], kv_count=HUGE), r"metadata count 1099511627776"),
    (raw_gguf([ARCH, gguf_str("x") + u32(99)]), r"'x'.*unknown value type 99"),
    (
        raw_gguf([ARCH], [tensor_info("token_embd.weight", [HUGE, HUGE], 0, 0)]),
        r"token_embd\.weight.*beyond the end of the file",
    ),
    (
        raw_gguf([ARCH], [tensor_info("token_embd.weight", [8] * 9, 0, 0)]),
        r"token_embd\.weight.*9 dimensions",
    ),
    (
        raw_gguf([ARCH], [tensor_info("token_embd.weight", [8], 77, 0)]),
        r"token_embd\.weight.*unknown type 77",
    ),
]
MALFORMED_IDS = [
    "u8-array-2**40",
    "string-array-2**40",
    "array-array-2**40",
    "nested-array-2**40",
    "string-in-array-2**60",
    "key-length-2**64",
    "string-value-2**50",
    "tensor-count-2**40",
    "kv-count-2**40",
    "unknown-value-type",
    "tensor-2**80-elements",
    "tensor-9-dims",
    "tensor-unknown-type",
]


@pytest.fixture(scope="module")
def malformed_results(tmp_path_factory):
    """Every malformed header loaded in one bounded subprocess (one torch import)."""
    folder = tmp_path_factory.mktemp("malformed")
    paths = []
    for n, (header, _) in enumerate(MALFORMED):
        paths.append(folder / f"bad{n}.gguf")
        paths[-1].write_bytes(header + bytes(64))
    return run_bounded([("model", p) for p in paths], timeout=120)


@pytest.mark.parametrize("n", range(len(MALFORMED)), ids=MALFORMED_IDS)
def test_malformed_gguf_header_is_one_error_with_bounded_memory(malformed_results, n):
    result, message = malformed_results[n], MALFORMED[n][1]
    assert result["outcome"] == "CheckpointError", result
    assert result["seconds"] < 10
    assert re.search(message, result["detail"]), result["detail"]
