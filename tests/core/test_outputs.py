"""The core's records cross a process boundary pickled (engine/core_process.py)."""

from __future__ import annotations

import pickle

from llm_inference.core.outputs import EngineCoreOutput


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
