"""Variants of the tiled prompt kernel's key loop, timed against the shipped kernel.

Each variant is the shipped `kernels/unified_attention.py` with one edit of its source (a
string replacement, asserted to apply), compiled as a module of its own, so that an idea for
the loop is measured before it is written into the kernel:
- `warp_specialize`: the loop as `tl.range(..., warp_specialize=True)` (Triton's automatic warp
  specialization; on Hopper its pass may refuse the loop: the error is printed).
- `loop_stages_4`: the loop as `tl.range(..., num_stages=4)`.
- `k_transposed`: the unmasked K tile loaded as [D, BLOCK_N] (pointers transposed), then
  transposed back.
- `contiguous_table`: the block-table load replaced by arithmetic on the sequence's first block,
  timed on a table whose blocks are contiguous: what the paged gather's dependent load costs.
- `prefetch_table`: the next tile's block ids loaded one iteration ahead (loop-carried).
- `page_ids`: one block id per page of the tile (BLOCK_N / block size loads, not BLOCK_N),
  broadcast over the page's tokens.
The Llama-3.1-8B heads (32 q, 8 KV, head_dim 128), bf16, block size 16, random block tables;
one layer, GPU ms from CUDA-graph replay with L2 flushed (benchmarks/unified_attention.py's
helpers), for a few tiles; rel err against the float32 reference; vLLM's FA3 beside where vLLM
is installed. `--check` runs each variant on tiny shapes against the reference (CPU with
TRITON_INTERPRET=1; tests/kernels/test_attention_benchmarks.py).

    PYTHONPATH=src python3 benchmarks/attention_loop_variants.py [--quick] [--json PATH]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/attention_loop_variants.py --check
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import tempfile

import torch
import unified_attention as bench  # benchmarks/unified_attention.py: batches, timing, FA3

from llm_inference.kernels import reference
from llm_inference.kernels import unified_attention as ua

ROWS = [(1, 8000, 0), (4, 2000, 0), (1, 4000, 8000), (16, 512, 0), (1, 512, 2000)]
TILES = [(256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3)]
CHECK_CASES = [(16, 16, 40, 8), (16, 32, 70, 23), (8, 32, 50, 0)]  # block size, BLOCK_N, T, c

LOOP = "    for n0 in range(start, end, BLOCK_N):\n        key = n0 + offs_n\n"
TABLE_LOAD = """        if MASKED:
            valid = key < end
            blk = tl.load(bt_row + key // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + key // BLOCK_SIZE).to(tl.int64)
        rows = blk * stride_n + (key % BLOCK_SIZE) * stride_t  # the same offsets in K and V
"""
MASK = """        if MASKED:
            valid = key < end
"""
PREFETCH_FIRST = """    nxt = start + offs_n
    blk = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < end, other=0)
"""
PREFETCH_NEXT = """        rows = blk.to(tl.int64) * stride_n + (key % BLOCK_SIZE) * stride_t
        nxt = key + BLOCK_N
        blk = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < end, other=0)
