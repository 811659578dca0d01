"""The sampler: one batch of last-token logits [B, V] -> one token per request, all on the device.

Order, as in vLLM v1:
  0. structured outputs: tokens outside the row's grammar -inf (sample/grammar.py; vLLM's
     runner masks the logits before its sampler), so that "raw" below means masked;
  1. logprobs from log_softmax of the raw logits (before anything below);
  2. allowed_token_ids (every other token -inf), then logit_bias (added) and bad_words (a
     word's last token -inf where the output ends with the tokens before it);
  3. penalties: repetition (prompt + output tokens), frequency and presence (output tokens);
  4. min_tokens: EOS and stop_token_ids set to -inf while len(output) < min_tokens;
  5. greedy rows take the argmax; the others go through temperature, top-k, top-p, min-p
     and are sampled with the exponential race: argmax(probs / E), E ~ Exp(1).

Steps 1-4 run only for rows off SamplingPath.STAGED (`SamplingMetadata.path`); on that path
the logits reach step 5 untouched, and the fused sampler applies step 0 as it reads them.
Step 5 has two implementations with the same semantics:
`sample_reference` (PyTorch, any device; the CPU engine's) and the kernel ops' fused sampler
(`ops.sample`, kernels/sampling.py), which `Sampler(ops)` calls where `ops.fused_sampler` (the
Triton ops). Both draw the same uniforms u[b, v] = uniform_noise(keys)[b, v] bit for bit, a pure
function of (seed_b, step_b, token v), step_b = len(output_token_ids[b]); a request's tokens
therefore do not depend on which requests share its batch nor on its row. The two agree on the
token except where float rounding decides a near-tie (kernels/sampling.py says why).

Broken rows (after steps 2-4): a NaN or +inf logit raises ValueError naming the
rows; a row whose logits are all -inf (e.g. min_tokens masked every token the model allows)
takes the argmax of the raw logits, with a RuntimeWarning, or raises if those are all -inf too.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from llm_inference.outputs import Logprobs
from llm_inference.sample.grammar import apply_grammar
from llm_inference.sample.metadata import SamplingMetadata, noise_keys
from llm_inference.sampling_params import SamplingPath

__all__ = [
    "Logprobs",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "noise_keys",
    "sample_reference",
    "exponential_noise",
    "uniform_noise",
]

_M32 = 0xFFFFFFFF
STATUS_BAD = -1  # in place of a token: the row holds a NaN or +inf logit (kernels/sampling.py)
STATUS_EMPTY = -2  # in place of a token: every logit of the row is -inf


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


def _noise_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] int64: the 24 bits of mix(mix(v) + keys[b]) that feed the noise."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    return _mix32((_mix32(v)[None, :] + keys[:, None]) & _M32) >> 8


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """(bits + 0.5) / 2**24 in float32: the uniform of `_noise_bits`' 24 bits."""
    return (bits.to(torch.float32) + 0.5) * (2.0**-24)


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms: u[b, v] = (mix(mix(v) + keys[b]) >> 8 + 0.5) / 2**24.

    Row b depends only on keys[b], so it is the same in any batch and at any row. Within a
    row all values differ (two bijections), and 24 bits feed the float. The largest, 1 -
    2**-25, rounds to 1.0 in float32: the race takes its E from `exponential_noise`.
    """
    return _uniform(_noise_bits(keys, vocab_size))


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 E = -log u of `uniform_noise`'s u, all positive, as the fused kernel
    computes it: near u = 1, where float32 loses log(u) (and rounds the largest u to 1, E to
    0, and a masked token's 0 / E to NaN, which argmax takes), from w = 1 - u, exact from the
    bits, by -log(1 - w) = w + w^2/2 + w^3/3."""
    bits = _noise_bits(keys, vocab_size)
    w = _uniform(0xFFFFFF - bits)
    return torch.where(w < 1e-3, w + w * w * (0.5 + w / 3), _uniform(bits).log_().neg_())


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: list[Logprobs | None] | None  # per row; None when no row asked for logprobs
    status: torch.Tensor | None = None  # [B] int64: the token, or STATUS_BAD / STATUS_EMPTY


def report_status(status: list[int]) -> None:
    """Host side of `Sampler(sync=False)`: raise for NaN/+inf rows, warn for emptied rows."""
    if STATUS_BAD not in status and STATUS_EMPTY not in status:  # the common case, at C speed
        return
    bad = [i for i, s in enumerate(status) if s == STATUS_BAD]
    _check_rows(bad, [i for i, s in enumerate(status) if s == STATUS_EMPTY])


