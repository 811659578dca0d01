"""Sampling under tensor parallelism: each rank holds the logits of its vocabulary slice only.

Every rank knows every request's sampling parameters (each applies the same SchedulerOutput
diffs), so all ranks split the step's rows the same way and call the same collectives:

- plain greedy rows (temperature 0; no penalties, logprobs or active min_tokens): each rank
  takes the max logit and its index over its slice; one all-gather of those [2, B] values, and
  every rank picks the largest (the lowest rank, hence the lowest global index, on ties), which
  is torch.argmax over the full row. A row whose gathered maxima hold NaN or +inf, or are all
  -inf, joins the next group instead, so the Sampler reports it as it does at one rank.
- every other row: the slices are gathered to rank 0, which runs the normal `Sampler` on the
  full logits; a seeded request therefore draws the same tokens at any tensor-parallel size.

Rank 0 returns the ModelRunnerOutput; the other ranks return None.
"""

from __future__ import annotations

import torch

from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.distributed.parallel_state import all_gather, gather_last_dim, get_tp_rank
from llm_inference.sampling_params import SamplingParams


def needs_full_logits(params: SamplingParams, num_output_tokens: int) -> bool:
    """True unless the row is plain greedy: the argmax of its raw logits."""
    plain = (
        params.greedy
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.logprobs is None
        and num_output_tokens >= params.min_tokens
    )
    return not plain


def distributed_argmax(local: torch.Tensor, vocab_start: int) -> tuple[list[int], list[bool]]:
    """Collective. `local` [B, shard] is this rank's slice of the logits, column j being token
    vocab_start + j. Returns, on every rank, the global argmax per row (lowest index on ties)
    and whether the row is well-formed (no NaN or +inf, not all -inf)."""
    idx = local.argmax(dim=-1)  # the first maximum of the slice
    vals = local.gather(1, idx[:, None])[:, 0].double()  # exact for float32/16 and bfloat16
    packed = torch.stack([vals, (idx + vocab_start).double()])
    every = all_gather(packed)  # [ranks, 2, B]
    maxima, indices = every[:, 0], every[:, 1]
    best = maxima.argmax(dim=0)  # the first rank holding the largest value
    tokens = indices.gather(0, best[None])[0].long()
    top = maxima.gather(0, best[None])[0]
    broken = (maxima.isnan() | (maxima == float("inf"))).any(dim=0) | (top == float("-inf"))
    return tokens.tolist(), (~broken).tolist()


def sample_tensor_parallel(
    runner, req_ids: list[str], sample_rows: list[int], hidden: torch.Tensor
) -> ModelRunnerOutput | None:
    """Collective. `hidden` [len(sample_rows), hidden] holds the rows to sample, in order."""
    batch = runner.input_batch
    rows = [batch.rows[req_ids[i]] for i in sample_rows]
    params = [batch.params[r] for r in rows]
    lm_head = runner.model.lm_head
    local = lm_head.compute_local_logits(hidden)
    tokens: list[int | None] = [None] * len(rows)
    full = [k for k, r in enumerate(rows) if needs_full_logits(params[k], len(batch.output_ids[r]))]
    full_set = set(full)
    fast = [k for k in range(len(rows)) if k not in full_set]
    if fast:
        pick = torch.tensor(fast, device=local.device)
        argmax, ok = distributed_argmax(local.index_select(0, pick), lm_head.vocab_start)
        for k, t, good in zip(fast, argmax, ok):
            if good:
                tokens[k] = t
            else:
                full.append(k)
        full.sort()
    logprobs: list[object | None] = [None] * len(req_ids)
    if full:
        pick = torch.tensor(full, device=local.device)
        logits = gather_last_dim(local.index_select(0, pick))
        if logits is not None:  # rank 0
            smd = runner.sampling_metadata([rows[k] for k in full])
            out = runner.sampler(logits[:, : lm_head.vocab_size], smd)
            for j, (k, t) in enumerate(zip(full, out.token_ids.tolist())):
                tokens[k] = t
                if out.logprobs is not None:
                    logprobs[sample_rows[k]] = out.logprobs[j]
    if get_tp_rank() != 0:
        return None
    sampled: list[list[int]] = [[] for _ in req_ids]
    for k, i in enumerate(sample_rows):
        sampled[i] = [tokens[k]]
    return ModelRunnerOutput(req_ids, sampled, logprobs)