"""
PAGE_AXES = """    pages = tl.arange(0, BLOCK_N // BLOCK_SIZE)
    within = tl.arange(0, BLOCK_SIZE)
"""
PAGE_IDS = """        ids = tl.load(bt_row + n0 // BLOCK_SIZE + pages,
                      mask=n0 + pages * BLOCK_SIZE < end, other=0).to(tl.int64)
        rows = ids[:, None] * stride_n + within[None, :] * stride_t
        rows = tl.reshape(rows, [BLOCK_N])
"""
CONTIGUOUS = """        blk = (key // BLOCK_SIZE + tl.load(bt_row)).to(tl.int64)
        rows = blk * stride_n + (key % BLOCK_SIZE) * stride_t
"""
WS_LOOP = LOOP.replace(
    "range(start, end, BLOCK_N)", "tl.range(start, end, BLOCK_N, warp_specialize=True)"
)
STAGES_LOOP = LOOP.replace(
    "range(start, end, BLOCK_N)", "tl.range(start, end, BLOCK_N, num_stages=4)"
)
K_LOAD = "            k = tl.load(k_head + rows[:, None] + offs_d[None, :])\n"
K_TRANSPOSED = "            k = tl.trans(tl.load(k_head + rows[None, :] + offs_d[:, None]))\n"
EDITS = {
    "warp_specialize": [(LOOP, WS_LOOP)],
    "loop_stages_4": [(LOOP, STAGES_LOOP)],
    "k_transposed": [(K_LOAD, K_TRANSPOSED)],
    "contiguous_table": [(TABLE_LOAD, MASK + CONTIGUOUS)],
    "prefetch_table": [(LOOP, PREFETCH_FIRST + LOOP), (TABLE_LOAD, MASK + PREFETCH_NEXT)],
    "page_ids": [(LOOP, PAGE_AXES + LOOP), (TABLE_LOAD, MASK + PAGE_IDS)],
}


def variant_modules() -> dict:
    """{"shipped": the kernel module, name: the edited copy}; an edit that no longer applies to
    the shipped source raises (the kernel changed: update the edit)."""
    source = inspect.getsource(ua)
    mods, folder = {"shipped": ua}, tempfile.mkdtemp()
    for name, edits in EDITS.items():
        text = source
        for old, new in edits:
            if text.count(old) != 1:
                raise RuntimeError(f"{name}: the edit no longer applies to unified_attention.py")
            text = text.replace(old, new)
        path = os.path.join(folder, f"ua_{name}.py")
        with open(path, "w") as f:
            f.write(text)
        spec = importlib.util.spec_from_file_location(f"ua_{name}", path)
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    return mods


def check(mods) -> None:
    """Each variant against the reference on tiny shapes (block sizes 8 and 16, a context),
    printing `RESULT <variant>_<case> ok|FAIL` (tests/kernels/test_attention_benchmarks.py)."""
    gen = torch.Generator().manual_seed(0)
    for name, mod in mods.items():
        for block_size, block_n, tokens, context in CHECK_CASES:
            heads, kv_heads, dim = 4, 2, 16
            blocks = (tokens + context + block_size - 1) // block_size + 1
            q = torch.randn(tokens, heads, dim, generator=gen)
            k = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
            v = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
            table = torch.randperm(blocks, generator=gen).to(torch.int32)[None]
            if name == "contiguous_table":
                table = torch.arange(blocks, dtype=torch.int32)[None]
            cu = torch.tensor([0, tokens], dtype=torch.int32)
            lens = torch.tensor([tokens + context], dtype=torch.int32)
            out = mod.launch(q, k, v, table, cu, lens, 0.25, None, 16, block_n)
            err = (out - reference.unified_attention(q, k, v, table, cu, lens, 0.25)).abs().max()
            ok = "ok" if err < 1e-4 else "FAIL"
            print(f"RESULT {name}_bs{block_size}_bn{block_n}_c{context} {ok}", flush=True)


def contiguous(table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A table with each sequence's blocks in one run: [s * per, (s + 1) * per)."""
    per = (seq_len + bench.BLOCK_SIZE - 1) // bench.BLOCK_SIZE
    seqs = torch.arange(table.shape[0], device=table.device, dtype=table.dtype)[:, None]
    return per * seqs + torch.arange(per, device=table.device, dtype=table.dtype)[None, :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="tiny shapes against the reference")
    parser.add_argument("--quick", action="store_true", help="the first two prompt rows only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    mods = variant_modules()
    if args.check:
        return check(mods)
    shape = bench.SHAPES["Llama-3.1-8B"]
    scale = shape[2] ** -0.5
    gen = torch.Generator().manual_seed(0)
    report = []
    print("| prompts | variant | BLOCK_M, BLOCK_N, warps, stages | ms | TFLOP/s | / FA3 | err |")
    print("|---|---|---|---:|---:|---:|---:|")
    for num_seqs, length, context in ROWS[:2] if args.quick else ROWS:
        case = bench.make_batch([length] * num_seqs, [context] * num_seqs, shape, gen)
        flops = bench.causal_flops(length, context, shape) * num_seqs
        fa3 = bench.fa3_ms(case, length, context + length, scale)
        prompts = f"{num_seqs} x {length}" + (f" after {context}" if context else "")
        print(f"| {prompts} | FA3 | | {fa3:.3f} | {flops / fa3 / 1e9:.0f} | 1.00 | |", flush=True)
        for name, mod in mods.items():
            run = case
            if name == "contiguous_table":
                run = (*case[:3], contiguous(case[3], context + length), *case[4:])
            out = torch.empty_like(case[0])
            for tile in TILES:
                row = dict(prompts=prompts, variant=name, tile=tile, fa3_ms=fa3)
                try:
                    fn = lambda: mod.launch(*run, scale, out, *tile)  # noqa: B023
                    fn()
                    row.update(ms=bench.graph_ms(fn), err=bench.rel_error(out, run, scale))
                    print(f"| {prompts} | {name} | {tile} | {row['ms']:.3f} "
                          f"| {flops / row['ms'] / 1e9:.0f} | {row['ms'] / fa3:.2f} "
                          f"| {row['err']:.1e} |", flush=True)  # fmt: skip
                except Exception as e:  # a variant Triton refuses: say so and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[-200:]}"
                    print(f"| {prompts} | {name} | {tile} | error | | | |", flush=True)
                report.append(row)
        del case
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
