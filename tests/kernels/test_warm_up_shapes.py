"""The step shapes the Triton ops list for an eager engine's warm-up (kernels/warm_up.py): they
reach every compiled attention variant (and skinny GEMM or not) that any step within the limits
reaches; the ops object lists them for its device and its skinny GEMM switch, the reference ops
none."""

import pytest

pytest.importorskip("triton")
from llm_inference.kernels import paged_attention as pa  # noqa: E402
from llm_inference.kernels import skinny_gemm as sg  # noqa: E402
from llm_inference.kernels.reference import ReferenceOps  # noqa: E402
from llm_inference.kernels.triton_ops import TritonOps  # noqa: E402
from llm_inference.kernels.warm_up import step_keys, warm_up_shapes  # noqa: E402

SHAPES = [
    # (KV heads, group, head_dim, block size, max_num_seqs, max_model_len, budget, SMs)
    (8, 4, 64, 16, 64, 4096, 512, 132),  # Llama 3.2 1B on an H200
    (8, 3, 128, 16, 40, 8192, 300, 132),  # 3B
    (4, 3, 128, 16, 48, 2048, 64, 132),  # 3B, a TP=2 rank
    (1, 8, 128, 32, 20, 16384, 40, 78),  # one KV head, another GPU
    (8, 3, 128, 16, 8, 32768, 32, 132),  # long contexts: up to 128 splits at one sequence
    (2, 1, 64, 16, 8, 1024, 16, 4),  # small limits, the interpreter's SM count
    (8, 4, 128, 16, 16, 1024, 2200, 132),  # 8B: the long tile's budgets, over max_model_len
]


def _keys(num_seqs, tokens, max_query_len, max_seq_len, shape, rows):
    kv, group, head_dim, block_size, *_, sms = shape
    return step_keys(kv, group, head_dim, block_size, sms, rows, num_seqs, tokens,
                     max_query_len, max_seq_len)  # fmt: skip


@pytest.mark.parametrize("rows", [16, 32, 64], ids=lambda r: f"skinny{r}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"kv{s[0]}g{s[1]}d{s[2]}s{s[4]}")
def test_steps_reach_every_variant(shape, rows):
    """Against every decode (batch, context in whole tiles) and mixed steps of every query
    length, at several sequence counts and longest contexts (their decodes split by those);
    the skinny GEMM up to 16, 32 (the engine's) and 64 rows (envs.LLM_INFERENCE_SKINNY_ROWS)."""
    kv, group, head_dim, block_size, max_seqs, max_len, budget, sms = shape
    steps = warm_up_shapes(kv, group, head_dim, block_size, max_seqs, max_len, budget, sms, rows)
    warmed = set()
    for s in steps:  # each step brings a variant the ones before it did not
        keys = _keys(s.num_seqs, s.num_tokens, s.max_query_len, s.max_seq_len, shape, rows)
        assert not keys <= warmed, s
        warmed |= keys
    block_n = pa.default_block_n(head_dim, block_size)
    contexts = range(block_n, max_len + block_n, block_n)
    every = set().union(*(_keys(b, b, 1, min(n, max_len), shape, rows)
                          for b in range(1, max_seqs + 1) for n in contexts))  # fmt: skip
    # A mixed step's tile follows its longest query; its decodes' split, its sequences and
    # longest context; its linear layers, all its tokens.
    for tokens in range(2, budget + 1):
        for query in {2, tokens // 2, tokens} - {0, 1}:
            for seqs in {1, 2, max_seqs // 2, max_seqs} - {0}:
                for n in (block_n, max_len // 3, max_len):
                    every |= _keys(seqs, tokens, query, max(n, 1), shape, rows)
    assert every <= warmed, f"not warmed up: {sorted(every - warmed, key=str)}"
    decode_keys = {k for k in warmed if k[0] == "decode"}
    assert {k[1] for k in decode_keys} == {False, True}  # these limits split and do not
    # Each linear path where a step can take it (more rows than the skinny GEMM's: cuBLAS),
    # the skinny GEMM at each padded row count up to the most rows a step has.
    assert (("cublas",) in warmed) == (max(budget, max_seqs) > rows)
    most = min(max(budget, max_seqs), rows)
    padded = {k[1] for k in warmed if k[0] == "skinny"}
    assert padded == {sg.block_m(m) for m in range(1, most + 1)}
    assert any(k[0] == "tiled" for k in warmed)


def test_the_ops_objects_list_them(monkeypatch):
    limits = (2, 1, 64, 16, 8, 1024, 64)
    assert ReferenceOps().warm_up_shapes(*limits) == []
    monkeypatch.delenv("LLM_INFERENCE_SKINNY_GEMM", raising=False)
    monkeypatch.delenv("LLM_INFERENCE_SKINNY_ROWS", raising=False)
    with_skinny = TritonOps("cpu").warm_up_shapes(*limits)
    assert with_skinny == warm_up_shapes(*limits, 4, 32)
    monkeypatch.setenv("LLM_INFERENCE_SKINNY_ROWS", "64")
    assert TritonOps("cpu").warm_up_shapes(*limits) == warm_up_shapes(*limits, 4, 64)
    monkeypatch.setenv("LLM_INFERENCE_SKINNY_GEMM", "0")
    assert TritonOps("cpu").warm_up_shapes(*limits) == warm_up_shapes(*limits, 4, 0)
