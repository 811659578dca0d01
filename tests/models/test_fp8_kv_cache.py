"""The FP8 KV cache (`kv_cache_dtype="fp8"`) on the CPU: the option and its checks, half the
bytes per block, the reference store's rounding and scales, a model's logits over an FP8 cache
near its logits over a float32 cache (with scales 1 and with scales that matter), and greedy
decoding near the unquantized cache's, alone and with FP8 weights. On CUDA (compute capability
8.9+): the engine with the Triton kernels and an FP8 cache, CUDA graphs and eager."""

from __future__ import annotations

import pytest
import torch
from fp8_testfiles import PROMPT, steady
from helpers import assert_greedy_close, make_sharp_checkpoint, needs_fp8, random_prompts

from llm_inference import LLM, SamplingParams
from llm_inference.engine import arg_utils
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.entrypoints.cli import build_parser
from llm_inference.executor.model_runner import ModelRunner
from llm_inference.kernels.reference import FP8, FP8_MAX, ReferenceOps, from_cache, to_cache
from llm_inference.layers.attention import AttentionMetadata
from llm_inference.models.loader import load_model

EPS = 2.0**-4  # e4m3 rounds to within half a step: 2^-4 of the value in the normal range
SUBNORMAL = 2.0**-10  # below 2^-6 (times the scale), steps are 2^-9: within 2^-10 absolute


@pytest.fixture(scope="module")
def steady_ckpt(tmp_path_factory):
    return steady(tmp_path_factory.mktemp("steady"))


