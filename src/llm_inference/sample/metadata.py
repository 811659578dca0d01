"""Per-step sampling inputs: `SamplingMetadata.build` turns the batch's SamplingParams, token
lists and seeds into tensors on the logits' device (one row per request), on the host each step:
the per-request Python work of the sampler (rows on SamplingPath.STAGED skip it: their inputs
are staged with the step's, sample/staging.py).

Noise keys: row b's key is a 32-bit hash of (seed_b, step_b), step_b = len(output_token_ids[b]);
both sampling paths draw the row's noise from the key and the token id alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llm_inference.sampling_params import GREEDY_EPS, SamplingParams, SamplingPath

if TYPE_CHECKING:
    from llm_inference.sample.grammar import GrammarMask

__all__ = ["SamplingMetadata", "noise_keys", "padded_token_ids"]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def splitmix64_np(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` over a uint64 array (numpy's uint64 arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seed_hash(seed: int) -> int:
    """The per-request half of a noise key:
    `noise_keys_np([seed_hash(s)], [t]) == noise_keys([s], [t])`."""
    return _splitmix64(seed & _M64)


def noise_keys_np(seed_hashes: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """`noise_keys` vectorized: uint32 keys from uint64 seed hashes and int64 steps."""
    x = seed_hashes.astype(np.uint64, copy=False) ^ steps.astype(np.uint64)
    return (splitmix64_np(x) & np.uint64(_M32)).astype(np.uint32)


def noise_keys(seeds: list[int], steps: list[int]) -> list[int]:
    """One 32-bit key per row from (seed, step); any Python int is a valid seed."""
    return [
        _splitmix64(_splitmix64(s & _M64) ^ (t & _M64)) & _M32
        for s, t in zip(seeds, steps, strict=True)
    ]


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: CUDA copies go through pinned
    memory, non-blocking (a plain copy from pageable memory would synchronize the stream,
    which async scheduling cannot afford)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def padded_token_ids(rows: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[B, max(1, max len)] int64; padding and ids outside [0, vocab_size) become vocab_size.

    One C-level conversion of the concatenated rows (np.fromiter) and one masked scatter,
    instead of padding each row in Python."""
    lengths = [len(r) for r in rows]
    width = max(1, max(lengths, default=0))
    try:
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, count=sum(lengths))
        flat[(flat < 0) | (flat >= vocab_size)] = vocab_size
    except OverflowError:  # an id beyond int64: out of range anyway
        flat = np.array([t if 0 <= t < vocab_size else vocab_size for r in rows for t in r])
    out = torch.full((len(rows), width), vocab_size, dtype=torch.int64)
    keep = torch.arange(width) < torch.tensor(lengths, dtype=torch.int64)[:, None]
    out.masked_scatter_(keep, torch.from_numpy(flat.astype(np.int64, copy=False)))
    return out.to(device)


