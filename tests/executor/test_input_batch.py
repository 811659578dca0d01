"""The worker's input batch: a run's SchedulerOutputs, pickled as a worker process would get
them and replayed into a fresh InputBatch, give the same step inputs as the in-process runner
built; and both agree with the pure-Python replay oracle (tests/batch_replay.py)."""

from __future__ import annotations

import bisect
import pickle

import numpy as np
import pytest
import torch
from batch_replay import BatchReplay

from llm_inference import LLM, SamplingParams
from llm_inference.core.kv_cache_manager import slot_mapping
from llm_inference.executor.input_batch import InputBatch, InputBuffers

INPUTS = ("input_ids", "positions", "slot_mapping")


def snapshot(step, buffers: InputBuffers) -> dict:
    """The step's inputs as plain lists (the buffers are overwritten by the next step)."""
    n, s = step.num_tokens, step.num_seqs
    b = buffers.np
    snap = {name: getattr(b, name)[:n].tolist() for name in INPUTS}
    snap["query_start_loc"] = b.query_start_loc[: s + 1].tolist()
    snap["seq_lens"] = b.seq_lens[:s].tolist()
    order = b.seq_order[:s].tolist()  # the decode kernel's order: longest first
    assert sorted(order) == list(range(s))
    assert [snap["seq_lens"][i] for i in order] == sorted(snap["seq_lens"], reverse=True)
    snap["logits_indices"] = b.logits_indices[: len(step.sample_rows)].tolist()
    snap["block_table"] = [
        row[: -(-length // 4)].tolist()
        for row, length in zip(buffers.np_table[:s], snap["seq_lens"])
    ]
    qsl, lens = snap["query_start_loc"], snap["seq_lens"]
    assert step.max_query_len == max(b - a for a, b in zip(qsl[:-1], qsl[1:]))
    assert step.max_seq_len == max(lens)
    snap["request_ids"] = step.request_ids
    # (flat index, request) of each sample still on the device: the request owning that row
    owner = [step.request_ids[bisect.bisect_right(qsl, t) - 1] for t in step.placeholder_tokens]
    snap["placeholders"] = list(zip(step.placeholder_tokens, owner))
    m = len(step.placeholder_tokens)
    snap["placeholder_src"] = b.placeholder_src[:m].tolist()
    snap["sampling"] = step.sampling
    if step.sampling is not None:  # the sampler's inputs, staged with the step's
        k = len(step.sample_rows)
        for name in ("keys", "top_k", "greedy", "temperature"):
            snap[name] = getattr(b.sampling, name)[:k].tolist()
    return snap


def run_recording(tiny_ckpt):
    """A run with preemptions (tiny cache), chunked prefill, aborts and n=2; returns the
    pickled SchedulerOutputs and the inputs the in-process runner built for each."""
    wire, built = [], []
    with LLM(
        str(tiny_ckpt),
        device="cpu",
        block_size=4,
        kv_cache_memory_bytes=24 * 2048,  # 24 blocks: 4 tokens x 2 layers x K,V x 2 x 16 fp32
        max_model_len=96,
        max_num_batched_tokens=24,
        max_num_seqs=6,
    ) as llm:
        runner = llm.engine.executor.workers[0].model_runner
        prepare = runner.input_batch.prepare

        def recording_prepare(so, buffers):
            step = prepare(so, buffers)
            built.append(snapshot(step, buffers))
            return step

        execute = runner.execute_model

        def recording_execute(so, *args):
            wire.append(pickle.dumps(so))
            return execute(so, *args)

        runner.input_batch.prepare = recording_prepare
        runner.execute_model = recording_execute
        g = torch.Generator().manual_seed(1)
        engine = llm.engine
        for i, n in enumerate([30, 7, 45, 3, 22, 15, 60, 9]):
            prompt = torch.randint(2, 320, (n,), generator=g).tolist()
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=12, n=2 if i == 3 else 1)
            engine.add_request(f"r{i}", prompt, params)
        for step in range(400):
            if not engine.has_unfinished_requests():
                break
            engine.step()
            if step == 5:
                engine.abort_request(["r2", "r5"])
        engine.step()  # an empty step still tells the workers what finished last
        assert len(runner.input_batch) == 0
        assert llm.stats()["num_preemptions"] > 0
        assert llm.stats()["num_free_kv_blocks"] == llm.stats()["num_kv_blocks"]
        vocab = runner.config.model.vocab_size
    return wire, built, vocab


@pytest.fixture(scope="module")
def recording(tiny_ckpt):
    return run_recording(tiny_ckpt)


def test_replayed_stream_gives_the_runner_inputs(recording):
    wire, built, vocab = recording
    batch = InputBatch(max_num_reqs=6, max_model_len=96, block_size=4, vocab_size=vocab)
    buffers = InputBuffers(max_tokens=24, max_seqs=6, max_blocks=24, device="cpu")
    replayed = []
    for data in wire:
        so = pickle.loads(data)
        batch.apply(so)
        if not so.is_empty:
            step = batch.prepare(so, buffers)
            replayed.append(snapshot(step, buffers))
            if step.sample_rows:  # as the runner does once it has sampled
                batch.set_sampled(step.sample_batch_rows)
    assert len(replayed) == len(built) > 20
    assert replayed == built
    assert any(snap["placeholders"] for snap in built)  # async scheduling was exercised
    assert any(snap["sampling"] is not None for snap in built)  # the staged sampler inputs
    assert len(batch) == 0  # every request finished or aborted: the worker holds none


def test_runner_inputs_agree_with_the_python_oracle(recording):
    wire, built, _ = recording
    oracle = BatchReplay()
    steps = iter(built)
    for data in wire:
        so = pickle.loads(data)
        views = oracle.apply(so)
        if so.is_empty:
            continue
        got = next(steps)
        want_ids = [t for v in views for t in v.token_ids]
        holes = [i for i, t in enumerate(want_ids) if t is None]  # samples in flight
        assert [i for i, _ in got["placeholders"]] == holes
        got_ids = list(got["input_ids"])
        for i in holes:
            got_ids[i] = None
        want_pos = [v.start_position + i for v in views for i in range(len(v.token_ids))]
        want_slots = [
            s
            for v in views
            for s in slot_mapping(v.block_ids, v.start_position, len(v.token_ids), 4)
        ]
        assert got_ids == want_ids
        assert got["positions"] == want_pos
        assert got["slot_mapping"] == want_slots
        ends = np.cumsum([len(v.token_ids) for v in views])
        assert got["logits_indices"] == [int(e) - 1 for e, v in zip(ends, views) if v.needs_sample]
        assert got["seq_lens"] == [v.start_position + len(v.token_ids) for v in views]
        assert got["request_ids"] == [v.request_id for v in views]


def test_pad_decode_fills_padding_rows():
    buffers = InputBuffers(max_tokens=8, max_seqs=8, max_blocks=4, device="cpu")
    b = buffers.np
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc"):
        getattr(b, name)[:] = 77
    buffers.pad_decode(3, 8)
    assert b.seq_order[3:8].tolist() == [3, 4, 5, 6, 7]  # after the real rows
    assert b.slot_mapping[3:8].tolist() == [-1] * 5
    assert b.seq_lens[3:8].tolist() == [1] * 5
    assert b.query_start_loc[3:9].tolist() == [3, 4, 5, 6, 7, 8]
    assert b.slot_mapping[:3].tolist() == [77] * 3  # real rows untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs CUDA")
def test_staging_cycles_through_persistent_pinned_arrays_after_their_copy():
    """On CUDA, stage() hands out STAGES pinned host arrays in turn (no allocation per step),
    and an array comes back only once the copy that read it has run: with the GPU kept busy
    and the host never waiting otherwise, every step's copy still carries its own values."""
    buffers = InputBuffers(max_tokens=64, max_seqs=8, max_blocks=4, device="cuda")
    seen, copies = [], []
    for step in range(3 * buffers.STAGES):
        buffers.stage()
        assert buffers.host_flat.is_pinned() and buffers.host_table.is_pinned()
        seen.append(buffers.host_flat.data_ptr())
        torch.cuda._sleep(10_000_000)  # the GPU busy: the copy below runs well after this
        buffers.np.input_ids[:] = step
        buffers.np_table[:] = step
        buffers.to_device(8, 4)
        copies.append((buffers.dev.input_ids.clone(), buffers.dev_table.clone()))
    torch.cuda.synchronize()
    for step, (ids, table) in enumerate(copies):
        assert ids.eq(step).all() and table.eq(step).all(), step
    assert (
        len(set(seen)) == buffers.STAGES
        and seen[: buffers.STAGES] == seen[buffers.STAGES :][: buffers.STAGES]
    )


def test_pad_mixed_fills_padding_tokens_and_sequences():
    """A prepared mixed step (5 sequences, 47 tokens) padded to 64 tokens and 8 sequences:
    every padded entry set, every real entry and everything else untouched."""
    from mixed_padding_checks import MIXED, build_step

    step, buffers = build_step(MIXED, max_seqs=8, max_tokens=80, gen=torch.Generator())
    t, s = step.num_tokens, step.num_seqs
    assert (t, s) == (47, 5)
    b = buffers.np
    before = {name: arr.copy() for name, arr in vars(b).items() if name != "sampling"}
    table = buffers.np_table.copy()
    buffers.pad_mixed(t, s, 64)
    assert b.input_ids[t:64].tolist() == [0] * 17
    assert b.positions[t:64].tolist() == [0] * 17
    assert b.slot_mapping[t:64].tolist() == [-1] * 17
    assert b.query_start_loc.tolist() == before["query_start_loc"][: s + 1].tolist() + [t] * 3
    assert b.seq_lens.tolist() == before["seq_lens"][:s].tolist() + [0] * 3
    for name in ("input_ids", "positions", "slot_mapping"):
        now = getattr(b, name)
        assert (now[:t] == before[name][:t]).all(), name  # real tokens unchanged
        assert (now[64:] == before[name][64:]).all(), name  # past the bucket: untouched
    for name in ("logits_indices", "placeholder_dst", "placeholder_src"):
        assert (getattr(b, name) == before[name]).all(), name
    assert (buffers.np_table == table).all()  # padding sequences' table rows are never read


def test_a_request_sent_twice_or_unknown_is_an_error():
    from llm_inference.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput

    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4)
    new = NewRequestData("a", [1, 2, 3], [], SamplingParams(), [0], 0)
    so = SchedulerOutput(1, [new], CachedRequestData(), {"a": 3}, 3)
    batch.apply(so)
    with pytest.raises(ValueError, match="sent as new twice"):
        batch.apply(so)


def test_placeholders_filled_in_place_equal_the_general_fill(tiny_ckpt):
    """A decode step of the same sequences in the same order as the last (the steady state of
    async scheduling) fills its placeholders with one copy; the result equals the general
    gather/scatter, and steps after the batch changed take the general path."""
    from llm_inference.executor.model_runner import ModelRunner

    seen = []
    with LLM(str(tiny_ckpt), device="cpu", max_model_len=96, max_num_seqs=8) as llm:
        runner = llm.engine.executor.workers[0].model_runner
        fill = runner._fill_placeholders

        def checked_fill(m, in_place=False):
            seen.append(in_place)
            if not m:
                return fill(m, in_place)
            ids = runner.buffers.dev.input_ids
            general = ids.clone()
            ModelRunner._fill_placeholders(runner, m)  # the general path
            general, ids[:] = ids.clone(), general
            fill(m, in_place)
            assert torch.equal(ids, general), in_place

        runner._fill_placeholders = checked_fill
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 9, 14, 3)]
        params = [SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True)
                  for t in (12, 5, 20, 8)]  # fmt: skip
        llm.generate(prompts, params, use_tqdm=False)
    assert True in seen and seen.count(False) >= 3  # steady steps, and steps after changes
