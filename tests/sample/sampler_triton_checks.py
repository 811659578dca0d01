"""Checks of the Triton sampling kernel through Sampler(TritonOps("cuda")), at V=1000, meant for
the CPU interpreter: `TRITON_INTERPRET=1 python sampler_triton_checks.py [NAME ...]` prints one
`RESULT name ok|FAIL` line per check (the interpreter must be on before triton is first
imported, hence a child process; see test_sampler_triton.py). Names ending in `_torch` run the
same check on the PyTorch path. The interpreter costs ~1 ms per reduction, so the chi-squared
checks draw a few hundred samples from sharply peaked rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sampler_checks as checks  # noqa: E402

from llm_inference.kernels.reference import ReferenceOps  # noqa: E402
from llm_inference.sample import sampler as sampler_mod  # noqa: E402
from llm_inference.sample.sampler import Sampler  # noqa: E402
from llm_inference.sampling_params import SamplingParams  # noqa: E402

V = 1000


def peaked_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3.0


CONFIGS = {  # (params, a wrong distribution for the power check)
    "temperature": (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0)),
    "top_k": (SamplingParams(temperature=1.5, top_k=6), SamplingParams(temperature=1.5, top_k=9)),
    "top_p": (SamplingParams(temperature=1.2, top_p=0.8), SamplingParams(temperature=1.2)),
    "min_p": (SamplingParams(temperature=1.5, min_p=0.05), SamplingParams(temperature=1.5)),
    "combined": (
        SamplingParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.03),
        SamplingParams(temperature=1.3, top_k=12),
    ),
}


def check_distribution(tri, name):
    params, wrong = CONFIGS[name]
    n = 600 if name == "temperature" else 400
    checks.check_distribution(tri, peaked_row(), params, wrong, n, "cpu")


def check_chi2_helper(_):
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * 7)
    counts = torch.tensor([200, 120, 80] + [0] * 7)
    assert checks.follows(counts, probs)
    assert not checks.follows(torch.tensor([150, 150, 100] + [0] * 7), probs)
    assert not checks.follows(torch.tensor([200, 120, 79, 1] + [0] * 6), probs)


def support(sampler, logits_row, params, n=60) -> set[int]:
    counts = checks.draw(sampler, logits_row, params, n, "cpu")
    return set(counts.nonzero()[:, 0].tolist())


def boundary_row(values: list[float]) -> torch.Tensor:
    row = torch.full((V,), -30.0)
    row[: len(values)] = torch.tensor(values)
    return row.roll(17)  # not at the start of the row


def check_boundaries(sampler):
    flat = dict(temperature=50.0)  # nearly uniform over the kept tokens: all of them show up
    ties = boundary_row([5.0, 4.0, 3.0, 3.0, 3.0, 1.0])
    assert support(sampler, ties, SamplingParams(top_k=3, **flat)) == {17, 18, 19, 20, 21}
    assert support(sampler, ties, SamplingParams(top_k=1, **flat)) == {17}
    assert support(sampler, boundary_row([2.0, 2.0, 1.0]), SamplingParams(top_k=1)) == {17, 18}
    assert support(sampler, ties, SamplingParams(top_p=1e-6, **flat)) == {17}
    # probs 0.5, 0.3, 0.15, 0.05: the token whose mass reaches top_p is kept, the next one not
    p = boundary_row(torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist())
    assert support(sampler, p, SamplingParams(top_p=0.8 - 1e-4), 80) == {17, 18}
    assert support(sampler, p, SamplingParams(top_p=0.8 + 1e-4), 80) == {17, 18, 19}
    assert support(sampler, p, SamplingParams(top_p=0.95 - 1e-4, top_k=2), 80) == {17, 18}


def check_greedy(tri):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=gen) * 3
    logits[2, [40, 900]] = 50.0  # a tie: the first index wins
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5)] * 3
    md = checks.build(params, V, outputs=[[7, 7]] * 6)
    tokens = tri(logits, md).token_ids
    assert tokens[[0, 2, 4]].tolist() == logits[[0, 2, 4]].argmax(-1).tolist()
    assert tokens[2].item() == 40
    md = checks.build([SamplingParams(temperature=0.0, frequency_penalty=2.0)], V, outputs=[[5, 5]])
    row = torch.zeros(1, V)
    row[0, 5] = 3.0
    assert tri(row, md).token_ids.item() != 5  # the argmax of the penalized logits


def check_seed_independence(tri):
    for target in (SamplingParams(temperature=0.7), CONFIGS["combined"][0]):
        checks.check_seed_independence(tri, V, "cpu", target)


def check_paths_agree(tri):
    """Same uniforms bit for bit: the paths differ only where rounding decides a near-tie."""
    n = 64
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(n, V, generator=gen) * 2
    params = [SamplingParams(temperature=0.6), SamplingParams(temperature=1.0, top_p=0.9)] * 32
    md = checks.build(params, V, seeds=list(range(100, 100 + n)))
    got = tri(logits, md).token_ids
    want = Sampler(ReferenceOps())(logits, md).token_ids
    assert (got == want).float().mean() >= 0.95, (got != want).nonzero()


def staged_metadata(params, canonical: bool):
    """Metadata of `params` (one row each, prompt of 3 tokens, first sample) the way the model
    runner's fast path gets it: staged by the input batch into the step buffers."""
    from llm_inference.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from llm_inference.executor.input_batch import InputBatch, InputBuffers

    n = len(params)
    batch = InputBatch(max_num_reqs=n, max_model_len=8, block_size=4, vocab_size=V)
    buffers = InputBuffers(max_tokens=3 * n, max_seqs=n, max_blocks=2, device="cpu")
    new = [NewRequestData(f"r{i}", [1, 2, 3], [], p, [i], 0) for i, p in enumerate(params)]
    so = SchedulerOutput(1, new, CachedRequestData(), {f"r{i}": 3 for i in range(n)}, 3 * n)
    batch.apply(so)
    step = batch.prepare(so, buffers)
    assert step.sampling is not None
    return buffers.dev.sampling.as_metadata(n, step.sampling, V, canonical)


