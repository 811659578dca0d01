"""The staging of sampling inputs (sample/staging.py): only a step whose rows are all on
SamplingPath.STAGED is staged, with the values `SamplingMetadata.build` gives; which rows take
the argmax; and which staged steps tensor parallelism races over its vocabulary slices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_inference.sample.metadata import SamplingMetadata
from llm_inference.sample.staging import SamplingArrays, SamplingRows
from llm_inference.sample.tensor_parallel import races_on_slices
from llm_inference.sampling_params import SamplingParams, SamplingPath

V = 50


def staged(params: list[SamplingParams], num_outputs: list[int] | None = None):
    """(metadata as staged, canonical dtypes, or None; the rows' SamplingRows)."""
    n = len(params)
    rows = SamplingRows(n + 2, V)  # more rows than requests: rows are picked, not assumed
    picked = np.arange(n)[::-1] + 2
    for r, p in zip(picked, params, strict=True):
        rows.add(int(r), p, [1, 2, 3])
    host = SamplingArrays(
        *(np.full(n, -7, np.int32) for _ in range(3)),
        *(np.full(n, -7.0, np.float32) for _ in range(3)),
    )
    outs = np.array(num_outputs or [0] * n, dtype=np.int64)
    flags = rows.stage(picked, outs, host)
    if flags is None:
        assert (host.keys == -7).all()  # nothing written
        return None, rows, picked
    dev = SamplingArrays(*(torch.from_numpy(getattr(host, f)) for f in vars(host)))
    return dev.as_metadata(n, flags, V, canonical=True), rows, picked


PLAIN = [
    SamplingParams(temperature=0.0, seed=1),
    SamplingParams(temperature=0.7, seed=2),
    SamplingParams(temperature=1.2, top_k=7, seed=3),
    SamplingParams(temperature=0.9, top_p=0.8, seed=4),
    SamplingParams(temperature=1.1, min_p=0.05, seed=5),
    SamplingParams(temperature=0.5, top_k=V + 10, seed=6),  # k >= V: off
]


def test_staged_inputs_equal_the_built_ones():
    outs = [0, 3, 1, 9, 2, 5]
    md, _, _ = staged(PLAIN, outs)
    want = SamplingMetadata.build(
        PLAIN, [[1, 2, 3]] * 6, [[]] * 6, [p.seed for p in PLAIN], (), V, "cpu",
        num_output_tokens=outs,
    )  # fmt: skip
    assert md.path == want.path
    for name in ("temperature", "greedy", "noise_keys", "top_k", "top_p", "min_p"):
        assert torch.equal(getattr(md, name), getattr(want, name)), name
    assert (md.all_greedy, md.all_random, md.max_top_k) == (False, False, 7)


@pytest.mark.parametrize(
    "slow",
    [
        dict(min_tokens=2),
        dict(logit_bias={3: 1.0}),
        dict(allowed_token_ids=[3, 4]),
        dict(repetition_penalty=1.2),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=-0.5),
        dict(logprobs=0),
        dict(bad_words=["x"]),
    ],
)
def test_one_row_off_the_staged_path_stages_nothing(slow):
    params = PLAIN[:3] + [SamplingParams(seed=9, **slow)]
    md, rows, picked = staged(params)
    assert md is None
    built = rows.metadata(list(picked), [0] * 4, (), "cpu")  # the host path instead
    assert built.path is params[3].sampling_path is not SamplingPath.STAGED


def test_argmax_only_for_greedy_rows_that_nothing_changes():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0, top_k=5),  # greedy: top-k is moot
    ]
    _, rows, picked = staged(params)
    assert rows.argmax_only(picked).tolist() == [True, False, False, False, True]


def test_races_on_slices_only_for_staged_unfiltered_sampled_steps():
    def races(params, fused=True):
        return races_on_slices(staged(params)[0], fused)

    hot, cold = SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)
    assert races([hot, hot])
    assert races([hot, cold])  # some greedy rows among them
    assert not races([hot, hot], fused=False)  # the PyTorch sampler: gather to rank 0
    assert not races([cold, cold])  # every row greedy: the argmax
    assert not races([hot, SamplingParams(min_tokens=1)])  # not staged
    for filtered in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)):
        assert not races([hot, SamplingParams(**filtered)]), filtered
