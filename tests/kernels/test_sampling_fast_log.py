"""The race's approximate outer log (kernels/sampling.py, FAST_LOG; module doc, "Noise").

CPU: the kernels compiled offline for sm_90 (Triton's bundled ptxas, no GPU needed) use
lg2.approx with FAST_LOG and libdevice's logf without, so the inline asm keeps compiling as
Triton changes; launches off CUDA or in the interpreter never ask for it. CUDA: the race with
the approximate log picks the accurate one's tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from llm_inference.kernels import sampling  # noqa: E402

NUM_WARPS = 8  # the launchers'


def _can_compile_for_nvidia() -> bool:
    import triton.backends

    return sampling._COMPILED and "nvidia" in triton.backends.backends


needs_compiler = pytest.mark.skipif(
    not _can_compile_for_nvidia(),
    reason="the kernels are interpreted (TRITON_INTERPRET=1) or triton has no NVIDIA backend",
)


def _ptx(kernel, signature: dict, constexprs: dict) -> str:
    """`kernel` compiled for an H100/H200 (sm_90) -> its PTX; a cubin is built too, so ptxas
    accepts the inline asm."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]


SPLIT_SIGNATURE = dict(
    logits_ptr="*bf16", stride="i32", keys_ptr="*i32", temp_ptr="*fp32", greedy_ptr="*u8",
    bitmask_ptr="*i32", mask_rows_ptr="*i32", mask_stride="i32", part_ptr="*fp32",
    idx_ptr="*i32", V="i32", chunk="i32", id_offset="i32",
)  # fmt: skip
SAMPLE_SIGNATURE = dict(
    logits_ptr="*bf16", stride="i32", keys_ptr="*i32", temp_ptr="*fp32", greedy_ptr="*u8",
    top_k_ptr="*i32", top_p_ptr="*fp32", min_p_ptr="*fp32", bitmask_ptr="*i32",
    mask_rows_ptr="*i32", mask_stride="i32", win_ptr="*fp64", out_ptr="*i64", V="i32", B="i32",
)  # fmt: skip


@needs_compiler
@pytest.mark.parametrize("fast", [True, False])
def test_split_race_log_for_sm90(fast):
    """lg2.approx with FAST_LOG (the outer log; one per element a thread handles in a step,
    with this Triton's layout), none without (libdevice's logf computes its log without it)."""
    consts = dict(HAS_GREEDY=True, HAS_MASK=False, FAST_LOG=fast, BLOCK=sampling.BLOCK)
    ptx = _ptx(sampling._split_race_kernel, SPLIT_SIGNATURE, consts)
    count = ptx.count("lg2.approx.f32")
    assert (count > 0) if fast else (count == 0), count


@needs_compiler
def test_sample_kernel_log_for_sm90():
    """The filtered race of the per-row kernel (rows whose unfiltered winner is dropped)
    uses it."""
    consts = dict(
        HAS_GREEDY=True, HAS_TOP_K=True, HAS_TOP_P=True, HAS_MIN_P=True, HAS_MASK=True,
        FAST_LOG=True,
        BLOCK=sampling.BLOCK, SEARCH_BLOCK=sampling.SEARCH_BLOCK, NP=sampling.NP,
        RETRIES=sampling.RETRIES,
    )  # fmt: skip
    ptx = _ptx(sampling._sample_kernel, SAMPLE_SIGNATURE, consts)
    assert ptx.count("lg2.approx.f32") > 0


def test_only_compiled_cuda_launches_ask_for_it(monkeypatch):
    """CPU tensors (the interpreter's) never; the switch off, never."""
    assert sampling.FAST_LOG is True  # the default
    assert not sampling._fast_log(torch.zeros(1, 8))
    if torch.cuda.is_available():
        cuda = torch.zeros(1, 8, device="cuda")
        nvidia = sampling._COMPILED and torch.version.hip is None
        assert sampling._fast_log(cuda) is nvidia
        monkeypatch.setattr(sampling, "FAST_LOG", False)
        assert not sampling._fast_log(cuda)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B", [8, 256])
def test_fast_log_picks_the_accurate_logs_tokens(monkeypatch, B):
    """The approximate log moves a race value by ~1e-7, so it changes a token only where the
    two best values of the row are that close: at 128,256 tokens, (almost) never. Peaked
    rows (a few strong candidates) and flat ones; plain rows take the split race, top-p rows
    the single program."""
    V = 128_256
    gen = torch.Generator(device="cuda").manual_seed(B)
    logits = torch.randn(B, V, device="cuda", generator=gen) * 2.0
    logits[: B // 2, :20] += torch.linspace(12.0, 6.0, 20, device="cuda")
    logits = logits.to(torch.bfloat16)
    keys = torch.randint(0, 2**31, (B,), device="cuda", generator=gen, dtype=torch.int32)
    temperature = torch.full((B,), 0.8, device="cuda")
    top_p = torch.full((B,), 0.95, device="cuda")
    got = {}
    for fast in (True, False):
        monkeypatch.setattr(sampling, "FAST_LOG", fast)
        got[fast] = (
            sampling.sample(logits, keys, temperature),
            sampling.sample(logits, keys, temperature, top_p=top_p),
        )
    for fast, accurate in zip(got[True], got[False]):
        assert (fast >= 0).all()
        assert (fast != accurate).sum() <= 1, (fast != accurate).nonzero()[:, 0].tolist()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("retries", [0, sampling.RETRIES])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_filtered_masked_sample_kernel_compiles_here(dtype, retries):
    """Every filter with a grammar's bitmask, at the engine's retries and at none (the tests'
    way to the exact search), compiles with this machine's Triton for its GPU: Triton 3.6
    failed in its coalesce pass on one such variant (fp16 logits, no retries) on an H200."""
    from triton.compiler import ASTSource, compile
    from triton.runtime import driver

    consts = dict(
        HAS_GREEDY=False, HAS_TOP_K=True, HAS_TOP_P=True, HAS_MIN_P=True, HAS_MASK=True,
        FAST_LOG=sampling._fast_log(torch.zeros(1, device="cuda")),
        BLOCK=sampling.BLOCK, SEARCH_BLOCK=sampling.SEARCH_BLOCK, NP=sampling.NP,
        RETRIES=retries,
    )  # fmt: skip
    signature = {**SAMPLE_SIGNATURE, "logits_ptr": f"*{dtype}",
                 **dict.fromkeys(consts, "constexpr")}  # fmt: skip
    source = ASTSource(fn=sampling._sample_kernel, signature=signature, constexprs=consts)
    target = driver.active.get_current_target()
    assert compile(source, target=target, options={"num_warps": NUM_WARPS}).asm["cubin"]