def _check_rows(bad: list[int], empty: list[int]) -> None:
    """Raise for rows with a NaN or +inf logit; warn for emptied rows (given the raw argmax)."""
    if bad:
        raise ValueError(f"sampler: NaN or +inf logits (after penalties) in rows {bad}")
    if empty:
        warnings.warn(
            f"sampler: rows {empty} had every token masked (min_tokens and stop tokens, or "
            "penalties): took the argmax of the raw logits",
            RuntimeWarning,
            stacklevel=4,
        )


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids (every other token of the row -inf), then logit_bias and bad_words
    (added: a bad word's entries are -inf), on float32 [B, V] logits in place; before the
    penalties, as vLLM's order."""
    if md.allowed is not None:
        lists, rows, cols = md.allowed
        blocked = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        blocked[lists] = True
        blocked[rows, cols] = False
        logits.masked_fill_(blocked, float("-inf"))
    if md.logit_bias is not None:
        rows, cols, values = md.logit_bias
        logits.index_put_((rows, cols), values, accumulate=True)
    return logits


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


def sample_reference(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Step 5 in PyTorch on processed float32 logits [B, V] -> [B] int64 tokens, or a status
    (STATUS_BAD, STATUS_EMPTY) on broken rows. The row max is one extra cheap reduction."""
    rowmax = logits.amax(dim=-1)  # NaN or +inf if any, -inf if all -inf
    if md.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        probs = Sampler.probs(logits, md)
        token_ids = probs.div_(exponential_noise(md.noise_keys, md.vocab_size)).argmax(dim=-1)
        if not md.all_random:
            token_ids = torch.where(md.greedy, logits.argmax(dim=-1), token_ids)
    status = torch.where(rowmax == float("-inf"), STATUS_EMPTY, STATUS_BAD)
    return torch.where(rowmax.isfinite(), token_ids, status)


def _resolve_status(token_ids: torch.Tensor, raw_logits: torch.Tensor) -> torch.Tensor:
    """Replace statuses as the module docstring says (one host sync to look)."""
    if not bool((token_ids < 0).any()):
        return token_ids
    empty = (token_ids == STATUS_EMPTY).nonzero()[:, 0]
    top, arg = raw_logits.index_select(0, empty).float().max(dim=-1)
    bad = (token_ids == STATUS_BAD).nonzero()[:, 0].tolist()
    if not bad and bool((top == float("-inf")).any()):
        raise ValueError(f"sampler: every logit is -inf in rows {empty[top.isneginf()].tolist()}")
    _check_rows(bad, empty.tolist())
    return token_ids.index_put((empty,), arg)


class Sampler(torch.nn.Module):
    """Samples one token per row of `logits` [B, V]; see the module docstring for the order.

    `ops`: the kernel ops object (kernels.get_ops). Where `ops.fused_sampler`, step 5 is its
    `sample` (needs CUDA, or TRITON_INTERPRET=1 on CPU), else `sample_reference`.
    """

    def __init__(self, ops: ModuleType) -> None:
        super().__init__()
        self.ops = ops
        self.fused = ops.fused_sampler

    def forward(self, logits: torch.Tensor, md: SamplingMetadata, sync: bool = True):
        """`sync=False` leaves broken rows for the caller to report from `status` (after
        its own device-to-host copy), so that sampling never waits for the device unless
        logprobs are asked for."""
        assert logits.dim() == 2 and logits.shape[1] == md.vocab_size, logits.shape
        raw, raw_logprobs = logits, None
        plain = md.path is SamplingPath.STAGED  # steps 1-4 have nothing to do
        in_kernel = plain and self.fused  # the fused sampler reads bf16/fp16 logits as they are
        if md.grammar is not None and not in_kernel:  # step 0 on a copy: the caller's stays
            raw = apply_grammar(logits.to(torch.float32, copy=True), md.grammar)
        if not in_kernel:
            logits = raw.to(torch.float32, copy=True)  # never change the caller's tensor
        if not plain:
            if md.logprobs_rows is not None:
                raw_logprobs = logits.index_select(0, md.logprobs_rows).log_softmax(dim=-1)
            logits = apply_logit_bias(logits, md)
            if not md.no_penalties:
                logits = apply_penalties(logits, md)
            if md.min_tokens_rows is not None:
                logits[md.min_tokens_rows, md.min_tokens_cols] = float("-inf")
        if self.fused:
            grammar = md.grammar if in_kernel else None
            token_ids = self.ops.sample(
                logits, md.noise_keys, md.temperature,
                greedy=None if md.all_random else md.greedy,
                top_k=md.top_k, top_p=md.top_p, min_p=md.min_p,
                bitmask=None if grammar is None else grammar.bitmask,
                bitmask_rows=None if grammar is None else grammar.row_index,
            )  # fmt: skip
        else:
            token_ids = sample_reference(logits, md)
        status = token_ids
        if sync:
            token_ids = _resolve_status(token_ids, raw)
        elif plain:  # no host sync; statuses reported from `status`. Nothing but a grammar
            # masked logits here, so an emptied row's raw logits are all -inf where it allows:
            # token 0 then. A broken row's token is 0 too: the next input stays a valid id.
            token_ids = token_ids.clamp(min=0)
        else:  # no host sync: take the raw argmax on emptied rows, report statuses
            token_ids = torch.where(token_ids == STATUS_EMPTY, raw.argmax(dim=-1), token_ids)
            token_ids = token_ids.clamp_(min=0)
        logprobs = None if raw_logprobs is None else self._logprobs(raw_logprobs, token_ids, md)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, status=status)

    def race_shard(
        self, logits: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor,
        greedy: torch.Tensor | None, vocab_start: int,
    ) -> torch.Tensor:  # fmt: skip
        """The fused sampler's race over one vocabulary slice (`ops.race_shard`; tensor
        parallel, sample/tensor_parallel.py): [3, B] float64 winners (value, token, max logit)."""
        return self.ops.race_shard(logits, keys, temperature, greedy, vocab_start)

    def warm_up(
        self, logits: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor,
        greedy: torch.Tensor, vocab_start: int | None = None,
        top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Compile the fused sampler's kernels for these inputs' shapes and dtypes
        (`ops.warm_up_sampler`, kernels/sampling.py "Compiles")."""
        self.ops.warm_up_sampler(logits, keys, temperature, greedy, vocab_start, top_k, top_p)

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
