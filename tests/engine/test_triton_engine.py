"""On CUDA: the engine with Triton kernels gives the same greedy tokens as with the PyTorch
reference kernels (float16, GQA, head_dim 64 and 128, block sizes 16 and 32, with and without
CUDA graphs).

The two paths round differently (the Triton attention multiplies bf16/fp16 probabilities
into V; the reference stays in float32), so where the reference's two best tokens are within
rounding of each other the argmax may legitimately flip, and the sequences part from there.
The test demands identical tokens up to any such point and that the point is a near-tie of
the reference (log-probability gap under NEAR_TIE). float16 keeps that rounding 8x smaller
than bfloat16 would."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_greedy_close, make_sharp_checkpoint, random_prompts

from llm_inference import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEAR_TIE = 0.15  # log-probability gap under which fp16 rounding may flip the argmax


@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (64, 32)])
def test_triton_greedy_equals_reference(tmp_path, head_dim, block_size, eager):
    folder = make_sharp_checkpoint(tmp_path, head_dim=head_dim)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    runs = {}
    for backend in ("auto", "reference"):
        with LLM(
            str(folder),
            device="cuda",
            dtype="float16",
            block_size=block_size,
            kv_cache_memory_bytes=64 << 20,
            kernel_backend=backend,
            enforce_eager=eager,
            max_num_seqs=8,
        ) as llm:
            if backend == "auto":
                assert (llm.engine.executor.workers[0].model_runner.graphs is None) == eager
            runs[backend] = llm.generate(random_prompts(), params, use_tqdm=False)
    # Before the first difference the sequences are identical; at it, the reference must have
    # found the two tokens nearly tied.
    assert_greedy_close(runs["auto"], runs["reference"], NEAR_TIE, "Triton")


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_first_requests_compile_nothing(tmp_path, eager):
    """Engine start compiles every Triton kernel its steps launch (graph capture for the model,
    or without graphs an all-padding forward per attention variant; a warm-up for the
    sampler), so requests of any batch size, sampled, greedy or filtered by top-p (and top-k),
    wait for no compile: before, a
    run's first steps at each new batch size compiled the sampler's merge, the first step too
    long for a graph (here 6 x 400 prompt tokens, eager) compiled the attention kernel for its
    sequence count, and an eager engine compiled attention variants in its first steps and
    whenever the batch or the longest context changed the decode split count (the eager case
    failed on the code before the warm-up: paged decode and tiled attention variants); since
    a mixed step's decodes take the decode kernel, a step past the graphs with decodes in it
    (the last batch) may split them in a way no graph did, so graph engines warm up eager
    steps too. An engine of 64 sequences, so the sampler's warm-up at all rows does not run
    the small batches' LM head: its skinny GEMM has a variant per row count padded to 16, 32
    or 64 (benchmarks/first_run.py --enforce-eager compiled the 16 in the first requests until
    the warm-up ran the LM head at one row; a served run compiled the 32 mid-run until it ran
    every power of two); the 40 long prompts below sample 40, then 30, 20 and 10 rows as they
    end."""
    from helpers import triton_compiles

    folder = make_sharp_checkpoint(tmp_path, head_dim=64)
    with LLM(str(folder), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
             max_num_seqs=64, enforce_eager=eager) as llm:  # fmt: skip
        prompts = random_prompts()
        with triton_compiles() as compiled:
            for n in (1, 3, 6, 6 * 2):
                batch = (prompts * 2)[:n]
                sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=9) for i in range(n)]
                llm.generate(batch, sampled, use_tqdm=False)
                mixed = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=9)
                         for i in range(n)]  # fmt: skip
                llm.generate(batch, mixed, use_tqdm=False)
                filtered = [SamplingParams(temperature=0.8, top_p=0.9, top_k=(0, 20)[i % 2],
                                           max_tokens=5) for i in range(n)]  # fmt: skip
                llm.generate(batch, filtered, use_tqdm=False)
            long = [[(7 * i + j) % 300 + 2 for j in range(400)] for i in range(6)]
            llm.generate(long, SamplingParams(temperature=0.8, max_tokens=3), use_tqdm=False)
            # 40 such prompts at once, ending at different steps, prompt chunks (past the
            # mixed graphs) beside decodes, whose split count follows that eager step's own
            # sizes.
            many = [[(11 * i + j) % 300 + 2 for j in range(400)] for i in range(40)]
            ends = [SamplingParams(temperature=0.8, max_tokens=8 + 16 * (i % 4)) for i in range(40)]
            llm.generate(many, ends, use_tqdm=False)
    assert compiled == [], compiled.details


def test_prompt_logprobs_with_graphs_equal_reference(tmp_path):
    """prompt_logprobs on CUDA from the graphs' hidden states (a prompt chunked over mixed
    graphs) equal the reference kernels' up to float16 rounding, and the most likely token
    too wherever the reference's top two are not close. Tolerance: 0.05 nats + 1% of the
    logprob. This sharpened model's logits are large, and so is their float16 rounding, which
    reaches unlikely tokens' logprobs whole: on the GPU, 0.053 off at -23.94 and 0.109 at
    -19.65, every other position within 0.05. A wrong position or row is off by nats."""
    folder = make_sharp_checkpoint(tmp_path, head_dim=64)
    prompt = random_prompts()[4]  # 250 tokens
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    runs = {}
    for backend in ("auto", "reference"):
        with LLM(str(folder), device="cuda", dtype="float16", kv_cache_memory_bytes=64 << 20,
                 kernel_backend=backend, max_num_batched_tokens=64) as llm:  # fmt: skip
            (runs[backend],) = llm.generate([prompt], params, use_tqdm=False)
    fast, ref = runs["auto"].prompt_logprobs, runs["reference"].prompt_logprobs
    assert len(fast) == len(ref) == len(prompt) and fast[0] is None
    far, flips = [], []
    for pos, (a, b) in enumerate(zip(fast[1:], ref[1:]), 1):
        assert a.token_id == b.token_id and len(a.top) == 2
        if abs(a.logprob - b.logprob) > 0.05 + 0.01 * abs(b.logprob):
            far.append((pos, a.logprob, b.logprob))
        (best, p1), (_, p2) = b.top.items()
        if p1 - p2 > 0.2 and next(iter(a.top)) != best:
            flips.append((pos, a.top, b.top))
    assert not far and not flips, f"logprobs off: {far[:5]}; top token changed: {flips[:5]}"


def test_structured_outputs_on_cuda_compile_nothing(tiny_ckpt):
    """Structured outputs on the Triton sampler with CUDA graphs: seeded rows stay on the staged
    path and the kernel reads the grammar's bitmask (greedy rows too), rows with logprobs mask
    the float32 copy; every answer follows its grammar, and no request compiles a kernel (the
    warm-up compiled the bitmask's variant)."""
    import json
    import re

    from helpers import triton_compiles

    from llm_inference import StructuredOutputsParams as S

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
              "ok": {"type": "boolean"}}, "required": ["n", "ok"]}  # fmt: skip
    specs = [S(json=schema, disable_any_whitespace=True), S(regex=r"[a-c]{2,4}\d"),
             S(choice=["yes please", "no"])]  # fmt: skip
    prompts = ["The quick brown", "Paris is the capital", "Hello world! How are", "One two"]
    with LLM(str(tiny_ckpt), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
             max_num_seqs=8) as llm:  # fmt: skip
        with triton_compiles() as compiled:
            params = [SamplingParams(temperature=0.0 if i % 4 == 3 else 1.0, seed=i,
                                     max_tokens=48, structured_outputs=specs[i % 3],
                                     logprobs=2 if i % 5 == 4 else None)
                      for i in range(12)]  # fmt: skip
            outs = llm.generate((prompts * 3)[:12], params, use_tqdm=False)
    assert compiled == [], compiled.details
    for i, o in enumerate(outs):
        assert o.finish_reason == "stop", o.text
        if i % 3 == 0:
            assert set(json.loads(o.text)) == {"n", "ok"}
        elif i % 3 == 1:
            assert re.fullmatch(r"[a-c]{2,4}\d", o.text)
        else:
            assert o.text in ("yes please", "no")


