"""Paged attention (reference decode and cached-prefix prefill) equals dense causal attention
over random, non-contiguous block tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm_inference.kernels import reference
from llm_inference.layers.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
    StepBuffers,
)


def dense_causal(q, k, v, scale):
    """q [T, Hq, D], k/v [T, Hkv, D]: plain causal attention, float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    t = q.shape[0]
    scores.masked_fill_(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def random_tables(lens, block_size, num_blocks, g):
    """Disjoint random physical blocks for each sequence."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, width = [], max(-(-n // block_size) for n in lens)
    for n in lens:
        k = -(-n // block_size)
        tables.append(perm[:k] + [0] * (width - k))
        perm = perm[k:]
    return torch.tensor(tables, dtype=torch.int32)


def fill_cache(k_cache, v_cache, tables, ks, vs, block_size, scales=(1.0, 1.0)):
    for table, k, v in zip(tables, ks, vs):
        pos = torch.arange(k.shape[0])
        slots = table[pos // block_size].long() * block_size + pos % block_size
        reference.store_kv_cache(k, v, k_cache, v_cache, slots, *scales)


@pytest.mark.parametrize("block_size,hq,hkv", [(16, 4, 4), (16, 8, 2), (32, 6, 2)])
def test_reference_decode_equals_dense(block_size, hq, hkv):
    g = torch.Generator().manual_seed(block_size + hq)
    d, lens, num_blocks = 16, [1, 17, 64, 5, 40], 64
    ks = [torch.randn(n, hkv, d, generator=g) for n in lens]
    vs = [torch.randn(n, hkv, d, generator=g) for n in lens]
    qs = [torch.randn(n, hq, d, generator=g) for n in lens]
    # Unwritten slots hold large random values: reading past a sequence's length shows.
    k_cache = 100 * torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v_cache = 100 * torch.randn(num_blocks, block_size, hkv, d, generator=g)
    tables = random_tables(lens, block_size, num_blocks, g)
    fill_cache(k_cache, v_cache, tables, ks, vs, block_size)
    q_last = torch.stack([q[-1] for q in qs])
    out = reference.paged_attention_decode(
        q_last, k_cache, v_cache, tables, torch.tensor(lens), d**-0.5
    )
    for i in range(len(lens)):
        want = dense_causal(qs[i], ks[i], vs[i], d**-0.5)[-1]
        assert torch.allclose(out[i].double(), want, atol=1e-5), i


def test_store_kv_cache_skips_padding():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.arange(9.0).view(3, 1, 3) + 1
    reference.store_kv_cache(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache.view(-1, 1, 3)[5], k[0])
    assert torch.equal(k_cache.view(-1, 1, 3)[0], k[2])
    assert torch.equal(v_cache.view(-1, 1, 3)[0], -k[2])
    assert int((k_cache != 0).any(-1).sum()) == 2


@pytest.mark.parametrize("fp8_scales", [None, (1.0, 1.0), (0.3, 1.7)])
def test_layer_prefill_chunk_and_decode_equal_dense(fp8_scales):
    """A mixed step: one sequence prefills a chunk on top of cached tokens, two decode. With
    an FP8 cache (`fp8_scales`: the layer's k_scale and v_scale), dense attention over K and V
    as the cache holds them (reference.to_cache, then from_cache)."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, bs, num_blocks = 4, 2, 16, 16, 32
    attn = Attention(hq, hkv, d, d**-0.5, AttentionBackend(reference))
    cache_dtype = torch.float32 if fp8_scales is None else reference.FP8
    attn.k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=cache_dtype)
    attn.v_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=cache_dtype)
    scales = fp8_scales or (1.0, 1.0)
    attn.k_scale, attn.v_scale = scales
    lens = [37, 20, 9]  # total tokens of each sequence after this step
    new = [13, 1, 1]  # tokens computed in this step
    tables = random_tables(lens, bs, num_blocks, g)
    qs = [torch.randn(n, hq, d, generator=g) for n in lens]
    ks = [torch.randn(n, hkv, d, generator=g) for n in lens]
    vs = [torch.randn(n, hkv, d, generator=g) for n in lens]
    # Earlier steps cached the first len - new tokens.
    fill_cache(
        attn.k_cache,
        attn.v_cache,
        tables,
        [k[: n - m] for k, n, m in zip(ks, lens, new)],
        [v[: n - m] for v, n, m in zip(vs, lens, new)],
        bs,
        scales,
    )
    q = torch.cat([x[n - m :] for x, n, m in zip(qs, lens, new)])
    k = torch.cat([x[n - m :] for x, n, m in zip(ks, lens, new)])
    v = torch.cat([x[n - m :] for x, n, m in zip(vs, lens, new)])
    slots = []
    for table, n, m in zip(tables, lens, new):
        pos = torch.arange(n - m, n)
        slots.append(table[pos // bs].long() * bs + pos % bs)
    buffers = StepBuffers(
        slot_mapping=torch.cat(slots).int(),
        query_start_loc=torch.tensor([0, 13, 14, 15], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=tables,
    )
    md = attn.backend.metadata(buffers, 15, 3, 13, 37, tables.shape[1])
    out = attn(q, k, v, md)

    def held(x, scale):  # x as the cache holds it
        return reference.from_cache(reference.to_cache(x, cache_dtype, scale), scale)

    ks, vs = [held(x, scales[0]) for x in ks], [held(x, scales[1]) for x in vs]
    want = torch.cat(
        [dense_causal(qs[i], ks[i], vs[i], d**-0.5)[-new[i] :] for i in range(3)]
    ).float()
    assert torch.allclose(out, want, atol=1e-5)


def test_dense_metadata_matches_sdpa():
    g = torch.Generator().manual_seed(3)
    attn = Attention(4, 2, 8, 8**-0.5, AttentionBackend(reference))
    q, k = torch.randn(10, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    v = torch.randn(10, 2, 8, generator=g)
    out = attn(q, k, v, AttentionMetadata.dense([6, 4]))
    for sl in (slice(0, 6), slice(6, 10)):
        want = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1),
            k[sl].repeat_interleave(2, 1).transpose(0, 1),
            v[sl].repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        assert torch.allclose(out[sl], want, atol=1e-6)
