"""A request's logit_bias and allowed_token_ids (up to 1,024 and 16,384 entries) become arrays
once, on its first step, not in a Python loop every step (issue 33: logit_bias over the whole
vocabulary for n=128 rows cost 0.46 s per step)."""

from __future__ import annotations

import dataclasses

import torch

from llm_inference.sample.metadata import SamplingMetadata
from llm_inference.sampling_params import SamplingParams

V = 32_000


class CountingDict(dict):
    """A dict that counts the loops over its items."""

    loops = 0

    def items(self):
        CountingDict.loops += 1
        return super().items()


def _build(params: list[SamplingParams], outputs: list[list[int]]) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[1, 2]] * n, outputs, list(range(n)), (2,), V, "cpu")


def test_lists_are_read_once_per_request_and_give_the_same_metadata():
    bias = {t: (t % 7) - 3.0 for t in range(0, 2048, 2)}
    allowed = list(range(V - 1, V - 16_385, -1)) + [V - 1]  # unsorted, one repeat
    lists = SamplingParams(logit_bias=bias, allowed_token_ids=allowed)
    object.__setattr__(lists, "logit_bias", CountingDict(lists.logit_bias))
    words = dataclasses.replace(
        SamplingParams(logit_bias={5: 1.5}), bad_words_token_ids=((9, 4), (7,))
    )
    params = [SamplingParams(), lists, words] * 4
    outputs = [[9], [1], [9]] * 4
    first = _build(params, outputs)
    CountingDict.loops = 0
    again = _build(params, outputs)
    assert CountingDict.loops == 0  # the second step reads the arrays kept on the params

    lists_rows = torch.tensor([1, 4, 7, 10])
    got_lists, got_rows, got_cols = again.allowed
    assert torch.equal(got_lists, lists_rows)
    want_cols = torch.tensor(sorted(set(allowed)))
    assert torch.equal(got_cols, want_cols.repeat(4))
    assert torch.equal(got_rows, lists_rows.repeat_interleave(len(want_cols)))
    rows, cols, values = again.logit_bias
    by_row = {}
    for r, c, v in zip(rows.tolist(), cols.tolist(), values.tolist()):
        by_row.setdefault(r, {})[c] = v
    assert by_row[1] == bias and by_row[4] == bias
    # row 2: its bias, and bad word (9, 4)'s last token after an output ending in 9, and (7,)
    assert by_row[2] == {5: 1.5, 4: float("-inf"), 7: float("-inf")}
    for a, b in zip(first.logit_bias + first.allowed, again.logit_bias + again.allowed):
        assert torch.equal(a, b)
