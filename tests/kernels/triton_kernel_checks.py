"""Checks of each Triton kernel against its reference, shared by the CPU and GPU tests.

Each `check_*` draws fresh random inputs, poisons every output with NaN first (or, for in-place
kernels, relies on inputs that the op must change), runs the Triton launcher and the reference,
and raises AssertionError on a mismatch. The CPU tests run them in a child process under
TRITON_INTERPRET=1 (`python triton_kernel_checks.py [KERNEL ...]`): the interpreter must be on
before triton is first imported.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

# Relative L2 error allowed per sequence (attention) and elementwise tolerances (the rest).
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
ELEM_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (k_scale, v_scale) of the FP8 cache cases: not 1, so a kernel that ignores either fails.
FP8_SCALES = (0.3, 1.7)


def as_cache(x: torch.Tensor, device, dtype, fp8: bool, scale: float) -> torch.Tensor:
    """x as a cache of `dtype`, or as an FP8 cache of that scale (reference.to_cache)."""
    reference, _ = _ops()
    return reference.to_cache(x, reference.FP8, scale).to(device) if fp8 else x.to(device, dtype)


def _ops():
    from llm_inference.kernels import reference, triton_ops

    return reference, triton_ops


def make_paged_case(device, dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size, gen,
                    fp8=False):  # fmt: skip
    """Random q and caches (`fp8`: FP8 caches with FP8_SCALES); each sequence's blocks are a
    random, non-contiguous set of a pool larger than needed. block_tables is a strided view
    with random (valid) ids past the end."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    width = max(need) + 2
    num_blocks = sum(need) + 7
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(seq_lens), width + 3), generator=gen)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used : used + n]
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = as_cache(torch.randn(cache_shape, generator=gen), device, dtype, fp8, FP8_SCALES[0])
    v_cache = as_cache(torch.randn(cache_shape, generator=gen), device, dtype, fp8, FP8_SCALES[1])
    q = (2 * torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)).to(device, dtype)
    block_tables = tables.to(device, torch.int32)[:, :width]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, lens


def assert_attention_close(out, q, k_cache, v_cache, block_tables, lens, scale, what="",
                           k_scale=1.0, v_scale=1.0):  # fmt: skip
    """Per sequence, relative L2 error against the reference in float32 (which reads any
    cache in float32)."""
    reference, _ = _ops()
    ref = reference.paged_attention_decode(
        q.float(), k_cache, v_cache, block_tables, lens, scale, k_scale=k_scale, v_scale=v_scale
    )
    assert torch.isfinite(out).all(), f"{what}: unwritten (NaN) or non-finite outputs"
    err = (out.float() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    worst = int(err.argmax())
    assert err.max() < ATTN_TOL[q.dtype], (
        f"{what}: relative error {err.max().item():.2e} at seq {worst} (len {int(lens[worst])})"
    )


def check_paged_attention(device, dtype, seq_lens, num_heads, num_kv_heads, head_dim,
                          block_size, seed, configs=(), fp8=False):  # fmt: skip
    """The public launcher (default and tight max_seq_len), then each configuration
    (splits, tile, fused merge[, True: in a random seq_order]) through `paged_attention.launch`:
    each sequence spreads its
    own tiles over the splits, so more splits than a short sequence has tiles leaves some
    empty. `fp8`: FP8 caches, with FP8_SCALES."""
    from llm_inference.kernels import paged_attention

    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(
        device, dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size, gen, fp8
    )
    q, k_cache, v_cache, block_tables, lens = case
    scale = head_dim**-0.5
    scales = dict(zip(("k_scale", "v_scale"), FP8_SCALES if fp8 else (1.0, 1.0)))
    for max_len in (None, max(seq_lens)):
        out = torch.full_like(q, float("nan"))
        res = paged_attention.paged_attention_decode(
            q, k_cache, v_cache, block_tables, lens, scale, out, max_seq_len=max_len, **scales
        )
        assert res is out
        assert_attention_close(out, *case, scale, f"max_seq_len={max_len}", **scales)
    for splits, block_n, fused, *ordered in configs:
        # ordered: the programs dispatched in a random order of the sequences (seq_order)
        order = torch.randperm(len(seq_lens), generator=gen).to(device) if ordered else None
        out = torch.full_like(q, float("nan"))
        paged_attention.launch(
            q, k_cache, v_cache, block_tables, lens, scale, out, splits, block_n,
            fused_merge=fused, seq_order=order, **scales,
        )  # fmt: skip
        what = f"splits={splits} n={block_n} fused={fused} ordered={bool(ordered)}"
        assert_attention_close(out, *case, scale, what, **scales)


def check_rms_norm(device, dtype, num_tokens, hidden, seed):
    reference, triton_ops = _ops()
    gen = torch.Generator().manual_seed(seed)
    # x and residual are row slices of wider buffers: row stride != hidden.
    x = torch.randn(num_tokens, hidden + 8, generator=gen).to(device, dtype)[:, :hidden]
    res = torch.randn(num_tokens, hidden + 4, generator=gen).to(device, dtype)[:, :hidden]
    weight = (1 + torch.randn(hidden, generator=gen)).to(device, dtype)
    tol = ELEM_TOL[dtype]
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=device)
    assert triton_ops.rms_norm(x, weight, 1e-5, out=out) is out
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-5), rtol=tol, atol=tol)

    ref_out, ref_res = reference.rms_norm(x.clone(), weight, 1e-5, res.clone())
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=device)
    got_out, got_res = triton_ops.rms_norm(x.clone(), weight, 1e-5, res, out=out)
    assert got_out is out and got_res.data_ptr() == res.data_ptr()
    torch.testing.assert_close(got_res, ref_res, rtol=0, atol=0)  # same fp32 add, same rounding
    torch.testing.assert_close(got_out, ref_out, rtol=tol, atol=tol)
    got = triton_ops.rms_norm(x.clone(), weight.float(), 1e-6)  # float32 weight
    torch.testing.assert_close(got, reference.rms_norm(x, weight.float(), 1e-6), rtol=tol, atol=tol)


