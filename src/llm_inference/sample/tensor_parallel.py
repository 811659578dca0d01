"""Sampling under tensor parallelism: each rank holds the logits of its vocabulary slice only
(ARCHITECTURE.md, "Tensor parallelism").

Every rank knows every request's sampling parameters (each applies the same SchedulerOutput
diffs), so all ranks split the step's rows the same way and call the same collectives: plain
greedy rows (temperature 0, SamplingPath.STAGED) take `distributed_argmax`; steps whose rows
are all STAGED and sample with temperature only take `distributed_race` with the fused sampler
(its noise is keyed by token id, so the slices' winners give the full row's token); every
other row is gathered to rank 0, which runs the normal `Sampler` (a seeded request draws the
same tokens at any tensor-parallel size) and broadcasts the tokens. A broken row gets a status
(STATUS_BAD, STATUS_EMPTY) that rank 0 reports on the host as `Sampler(sync=False)` does.
Structured outputs: every rank first masks its slice with the step's grammar bitmask (each
has it: with the SchedulerOutput, or with `sample_tokens` when the step's forward went
first), so each of those ways sees only the grammar's tokens, as one sampler over the whole
row would (sample/grammar.py).

Every rank ends with the same tokens tensor on its device, so each can feed the samples still
in flight to the next step (async scheduling) without the host. Nothing here waits for the
device except the logprobs of rows that ask for them (those steps run synchronously anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from llm_inference.distributed.parallel_state import all_gather, broadcast, gather_last_dim
from llm_inference.sample.grammar import GrammarMask, apply_grammar
from llm_inference.sample.metadata import SamplingMetadata, to_device
from llm_inference.sample.sampler import STATUS_BAD, STATUS_EMPTY, Sampler, SamplerOutput


def distributed_argmax(local: torch.Tensor, vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective. `local` [B, shard] is this rank's slice of the logits, column j being token
    vocab_start + j. Returns, on every rank and on the device, the global argmax per row
    (lowest index on ties) and its status, as `pick_winners`: each rank's winner is the first
    maximum of its slice, ranked by its logit."""
    idx = local.argmax(dim=-1)  # the first maximum of the slice (NaN counts as the largest)
    vals = local.gather(1, idx[:, None])[:, 0].double()  # exact for float32/16 and bfloat16
    return pick_winners(all_gather(torch.stack([vals, (idx + vocab_start).double(), vals])))


def pick_winners(every: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`every` [ranks, 3, B] float64: each rank's winners (value, token id, max logit)
    -> (tokens, status) [B] int64: the token of the first rank holding the largest value (the
    lowest token id on ties, as one race over the whole row); STATUS_BAD where a rank saw a NaN
    or +inf logit, STATUS_EMPTY (token 0) where every logit is -inf."""
    values, ids, tops = every[:, 0], every[:, 1], every[:, 2]
    best = values.argmax(dim=0)  # the first rank holding the largest value
    tokens = ids.gather(0, best[None])[0].long()
    top = tops.amax(dim=0)
    tokens = torch.where(top == float("-inf"), 0, tokens)
    status = torch.where(top == float("-inf"), STATUS_EMPTY, tokens)
    return tokens, torch.where(top.isnan() | (top == float("inf")), STATUS_BAD, status)


def distributed_race(
    sampler: Sampler, local: torch.Tensor, vocab_start: int, staged: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective, on CUDA. The fused sampler's race (temperature only; greedy rows the
    argmax) over the ranks' vocabulary slices `local` [B, shard], with the step's `staged`
    inputs: every rank gets (tokens, status) [B] int64 on the device, those `Sampler` gives for
    the full logits."""
    greedy = None if staged.all_random else staged.greedy
    winners = sampler.race_shard(local, staged.noise_keys, staged.temperature, greedy, vocab_start)
    return pick_winners(all_gather(winners))


def races_on_slices(staged: SamplingMetadata | None, fused: bool) -> bool:
    """Whether a step's samples take `distributed_race`: the fused sampler, every row STAGED
    (`staged`: their inputs as staged on the device, else None), no top-k, top-p or min-p, and
    not every row greedy (those take the cheaper `distributed_argmax`)."""
    return (
        fused
        and staged is not None
        and not staged.all_greedy
        and staged.top_k is None
        and staged.top_p is None
        and staged.min_p is None
    )


def sample_tensor_parallel(
    sampler: Sampler,
    local: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    staged: SamplingMetadata | None,
    argmax_only: Sequence[bool],
    metadata: Callable[[list[int]], SamplingMetadata],
    grammar: GrammarMask | None = None,
) -> SamplerOutput:
    """Collective. `local` [R, shard]: this rank's logits of the R rows to sample (column j is
    token vocab_start + j; `vocab_size` tokens in all); `staged`: their inputs as staged on the
    device when every row is STAGED, else None; `argmax_only[k]`: row k takes the argmax of
    its raw logits; `metadata(ks)`: the SamplingMetadata of rows ks (called on rank 0 only,
    at most once); `grammar`: the step's bitmask, applied to `local` in place first. Every rank
    returns the same `token_ids` [R] on its device; `status` and `logprobs` are rank 0's only."""
    if grammar is not None:
        apply_grammar(local, grammar, vocab_start)
    num = local.shape[0]
    if races_on_slices(staged, sampler.fused):
        tokens, status = distributed_race(sampler, local, vocab_start, staged)
        return SamplerOutput(token_ids=tokens, logprobs=None, status=status)
    full = [k for k in range(num) if not argmax_only[k]]
    if not full:  # all plain greedy: every rank already holds every token
        tokens, status = distributed_argmax(local, vocab_start)
        return SamplerOutput(token_ids=tokens, logprobs=None, status=status)
    device = local.device
    tokens = torch.empty(num, dtype=torch.long, device=device)
    status = torch.empty_like(tokens)
    pick = None  # the full rows' positions, unless every row is one
    if len(full) < num:
        full_set = set(full)
        fast = to_device(torch.tensor([k for k in range(num) if k not in full_set]), device)
        fast_tokens, fast_status = distributed_argmax(local.index_select(0, fast), vocab_start)
        tokens.index_copy_(0, fast, fast_tokens)
        status.index_copy_(0, fast, fast_status)
        pick = to_device(torch.tensor(full), device)
    logits = gather_last_dim(local if pick is None else local.index_select(0, pick))
    sampled = torch.empty(len(full), dtype=torch.long, device=device)
    logprobs: list[object | None] | None = None
    if logits is not None:  # rank 0
        # sync=False: nothing may raise between two collectives (the other ranks would wait
        # in the broadcast); broken rows are reported from `status` on the host.
        out = sampler(logits[:, :vocab_size], metadata(full), sync=False)
        sampled = out.token_ids.to(torch.long).contiguous()
        if pick is None:
            status = out.status
        else:
            status.index_copy_(0, pick, out.status.to(torch.long))
        if out.logprobs is not None:
            logprobs = [None] * num
            for j, k in enumerate(full):
                logprobs[k] = out.logprobs[j]
    broadcast(sampled, src=0)
    if pick is None:
        return SamplerOutput(token_ids=sampled, logprobs=logprobs, status=status)
    tokens.index_copy_(0, pick, sampled)
    return SamplerOutput(token_ids=tokens, logprobs=logprobs, status=status)
