"""Sampler: processed probabilities, sampling distribution, seeds, penalties, min_tokens,
logprobs, checked against direct reference computations written here."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from llm_inference.kernels.reference import ReferenceOps
from llm_inference.sample.sampler import (
    Sampler,
    apply_penalties,
    exponential_noise,
    noise_keys,
    uniform_noise,
)
from llm_inference.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sampler_checks as checks  # noqa: E402

EOS = checks.EOS  # the EOS id checks.build passes


def build(params, prompts=None, outputs=None, seeds=None, vocab=10):
    """sampler_checks.build with this file's argument order and a 10-token vocabulary."""
    return checks.build(params, vocab, seeds=seeds, outputs=outputs, prompts=prompts)


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Temperature, top-k, top-p, min-p for one row, written plainly in float64."""
    x = [v / p.temperature for v in logits]
    if p.top_k > 0:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    m = max(x)
    e = [math.exp(v - m) for v in x]
    probs = [v / sum(e) for v in e]
    if p.top_p < 1.0:  # keep the most likely tokens until their mass reaches top_p
        keep, mass = set(), 0.0
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            if mass >= p.top_p:
                break
            keep.add(i)
            mass += probs[i]
        probs = [v if i in keep else 0.0 for i, v in enumerate(probs)]
    if p.min_p > 0.0:
        top = max(probs)
        probs = [v if v >= p.min_p * top else 0.0 for v in probs]
    total = sum(probs)
    return [v / total for v in probs]


LOGITS = torch.tensor(
    [
        [2.0, 1.1, -0.3, 0.7, 3.1, -1.2, 0.2, 1.9, -2.2, 0.45],
        [0.5, -0.6, 1.4, 2.2, 0.1, -0.9, 1.0, 0.3, -1.7, 1.8],
        [-1.0, 0.0, 1.0, 2.0, 3.0, -0.5, 0.5, 1.5, 2.5, -2.0],
    ]
)
PARAMS = [
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=2.0, top_k=4),
]


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [0, 5, 4], [2, 4]])
def test_probs_equal_reference(rows):
    """Batches mixing the filters (rows [0, 5, 4] take the top-k-only path)."""
    params = [PARAMS[r] for r in rows]
    logits = torch.cat([LOGITS, LOGITS])[: len(rows)]
    probs = Sampler.probs(logits, build(params))
    for b, p in enumerate(params):
        expected = torch.tensor(reference_probs(logits[b].tolist(), p), dtype=torch.float32)
        torch.testing.assert_close(probs[b], expected, atol=1e-6, rtol=1e-5)
    assert (probs[0] > 0).sum() == 3  # top_k=3 keeps three tokens


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-squared quantile; z=3.719 -> p = 1e-4."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    nz = probs > 0
    expected = n * probs[nz].double()
    return (((counts[nz].double() - expected) ** 2) / expected).sum().item()


@pytest.mark.parametrize("over", ["seeds", "steps"])
def test_samples_follow_processed_probs(over):
    """Many samples from fixed logits: many requests at step 0, or one seed over many steps."""
    logits = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, -0.2, -1.0, -2.5])
    p = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, min_p=0.05)
    n, vocab = 40000, 8
    rng = random.Random(0)
    seeds = [rng.getrandbits(63) for _ in range(n)]
    md = build([p] * n, seeds=seeds, vocab=vocab)
    if over == "steps":
        keys = noise_keys([12345] * n, list(range(n)))
        md = dataclasses.replace(md, noise_keys=torch.tensor(keys))
    counts = torch.bincount(
        Sampler(ReferenceOps())(logits.expand(n, vocab), md).token_ids, minlength=vocab
    )
    probs = torch.tensor(reference_probs(logits.tolist(), p))
    assert (counts[probs == 0] == 0).all()  # filtered tokens never appear
    df = int((probs > 0).sum()) - 1
    assert chi2(counts, probs) < chi2_critical(df)
    # the test has power: a plausible wrong answer (temperature ignored) fails it
    wrong = torch.tensor(reference_probs(logits.tolist(), p.replace(temperature=1.0)))
    assert chi2(counts, wrong) > chi2_critical(df)


def test_uniform_noise_is_uniform_and_batch_independent():
    keys = torch.tensor(noise_keys(list(range(200)), [3] * 200))
    u = uniform_noise(keys, 1000)
    assert 0.0 < u.min() and u.max() < 1.0
    bins = 50
    counts = torch.histc(u, bins=bins, min=0.0, max=1.0)
    assert chi2(counts, torch.full((bins,), 1.0 / bins)) < chi2_critical(bins - 1)
    alone = uniform_noise(torch.tensor(noise_keys([7], [3])), 1000)
    assert torch.equal(alone[0], u[7])  # same (seed, step): same noise, any batch or row
    assert not torch.equal(u[7], u[8])
    other_step = uniform_noise(torch.tensor(noise_keys([7], [4])), 1000)
    assert not torch.equal(alone, other_step)
    huge = noise_keys([2**80 + 5, -3], [0, 0])  # any Python int works as a seed
    assert all(0 <= k < 2**32 for k in huge)


def key_drawing_top_bits(token: int) -> int:
    """A noise key whose `token` draws the largest 24 bits (u = 1 - 2**-25): lowbias32 inverted
    (xor-shifts undone, multipliers inverted mod 2**32)."""
    m = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = x * 0x7FEB352D & m
        x ^= x >> 15
        x = x * 0x846CA68B & m
        return x ^ (x >> 16)

    def unmix(x):
        x ^= x >> 16
        x = x * pow(0x846CA68B, -1, 1 << 32) & m
        x ^= (x >> 15) ^ (x >> 30)
        x = x * pow(0x7FEB352D, -1, 1 << 32) & m
        return x ^ (x >> 16)

    assert unmix(mix(12345)) == 12345
    return (unmix(m) - mix(token)) & m


def test_noise_near_one_never_samples_a_masked_token():
    """The largest u rounds to 1.0 in float32; E = -log u must stay positive there (else a
    masked token's 0 / E is NaN and argmax takes it: once in ~130 rows of a 128k vocabulary)."""
    keys = torch.tensor([key_drawing_top_bits(0)])
    assert uniform_noise(keys, 8)[0, 0] == 1.0  # the rounding this guards against
    e = exponential_noise(keys, 8)
    assert (e > 0).all() and e.isfinite().all()
    assert e[0, 0].item() == pytest.approx(2.0**-25, rel=1e-6)
    keys = torch.tensor(noise_keys(list(range(50)), [0] * 50))  # elsewhere: -log u
    u = uniform_noise(keys, 4000).double()
    fine = u < 0.999
    assert torch.allclose(exponential_noise(keys, 4000).double()[fine], -u[fine].log(), rtol=1e-6)
    md = dataclasses.replace(build([SamplingParams(temperature=1.0)], vocab=8),
                             noise_keys=torch.tensor([key_drawing_top_bits(0)]))  # fmt: skip
    logits = torch.tensor([[float("-inf"), 0.0, 0.5, 1.0, -1.0, 0.2, 0.3, 0.1]])
    assert Sampler(ReferenceOps())(logits, md).token_ids.item() != 0
    # where token 0 is allowed, the tiny E makes it win the race, as it should
    logits[0, 0] = 0.0
    assert Sampler(ReferenceOps())(logits, md).token_ids.item() == 0


def fake_logits(seq: list[int], vocab: int) -> torch.Tensor:
    """Deterministic logits that depend on the whole sequence, like a model's."""
    gen = torch.Generator().manual_seed(hash(tuple(seq)) % (2**31))
    return torch.randn(vocab, generator=gen) * 2.0


def generate(reqs, steps, vocab=50, companions_at=None):
    """Run `steps` sampling steps for reqs = [(params, prompt, seed)]; each step the batch
    holds the requests chosen by companions_at(step) (default all), in that order."""
    outs = [[] for _ in reqs]
    sampler = Sampler(ReferenceOps())
    for step in range(steps):
        rows = companions_at(step) if companions_at else list(range(len(reqs)))
        md = build(
            [reqs[r][0] for r in rows],
            [reqs[r][1] for r in rows],
            [outs[r] for r in rows],
            [reqs[r][2] for r in rows],
            vocab=vocab,
        )
        logits = torch.stack([fake_logits(reqs[r][1] + outs[r], vocab) for r in rows])
        for r, t in zip(rows, sampler(logits, md).token_ids.tolist(), strict=True):
            outs[r].append(t)
    return outs


def test_seeded_request_is_independent_of_its_batch():
    target = (SamplingParams(temperature=1.0, top_p=0.95), [3, 4, 5], 1234)
    alone = generate([target], 16)[0]
    companions = [
        (SamplingParams(temperature=0.0), [9, 9], 1),
        (SamplingParams(top_k=5, repetition_penalty=1.3, logprobs=2), [1, 2, 3, 4], 2),
        (SamplingParams(min_p=0.1, presence_penalty=1.0, min_tokens=4), [7], 3),
        (SamplingParams(temperature=0.5, frequency_penalty=0.5), [3, 4, 5], 1235),
    ]
    reqs = companions[:2] + [target] + companions[2:]
    in_batch = generate(reqs, 16)
    assert in_batch[2] == alone
    # companions come and go, and the target changes rows
    pattern = [[2], [0, 2, 1], [4, 3, 2], [2, 0], [1, 2, 3, 4, 0]]
    shuffled = generate(reqs, 16, companions_at=lambda s: pattern[s % len(pattern)])
    assert shuffled[2] == alone
    assert in_batch[4] != in_batch[2]  # same prompt, different seed: a different text
    other_seed = generate([(target[0], target[1], 99)], 16)[0]
    assert other_seed != alone


def test_greedy_rows_take_argmax_after_penalties():
    logits = LOGITS[:1].expand(4, 10).clone()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-6, top_k=3),
        SamplingParams(temperature=0.0, frequency_penalty=2.0),  # token 4 said 2 times
        SamplingParams(temperature=1.0),
    ]
    outputs = [[4, 4], [4, 4], [4, 4], [4, 4]]
    before = logits.clone()
    md = build(params, outputs=outputs)
    assert not md.all_greedy and not md.all_random
    tokens = Sampler(ReferenceOps())(logits, md).token_ids.tolist()
    assert tokens[:3] == [4, 4, 0]  # 3.1 - 2 * 2 < 2.0 (token 0)
    assert torch.equal(logits, before)  # the caller's logits are untouched