def check_silu_and_mul(device, dtype, num_tokens, inter, seed):
    reference, triton_ops = _ops()
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(num_tokens, 2 * inter, generator=gen)).to(device, dtype)
    out = torch.full((num_tokens, inter), float("nan"), dtype=dtype, device=device)
    assert triton_ops.silu_and_mul(x, out=out) is out
    tol = ELEM_TOL[dtype]
    torch.testing.assert_close(out, reference.silu_and_mul(x), rtol=tol, atol=tol)
    x3 = x.view(2, num_tokens // 2, 2 * inter) if num_tokens % 2 == 0 else x[None]
    got = triton_ops.silu_and_mul(x3)
    torch.testing.assert_close(got, reference.silu_and_mul(x3), rtol=tol, atol=tol)


def _split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    """q, k, v views of a fused qkv [T, (Hq + 2 Hkv) D], as the model makes them."""
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].unflatten(1, (num_heads, head_dim))
    k = qkv[:, q_end:k_end].unflatten(1, (num_kv_heads, head_dim))
    v = qkv[:, k_end:].unflatten(1, (num_kv_heads, head_dim))
    return q, k, v


def _fused_qkv(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim, gen):
    """A random qkv whose rows are padded (token stride > width)."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    return torch.randn(num_tokens, width + 16, generator=gen).to(device, dtype)[:, :width]


def check_rotary(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim, seed):
    reference, triton_ops = _ops()
    gen = torch.Generator().manual_seed(seed)
    max_pos = 8192
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    # Positions >= 1 so that every element changes (an unwritten one is caught).
    positions = torch.randint(1, max_pos, (num_tokens,), generator=gen).to(device)
    qkv = _fused_qkv(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim, gen)
    ref_qkv = qkv.clone()
    ref_q, ref_k, _ = _split_qkv(ref_qkv, num_heads, num_kv_heads, head_dim)
    reference.rotary_embedding(positions, ref_q, ref_k, cos_sin)
    q, k, _ = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    assert q.stride(0) != q.shape[1] * head_dim  # really a strided view
    got_q, got_k = triton_ops.rotary_embedding(positions, q, k, cos_sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    tol = ELEM_TOL[dtype]
    torch.testing.assert_close(qkv, ref_qkv, rtol=tol, atol=tol)
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], ref_qkv[:, v_start:]), "v must be untouched"


def fp8_representable(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Normal e4m3 values (or 0) times a power-of-two `scale`, every 7th one 1000 x scale: an
    FP8 store keeps them exactly or saturates them to 448, without rounding (Triton's
    interpreter rounds float32 to float8 wrongly: 7.97 becomes 4)."""
    reference, _ = _ops()
    e4m3 = (8 * x.float()).to(reference.FP8).float()
    e4m3[e4m3.abs() < 2.0**-6] = 0  # no subnormals
    e4m3.view(-1)[::7] = 1000.0
    return (e4m3 * scale).to(x.dtype)


