"""The families' hooks on the Triton kernels, run in a child process under TRITON_INTERPRET=1
(`python families_triton_checks.py [CASE ...]`, one `RESULT <case> ok|FAIL` line each).

Each case loads a tiny random checkpoint (families.py) on the Triton ops and runs two paged
steps through the KV cache: a prompt chunk of two sequences, then a decode step of both (the
tiled kernel, then the split-K decode kernel; RoPE fused with the cache store). Its logits must
equal the reference model's dense forward (float32): the q/k norms run the Triton RMSNorm on
rows of one head (head_dim 128 here, as Qwen3's), the biases ride on the linear layers.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CASES = {
    "qwen2_bias": ("qwen2", {}),
    "qwen3_qk_norm_head_dim_128": ("qwen3", {"head_dim": 128, "num_attention_heads": 2,
                                             "num_key_value_heads": 1}),
}  # fmt: skip
BLOCK = 16


def _paged_step(model, ids, positions, qsl, seq_lens, tables):
    from llm_inference.layers.attention import AttentionMetadata

    i32 = torch.int32
    slots = torch.cat([
        tables[s, positions[a:b] // BLOCK] * BLOCK + positions[a:b] % BLOCK
        for s, (a, b) in enumerate(zip(qsl[:-1], qsl[1:]))
    ])  # fmt: skip
    md = AttentionMetadata(
        slots.to(i32), torch.tensor(qsl, dtype=i32), torch.tensor(seq_lens, dtype=i32),
        tables.to(i32), max(b - a for a, b in zip(qsl[:-1], qsl[1:])), max(seq_lens),
    )  # fmt: skip
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, md))


def check(case: str) -> None:
    from families import make_family_checkpoint

    from llm_inference.kernels import reference
    from llm_inference.kernels.triton_ops import TritonOps
    from llm_inference.models.loader import load_model

    family, overrides = CASES[case]
    folder = make_family_checkpoint(Path(tempfile.mkdtemp()) / case, family, **overrides)
    model = load_model(folder, TritonOps("cpu"))
    c = model.config
    for attn in model.attention_layers():
        shape = (8, BLOCK, c.num_key_value_heads, c.head_dim)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (10, 6)]
    tables = torch.tensor([[5, 2], [0, 7]])
    # step 1: the first 9 and 5 tokens; step 2: one more token of each
    first = _paged_step(
        model, torch.cat([seqs[0][:9], seqs[1][:5]]),
        torch.cat([torch.arange(9), torch.arange(5)]), [0, 9, 14], [9, 5], tables,
    )  # fmt: skip
    second = _paged_step(
        model, torch.stack([seqs[0][9], seqs[1][5]]), torch.tensor([9, 5]), [0, 1, 2], [10, 6],
        tables,
    )  # fmt: skip
    ref = load_model(folder, reference)
    for s, got in zip(seqs, ([first[:9], second[0:1]], [first[9:], second[1:2]])):
        with torch.no_grad():
            want = ref.compute_logits(ref(s, torch.arange(len(s)), [len(s)]))
        got = torch.cat(got)
        assert torch.isfinite(got).all()
        err = (got - want).abs().max().item()
        assert err < 1e-3 * max(1.0, want.abs().max().item()), f"{case}: max error {err}"


def main(cases: list[str]) -> None:
    sys.path.insert(0, str(HERE.parent))  # tests/: helpers.py, interpreter.py
    sys.path.insert(0, str(HERE))
    from interpreter import report_each

    report_each(cases, check)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
