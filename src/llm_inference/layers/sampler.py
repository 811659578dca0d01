"""The sampler: one batch of last-token logits -> one token per request, all on the device.

Order, as in vLLM v1:
  1. logprobs from log_softmax of the raw logits (before anything below);
  2. penalties: repetition (prompt + output tokens), frequency and presence (output tokens);
  3. min_tokens: EOS and stop_token_ids set to -inf while len(output) < min_tokens;
  4. greedy rows take the argmax; the others go through temperature, top-k, top-p, min-p
     and are sampled with the exponential race: argmax(probs / E), E ~ Exp(1).

Every request has a seed (the engine draws one when the user gave none). The noise for row b
is a pure function of (seed_b, step_b, token id), step_b = len(output_token_ids[b]), computed
by a counter-based hash; a request's tokens therefore do not depend on which requests share
its batch nor on its row. Per-request Python work happens only in `SamplingMetadata.build`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_inference.outputs import Logprobs
from llm_inference.sampling_params import GREEDY_EPS, SamplingParams

__all__ = [
    "Logprobs",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "noise_keys",
    "uniform_noise",
]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def noise_keys(seeds: list[int], steps: list[int]) -> list[int]:
    """One 32-bit key per row from (seed, step); any Python int is a valid seed."""
    return [
        _splitmix64(_splitmix64(s & _M64) ^ (t & _M64)) & _M32
        for s, t in zip(seeds, steps, strict=True)
    ]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32): c is split in 16-bit halves so that
    every intermediate stays below 2**49 (no int64 overflow)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit bijective integer hash (Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1): u[b, v] = mix(mix(v) + keys[b]) / 2**32.

    Row b depends only on keys[b], so it is the same in any batch and at any row. Within a
    row all values differ (two bijections), and 24 bits feed the float.
    """
    v = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    x = _mix32((_mix32(v)[None, :] + keys[:, None]) & _M32)
    return ((x >> 8).to(torch.float32) + 0.5) * (2.0**-24)


