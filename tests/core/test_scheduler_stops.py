"""Stop conditions, aborts and errors of the Scheduler (fake model outputs)."""

from __future__ import annotations

import pytest
from batch_replay import ReplayScheduler as Scheduler

from llm_inference.config import SchedulerConfig
from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=32, block_size=4, max_model_len=256):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=max_model_len)
    return Scheduler(config, num_blocks=num_blocks, block_size=block_size)


def run(sched, req, tokens):
    """Feed `tokens` one per step to `req` (alone) until it finishes; returns steps taken."""
    sched.add_request(req)
    for n, token in enumerate(tokens, start=1):
        out = sched.schedule()
        assert [s.request_id for s in out.scheduled] == [req.request_id]
        updated = sched.update_from_output(out, ModelRunnerOutput([req.request_id], [[token]]))
        assert [o.request_id for o in updated] == [req.request_id]
        if req.is_finished:
            return n
    return None


def request(params=None, **kwargs):
    """A 3-token prompt with EOS = 2."""
    return Request("r", [10, 11, 12], params or SamplingParams(), eos_token_ids=(EOS,), **kwargs)


def assert_freed(sched):
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert sched.running == [] and not sched.waiting
    assert not sched.has_unfinished_requests()
    assert sched.get_num_unfinished_requests() == 0


def test_finishes_on_eos_and_frees_its_blocks():
    sched = make_scheduler()
    req = request(SamplingParams(max_tokens=10))
    assert run(sched, req, [5, 6, EOS, 7]) == 3
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.finish_reason == "stop" and req.stop_reason is None  # natural end, as vLLM
    assert req.output_token_ids == [5, 6, EOS]
    assert req.block_ids == []
    assert_freed(sched)


def test_eos_before_min_tokens_does_not_stop():
    sched = make_scheduler()
    req = request(SamplingParams(max_tokens=10, min_tokens=3))
    assert run(sched, req, [EOS, EOS, EOS, EOS]) == 3
    assert req.output_token_ids == [EOS, EOS, EOS]
    assert req.finish_reason == "stop"


def test_stop_reason_names_a_stop_token_not_eos():
    """EOS listed in stop_token_ids too is still EOS (vLLM checks EOS first); with ignore_eos
    it is only a stop token, and named."""
    for ignore_eos, reason in ((False, None), (True, EOS)):
        sched = make_scheduler()
        params = SamplingParams(max_tokens=10, stop_token_ids=[9, EOS], ignore_eos=ignore_eos)
        req = request(params)
        assert run(sched, req, [5, EOS, 9]) == 2
        assert req.finish_reason == "stop" and req.stop_reason == reason


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    req = request(SamplingParams(max_tokens=4, ignore_eos=True))
    assert run(sched, req, [EOS] * 10) == 4
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.finish_reason == "length" and req.stop_reason is None


def test_stop_token_ids_stop_even_with_ignore_eos_but_not_before_min_tokens():
    sched = make_scheduler()
    req = request(SamplingParams(max_tokens=10, stop_token_ids=[9], ignore_eos=True, min_tokens=2))
    assert run(sched, req, [9, EOS, 9, 9]) == 3
    assert req.stop_reason == 9 and req.finish_reason == "stop"


def test_max_tokens_from_sampling_params_or_engine_override():
    sched = make_scheduler()
    req = request(SamplingParams(max_tokens=3))
    assert req.max_tokens == 3
    assert run(sched, req, [5] * 10) == 3
    assert req.finish_reason == "length"
    req = request(SamplingParams(max_tokens=3), max_tokens=5)
    assert run(sched, req, [5] * 10) == 5
    assert_freed(sched)


def test_eos_wins_over_length_on_the_same_token():
    sched = make_scheduler()
    req = request(SamplingParams(max_tokens=2))
    assert run(sched, req, [5, EOS]) == 2
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_max_model_len_stops_the_sequence():
    sched = make_scheduler(max_model_len=8)
    req = request(SamplingParams(max_tokens=None))
    assert run(sched, req, [5] * 10) == 5  # 3 + 5 == max_model_len
    assert req.num_tokens == 8 and req.finish_reason == "length"


def test_abort_frees_running_and_waiting_requests():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), 8, 4)
    a = Request("a", [1] * 5, SamplingParams())
    b = Request("b", [1] * 5, SamplingParams())
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    assert a.status is RequestStatus.RUNNING and len(a.block_ids) == 2
    assert sched.kv_cache_manager.num_free_blocks == 6
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    for req in (a, b):
        assert req.finish_reason == "abort" and req.block_ids == []
    assert_freed(sched)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # already gone: ignored
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    a = Request("a", [1, 2], SamplingParams())
    b = Request("b", [1, 2], SamplingParams())
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    updated = sched.update_from_output(out, ModelRunnerOutput(["a", "b"], [[5], [6]]))
    assert [o.request_id for o in updated] == ["b"]
    assert updated[0].new_token_ids == [6] and not updated[0].finished
    assert a.output_token_ids == [] and b.output_token_ids == [6]
    assert [r.request_id for r in sched.running] == ["b"]


def test_prompt_larger_than_the_whole_cache_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(RuntimeError, match="whole cache has 2 blocks"):
        sched.add_request(Request("big", [1] * 9, SamplingParams()))
    sched = make_scheduler(max_model_len=4)
    with pytest.raises(AssertionError):  # the front end refuses it (one length check)
        sched.add_request(Request("long", [1] * 4, SamplingParams()))
    sched.add_request(Request("ok", [1] * 3, SamplingParams()))  # room for one output token


def test_a_sequence_outgrowing_the_cache_raises_instead_of_looping():
    sched = make_scheduler(num_blocks=2, block_size=4)
    req = Request("r", [1] * 8, SamplingParams(max_tokens=50))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["r"], [[3]]))
    with pytest.raises(RuntimeError, match="needs 3 KV blocks"):
        sched.schedule()


def test_missing_sample_is_an_error():
    sched = make_scheduler()
    sched.add_request(Request("r", [1, 2], SamplingParams()))
    out = sched.schedule()
    with pytest.raises(ValueError, match="needed a sample"):
        sched.update_from_output(out, ModelRunnerOutput(["r"], [[]]))


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(Request("r", [1], SamplingParams()))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(Request("r", [1], SamplingParams()))


def test_every_request_is_reported_every_step_it_gets_a_token():
    """The core reports every step's new tokens; what a caller sees of them is the front
    end's choice (FINAL_ONLY included)."""
    sched = make_scheduler()
    req = request(SamplingParams(max_tokens=4, ignore_eos=True))
    other = Request("o", [10, 11], SamplingParams(max_tokens=6), eos_token_ids=(EOS,))
    sched.add_request(req)
    sched.add_request(other)
    reports = []
    for token in (5, 6, EOS, 7):
        out = sched.schedule()
        ids = [s.request_id for s in out.scheduled]
        tokens = [[token] for _ in ids]
        reports.append(sched.update_from_output(out, ModelRunnerOutput(ids, tokens)))
    assert [[o.request_id for o in step] for step in reports] == [["r", "o"]] * 3 + [["r"]]
    assert [step[0].new_token_ids for step in reports] == [[5], [6], [EOS], [7]]  # EOS ignored
    assert [step[0].finish_reason for step in reports] == [None, None, None, "length"]
    assert req.output_token_ids == [5, 6, EOS, 7]
    assert reports[2][1].finish_reason == "stop"  # the other one stopped at EOS
    assert_freed(sched)
