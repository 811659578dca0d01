"""PDL as a property of the Triton ops object (kernels/triton_ops.TritonOps.pdl), decided at
construction by kernels/pdl.resolve from the device and envs.LLM_INFERENCE_PDL (auto: wherever
supported; 0: off; 1: required)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from llm_inference.kernels import pdl  # noqa: E402
from llm_inference.kernels.triton_ops import TritonOps  # noqa: E402


def test_default_is_off_where_unsupported_and_required_is_an_error():
    assert pdl.resolve(None, "cpu") is False
    assert pdl.resolve(False, "cpu") is False
    with pytest.raises(ValueError, match="LLM_INFERENCE_PDL=1 needs a CUDA device"):
        pdl.resolve(True, "cpu")


def test_the_ops_object_reads_the_switch_once(monkeypatch):
    monkeypatch.delenv("LLM_INFERENCE_PDL", raising=False)
    ops = TritonOps("cpu")  # the CPU: only under Triton's interpreter, as the tests run it
    assert ops.pdl is False
    monkeypatch.setenv("LLM_INFERENCE_PDL", "1")
    assert ops.pdl is False  # decided at construction
    with pytest.raises(ValueError, match="LLM_INFERENCE_PDL=1 needs a CUDA device"):
        TritonOps("cpu")
    monkeypatch.setenv("LLM_INFERENCE_PDL", "yes")
    with pytest.raises(ValueError, match="LLM_INFERENCE_PDL must be"):
        TritonOps("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_follows_the_compute_capability(monkeypatch):
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.resolve(None, "cuda") is hopper
    assert pdl.resolve(False, "cuda") is False
    if hopper:
        assert pdl.resolve(True, "cuda") is True
    else:
        with pytest.raises(ValueError, match="compute capability 9.0"):
            pdl.resolve(True, "cuda")
    for value, want in (("auto", hopper), ("0", False)):
        monkeypatch.setenv("LLM_INFERENCE_PDL", value)
        assert TritonOps("cuda").pdl is want
