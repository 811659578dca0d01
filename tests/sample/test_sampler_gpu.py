"""The Triton sampling path on the GPU at the real vocab (128,256) and batch 256: distributions
against Sampler.probs in float64, seed independence, agreement with the torch path on the
same uniforms; the split race equal to the single program. Skipped without CUDA; no timing
here (benchmarks/sampler_race.py times the race)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
pytest.importorskip("triton")
import sampler_checks as checks  # noqa: E402
import sampler_triton_checks  # noqa: E402

from llm_inference.kernels.reference import ReferenceOps  # noqa: E402
from llm_inference.kernels.triton_ops import TritonOps  # noqa: E402
from llm_inference.sample.sampler import Sampler  # noqa: E402
from llm_inference.sampling_params import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
V, B = 128_256, 256


def llama_like_row(seed: int = 0) -> torch.Tensor:
    """A peaked row over the full vocab: a long tail, a few strong candidates."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(V, generator=gen) * 2.0
    row[torch.randperm(V, generator=gen)[:20]] += torch.linspace(12.0, 6.0, 20)
    return row


CONFIGS = [
    (SamplingParams(temperature=0.6), SamplingParams(temperature=0.9)),
    (SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, top_k=5)),
    (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8)),
    (SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=1.2)),
    (  # temperature 1: enough tokens survive the three filters for a chi-squared test
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.0, top_k=50),
    ),
]


@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_distribution_at_real_vocab(config):
    params, wrong = CONFIGS[config]
    sampler = Sampler(TritonOps("cuda"))
    row = llama_like_row()
    checks.check_distribution(sampler, row, params, wrong, 16 * B, "cuda")  # one launch


@pytest.mark.parametrize("target", [CONFIGS[0][0], CONFIGS[4][0]], ids=["plain", "filtered"])
def test_seed_independence_at_real_vocab(target):
    checks.check_seed_independence(Sampler(TritonOps("cuda")), V, "cuda", target)


def test_paths_agree_at_batch_256():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(B, V, generator=gen) * 2).cuda()
    params = [c[0] for c in CONFIGS] * (B // len(CONFIGS)) + [CONFIGS[0][0]] * (B % len(CONFIGS))
    params[::7] = [SamplingParams(temperature=0.0)] * len(params[::7])
    md = checks.build(params, V, "cuda", seeds=list(range(B)))
    got = Sampler(TritonOps("cuda"))(logits, md).token_ids
    want = Sampler(ReferenceOps())(logits, md).token_ids
    greedy = torch.tensor([p.temperature == 0.0 for p in params], device="cuda")
    assert torch.equal(got[greedy], logits[greedy].argmax(-1))
    assert (got == want).float().mean() >= 0.95, (got != want).nonzero()[:, 0].tolist()


def test_broken_rows_on_gpu():
    logits = torch.randn(4, V, device="cuda")
    logits[3, 5] = float("nan")
    md = checks.build([SamplingParams(top_p=0.9)] * 4, V, "cuda")
    with pytest.raises(ValueError, match=r"rows \[3\]"):
        Sampler(TritonOps("cuda"))(logits, md)


def test_split_race_equals_single_program_on_gpu():
    sampler_triton_checks.check_split_race_exact(None, "cuda")


def test_shard_race_equals_sample_on_gpu():
    """Tensor parallel's race over vocabulary slices at the real vocabulary (128,256 over two
    and three ranks, the last slice padded) gives `sample`'s tokens, bfloat16 included."""
    sampler_triton_checks.check_shard_race_exact(None, "cuda", width=128256)


def test_grammar_bitmask_on_gpu():
    """A grammar's bitmask in the compiled kernels: exactly the launch on logits with -inf
    outside the grammar (split race and filtered rows, float32 and half)."""
    sampler_triton_checks.check_grammar_bitmask_exact(None, "cuda")


def test_no_compiles_after_warm_up_at_any_batch():
    """After `warm_up` at the largest batch, the race at every batch size of a run (split or
    not, with and without greedy rows, with and without a grammar's bitmask, whole rows and
    vocabulary slices) compiles nothing: the batch size and split count are not specialized.
    Before, each new batch size could cost a compile in the middle of a run."""
    from helpers import triton_compiles

    from llm_inference.kernels import sampling

    dev = "cuda"
    logits = torch.randn(B, V, device=dev).to(torch.bfloat16)
    keys = torch.randint(0, 2**31, (B,), dtype=torch.int32, device=dev)
    temperature = torch.full((B,), 0.7, device=dev)
    greedy = torch.arange(B, device=dev).remainder(3).eq(0).to(torch.int32)
    shard = logits[:, : V // 2]
    bitmask = torch.full((3, -(-V // 32)), -1, dtype=torch.int32, device=dev)
    mask_rows = torch.arange(B, device=dev).remainder(5).sub(2).clamp(max=2).to(torch.int32)
    sampling.warm_up(logits, keys, temperature, greedy)
    sampling.warm_up(shard, keys, temperature, greedy, vocab_start=V // 2)
    with triton_compiles() as compiled:
        for b in (1, 2, 3, 15, 16, 17, 31, 32, 64, 100, 128, 129, 200, 255, 256):
            for g in (None, greedy[:b]):
                tokens = sampling.sample(logits[:b], keys[:b], temperature[:b], greedy=g)
                masked = sampling.sample(logits[:b], keys[:b], temperature[:b], greedy=g,
                                         bitmask=bitmask, bitmask_rows=mask_rows[:b])  # fmt: skip
                assert torch.equal(masked, tokens)  # every bit set: the same tokens
                sampling.race_shard(shard[:b], keys[:b], temperature[:b], g, V // 2)
        torch.cuda.synchronize()
    assert compiled == [], compiled.details
    # the merge's wider tile changed no token: greedy rows still take the argmax
    rows = greedy.bool()
    assert torch.equal(tokens[rows], logits.float().argmax(dim=-1)[rows])