def test_biased_and_constrained_rows_on_the_triton_sampler(tiny_ckpt):
    """The slow path's float32 logits (allowed_token_ids, logit_bias, choice) through the Triton
    sampler, in one batch with plain greedy and seeded rows: each constraint holds, and the
    plain rows run to their length. (Their tokens are not compared with a run alone: this
    random model's logits are nearly flat, and another batch shape may round them apart.)"""
    from llm_inference import StructuredOutputsParams

    prompts = ["The quick brown", "Paris is the capital", "Hello world! How are", "One two"]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_ckpt), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
             max_num_seqs=8) as llm:  # fmt: skip
        alone = llm.generate(prompts[:2], [plain, seeded], use_tqdm=False)
        allowed = sorted(set(alone[0].token_ids))[:3]
        favourite = alone[1].token_ids[0]
        choices = ["yes please", "no", "maybe later"]
        params = [
            plain,
            seeded,
            SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True,
                           allowed_token_ids=allowed),
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                           logit_bias={favourite: 100.0}),
            SamplingParams(temperature=1.0, seed=2, max_tokens=20, n=3,
                           structured_outputs=StructuredOutputsParams(choice=choices)),
        ]  # fmt: skip
        outs = llm.generate(prompts[:2] + prompts[2:] + prompts[:1], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs[:2]] == [12, 12]
    assert set(outs[2].token_ids) <= set(allowed) and len(outs[2].token_ids) == 12
    assert outs[3].token_ids == [favourite] * 6
    assert {c.text for c in outs[4].outputs} <= set(choices)