def _min_tokens_pairs(
    params: list[SamplingParams], num_outputs: list[int], eos: tuple[int, ...], V: int
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to mask while len(output) < min_tokens: stop_token_ids, and EOS
    unless ignore_eos."""
    rows, cols = [], []
    for b, (p, num_out) in enumerate(zip(params, num_outputs, strict=True)):
        if num_out < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            ids = sorted(t for t in ids if 0 <= t < V)
            rows += [b] * len(ids)
            cols += ids
    return rows, cols


def _request_arrays(p: SamplingParams, V: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """p's logit_bias as (token ids, biases) and its allowed_token_ids (sorted, unique, None
    without a list) as arrays, ids >= V dropped. Built on a request's first step and kept on
    its params, which never change: a request's lists then cost a copy per step, not a loop
    in Python over up to 16,384 ids (`protocol.LIST_LIMITS`)."""
    cached = p.__dict__.get("_arrays")
    if cached is None or cached[0] != V:
        bias = {t: float(v) for t, v in (p.logit_bias or {}).items() if t < V}
        ids = p.allowed_token_ids
        ids = None if ids is None else np.unique(np.asarray(ids, np.int64))
        cached = (
            V,
            np.fromiter(bias.keys(), np.int64, len(bias)),
            np.fromiter(bias.values(), np.float32, len(bias)),
            None if ids is None else ids[ids < V],
        )
        object.__setattr__(p, "_arrays", cached)  # a cache beside the frozen fields
    return cached[1:]


def _bias_lists(params: list[SamplingParams], outputs: list[list[int]], V: int):
    """(rows, token ids, biases) of logit_bias and of bad_words (-inf on a word's last token
    where the output ends with the tokens before it), and (rows with a list, rows, token ids)
    of allowed_token_ids, as arrays; None for either when no row uses it. Ids >= V are dropped
    (the engine's validate_request refuses them before)."""
    rows, cols, values, lists, arows, acols = [], [], [], [], [], []
    for b, p in enumerate(params):
        bias_ids, biases, allowed = _request_arrays(p, V)
        words = [
            last
            for *head, last in p.bad_words_token_ids
            if last < V and (not head or outputs[b][-len(head) :] == head)
        ]
        if len(bias_ids) or words:
            cols += [bias_ids, np.array(words, np.int64)]
            values += [biases, np.full(len(words), -np.inf, np.float32)]
            rows.append(np.full(len(bias_ids) + len(words), b, np.int64))
        if allowed is not None:
            lists.append(b)
            arows.append(np.full(len(allowed), b, np.int64))
            acols.append(allowed)
    bias = tuple(map(np.concatenate, (rows, cols, values))) if rows else None
    allowed = (np.array(lists), np.concatenate(arows), np.concatenate(acols)) if lists else None
    return bias, allowed


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs: tensors on the logits' device, one row per request.

    `path` is the rows' most demanding SamplingPath: on STAGED only temperature, top-k, top-p
    and min-p apply and the logits reach the race untouched. Optional tensors are None when no
    row needs that step, so the sampler skips it.
    """

    path: SamplingPath
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
    # The host path's steps (SamplingMetadata.build); the defaults: no row has them.
    no_penalties: bool = True
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    presence_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    prompt_token_ids: torch.Tensor | None = None  # [B, Lp] int64 padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # [B, Lo] int64 padded with vocab_size
    min_tokens_rows: torch.Tensor | None = None  # [M] rows and
    min_tokens_cols: torch.Tensor | None = None  # [M] token ids to set to -inf
    logprobs_k: list[int | None] | None = None  # per row: SamplingParams.logprobs
    logprobs_rows: torch.Tensor | None = None  # [R] rows that asked for logprobs
    max_num_logprobs: int | None = None  # largest k asked (None: no row asked)
    # logit_bias and bad_words: (rows, token ids, float32 biases, -inf for a bad word) to add,
    # None when no row has one
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids: (rows that have a list, rows, token ids), None when no row has one
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Structured outputs: the step's grammar bitmask (sample/grammar.py), set by the model
    # runner on any path; None when no row has a grammar
    grammar: GrammarMask | None = None

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
        num_output_tokens: list[int] | None = None,
    ) -> SamplingMetadata:
        """`num_output_tokens` (default: the lengths of `output_token_ids`) counts each row's
        output tokens before this sample, in-flight ones included (async scheduling: the
        lists may lack the last sampled token; rows with penalties never run that way)."""
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
        steps = num_output_tokens or [len(out) for out in output_token_ids]
        rows, cols = _min_tokens_pairs(params, steps, eos_token_ids, V)
        lp_rows = [b for b, p in enumerate(params) if p.logprobs is not None]
        bias, allowed = _bias_lists(params, output_token_ids, V)

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32), device)

        def ints(values: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.int64), device)

        return cls(
            path=max((p.sampling_path for p in params), default=SamplingPath.STAGED),
            vocab_size=V,
            temperature=floats(temps),
            greedy=to_device(torch.tensor(greedy, dtype=torch.bool), device),
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
            prompt_token_ids=padded_token_ids(prompt_token_ids, V, device) if use_rep else None,
            output_token_ids=None if no_pen else padded_token_ids(output_token_ids, V, device),
            min_tokens_rows=ints(rows) if rows else None,
            min_tokens_cols=ints(cols) if rows else None,
            logprobs_k=[p.logprobs for p in params],
            logprobs_rows=ints(lp_rows) if lp_rows else None,
            max_num_logprobs=max((params[b].logprobs for b in lp_rows), default=None),
            logit_bias=None if bias is None else (ints(bias[0]), ints(bias[1]), floats(bias[2])),
            allowed=None if allowed is None else tuple(ints(x) for x in allowed),
        )
