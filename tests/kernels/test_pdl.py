"""kernels/pdl.resolve: the engine option `pdl` (None: wherever supported) against the device."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from llm_inference.kernels import pdl  # noqa: E402


def test_default_is_off_where_unsupported_and_true_is_an_error():
    assert pdl.resolve(None, "cpu") is False
    assert pdl.resolve(False, "cpu") is False
    with pytest.raises(ValueError, match="pdl=True needs a CUDA device"):
        pdl.resolve(True, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_follows_the_compute_capability():
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.resolve(None, "cuda") is hopper
    assert pdl.resolve(False, "cuda") is False
    if hopper:
        assert pdl.resolve(True, "cuda") is True
    else:
        with pytest.raises(ValueError, match="compute capability 9.0"):
            pdl.resolve(True, "cuda")