def test_option_resolves_to_the_cache_dtype(steady_ckpt):
    def cache_dtype(**kw):
        return EngineArgs(str(steady_ckpt), device="cpu", **kw).create_engine_config().cache

    assert cache_dtype().kv_cache_dtype == "float32"  # auto: the model dtype
    assert cache_dtype(dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert cache_dtype(kv_cache_dtype="fp8").kv_cache_dtype == "float8_e4m3fn"
    assert cache_dtype(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "float8_e4m3fn"
    for bad in ("fp8_e5m2", "float8", "int8", None):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
            cache_dtype(kv_cache_dtype=bad)
    args = build_parser().parse_args(["generate", "x", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"


def test_triton_needs_compute_capability_8_9(steady_ckpt, monkeypatch):
    """Triton converts float8_e4m3fn on Ada and Hopper only: an older GPU is refused when the
    config is built, naming the option (the reference kernels still run it)."""
    monkeypatch.setattr(arg_utils, "resolve_device", lambda device: "cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    args = EngineArgs(str(steady_ckpt), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs compute capability 8\.9"):
        args.create_engine_config()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert args.create_engine_config().cache.kv_cache_dtype == "float8_e4m3fn"


def test_an_fp8_block_takes_a_quarter_of_float32s_bytes(steady_ckpt):
    """The same memory holds four times the float32 cache's blocks (twice bfloat16's), and the
    caches are allocated in FP8."""
    runners = {}
    for kv in ("auto", "fp8"):
        config = EngineArgs(
            str(steady_ckpt), device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 20
        ).create_engine_config()
        runners[kv] = ModelRunner(config, torch.device("cpu"))
    per_block = {kv: r.kv_bytes_per_block() for kv, r in runners.items()}
    assert per_block["auto"] == 4 * per_block["fp8"]
    blocks = {kv: r.determine_num_blocks() for kv, r in runners.items()}
    assert blocks["fp8"] == (1 << 20) // per_block["fp8"] == 4 * blocks["auto"]
    runners["fp8"].allocate_kv_cache(blocks["fp8"], 64)
    for attn in runners["fp8"].model.attention_layers():
        assert attn.k_cache.dtype == attn.v_cache.dtype == FP8
        assert attn.k_cache.shape[0] == blocks["fp8"]


def test_store_rounds_saturates_and_reads_back_with_the_scale():
    """x / scale rounded to e4m3 (within half a step), saturated at 448: read back times the
    scale, within the rounding bound of x; a value past 448 x scale reads 448 x scale."""
    g = torch.Generator().manual_seed(0)
    x = 30 * torch.randn(1000, generator=g)
    x[:2] = torch.tensor([1e4, -1e4])
    for scale in (1.0, 0.3, 4.0):
        stored = to_cache(x, FP8, scale)
        assert stored.dtype == FP8 and torch.isfinite(stored.float()).all()
        assert stored[:2].float().tolist() == [FP8_MAX, -FP8_MAX]
        back = from_cache(stored, scale)
        inside = x.abs() <= FP8_MAX * scale
        bound = EPS * x.abs() + SUBNORMAL * scale
        assert ((back - x).abs()[inside] <= bound[inside]).all(), scale
    assert not torch.equal(to_cache(x, FP8, 0.3), to_cache(x, FP8, 1.0))
    # other caches hold x as it is, and ignore the scale
    assert torch.equal(to_cache(x, torch.float32, 0.3), x)
    assert torch.equal(from_cache(x, 0.3), x)


def paged_logits(model, ids: torch.Tensor, cache_dtype: torch.dtype, chunk: int) -> torch.Tensor:
    """The model's logits over one prompt run through a paged KV cache of `cache_dtype`, in
    chunks of `chunk` tokens (so later chunks read earlier ones from the cache)."""
    bs, n = 16, len(ids)
    blocks = -(-n // bs)
    for attn in model.attention_layers():
        shape = (blocks, bs, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=cache_dtype)
        attn.v_cache = torch.zeros(shape, dtype=cache_dtype)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    out = []
    with torch.no_grad():
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            md = AttentionMetadata(
                slot_mapping=torch.arange(start, end, dtype=torch.int32),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32),
                block_table=table,
                max_query_len=end - start,
                max_seq_len=end,
            )
            out.append(model.compute_logits(model(ids[start:end], torch.arange(start, end), md)))
    return torch.cat(out)


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.01, 0.004)], ids=["scale_1", "scales"])
def test_logits_over_an_fp8_cache_near_a_float32_cache(steady_ckpt, scales):
    """Rounding K and V to e4m3 (relative RMS error about 2.4%, more in subnormals: K and V of
    this model have an RMS of 0.16, so with scale 1 many fall below 2^-6) moves each attention
    output by a percent or two; the steady model's layers update its residual stream by about
    a hundredth, so the logits move by about 2e-4 of their norm (measured: 1.7e-4); the bound
    is five times that. The second case's scales bring K and V to an RMS of about 16 and 40
    (normal e4m3): a store or a read that ignored them would move the logits by 8e-3."""
    model = load_model(steady_ckpt, ReferenceOps())
    ids = torch.cat([PROMPT, PROMPT.flip(0), PROMPT + 3])
    ref = paged_logits(model, ids, torch.float32, chunk=len(ids))
    dense = model.compute_logits(model(ids, torch.arange(len(ids)), [len(ids)])).detach()
    torch.testing.assert_close(ref, dense, rtol=1e-4, atol=1e-4)  # the float32 cache: exact
    for attn in model.attention_layers():
        attn.k_scale, attn.v_scale = scales
    for chunk in (len(ids), 7, 1):  # one prompt step, chunks, then decode-sized steps
        got = paged_logits(model, ids, FP8, chunk)
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 0.001, f"chunk {chunk}: relative logit error {err:.4f}"
        assert (got - ref).norm() > 0  # the cache really is FP8


def test_greedy_tokens_follow_the_unquantized_cache(tmp_path):
    """A steady model with a peaked next-token distribution (as test_fp8_checkpoints'):
    greedy tokens with an FP8 cache, alone and with FP8 weights, part from the float32
    cache's only at near ties."""
    folder = steady(tmp_path / "peaked", make_sharp_checkpoint, factor=100, num_hidden_layers=2)
    prompts = [[1, 5, 9, 20], [3, 4, 7, 8, 9, 10], list(range(40, 60)), [11] * 5, [7, 300, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    runs = {}
    for kv, quantization in (("auto", None), ("fp8", None), ("fp8", "fp8")):
        with LLM(str(folder), device="cpu", kv_cache_dtype=kv, quantization=quantization) as llm:
            runs[kv, quantization] = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_close(runs["fp8", None], runs["auto", None], near_tie=0.25, who="FP8 KV")
    assert_greedy_close(runs["fp8", "fp8"], runs["auto", None], near_tie=0.25, who="both FP8")


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
def test_cuda_engine_with_an_fp8_cache(tmp_path, eager):
    """The engine on CUDA (Triton kernels, bfloat16, CUDA graphs or not) with an FP8 cache:
    twice the bfloat16 cache's blocks in the same bytes, and greedy tokens as the bfloat16
    cache's up to near ties, prompts from 1 to 250 tokens (mixed steps and decodes)."""
    folder = steady(tmp_path / "peaked", make_sharp_checkpoint, factor=100, num_hidden_layers=2)
    prompts = random_prompts((1, 7, 33, 120, 250))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    runs, blocks = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(str(folder), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
                 enforce_eager=eager, kv_cache_dtype=kv) as llm:  # fmt: skip
            attn = llm.engine.executor.workers[0].model_runner.model.attention_layers()[0]
            assert (attn.k_cache.dtype == FP8) == (kv == "fp8")
            runs[kv] = llm.generate(prompts, params, use_tqdm=False)
            blocks[kv] = llm.stats()["num_kv_blocks"]
    assert blocks["fp8"] == 2 * blocks["auto"]
    assert_greedy_close(runs["fp8"], runs["auto"], near_tie=0.5, who="FP8 KV on CUDA")