def check_quantize_rows(device, dtype, num_tokens, hidden, seed, representable=False):
    """Per-token and static-scale FP8 quantization of rows that are slices of a wider buffer
    (row stride != hidden), an all-zero row among them: the scales always equal the
    reference's; the FP8 bytes too, on the GPU, and under the interpreter for
    `representable` rows (each row e4m3 values times a power of two 2^-3 to 2^3, its largest 448
    times it, and a static scale of 2^-3: x / scale is an e4m3 value, or beyond 448 and
    saturates, and never rounds)."""
    reference, triton_ops = _ops()
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(num_tokens, hidden + 8, generator=gen))[:, :hidden]
    x[1] = 0.0
    if representable:
        e4m3 = (8 * x).to(reference.FP8).float()
        e4m3[:, 0] = reference.FP8_MAX
        x = e4m3 * 2.0 ** torch.randint(-3, 4, (num_tokens, 1), generator=gen).float()
    x = x.to(device, dtype)
    static = torch.tensor(2.0**-3 if representable else 0.37, device=device)
    for scale in (None, static):
        q, got = triton_ops.quantize_rows(x, scale)
        want_q, want = reference.quantize_rows(x, scale)
        assert got.shape == (num_tokens, 1) and got.dtype == torch.float32
        assert torch.equal(got, want), f"scales differ by {(got - want).abs().max()}"
        if device == "cuda" or representable:
            assert q.dtype == reference.FP8 and q.shape == x.shape
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (
                f"max diff {(q.float() - want_q.float()).abs().max()} (scale {scale})"
            )
    if representable:  # the static case tests the saturation
        assert (q.float().abs() == reference.FP8_MAX).sum() > num_tokens


def check_silu_and_mul_quant(device, dtype, num_tokens, inter, seed):
    """SiLU-and-mul quantized per token (x [T, 2I] rows that are slices of a wider buffer, an
    all-zero row among them) against the reference: the scales to float32 rounding (SiLU's
    exponential differs); on the GPU each value within one e4m3 step of the reference's (a
    product on the edge of two steps may round either way). The interpreter rounds some
    float32 values to the wrong e4m3 value (-7.86 to -4), so there only the scales count."""
    reference, triton_ops = _ops()
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(num_tokens, 2 * inter + 8, generator=gen))[:, : 2 * inter]
    x[1] = 0.0
    x = x.to(device, dtype)
    q, scale = triton_ops.silu_and_mul_quant(x)
    want_q, want = reference.silu_and_mul_quant(x)
    assert q.shape == (num_tokens, inter) and q.dtype == reference.FP8
    assert scale.shape == (num_tokens, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, want, rtol=1e-5, atol=0)
    if device == "cuda":
        got, ref = q.float() * scale, want_q.float() * want
        step = 2.0**-3 * ref.abs() + 2.0**-9 * want  # one e4m3 step (subnormals: 2^-9 * scale)
        assert ((got - ref).abs() <= step * 1.001).all(), f"max diff {(got - ref).abs().max()}"
        assert not q[1].float().any()


