"""The core's records cross a process boundary pickled (engine/core_process.py)."""

from __future__ import annotations

import pickle

from llm_inference.core.outputs import EngineCoreOutput, merge_steps


def test_engine_core_output_pickles_every_field():
    running = EngineCoreOutput("a", [5])
    finishing = EngineCoreOutput("b", [7, 2], "stop", 2, [0.5], [None, 1.0], [9, 7, 2])
    abort = EngineCoreOutput("c", [], "abort", output_token_ids=[])
    only_logprobs = EngineCoreOutput("d", [3], new_logprobs=[-0.1])
    only_prompt_lps = EngineCoreOutput("e", [4], prompt_logprobs=[])  # empty, not None
    records = [running, finishing, abort, only_logprobs, only_prompt_lps]
    back = pickle.loads(pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == records
    assert back[4].prompt_logprobs == [] and back[0].prompt_logprobs is None
    # a running request's record (most of a step's) travels as its id and tokens only
    assert running.__reduce__()[1] == ("a", [5])


def test_merge_steps_joins_each_request_in_order():
    a1 = EngineCoreOutput("a", [1], new_logprobs=[-0.1], prompt_logprobs=[None, -1.0])
    b1 = EngineCoreOutput("b", [5])
    a2 = EngineCoreOutput("a", [2], new_logprobs=[-0.2])
    c2 = EngineCoreOutput("c", [9])
    a3 = EngineCoreOutput("a", [3, 4], "stop", 4, [-0.3, -0.4], None, [1, 2, 3, 4])
    steps = [[a1, b1], [a2, c2], [a3]]
    merged = merge_steps(steps)
    assert [r.request_id for r in merged] == ["a", "b", "c"]
    a = merged[0]
    assert a.new_token_ids == [1, 2, 3, 4] and a.new_logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert a.prompt_logprobs == [None, -1.0]  # the first record's, carried once
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == ("stop", 4, [1, 2, 3, 4])
    assert merged[1] is b1 and merged[2] is c2  # alone: as they came
    assert a1.new_token_ids == [1] and a1.new_logprobs == [-0.1]  # the records unchanged
    # one step: the same list; no logprobs asked: None stays None
    assert merge_steps([[b1]]) == [b1]
    x = merge_steps([[EngineCoreOutput("x", [1])], [EngineCoreOutput("x", [2])]])[0]
    assert x.new_token_ids == [1, 2] and x.new_logprobs is None