def _padded(rows: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[B, max_len] int64; padding and ids outside [0, vocab_size) become vocab_size."""
    width = max(1, max((len(r) for r in rows), default=0))
    data = [[t if 0 <= t < vocab_size else vocab_size for t in r] for r in rows]
    data = [r + [vocab_size] * (width - len(r)) for r in data]
    return torch.tensor(data, dtype=torch.int64, device=device)


def _min_tokens_pairs(
    params: list[SamplingParams], outputs: list[list[int]], eos: tuple[int, ...], V: int
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to mask while len(output) < min_tokens: stop_token_ids, and EOS
    unless ignore_eos."""
    rows, cols = [], []
    for b, (p, out) in enumerate(zip(params, outputs, strict=True)):
        if len(out) < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            ids = sorted(t for t in ids if 0 <= t < V)
            rows += [b] * len(ids)
            cols += ids
    return rows, cols


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs: tensors on the logits' device, one row per request.

    Optional tensors are None when no row needs that step, so the sampler skips it.
    """

    vocab_size: int
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    noise_keys: torch.Tensor  # [B] int64 in [0, 2**32), from (seed, step)
    top_k: torch.Tensor | None  # [B] int64; vocab_size where top-k is off
    max_top_k: int  # largest active k (0 if none)
    top_p: torch.Tensor | None  # [B] float32; 1.0 where off
    min_p: torch.Tensor | None  # [B] float32; 0.0 where off
    no_penalties: bool
    repetition_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64 padded with vocab_size
    output_token_ids: torch.Tensor | None  # [B, Lo] int64 padded with vocab_size
    min_tokens_rows: torch.Tensor | None  # [M] rows and
    min_tokens_cols: torch.Tensor | None  # [M] token ids to set to -inf
    logprobs_k: list[int | None]  # per row: SamplingParams.logprobs
    logprobs_rows: torch.Tensor | None  # [R] rows that asked for logprobs
    max_num_logprobs: int | None  # largest k asked (None: no row asked)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        seeds: list[int],
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        device,
    ) -> SamplingMetadata:
        V = vocab_size
        greedy = [p.temperature < GREEDY_EPS for p in params]
        temps, ks, top_ps, min_ps = [], [], [], []
        for p, g in zip(params, greedy, strict=True):
            temps.append(1.0 if g else p.temperature)
            ks.append(V if g or not 0 < p.top_k < V else p.top_k)
            top_ps.append(1.0 if g else p.top_p)
            min_ps.append(0.0 if g else p.min_p)
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        no_pen = not use_rep and all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params
        )
        rows, cols = _min_tokens_pairs(params, output_token_ids, eos_token_ids, V)
        lp_rows = [b for b, p in enumerate(params) if p.logprobs is not None]
        steps = [len(out) for out in output_token_ids]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            vocab_size=V,
            temperature=floats(temps),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            noise_keys=ints(noise_keys(seeds, steps)),
            top_k=ints(ks) if any(k < V for k in ks) else None,
            max_top_k=max((k for k in ks if k < V), default=0),
            top_p=floats(top_ps) if any(p < 1.0 for p in top_ps) else None,
            min_p=floats(min_ps) if any(p > 0.0 for p in min_ps) else None,
            no_penalties=no_pen,
            repetition_penalty=None if no_pen else floats([p.repetition_penalty for p in params]),
            presence_penalty=None if no_pen else floats([p.presence_penalty for p in params]),
            frequency_penalty=None if no_pen else floats([p.frequency_penalty for p in params]),
            prompt_token_ids=_padded(prompt_token_ids, V, device) if use_rep else None,
            output_token_ids=None if no_pen else _padded(output_token_ids, V, device),
            min_tokens_rows=ints(rows) if rows else None,
            min_tokens_cols=ints(cols) if rows else None,
            logprobs_k=[p.logprobs for p in params],
            logprobs_rows=ints(lp_rows) if lp_rows else None,
            max_num_logprobs=max((params[b].logprobs for b in lp_rows), default=None),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: list[Logprobs | None] | None  # per row; None when no row asked for logprobs


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties on float32 [B, V] logits (in place), vectorized over the batch.

    repetition: tokens seen in prompt or output: positive logits / r, negative * r;
    frequency: - f * count in output; presence: - p * (count in output > 0).
    """
    B, V = logits.shape
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)
    ones = torch.ones(md.output_token_ids.shape, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, md.output_token_ids, ones)
    counts = counts[:, :V]
    if md.prompt_token_ids is not None:
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, md.prompt_token_ids, True)
        seen = seen[:, :V] | (counts > 0)
        penalty = torch.where(seen, md.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= md.frequency_penalty[:, None] * counts
    logits -= md.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask to -inf the logits outside top-k, then outside the top-p nucleus (ties at the
    k-th value are kept). The nucleus is the smallest set of most likely tokens whose mass
    reaches p; at least one token always stays."""
    if md.top_k is None and md.top_p is None:
        return logits
    V = logits.shape[1]
    if md.top_p is None:  # top-k only: a partial top-k is cheaper than a full sort
        top = logits.topk(md.max_top_k, dim=-1).values
        kth = top.gather(1, (md.top_k.clamp(max=md.max_top_k) - 1)[:, None])
        kth = kth.masked_fill(md.top_k[:, None] >= V, float("-inf"))
        return logits.masked_fill_(logits < kth, float("-inf"))
    srt, idx = logits.sort(dim=-1)  # ascending
    if md.top_k is not None:
        kth = srt.gather(1, (V - md.top_k)[:, None])
        srt.masked_fill_(srt < kth, float("-inf"))
    cum = srt.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1.0 - md.top_p[:, None]
    drop[:, -1] = False
    srt.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, srt)


class Sampler(torch.nn.Module):
    """Samples one token per row of `logits` [B, V]; see the module docstring for the order."""

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[1] == md.vocab_size, logits.shape
        logits = logits.to(torch.float32, copy=True)  # never change the caller's tensor
        raw_logprobs = None
        if md.logprobs_rows is not None:
            raw_logprobs = logits.index_select(0, md.logprobs_rows).log_softmax(dim=-1)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)
        if md.min_tokens_rows is not None:
            logits[md.min_tokens_rows, md.min_tokens_cols] = float("-inf")
        if md.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            probs = self.probs(logits, md)
            exp = uniform_noise(md.noise_keys, md.vocab_size).log_().neg_()  # E ~ Exp(1)
            token_ids = probs.div_(exp).argmax(dim=-1)
            if not md.all_random:
                token_ids = torch.where(md.greedy, logits.argmax(dim=-1), token_ids)
        logprobs = None if raw_logprobs is None else self._logprobs(raw_logprobs, token_ids, md)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p ([B, V] float32, rows sum
        to 1). Greedy rows are computed at temperature 1 and unused."""
        logits = logits / md.temperature[:, None]
        logits = apply_top_k_top_p(logits, md)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            keep = probs >= md.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs * keep
            probs /= probs.sum(dim=-1, keepdim=True)
        return probs

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, token_ids: torch.Tensor, md: SamplingMetadata
    ) -> list[Logprobs | None]:
        """One device->host copy of the sampled tokens' and top-k logprobs of asking rows."""
        tokens = token_ids.index_select(0, md.logprobs_rows)
        chosen = raw.gather(1, tokens[:, None])[:, 0].tolist()
        top_vals, top_ids = raw.topk(min(md.max_num_logprobs, raw.shape[1]), dim=-1)
        top_vals, top_ids, tokens = top_vals.tolist(), top_ids.tolist(), tokens.tolist()
        out: list[Logprobs | None] = [None] * len(md.logprobs_k)
        for i, b in enumerate(md.logprobs_rows.tolist()):
            k = md.logprobs_k[b]
            top = dict(zip(top_ids[i][:k], top_vals[i][:k], strict=True))
            out[b] = Logprobs(token_id=tokens[i], logprob=chosen[i], top=top)
        return out
