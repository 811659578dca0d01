"""Structured outputs in the PyTorch sampler (sample/grammar.py): the bitmask unpacked as
xgrammar packs it, applied to constrained rows only, on a vocabulary slice as on the whole row,
before logprobs; a constrained row samples what it would from logits holding only the
grammar's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampler_checks import build

from llm_inference.kernels.reference import ReferenceOps
from llm_inference.sample.grammar import GrammarMask, MaskStaging, allowed_tokens, apply_grammar
from llm_inference.sample.sampler import Sampler
from llm_inference.sampling_params import SamplingParams

V = 100


def random_bitmask(rows: int, seed: int = 0) -> np.ndarray:
    """int32 words with about half the bits set, negative words (bit 31) included."""
    rng = np.random.default_rng(seed)
    return rng.integers(-(2**31), 2**31, size=(rows, -(-V // 32)), dtype=np.int64).astype(np.int32)


def bit(bitmask: np.ndarray, r: int, v: int) -> bool:
    return bool((int(bitmask[r, v // 32]) >> (v % 32)) & 1)


def mask(bitmask: np.ndarray, rows: list[int], num_rows: int) -> GrammarMask:
    """A step's mask on the CPU, as the model runner builds it."""
    return MaskStaging(torch.device("cpu")).build(bitmask, rows, num_rows)


def sent_apart(bitmask: np.ndarray, rows: list[int], num_rows: int, device) -> GrammarMask:
    """The same mask made of three tensors, each copied to the device on its own."""
    index = np.full(num_rows, -1, dtype=np.int32)
    index[rows] = np.arange(len(rows), dtype=np.int32)
    return GrammarMask(
        bitmask=torch.from_numpy(bitmask).to(device),
        rows=torch.tensor(rows, dtype=torch.int32, device=device),
        row_index=torch.from_numpy(index).to(device),
    )


def test_allowed_tokens_unpacks_xgrammars_layout():
    """Bit v % 32 of word v // 32, for a whole row and for vocabulary slices, one running past
    the bitmask (those tokens are not allowed)."""
    bm = random_bitmask(3)
    for start, width in ((0, V), (40, 30), (90, 40)):
        got = allowed_tokens(torch.from_numpy(bm), start, width)
        want = [[start + j < 32 * bm.shape[1] and bit(bm, r, start + j) for j in range(width)]
                for r in range(3)]  # fmt: skip
        assert got.tolist() == want, (start, width)