def check_staged_inputs(sampler):
    """The runner's fast path (int32 keys, top-k and greedy flags staged by the input batch;
    half-precision logits straight into the kernel) samples exactly what `build` and float32
    logits give."""
    n = 24
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.2, top_k=7),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.1, min_p=0.05),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02),
    ]
    seeds = [(i * 7919) << 33 | i for i in range(n)]  # keys of every width
    params = [kinds[i % len(kinds)].replace(seed=seeds[i]) for i in range(n)]
    gen = torch.Generator().manual_seed(4)
    half = (torch.randn(n, V, generator=gen) * 3).to(torch.float16)
    want = sampler(half.float(), checks.build(params, V, seeds=seeds)).token_ids
    triton = sampler.fused
    got = sampler(half if triton else half.float(), staged_metadata(params, not triton))
    assert got.token_ids.tolist() == want.tolist()


def check_status_codes(tri):
    from llm_inference.kernels import sampling

    assert sampling.STATUS_BAD == sampler_mod.STATUS_BAD
    assert sampling.STATUS_EMPTY == sampler_mod.STATUS_EMPTY


def check_broken_rows(sampler):
    for params in (SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)):
        _check_broken_rows(sampler, params)


def _check_broken_rows(sampler, params):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[1, 123] = bad
        with pytest.raises(ValueError, match=r"rows \[1\]"):
            sampler(broken, checks.build([params] * 3, V))
    # min_tokens masks EOS and the stop token, the only tokens the model allows in row 2
    masked = logits.clone()
    masked[2] = float("-inf")
    masked[2, [checks.EOS, 9]] = torch.tensor([4.0, 5.0])
    rows = [params, params, params.replace(min_tokens=3, stop_token_ids=[9])]
    with pytest.warns(RuntimeWarning, match=r"rows \[2\]"):
        tokens = sampler(masked, checks.build(rows, V)).token_ids
    assert tokens[2].item() == 9  # the raw argmax
    assert (
        tokens[:2].tolist()
        == Sampler(ReferenceOps())(logits[:2], checks.build([params] * 2, V)).token_ids.tolist()
    )
    masked[2] = float("-inf")
    with pytest.raises(ValueError, match=r"every logit is -inf in rows \[2\]"):
        sampler(masked, checks.build(rows, V))


