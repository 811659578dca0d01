"""FP8 at tensor_parallel_size 2 on the CPU (gloo): each rank holds its part of the weights
with the scales of its rows (a column-parallel layer's per-row scales sharded with them, a
row-parallel layer's whole), and the sharded model's logits are the unsharded FP8 model's up
to rounding. Row-parallel layers scale each rank's part of the input per token (and online
quantization each rank's part of a weight row), so the two differ by a little rounding."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from tp_helpers import run_ranks

from llm_inference.config import Fp8Format
from llm_inference.kernels.reference import ReferenceOps
from llm_inference.models.loader import load_model, load_model_config

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from fp8_testfiles import logits, steady, write_fp8_checkpoint  # noqa: E402


def fp8_model(folder: Path, layout: str):
    config = load_model_config(folder)
    if layout == "online":
        config = dataclasses.replace(config, quantization=Fp8Format("online"))
    return load_model(folder, ReferenceOps(), config=config)


def run_rank(rank: int, world_size: int, folder: str, layout: str) -> dict:
    model = fp8_model(Path(folder), layout)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    return {
        "logits": logits(model),
        "dtype": attn.qkv_proj.weight.dtype,
        **{
            name: (layer.weight.float(), layer.weight_scale.data)
            for name, layer in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("down", mlp.down_proj))
        },
    }


@pytest.mark.parametrize("layout", ["online", "ct-channel", "fp8-tensor-static", "fp8-block"])
def test_fp8_tp2_equals_tp1(tmp_path, layout):
    folder = steady(tmp_path / "base")
    if layout != "online":
        write_fp8_checkpoint(folder, tmp_path / layout, layout)
        folder = tmp_path / layout
    full = fp8_model(folder, layout)
    want = logits(full)
    ranks = run_ranks(run_rank, 2, str(folder), layout)
    # Static input scales quantize every rank's part of an input as TP=1 does: the same
    # products, summed in another order. Per-token scales of a part differ a little.
    tolerance = 1e-6 if layout == "fp8-tensor-static" else 1e-3
    for got in ranks:
        err = (got["logits"] - want).norm() / want.norm()
        assert err < tolerance, f"TP=2 logits off by {err:.2e} of TP=1's"
        assert got["dtype"] == torch.float8_e4m3fn
    attn = full.layers[0].self_attn
    qkv_rows = [attn.qkv_proj.weight_scale.data[a:b] for a, b in ((0, 64), (64, 96), (96, 128))]
    for r, got in enumerate(ranks):  # 4 heads of 16 and 2 KV heads: q 32 rows, k and v 16 each
        q, k, v = (s.chunk(2)[r] for s in qkv_rows)
        torch.testing.assert_close(got["qkv"][1], torch.cat([q, k, v]), rtol=0, atol=0)
        assert got["o"][1].shape == got["down"][1].shape == (64,)  # whole rows on each rank
        if layout in ("ct-channel", "fp8-tensor-static"):  # the checkpoint's values as stored
            torch.testing.assert_close(got["o"][0], attn.o_proj.weight.float().chunk(2, 1)[r])
            torch.testing.assert_close(got["o"][1], attn.o_proj.weight_scale.data)