def reference_penalties(logits, prompt, output, p):
    out = list(logits)
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_penalties_equal_reference():
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.2),
        SamplingParams(),
    ]
    prompts = [[0, 2, 2, 5], [1], [3, 9, 8, 8, 8], [0, 1, 2]]
    outputs = [[5, 6, 6], [1, 1, 4, 1, 7], [], [3, 3]]
    md = build(params, prompts, outputs)
    got = apply_penalties(LOGITS[[0, 1, 2, 0]].clone(), md)
    for b, p in enumerate(params):
        expected = reference_penalties(LOGITS[[0, 1, 2, 0]][b].tolist(), prompts[b], outputs[b], p)
        torch.testing.assert_close(got[b], torch.tensor(expected), atol=1e-6, rtol=1e-6)
    assert not torch.equal(got[2], LOGITS[2])  # the repetition penalty hit prompt tokens
    torch.testing.assert_close(got[3], LOGITS[0])


def test_min_tokens_masks_eos_and_stop_ids():
    stop = 7
    logits = torch.full((4, 10), -5.0)
    logits[:, EOS] = 10.0
    logits[:, stop] = 9.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop]),  # reached
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(min_tokens=5, stop_token_ids=[stop]),
    ]
    outputs = [[2, 3], [2, 3], [2], [2]]
    md = build(params, outputs=outputs)
    tokens = Sampler(ReferenceOps())(logits, md).token_ids.tolist()
    assert tokens[0] not in (EOS, stop)
    assert tokens[1] == EOS
    assert tokens[2] == EOS  # ignore_eos: EOS is not a stop token, only stop ids are masked
    assert tokens[3] not in (EOS, stop)
    n = 2000  # sampled rows never draw a masked token, though they carry nearly all the mass
    md = build([params[3]] * n, outputs=[[2]] * n, seeds=list(range(n)))
    drawn = Sampler(ReferenceOps())(logits[3:].expand(n, 10), md).token_ids
    assert not torch.isin(drawn, torch.tensor([EOS, stop])).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_log_softmax_of_raw_logits(dtype):
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=2.0, logprobs=4),
        SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0),
        SamplingParams(),
    ]
    logits = LOGITS.to(dtype)
    md = build(params, prompts=[[4, 0], [], []], outputs=[[7], [3], []])
    out = Sampler(ReferenceOps())(logits, md)
    raw = logits.float().log_softmax(dim=-1)
    assert out.logprobs[2] is None
    for b in (0, 1):
        lp = out.logprobs[b]
        assert lp.token_id == out.token_ids[b].item()
        assert lp.logprob == pytest.approx(raw[b, lp.token_id].item(), abs=1e-6)
    assert out.logprobs[1].top == {}
    assert raw[1].argmax().item() == 3
    assert out.token_ids[1].item() == 9  # presence penalty moved greedy off the raw argmax
    top = out.logprobs[0].top
    values, ids = raw[0].topk(4)
    assert list(top) == ids.tolist()
    assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-6)
    assert Sampler(ReferenceOps())(logits, build([SamplingParams()] * 3)).logprobs is None