def check_rms_norm_quant(device, dtype, num_tokens, hidden, seed):
    """RMSNorm quantized per token, with and without the residual add (x and residual rows that
    are slices of wider buffers, an all-zero row among them), against the reference: the new
    residual bit for bit, the scales to float32 rounding (the row's sum of squares is added in
    another order); on the GPU each value within one e4m3 step of the reference's. The
    interpreter rounds some float32 values to the wrong e4m3 value, so there only the scales
    and the residual count."""
    reference, triton_ops = _ops()
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(num_tokens, hidden + 8, generator=gen))[:, :hidden]
    res = torch.randn(num_tokens, hidden + 4, generator=gen)[:, :hidden]
    x[1], res[1] = 0.0, 0.0
    x, res = x.to(device, dtype), res.to(device, dtype)
    weight = (1 + torch.randn(hidden, generator=gen)).to(device, dtype)
    for residual in (None, res):
        want_q, want, want_res = reference.rms_norm_quant(
            x, weight, 1e-5, None if residual is None else residual.clone()
        )
        got_res = None if residual is None else residual.clone()
        q, scale, new_res = triton_ops.rms_norm_quant(x, weight, 1e-5, got_res)
        assert q.shape == (num_tokens, hidden) and q.dtype == reference.FP8
        assert scale.shape == (num_tokens, 1) and scale.dtype == torch.float32
        torch.testing.assert_close(scale, want, rtol=1e-5, atol=0)
        if residual is None:
            assert new_res is None
        else:  # written in place, as rms_norm's
            assert new_res is got_res and torch.equal(new_res, want_res)
        if device == "cuda":
            got, ref = q.float() * scale, want_q.float() * want
            step = 2.0**-3 * ref.abs() + 2.0**-9 * want  # one e4m3 step (subnormals: 2^-9)
            assert ((got - ref).abs() <= step * 1.001).all(), f"max diff {(got - ref).abs().max()}"
            assert not q[1].float().any()


def check_store_kv_cache(device, dtype, num_tokens, num_kv_heads, head_dim, block_size, seed,
                         fp8=False, representable=False):  # fmt: skip
    """`fp8`: FP8 caches, with FP8_SCALES; `representable`: inputs of `fp8_representable` and
    scales 0.25 and 4 (the interpreter's case)."""
    reference, triton_ops = _ops()
    gen = torch.Generator().manual_seed(seed)
    qkv = _fused_qkv(device, dtype, num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, gen)
    _, k, v = _split_qkv(qkv, 2 * num_kv_heads, num_kv_heads, head_dim)
    scales = ((0.25, 4.0) if representable else FP8_SCALES) if fp8 else (1.0, 1.0)
    if representable:
        k.copy_(fp8_representable(k, scales[0]))
        v.copy_(fp8_representable(v, scales[1]))
    num_blocks = 2 * math.ceil(num_tokens / block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1  # padding tokens
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache_dtype = reference.FP8 if fp8 else dtype
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(k, v, ref_k, ref_v, slots, *scales)
    triton_ops.store_kv_cache(k, v, k_cache, v_cache, slots.to(torch.int32), *scales)
    # Exact, bit for bit: written slots hold the inputs (FP8: rounded the same way), skipped
    # and untouched slots stay NaN.
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
            f"max diff {(got.float() - want.float()).nan_to_num().abs().max()}"
        )
    if representable:  # the case tests the scales and the saturation
        assert (ref_k.float().abs() == 448).any() and (ref_v.float().abs() == 448).any()


