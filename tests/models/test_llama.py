"""Our Llama forward against transformers' LlamaForCausalLM with the same weights (float32)."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_model, make_checkpoint

from llm_inference.kernels import reference
from llm_inference.models.loader import load_model

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

CASES = {
    "default_rope": {},
    "tied": {"tie_word_embeddings": True},
    "gqa1_mha": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "gqa2": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "gqa4": {"num_attention_heads": 8, "num_key_value_heads": 2},
    "head_dim_32": {"head_dim": 32},
    "llama3_scaling": {"rope_parameters": {"rope_theta": 500000.0, **LLAMA3_SCALING}},
}


def _compare(folder, input_ids, positions, atol=1e-4):
    ref = hf_model(folder)
    ours = load_model(folder, reference)
    with torch.no_grad():
        want = ref(input_ids[None], position_ids=positions[None]).logits[0]
        got = ours.compute_logits(ours(input_ids, positions, [len(input_ids)]))
    err = (want - got).abs().max().item()
    assert err < atol, f"max abs logit error {err}"
    return want


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    folder = make_checkpoint(tmp_path, **CASES[name])
    ids = torch.randint(0, 320, (23,), generator=torch.Generator().manual_seed(1))
    _compare(folder, ids, torch.arange(23))


def test_llama3_scaling_beyond_8192(tmp_path):
    rope = {"rope_theta": 500000.0, **LLAMA3_SCALING, "original_max_position_embeddings": 8192}
    folder = make_checkpoint(tmp_path, rope_parameters=rope, max_position_embeddings=16384)
    ids = torch.randint(0, 320, (17,), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(12000, 12017)
    want = _compare(folder, ids, positions)
    # The scaling matters at these positions: without it the logits differ.
    plain = make_checkpoint(
        tmp_path / "plain", rope_parameters={"rope_theta": 500000.0}, max_position_embeddings=16384
    )
    ours = load_model(plain, reference)
    with torch.no_grad():
        other = ours.compute_logits(ours(ids, positions, [17]))
    assert (want - other).abs().max() > 1e-3


def test_sharded_checkpoint(tmp_path):
    folder = make_checkpoint(tmp_path, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("*.safetensors"))) > 2
    ids = torch.randint(0, 320, (11,), generator=torch.Generator().manual_seed(3))
    _compare(folder, ids, torch.arange(11))


def test_flat_batch_equals_unbatched(tiny_ckpt):
    ours = load_model(tiny_ckpt, reference)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 320, (n,), generator=g) for n in (5, 13, 1)]
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        batched = ours.compute_logits(ours(ids, positions, [len(s) for s in seqs]))
        start = 0
        for s in seqs:
            alone = ours.compute_logits(ours(s, torch.arange(len(s)), [len(s)]))
            got = batched[start : start + len(s)]
            assert (alone - got).abs().max() < 1e-5
            start += len(s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close(tiny_ckpt, dtype):
    ref = load_model(tiny_ckpt, reference)
    ours = load_model(tiny_ckpt, reference, dtype=dtype)
    assert ours.embed_tokens.weight.dtype == dtype
    ids = torch.randint(0, 320, (9,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref.compute_logits(ref(ids, torch.arange(9), [9]))
        got = ours.compute_logits(ours(ids, torch.arange(9), [9])).float()
    rel = (want - got).norm() / want.norm()
    assert rel < 3e-2, rel


def test_partial_sums_are_normed_in_alternating_order(tiny_ckpt, monkeypatch):
    """o_proj and down_proj leave their per-rank partial sums to the norm after them, which
    sums them (parallel_state.all_reduce_add_rms_norm): every layer's two norms after the
    first and the final norm, called with consecutive `index` values in forward order, so
    that consecutive fused calls alternate their buffer halves, also from one forward pass
    to the next."""
    from llm_inference.layers import norm

    calls = []
    real = norm.all_reduce_add_rms_norm

    def spy(x, residual, weight, eps, ops, index=0):
        calls.append(index)
        return real(x, residual, weight, eps, ops, index)

    monkeypatch.setattr(norm, "all_reduce_add_rms_norm", spy)
    model = load_model(tiny_ckpt, reference)
    ids = torch.randint(0, 320, (7,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for _ in range(2):
            model(ids, torch.arange(7), [7])
    layers = len(model.layers)
    assert calls == list(range(2 * layers)) * 2
    assert not any(layer.self_attn.o_proj.reduce_results for layer in model.layers)
    assert not any(layer.mlp.down_proj.reduce_results for layer in model.layers)
