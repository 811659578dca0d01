"""Checks shared by the sampler tests on CPU (Triton interpreter) and on the GPU: distribution
against Sampler.probs in float64 (chi-squared), seed independence, agreement of the two paths."""

from __future__ import annotations

import math
import random

import torch

from llm_inference.sample.sampler import Sampler, SamplingMetadata
from llm_inference.sampling_params import SamplingParams

EOS = 1


def build(params, vocab, device="cpu", seeds=None, outputs=None, prompts=None, eos=(EOS,)):
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[]] * n,
        outputs if outputs is not None else [[]] * n,
        seeds if seeds is not None else list(range(n)),
        eos,
        vocab,
        device,
    )


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-squared quantile; z=3.719 -> p = 1e-4."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_binned(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """(statistic, df) of counts [V] against probs [V]: tokens expected fewer than
    `min_expected` times share one bin; a count where probs is 0 gives +inf."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    n = counts.sum()
    if (counts[probs == 0] > 0).any():
        return math.inf, 1
    big = n * probs >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([n * probs[big], n * probs[~big].sum()[None]])
    if exp[-1] < min_expected:  # too small to stand alone: merge into the smallest bin
        obs = torch.cat([obs[:-2], obs[-2:].sum()[None]])
        exp = torch.cat([exp[:-2], exp[-2:].sum()[None]])
    return (((obs - exp) ** 2) / exp).sum().item(), len(obs) - 1


def follows(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    stat, df = chi2_binned(counts, probs)
    return df >= 1 and stat < chi2_critical(df)


def draw(sampler, logits_row, params: SamplingParams, n: int, device) -> torch.Tensor:
    """Token counts [V] of n requests with random seeds sampling the same logits at step 0."""
    V = logits_row.shape[0]
    rng = random.Random(hash((params.temperature, params.top_k, params.top_p, n)))
    md = build([params] * n, V, device, seeds=[rng.getrandbits(63) for _ in range(n)])
    tokens = sampler(logits_row.to(device).expand(n, V), md).token_ids
    return torch.bincount(tokens.cpu(), minlength=V)


def reference_probs(logits_row, params: SamplingParams) -> torch.Tensor:
    """Sampler.probs in float64 for one row."""
    md = build([params], logits_row.shape[0])
    return Sampler.probs(logits_row.double().cpu()[None], md)[0]


def check_distribution(sampler, logits_row, params, wrong_params, n, device) -> None:
    counts = draw(sampler, logits_row, params, n, device)
    probs = reference_probs(logits_row, params)
    assert (counts[probs == 0] == 0).all(), "a filtered token was drawn"
    assert follows(counts, probs), chi2_binned(counts, probs)
    # the same test has power: a plausible wrong distribution fails it
    assert not follows(counts, reference_probs(logits_row, wrong_params))


COMPANIONS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=7, top_p=0.9),
    SamplingParams(temperature=1.3, min_p=0.1),
]


def _token_at(sampler, rows, params, seeds, pos, step, device) -> int:
    md = build(params, rows[0].shape[0], device, seeds=seeds, outputs=[[2] * step] * len(rows))
    return sampler(torch.stack(rows).to(device), md).token_ids[pos].item()


def check_seed_independence(sampler, V: int, device, target: SamplingParams) -> None:
    """The same (seed, step) row gives the same token alone and among 1 or 3 other rows, at
    every position, for two steps."""
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(V, generator=gen) * 3
    others = list(torch.randn(3, V, generator=gen) * 3)
    for step in (0, 7):
        alone = _token_at(sampler, [row], [target], [1234], 0, step, device)
        for k in (1, 3):
            for pos in range(k + 1):
                rows = others[:pos] + [row] + others[pos:k]
                params = COMPANIONS[:pos] + [target] + COMPANIONS[pos:k]
                seeds = [11, 22, 33][:pos] + [1234] + [11, 22, 33][pos:k]
                got = _token_at(sampler, rows, params, seeds, pos, step, device)
                assert got == alone, (step, k, pos)