def check_rotary_store_kv(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim,
                          block_size, seed, fp8=False):  # fmt: skip
    """The fused launch equals rotary_embedding then store_kv_cache of the reference: q and k
    rotated in place in the strided qkv, rotated k and v at their slots, skipped slots (-1)
    and untouched ones left NaN, v unchanged. `fp8`: FP8 caches with FP8_SCALES, within one
    e4m3 step (the rotated k may differ in its last bit)."""
    reference, triton_ops = _ops()
    gen = torch.Generator().manual_seed(seed)
    max_pos = 4096
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    positions = torch.randint(1, max_pos, (num_tokens,), generator=gen).to(device)
    qkv = _fused_qkv(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim, gen)
    num_blocks = 2 * math.ceil(num_tokens / block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache_dtype, scales = (reference.FP8, FP8_SCALES) if fp8 else (dtype, (1.0, 1.0))
    caches = [torch.full(shape, float("nan"), dtype=cache_dtype, device=device) for _ in "kv"]
    ref_qkv, ref_caches = qkv.clone(), [c.clone() for c in caches]
    ref_q, ref_k, ref_v = _split_qkv(ref_qkv, num_heads, num_kv_heads, head_dim)
    reference.rotary_store_kv(positions, ref_q, ref_k, ref_v, cos_sin, *ref_caches, slots,
                              *scales)  # fmt: skip
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    got = triton_ops.rotary_store_kv(positions, q, k, v, cos_sin, *caches, slots.to(torch.int32),
                                     *scales)  # fmt: skip
    assert got.data_ptr() == q.data_ptr()
    tol = ELEM_TOL[dtype]
    torch.testing.assert_close(qkv, ref_qkv, rtol=tol, atol=tol)
    rtol = 2.0**-3 if fp8 else tol  # an e4m3 step is 1/8 of the value or less
    for c, ref in zip(caches, ref_caches):
        torch.testing.assert_close(c.float(), ref.float(), rtol=rtol, atol=tol, equal_nan=True)
    assert (slots >= 0).any() and (slots < 0).any()


def check_all_reduce_norm(dtype, world, rank, seed, rows=5, hidden=48):
    """One rank's call of the fused all-reduce + residual add + RMSNorm, its peers simulated:
    their rows already in their buffers (second half: a non-zero buffer offset) and their
    signals already in this rank's flags. The result must equal the RMSNorm kernel on the
    rank-order sum exactly; the call consumes its flags, signals every peer and writes its
    own rows to its buffer, nothing else."""
    from llm_inference.distributed.all_reduce_norm import all_reduce_add_rms_norm
    from llm_inference.kernels import rms_norm

    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    half = rows * hidden
    bufs = [torch.full((2 * half,), float("nan"), dtype=dtype) for _ in range(world)]
    flags = [torch.zeros(rows * world, dtype=torch.int32) for _ in range(world)]
    slots = torch.arange(rows) * world
    for peer in range(world):
        if peer != rank:
            bufs[peer][half:] = parts[peer].flatten()
            flags[rank][slots + peer] = 1
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    got_res = residual.clone()
    out, res = all_reduce_add_rms_norm(
        parts[rank], got_res, weight, 1e-5, buf_ptrs, flag_ptrs, rank, half
    )
    want_res = residual.clone()
    reduced = sum(p.float() for p in parts).to(dtype)
    want = rms_norm.rms_norm(reduced, weight, 1e-5, want_res)[0]
    assert res is got_res and torch.equal(got_res, want_res), "residual"
    assert torch.equal(out, want), f"max diff {(out.float() - want.float()).abs().max()}"
    assert int(flags[rank].sum()) == 0, "flags not consumed"
    for peer in range(world):
        if peer != rank:
            assert flags[peer][slots + rank].tolist() == [1] * rows, f"peer {peer} not signalled"
    assert torch.equal(bufs[rank][half:], parts[rank].flatten()), "own rows not in the buffer"
    assert torch.isnan(bufs[rank][:half]).all(), "the other half was written"


def _fused_rank(rank, xs, residual, weight, buf_ptrs, flag_ptrs, half, outs):
    from llm_inference.distributed.all_reduce_norm import all_reduce_add_rms_norm

    for k, x in enumerate(xs):
        outs[rank, k], residual = all_reduce_add_rms_norm(
            x[rank], residual, weight, 1e-5, buf_ptrs, flag_ptrs, rank, (k & 1) * half
        )


def check_all_reduce_norm_ranks(dtype, world, seed, calls=4, rows=3, hidden=40):
    """Every rank at once: one forked process per rank, the buffers and flags in shared
    memory mapped before the fork (so at the same addresses in every rank), `calls` calls in a
    row alternating halves. Every rank's every result must equal the RMSNorm kernel on the
    rank-order sum, and every flag end consumed."""
    import multiprocessing

    from llm_inference.kernels import rms_norm

    gen = torch.Generator().manual_seed(seed)
    half = rows * hidden
    bufs = [torch.zeros(2 * half, dtype=dtype).share_memory_() for _ in range(world)]
    flags = [torch.zeros(rows * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    outs = torch.zeros(world, calls, rows, hidden, dtype=dtype).share_memory_()
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    xs = [torch.randn(world, rows, hidden, generator=gen).to(dtype) for _ in range(calls)]
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(
            target=_fused_rank,
            args=(r, xs, residual.clone(), weight, buf_ptrs, flag_ptrs, half, outs),
        )  # fmt: skip
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * world, "a rank failed or deadlocked"
    for k, x in enumerate(xs):
        want, residual = rms_norm.rms_norm(x.float().sum(0).to(dtype), weight, 1e-5, residual)
        for r in range(world):
            assert torch.equal(outs[r, k], want), f"call {k} rank {r}"
    assert sum(int(f.sum()) for f in flags) == 0, "flags left set"


INTERPRETER_KERNELS = ("paged_attention", "paged_attention_fp8", "rms_norm", "silu_and_mul",
                       "rotary", "store_kv_cache", "store_kv_cache_fp8", "rotary_store_kv",
                       "all_reduce_norm", "quantize_rows", "silu_and_mul_quant",
                       "rms_norm_quant")  # fmt: skip


def run_interpreter(kernel: str) -> None:
    """Small CPU cases in float32 and float16, for TRITON_INTERPRET=1."""
    for i, dtype in enumerate((torch.float32, torch.float16)):
        if kernel == "paged_attention":
            lens = [1, 15, 16, 17, 70, 131]
            shapes = (((4, 2, 16), 16), ((6, 2, 32), 32), ((8, 1, 16), 16))
            for shape, bs in shapes if dtype == torch.float32 else shapes[1:2]:
                cfgs = [(1, 16, False), (3, 32, False), (9, 16, True), (16, 16, False),
                        (1, 16, False, True), (3, 32, False, True),
                        (9, 16, True, True)]  # fmt: skip
                check_paged_attention("cpu", dtype, lens, *shape, bs, seed=i, configs=cfgs)
        elif kernel == "paged_attention_fp8":  # float8 -> float32 / float16 reads
            cfgs = [(3, 32, False), (9, 16, True, True)]
            check_paged_attention("cpu", dtype, [1, 17, 70, 131], 8, 2, 32, 16, seed=i,
                                  configs=cfgs, fp8=True)  # fmt: skip
        elif kernel == "rms_norm":
            check_rms_norm("cpu", dtype, 5, 48, seed=i)
        elif kernel == "silu_and_mul":
            check_silu_and_mul("cpu", dtype, 6, 40, seed=i)
        elif kernel == "rotary":
            check_rotary("cpu", dtype, 7, 6, 2, 16, seed=i)
        elif kernel == "store_kv_cache":
            check_store_kv_cache("cpu", dtype, 21, 2, 16, 8, seed=i)
        elif kernel == "store_kv_cache_fp8":
            check_store_kv_cache("cpu", dtype, 21, 2, 16, 8, seed=i, fp8=True, representable=True)
        elif kernel == "rotary_store_kv":
            check_rotary_store_kv("cpu", dtype, 19, 6, 2, 16, 8, seed=i)
        elif kernel == "quantize_rows":  # 1,100 columns: two steps of each loop, the last masked
            check_quantize_rows("cpu", dtype, 5, 1100, seed=i)
            check_quantize_rows("cpu", dtype, 5, 1100, seed=i, representable=True)
        elif kernel == "silu_and_mul_quant":  # 1,100 columns: two steps of each loop
            check_silu_and_mul_quant("cpu", dtype, 5, 1100, seed=i)
        elif kernel == "rms_norm_quant":
            check_rms_norm_quant("cpu", dtype, 5, 48, seed=i)
        elif kernel == "all_reduce_norm":
            check_all_reduce_norm(dtype, world=2, rank=1, seed=i)
            check_all_reduce_norm(dtype, world=4, rank=2, seed=i)
            check_all_reduce_norm_ranks(dtype, world=2 + i, seed=i)
        else:
            raise ValueError(kernel)


def main(kernels: list[str]) -> None:
    """Run each kernel's interpreter cases; print one `RESULT <kernel> ok|FAIL` line each."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: interpreter.py
    from interpreter import report_each

    report_each(kernels, run_interpreter)


if __name__ == "__main__":
    main(sys.argv[1:] or list(INTERPRETER_KERNELS))