def test_apply_grammar_masks_constrained_rows_only_and_slices_agree():
    bm = random_bitmask(2, seed=1)
    m = mask(bm, [1, 3], 4)
    assert m.row_index.tolist() == [-1, 0, -1, 1]
    logits = torch.randn(4, V)
    out = apply_grammar(logits.clone(), m)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    for k, r in enumerate((1, 3)):
        keep = torch.tensor([bit(bm, k, v) for v in range(V)])
        assert torch.equal(out[r], logits[r].masked_fill(~keep, float("-inf")))
    # under tensor parallelism each rank masks its slice: the slices make up the whole row
    slices = [apply_grammar(logits[:, s : s + 34].clone(), m, s) for s in (0, 34, 68)]
    assert torch.equal(torch.cat(slices, dim=1), out)
    with pytest.raises(ValueError, match="2 bitmask rows for 1 constrained rows"):
        MaskStaging(torch.device("cpu")).build(bm, [0], 4)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs CUDA"))],
)  # fmt: skip
def test_masks_packed_through_the_staging_buffer_equal_those_sent_apart(device):
    """MaskStaging: one pinned buffer, reused (and grown) from step to step, gives the device
    the same bitmask, rows and row index as three separate copies, the row index 16-byte
    aligned whatever the bitmask's size (Triton specializes on it); a mask built from it stays
    intact after the next one overwrites the buffer."""
    staging, masks = MaskStaging(torch.device(device)), []
    for m, rows, num_rows, words in ((2, [1, 3], 4, 4), (5, [0, 2, 3, 6, 7], 9, 4),
                                     (1, [0], 1, 4), (3, [0, 1, 4], 5, 5)):  # fmt: skip
        bm = np.resize(random_bitmask(m, seed=m), (m, words))
        want = sent_apart(bm, rows, num_rows, device)
        got = staging.build(bm, rows, num_rows)
        assert got.row_index.data_ptr() % 16 == 0
        masks.append((want, got))
    if device == "cuda":
        torch.cuda.synchronize()
    for want, got in masks:
        assert torch.equal(got.bitmask, want.bitmask) and got.bitmask.shape == want.bitmask.shape
        assert torch.equal(got.rows, want.rows) and got.rows.dtype == torch.int32
        assert torch.equal(got.row_index, want.row_index)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs CUDA"))],
)  # fmt: skip
def test_masks_filled_in_the_staging_buffer_equal_those_copied_in(device):
    """`bitmask_buffer` hands out the staging buffer's head for the bitmask to be filled in
    place (the engine core's fill, worker in its process); `build` then sends it without
    packing it, the same mask as one copied in. In place and copied builds alternate; the
    buffer grows for larger steps, and keeps what it held where a step has more sample rows
    than were reserved (`max_rows`)."""
    staging, masks = MaskStaging(torch.device(device)), []
    for m, rows, num_rows, words, max_rows in ((2, [1, 3], 4, 4, 4), (2, [0, 1], 3, 4, None),
                                               (5, [0, 2, 3, 6, 7], 9, 6, 9),
                                               (7, list(range(7)), 40, 6, 7),
                                               (1, [0], 1, 4, 1)):  # fmt: skip
        bm = np.resize(random_bitmask(m, seed=m + words), (m, words))
        want = sent_apart(bm, rows, num_rows, device)
        if max_rows is not None:  # filled in place
            buffer = staging.bitmask_buffer(m, words, max_rows)
            assert buffer.shape == (m, words) and np.shares_memory(buffer, staging.host.numpy())
            buffer[:] = bm
            bm = buffer
        masks.append((want, staging.build(bm, rows, num_rows)))
    if device == "cuda":
        torch.cuda.synchronize()
    for want, got in masks:
        assert torch.equal(got.bitmask, want.bitmask) and got.bitmask.shape == want.bitmask.shape
        assert torch.equal(got.rows, want.rows) and torch.equal(got.row_index, want.row_index)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
     SamplingParams(temperature=0.8, top_k=5, top_p=0.9), SamplingParams(logprobs=3)],
)  # fmt: skip
def test_constrained_rows_sample_from_the_grammars_tokens(params):
    """A constrained row's token is the one the same row draws from logits that hold only its
    grammar's tokens (same noise), on the staged path and on the host path (logprobs, whose
    values are the masked row's); unconstrained rows draw as without a grammar; the caller's
    logits are left alone."""
    sampler = Sampler(ReferenceOps())
    n = 6
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(2)) * 3
    before = logits.clone()
    bm = random_bitmask(3, seed=3)
    rows = [0, 2, 5]
    md = build([params] * n, V, seeds=list(range(10, 10 + n)))
    free = sampler(logits, md)
    md.grammar = mask(bm, rows, n)
    got = sampler(logits, md)
    assert torch.equal(logits, before)
    masked = apply_grammar(logits.clone(), md.grammar)
    md.grammar = None
    want = sampler(masked, md)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    assert all(bit(bm, k, got.token_ids[r].item()) for k, r in enumerate(rows))
    others = [1, 3, 4]
    assert got.token_ids[others].tolist() == free.token_ids[others].tolist()
    if params.logprobs is not None:
        for r in range(n):
            assert got.logprobs[r].logprob == pytest.approx(want.logprobs[r].logprob)
            assert got.logprobs[r].top == pytest.approx(want.logprobs[r].top)


def test_an_emptied_constrained_row_falls_back_inside_its_grammar():
    """A constrained row whose every allowed token is a bad word (emptied after the grammar)
    falls back to the argmax among the grammar's tokens, not the raw row's, with the warning."""
    logits = torch.zeros(1, V)
    logits[0, 7] = 9.0  # the raw argmax, outside the grammar
    logits[0, 20] = 5.0
    bm = np.zeros((1, -(-V // 32)), dtype=np.int32)
    bm[0, 0] = 1 << 20  # only token 20
    params = SamplingParams(temperature=0.0, bad_words=["x"]).replace(bad_words_token_ids=((20,),))
    md = build([params], V)
    md.grammar = mask(bm, [0], 1)
    with pytest.warns(RuntimeWarning, match=r"rows \[0\]"):
        assert Sampler(ReferenceOps())(logits, md).token_ids.tolist() == [20]