def check_split_race_exact(_, device: str = "cpu"):
    """The split race (column ranges per row, then a merge; taken when no row filters and the
    batch is small) gives the single program's tokens exactly: first index on ties within and
    across ranges, ranges that are all -inf, NaN and emptied rows, greedy and noise rows."""
    from llm_inference.kernels import sampling

    B, width = 6, 5000  # three 2,048-column ranges, the last one partial
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(B, width, generator=gen)
    logits[0, [10, 2100, 4500]] = 50.0  # a tie across ranges
    logits[1, :3000] = float("-inf")  # leading ranges empty
    logits[2, 4096] = float("nan")
    logits[3] = float("-inf")
    logits[4, [2047, 2048]] = 30.0  # a tie at a range boundary
    keys = torch.randint(0, 2**32, (B,), generator=gen)
    temp = torch.full((B,), 0.8)
    greedy = torch.tensor([True, False, True, False, True, False])
    logits, keys, temp, greedy = (t.to(device) for t in (logits, keys, temp, greedy))
    saved = sampling.SPLIT_PROGRAMS
    try:
        sampling.SPLIT_PROGRAMS = 1  # one program per row
        assert sampling.race_splits(B, width, 2048) == 1
        want = sampling.sample(logits, keys, temp, greedy).tolist()
        want_random = sampling.sample(logits, keys, temp).tolist()
        want_bf16 = sampling.sample(logits.bfloat16(), keys, temp, greedy).tolist()
    finally:
        sampling.SPLIT_PROGRAMS = saved
    assert want[0] == 10 and want[4] == 2047
    assert want[2] == sampling.STATUS_BAD and want[3] == sampling.STATUS_EMPTY
    assert want[1] >= 3000 and want_random[1] >= 3000
    assert sampling.race_splits(B, width, 2048) == 3
    assert sampling.sample(logits, keys, temp, greedy).tolist() == want
    assert sampling.sample(logits, keys, temp).tolist() == want_random
    assert sampling.sample(logits.bfloat16(), keys, temp, greedy).tolist() == want_bf16
    for splits in (2, 3):
        out = torch.empty(B, dtype=torch.int64, device=device)
        sampling._split_race(logits, keys, temp, greedy, temp, out, splits, 2048)
        assert out.tolist() == want, splits


