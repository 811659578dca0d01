"""A front end that lagged processes several steps' records as one (`core.outputs.merge_steps`):
where a stop string completes inside such a record, the tokens after it are dropped, so every
output kind reads as it does one step at a time: the same text, token ids, logprobs,
cumulative logprob and finish reason (the tiny byte-level BPE tokenizer of tests/helpers.py)."""

from __future__ import annotations

import pytest
from helpers import _tokenizer_template

from llm_inference.core.outputs import EngineCoreOutput
from llm_inference.engine.output_processor import OutputProcessor
from llm_inference.outputs import Logprobs, RequestOutputKind
from llm_inference.sampling_params import SamplingParams

TOK = _tokenizer_template()
IDS = TOK.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)


def _final(records, kind, params):
    """The request's final output (DELTA: its deltas joined) after `records`, one call each."""
    processor = OutputProcessor(TOK)
    (cid,) = processor.add_request("r", None, [1, 2], [params], output_kind=kind)
    outs = []
    for ids, lps in records:
        results, _ = processor.process_outputs([EngineCoreOutput(cid, ids, new_logprobs=lps)])
        outs += results
    if kind is not RequestOutputKind.DELTA:
        c = outs[-1].outputs[0]
        return c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason
    cs = [o.outputs[0] for o in outs]
    lps = [lp for c in cs for lp in c.logprobs]
    return ("".join(c.text for c in cs), [t for c in cs for t in c.token_ids], lps,
            cs[-1].cumulative_logprob, cs[-1].finish_reason)  # fmt: skip


@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda k: k.name)
@pytest.mark.parametrize("merged", [3, len(IDS)], ids=lambda n: f"records_of_{n}")
def test_a_stop_string_inside_a_merged_record_ends_the_tokens_there(kind, merged):
    params = SamplingParams(stop=["fox"], logprobs=0, max_tokens=100)
    lps = [Logprobs(token_id=t, logprob=-0.1 * (i + 1), top={}) for i, t in enumerate(IDS)]
    one_by_one = [([t], [lp]) for t, lp in zip(IDS, lps)]
    chunks = [(IDS[i : i + merged], lps[i : i + merged]) for i in range(0, len(IDS), merged)]
    want = _final(one_by_one, kind, params)
    got = _final(chunks, kind, params)
    assert want[0] == "The quick brown " and want[4] == "stop"
    assert len(want[1]) < len(IDS)  # the stop ended the tokens early
    assert got == want