def kept_set(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The tokens a filtered row keeps, from the definitions (float64 masses): fewer than
    top_k tokens above, less than top_p of the top-k set's mass above, exp(x - max) >= min_p."""
    above = x[None, :] > x[:, None]  # [j, i]: token i above token j
    in_k = above.sum(1) < top_k
    w = (x.double() - x.max().double()).exp()
    mass_above = (above & in_k[None, :]).double() @ w
    in_p = mass_above < top_p * w[in_k].sum()
    return in_k & in_p & ((x - x.max()).exp() >= min_p)


def check_filtered_rows_exact(_, device: str = "cpu"):
    """A filtered row's token is the race over its kept tokens exactly: the race with the other
    logits set to -inf. The unfiltered winner is kept on some rows (the one-pass test) and
    dropped on others (then races above it, or with RETRIES = 0 the exact search at once)."""
    from llm_inference.kernels import sampling

    B, width = 48, 1000
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(B, width, generator=gen)
    keys = torch.randint(0, 2**32, (B,), generator=gen)
    temp = torch.full((B,), 0.9)
    free = sampling.sample(logits, keys, temp)
    saved = sampling.RETRIES
    for k, p, mp in ((width, 0.6, 0.0), (30, 1.0, 0.0), (width, 1.0, 0.2), (50, 0.8, 0.1)):
        kept = torch.stack([kept_set(row / 0.9, k, p, mp) for row in logits])
        want = sampling.sample(logits.masked_fill(~kept, float("-inf")), keys, temp)
        dropped = (want != free).sum().item()  # rows whose unfiltered winner is not kept
        assert 0 < dropped < B, (k, p, mp, dropped)
        filters = [torch.full((B,), x) for x in (k, p, mp)]
        try:
            for sampling.RETRIES in (saved, 0):
                got = sampling.sample(logits, keys, temp, None, *filters)
                assert got.tolist() == want.tolist(), (k, p, mp, sampling.RETRIES)
        finally:
            sampling.RETRIES = saved


def check_shard_race_exact(_, device: str = "cpu", width: int = 5000, ranks=(2, 3)):
    """Tensor parallel's race (sample/tensor_parallel.py): each rank races over its vocabulary
    slice with the slice's token ids (kernels/sampling.py race_shard, the last slice padded
    with -inf as the LM head pads it), and pick_winners over the gathered winners gives
    `sample`'s token of the whole row exactly: ties across slices go to the lowest token id;
    NaN rows are BAD and all -inf rows EMPTY (token 0); greedy rows take the argmax. A slice
    that forgets its token-id offset draws other noise and picks other tokens."""
    from llm_inference.kernels import sampling
    from llm_inference.sample.tensor_parallel import pick_winners

    B = 8
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(B, width, generator=gen) * 2.0
    logits[0, [17, width // 2 + 3]] = 40.0  # a tie across slices (greedy row)
    logits[1, : width - 100] = float("-inf")  # only the last slice can win
    logits[2, width // 3] = float("nan")
    logits[3] = float("-inf")
    keys = torch.randint(0, 2**32, (B,), generator=gen).to(torch.int32)  # the staged dtype
    temp = torch.rand(B, generator=gen) + 0.3
    greedy = torch.tensor([1, 0, 0, 0, 1, 0, 0, 0], dtype=torch.int32)
    logits, keys, temp, greedy = (t.to(device) for t in (logits, keys, temp, greedy))
    for dtype in (torch.float32, torch.bfloat16 if device != "cpu" else torch.float16):
        x = logits.to(dtype)
        for g in (greedy, None):
            want = sampling.sample(x, keys, temp, g)
            want = torch.where(want == sampling.STATUS_EMPTY, 0, want)
            for n in ranks:
                shard = -(-width // n)
                padded = torch.full((B, shard * n), float("-inf"), dtype=dtype, device=device)
                padded[:, :width] = x
                winners = [sampling.race_shard(padded[:, r * shard : (r + 1) * shard]
                                               .contiguous(), keys, temp, g, r * shard)
                           for r in range(n)]  # fmt: skip
                tokens, status = pick_winners(torch.stack(winners))
                what = f"{dtype} greedy={g is not None} ranks={n}"
                assert status[2] == sampling.STATUS_BAD, what
                assert status[3] == sampling.STATUS_EMPTY and tokens[3] == 0, what
                ok = [0, 1, 4, 5, 6, 7]  # the rows with a token: its status is the token
                assert tokens[ok].tolist() == want[ok].tolist(), what
                assert status[ok].tolist() == want[ok].tolist(), what
                if g is not None:
                    assert tokens[0] == 17, what
    # The noise must be the token's: slices raced with their columns as ids draw other noise.
    n, shard = 2, -(-width // 2)
    x = torch.randn(64, width, generator=gen).to(device)
    k = torch.randint(0, 2**32, (64,), generator=gen).to(device)
    t = torch.ones(64, device=device)
    want = sampling.sample(x, k, t)
    wrong = pick_winners(torch.stack([
        sampling.race_shard(x[:, r * shard : (r + 1) * shard].contiguous(), k, t, None, 0)
        for r in range(n)
    ]))[0]  # fmt: skip
    assert (wrong != want).any()


def check_grammar_bitmask_exact(_, device: str = "cpu"):
    """A grammar's bitmask (structured outputs) in the kernels: a masked row's token is the one
    of the same launch on logits holding only its allowed tokens (-inf elsewhere), exactly, on
    the split race (greedy and noise rows, several column ranges) and on the filtered path
    (top-k, top-p, min-p), for float32 and half logits; a row without a bitmask row (-1) draws
    what it draws in a launch without a bitmask. Bad bitmask arguments raise."""
    from llm_inference.kernels import sampling

    B, width = 8, 5000
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(B, width, generator=gen) * 2).to(device)
    keys = torch.randint(0, 2**32, (B,), generator=gen).to(device)
    temp = (torch.rand(B, generator=gen) + 0.5).to(device)
    greedy = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0], dtype=torch.int32, device=device)
    words = -(-width // 32)
    bitmask = torch.randint(-(2**31), 2**31, (5, words), generator=gen).to(torch.int32)
    bitmask[4] = 0
    bitmask[4, 100] = 1 << 7  # one token only: 3207
    bitmask = bitmask.to(device)
    rows = torch.tensor([0, -1, 1, 2, -1, 3, 4, -1], dtype=torch.int32, device=device)
    bits = (bitmask[:, :, None] >> torch.arange(32, device=device)) & 1
    allowed = bits.reshape(5, -1)[:, :width].bool()
    keep = torch.ones(B, width, dtype=torch.bool, device=device)
    keep[rows >= 0] = allowed[rows[rows >= 0].long()]
    none = [None, None, None]
    filters = [torch.full((B,), 40, device=device), torch.full((B,), 0.8, device=device),
               torch.full((B,), 0.05, device=device)]  # fmt: skip
    saved = sampling.RETRIES
    # the filtered rows through the one-pass test and races above a dropped winner, then (with
    # RETRIES = 0) through the exact search whenever the winner is dropped
    for dtype, f, g, retries in ((torch.float32, none, greedy, saved),
                                 (torch.float32, none, None, saved),
                                 (torch.float32, filters, greedy, saved),
                                 (torch.float16, filters, None, 0)):  # fmt: skip
        x = logits.to(dtype)
        try:
            sampling.RETRIES = retries
            got = sampling.sample(x, keys, temp, g, *f, bitmask=bitmask, bitmask_rows=rows)
            want = sampling.sample(x.masked_fill(~keep, float("-inf")), keys, temp, g, *f)
            free = sampling.sample(x, keys, temp, g, *f)
        finally:
            sampling.RETRIES = saved
        assert got.tolist() == want.tolist(), (dtype, f[0] is not None, g is not None)
        assert keep[torch.arange(B), got].all()
        assert got[6] == 3207
        assert got[rows < 0].tolist() == free[rows < 0].tolist()
    for bad in ((bitmask, None), (bitmask.long(), rows), (bitmask[:, :10], rows),
                (bitmask, rows.long())):  # fmt: skip
        with pytest.raises(ValueError, match="bitmask"):
            sampling.sample(logits, keys, temp, None, bitmask=bad[0], bitmask_rows=bad[1])


def check_grammar_through_the_sampler(sampler):
    """The runner's fast path with a grammar: staged rows, half logits straight into the kernel
    with the bitmask, give what the PyTorch path gives on the masked float32 logits."""
    import numpy as np

    from llm_inference.sample.grammar import MaskStaging, apply_grammar

    n = 12
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9),
              SamplingParams(temperature=1.2, top_p=0.8)] * 4  # fmt: skip
    seeds = list(range(50, 50 + n))
    params = [p.replace(seed=s) for p, s in zip(params, seeds)]
    gen = torch.Generator().manual_seed(8)
    half = (torch.randn(n, V, generator=gen) * 3).to(torch.float16)
    rng = np.random.default_rng(0)
    bm = rng.integers(-(2**31), 2**31, size=(8, -(-V // 32)), dtype=np.int64).astype(np.int32)
    mask = MaskStaging(torch.device("cpu")).build(bm, [0, 1, 2, 4, 5, 7, 9, 11], n)
    md = staged_metadata(params, not sampler.fused)
    md.grammar = mask
    got = sampler(half if sampler.fused else half.float(), md).token_ids
    want = Sampler(ReferenceOps())(apply_grammar(half.float(), mask),
                                   checks.build(params, V, seeds=seeds)).token_ids  # fmt: skip
    assert (got == want).float().mean() >= 0.9, (got, want)  # rounding may split a near-tie
    index = mask.row_index
    assert all(int(bm[index[r], t // 32]) >> (t % 32) & 1 for r, t in enumerate(got.tolist())
               if index[r] >= 0)  # fmt: skip


CHECKS = {f"distribution_{name}": (check_distribution, name) for name in CONFIGS}
CHECKS |= {
    "chi2_helper": (check_chi2_helper, None),
    "boundaries": (check_boundaries, None),
    "boundaries_torch": (check_boundaries, None),
    "greedy": (check_greedy, None),
    "seed_independence": (check_seed_independence, None),
    "paths_agree": (check_paths_agree, None),
    "status_codes": (check_status_codes, None),
    "staged_inputs": (check_staged_inputs, None),
    "staged_inputs_torch": (check_staged_inputs, None),
    "broken_rows": (check_broken_rows, None),
    "broken_rows_torch": (check_broken_rows, None),
    "split_race_exact": (check_split_race_exact, None),
    "filtered_rows_exact": (check_filtered_rows_exact, None),
    "shard_race_exact": (check_shard_race_exact, None),
    "grammar_bitmask_exact": (check_grammar_bitmask_exact, None),
    "grammar_through_the_sampler": (check_grammar_through_the_sampler, None),
    "grammar_through_the_sampler_torch": (check_grammar_through_the_sampler, None),
}


def run_check(name: str) -> None:
    fn, arg = CHECKS[name]
    if name.endswith("_torch"):
        sampler = Sampler(ReferenceOps())
    else:
        from llm_inference.kernels.triton_ops import TritonOps  # after TRITON_INTERPRET is set

        sampler = Sampler(TritonOps("cpu"))
    fn(sampler, arg) if arg is not None else fn(sampler)


def main(names: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: interpreter.py
    from interpreter import report_each

    report_each(names or list(CHECKS), run_check)


if __name__ == "__main__":
    main(sys.argv[1:])
