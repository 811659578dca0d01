"""Fused sampling in Triton: temperature, top-k, top-p, min-p and the seeded race over the rows of
logits [B, V] (float32, or bfloat16/float16 read as float32; last dim contiguous; already
penalized and min_tokens-masked) -> token ids [B] int64.

For row b, with l = logits[b] and x = l / temperature[b]:
  * greedy rows: argmax(l), first index on ties; one pass;
  * rows without top-k/top-p/min-p: argmax(x - log(-log u)) (Gumbel-max, i.e. the exponential
    race argmax(p / E), E = -log u ~ Exp(1), written in log space); one pass;
  * filtered rows: the race over the kept tokens {x >= thr and exp(x - m) >= min_p}, where
    thr keeps the top-k tokens, then of those the top-p nucleus: the kept tokens are all the
    x above some value. The race over all tokens runs first (as for unfiltered rows); its
    winner w is the filtered race's winner too when it is kept, which one more pass decides:
    fewer than k tokens have x > x_w, and their mass sum exp(x - m) is under top_p * the mass
    of the row (of the top-k set, with top-k; there the test takes the mass of the x >= x_w, a
    part of that set: sufficient, not necessary). That holds for a row with probability about
    1 - (the mass outside the kept set), >= top_p with top-p alone, so most rows cost two
    passes. A winner surely dropped drops every x <= x_w with it: the race runs again over
    the x > x_w, up to RETRIES times (with top-p alone, rarely more than once). Else the exact
    search:
    a stats pass (max m, smallest finite value), a threshold search for top-k (count of
    x >= t reaches k), then one for top-p over the top-k set (mass of x >= t reaches
    top_p * mass of the top-k set), then the filtered race. No sort: each search pass counts
    (or sums) the row above NP pivots spread between two element values lo <= answer <= up,
    then moves lo up to the smallest element above the highest pivot that still reaches the
    target, and up down to the largest element below the lowest one that does not. Pivot NP-1
    is `up` itself, so every pass settles or removes an element; in practice the value range
    shrinks NP-1 fold per pass. Ties at the threshold are all kept (top-k as the torch
    reference; top-p keeps the tied tokens the reference's sort order would split). The row
    maximum is always kept. The tests sum in a fixed order, so a row's path and token are
    a function of the row alone (they may round a mass exactly at the boundary differently).

Noise: u[b, v] is bit for bit `sample.sampler.uniform_noise(keys)[b, v]` (lowbias32 hash of the
token id plus the row's 32-bit key from (seed, step)); only the logs and the race arithmetic round
differently from the torch path. A row's token is a pure function of its own logits, parameters and
(seed, step): never of its batch companions or its row. Of the two logs in x - log(E), E = -log u,
the inner one stays accurate (libdevice's logf, and a series for u near 1, where log(u) is all
cancellation). On NVIDIA GPUs the outer one is the hardware's lg2.approx.f32 times ln 2 (FAST_LOG;
the race is bound by this arithmetic): E is a normal float in about (3e-8, 17.3), where
lg2.approx errs by about an ulp of log(E), the size of the rounding of x - log(E) itself, so a
token changes only where the row's two best race values are that close. Triton's interpreter
cannot run inline PTX: there (and off NVIDIA) both logs are accurate.

Grammar (structured outputs): `sample` may take a token bitmask [M, ceil(V / 32)] int32 (bit
v % 32 of word v // 32 allows token v: xgrammar's layout) and, per row, its bitmask row (-1: the
row is free). Every pass reads x through `_load_x`, which gives -inf to the tokens a row's mask
disallows, so every path above applies to the grammar's tokens only, as if their logits alone
were given. A launch without a bitmask compiles without that code (HAS_MASK); in one with, a
free row's mask loads are predicated off.

Status instead of a token: -1 when the row holds a NaN or +inf logit, -2 when every logit is -inf.
The caller (the Sampler) turns those into an error or a fallback.

Split rows: the race over all tokens is split (one program per long row is the whole sampling
time of a small batch): programs (row, s) scan BLOCK-aligned column ranges and write their best
value, its index and the range's max logit; `_merge_kernel` then takes, per row, the first range
holding the largest value, so the token (first index on ties), the noise and the statuses are
exactly the single program's. Splits are chosen to give about SPLIT_PROGRAMS programs in all; a
batch large enough to fill the GPU runs unsplit. When a row of the launch filters (a top-k, top-p
or min-p tensor is given), the merge hands its winners to `_sample_kernel`, one program per row.

Compiles: Triton compiles a kernel again for each new constexpr, each integer argument newly
equal to 1 or divisible by 16, and each tensor argument newly (or no longer) at an address that
is a multiple of 16 bytes. The batch size and the split count change from step to step, so
they are not specialized (`do_not_specialize`) and the merge's tile is sized from V: one
compiled kernel per variant serves every step. `warm_up` compiles the variants an engine meets
before its first request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # race and stats passes: elements per step
SPLIT_PROGRAMS = 512  # split race: about this many programs per launch (a few per SM)
SEARCH_BLOCK = 256  # search passes: a [SEARCH_BLOCK, NP] tile per step
NP = 16  # pivots per search pass
RETRIES = 4  # filtered rows: races above a dropped winner before the exact search
STATUS_BAD = -1  # a NaN or +inf logit in the row
STATUS_EMPTY = -2  # every logit of the row is -inf
_BAD = tl.constexpr(STATUS_BAD)  # kernels may read globals only as constexpr (Triton 3.6)
_EMPTY = tl.constexpr(STATUS_EMPTY)
_C1 = tl.constexpr(0x7FEB352D)  # lowbias32's multipliers
_C2 = tl.constexpr(0x846CA68B)
_LN2 = tl.constexpr(0.6931471805599453)
# The race's outer log: the hardware's lg2.approx (True) or libdevice's accurate logf (False;
# module doc, "Noise"). Read at each launch, so set it before `warm_up` (a change afterwards
# compiles the other variant at the next launch); benchmarks/sampler_race.py --accurate-log
# sets it False for an A/B. Applies only to compiled kernels on CUDA devices (`_fast_log`).
FAST_LOG = True


@triton.jit
def _load_x(row_ptr, cols, V, t, mask_ptr, masked, HAS_MASK: tl.constexpr):
    """x = logits / t at `cols` (-inf past V); with HAS_MASK, -inf too where the row's grammar
    bitmask (its words at `mask_ptr`, read where `masked`) disallows the token."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / t
    if HAS_MASK:
        word = tl.load(mask_ptr + cols // 32, mask=cols < tl.where(masked, V, 0), other=-1)
        x = tl.where(((word >> (cols % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def _stats(row_ptr, V, t, mask_ptr, masked, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """(max of x, +inf if a logit is NaN or +inf; smallest finite x, +inf if none)."""
    m = tl.full((), float("-inf"), tl.float32)
    fmin = tl.full((), float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _load_x(row_ptr, cols, V, t, mask_ptr, masked, HAS_MASK)
        m = tl.maximum(m, tl.max(tl.where(x != x, float("inf"), x)))
        fmin = tl.minimum(fmin, tl.min(tl.where(x > float("-inf"), x, float("inf"))))
    return m, fmin


@triton.jit
def _search(row_ptr, V, t, m, lo, up, target, mask_ptr, masked, HAS_MASK: tl.constexpr,
            MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):  # fmt: skip
    """The largest element value thr in [lo, up] with S(thr) >= W, where S(c) sums w over the
    elements x >= c, w = 1 (count; W = target) or exp(x - m) (MASS; W = target * S(lo)).
    lo and up must be element values and lo valid (else lo is returned)."""
    j = tl.arange(0, NP)
    frac = j.to(tl.float32) / (NP - 1)
    W = tl.full((), -1.0, tl.float32) if MASS else target.to(tl.float32)
    while lo < up:
        piv = lo * (1.0 - frac) + up * frac
        piv = tl.where(j == NP - 1, up, tl.where(j == 0, lo, piv))[None, :]
        # Per lane and pivot, reduced once after the loop (a reduction per tile costs more
        # than the tile's arithmetic)
        S = tl.zeros((BLOCK, NP), tl.float32)
        mn = tl.full((BLOCK, NP), float("inf"), tl.float32)
        mx = tl.full((BLOCK, NP), float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = _load_x(row_ptr, cols, V, t, mask_ptr, masked, HAS_MASK)
            ge = x[:, None] >= piv
            if MASS:
                S += tl.where(ge, tl.exp(x - m)[:, None], 0.0)
            else:
                S += ge.to(tl.float32)
            mn = tl.minimum(mn, tl.where(ge, x[:, None], float("inf")))
            mx = tl.maximum(mx, tl.where(ge, float("-inf"), x[:, None]))
        S = tl.sum(S, axis=0)
        W = tl.where(W < 0.0, target * tl.sum(tl.where(j == 0, S, 0.0)), W)
        valid = S >= W
        lo = tl.maximum(lo, tl.max(tl.where(valid, tl.min(mn, axis=0), float("-inf"))))
        up = tl.minimum(up, tl.min(tl.where(valid, float("inf"), tl.max(mx, axis=0))))
    return lo


@triton.jit
def _race(row_ptr, V, t, key, thr, min_p, m, mask_ptr, masked, HAS_MASK: tl.constexpr,
          NOISE: tl.constexpr, FILTER: tl.constexpr, FAST_LOG: tl.constexpr,
          BLOCK: tl.constexpr, lo, id_offset):  # fmt: skip
    """(argmax over the kept tokens in columns [lo, V) of x - log(-log u), or of x without
    NOISE; the best value; the max of x, +inf if a logit is NaN or +inf). u is uniform_noise's:
    (mix(mix(v) + key) >> 8 + 0.5) / 2**24 with mix = lowbias32, v = id_offset + column (a
    vocabulary shard's first token id; the returned index is the column). The lanes are
    reduced once, after the loop, not per block (benchmarks/DECISIONS.md). FAST_LOG: the outer
    log by lg2.approx (PTX inline asm: CUDA only, not the interpreter; module doc)."""
    # Per lane: the best value so far, its column (the first on ties: a later column must be
    # strictly better) and the max of x; reduced across lanes once, after the loop.
    best_l = tl.full((BLOCK,), float("-inf"), tl.float32)
    idx_l = tl.full((BLOCK,), 0, tl.int32)
    top_l = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(lo, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _load_x(row_ptr, cols, V, t, mask_ptr, masked, HAS_MASK)
        top_l = tl.maximum(top_l, tl.where(x != x, float("inf"), x))
        s = x
        if NOISE:
            h = (cols + id_offset).to(tl.uint32)
            for _ in tl.static_range(2):  # mix(mix(v) + key)
                h = h ^ (h >> 16)
                h = h * _C1
                h = h ^ (h >> 15)
                h = h * _C2
                h = h ^ (h >> 16)
                if _ == 0:
                    h = h + key
            # E = -log(u), exact enough where it decides the race: u near 1, where the
            # GPU's fast log loses every digit of log(u), takes -log(1 - w) = w + w^2/2 + ..
            # with w = 1 - u computed exactly from the bits.
            u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08
            w = ((16777215 - (h >> 8)).to(tl.float32) + 0.5) * 5.9604644775390625e-08
            e = tl.where(w < 1e-3, w + w * w * (0.5 + w * 0.3333333333), -tl.log(u))
            if FAST_LOG:  # one MUFU instruction instead of libdevice's logf (module doc)
                lg2 = tl.inline_asm_elementwise(
                    "lg2.approx.f32 $0, $1;", "=r,r", [e], dtype=tl.float32, is_pure=True,
                    pack=1,
                )  # fmt: skip
                s = x - lg2 * _LN2
            else:
                s = x - tl.log(e)
        if FILTER:
            s = tl.where((x >= thr) & (tl.exp(x - m) >= min_p), s, float("-inf"))
        take = (s > best_l) & (cols < V)
        idx_l = tl.where(take, cols, idx_l)
        best_l = tl.where(take, s, best_l)
    best = tl.max(best_l)
    # the smallest column holding the best value; every lane -inf: column 0
    idx = tl.min(tl.where(best_l == best, idx_l, 2147483647))
    idx = tl.where(best == float("-inf"), 0, idx)
    return idx, best, tl.max(top_l)


@triton.jit
def _above(row_ptr, V, t, m, xw, mask_ptr, masked, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Over x = logits / t, one pass: (mass exp(x - m) of the x > xw, their count, the mass of
    the x >= xw, the mass of every x). Per-lane sums reduced once, in a fixed order."""
    above = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.float32)
    at = tl.zeros((BLOCK,), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _load_x(row_ptr, cols, V, t, mask_ptr, masked, HAS_MASK)
        w = tl.exp(x - m)
        above += tl.where(x > xw, w, 0.0)
        count += (x > xw).to(tl.float32)
        at += tl.where(x >= xw, w, 0.0)
        total += w
    return tl.sum(above), tl.sum(count), tl.sum(at), tl.sum(total)


@triton.jit
def _verdict(row_ptr, V, t, m, xw, k, p, min_p, mask_ptr, masked, HAS_MASK: tl.constexpr,
             BLOCK: tl.constexpr):  # fmt: skip
    """(unsure, out) for a token of value xw: the filters may drop it (the test that keeps it
    fails), and they surely drop it. Kept: fewer than k tokens above, less than top_p of the
    mass above (of the top-k set's mass; with top-k, the mass of the x >= xw stands in for
    it: a sufficient test, and the whole mass for a sure one), exp(xw - m) >= min_p."""
    unsure = tl.exp(xw - m) < min_p
    out = unsure
    if (k < V) | (p < 1.0):
        above, count, at, total = _above(row_ptr, V, t, m, xw, mask_ptr, masked, HAS_MASK, BLOCK)
        unsure = unsure | (count >= k) | ((p < 1.0) & (above >= p * tl.where(k < V, at, total)))
        out = out | (count >= k) | ((p < 1.0) & (above >= p * total))
    return unsure, out


@triton.jit
def _next_up(x):
    """The smallest float32 above a finite x."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(x >= 0.0, b + 1, b - 1)
    return tl.where(x == 0.0, 1, b).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["B"])
def _sample_kernel(logits_ptr, stride, keys_ptr, temp_ptr, greedy_ptr, top_k_ptr, top_p_ptr,
                   min_p_ptr, bitmask_ptr, mask_rows_ptr, mask_stride, win_ptr, out_ptr, V, B,
                   HAS_GREEDY: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                   HAS_MIN_P: tl.constexpr, HAS_MASK: tl.constexpr, FAST_LOG: tl.constexpr,
                   BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NP: tl.constexpr,
                   RETRIES: tl.constexpr):  # fmt: skip
    """Row b's token from its unfiltered race winner (win [3, B], `_split_race`'s raw output):
    the winner itself on greedy and unfiltered rows and where the filters keep it; else the
    race again above a dropped winner, at most RETRIES times; else the exact search (module
    doc, "Filtered rows")."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    mask_ptr, masked = _mask_row(bitmask_ptr, mask_rows_ptr, mask_stride, row, HAS_MASK)
    t = tl.load(temp_ptr + row)
    idx = tl.load(win_ptr + B + row).to(tl.int32)
    top = tl.load(win_ptr + 2 * B + row).to(tl.float32)  # max of x; +-inf: a status
    greedy = tl.full((), 0, tl.int32)
    k = tl.full((), V, tl.float32)
    p = tl.full((), 1.0, tl.float32)
    min_p = tl.full((), 0.0, tl.float32)
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + row).to(tl.int32)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.float32)
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)
    filtered = (k < V) | (p < 1.0) | (min_p > 0.0)
    if (greedy == 0) & filtered & (top > float("-inf")) & (top < float("inf")):
        m = top
        key = tl.load(keys_ptr + row).to(tl.uint32)
        xw = tl.load(row_ptr + idx).to(tl.float32) / t
        unsure, out = _verdict(row_ptr, V, t, m, xw, k, p, min_p, mask_ptr, masked, HAS_MASK,
                               BLOCK)  # fmt: skip
        tries = 0
        if RETRIES > 0:  # no loop at all without (Triton 3.6 fails on a never-taken one)
            while unsure & out & (tries < RETRIES):  # the kept tokens are all above xw
                idx, _, top = _race(row_ptr, V, t, key, _next_up(xw), min_p, m, mask_ptr, masked,
                                    HAS_MASK, True, True, FAST_LOG, BLOCK, 0, 0)  # fmt: skip
                xw = tl.load(row_ptr + idx).to(tl.float32) / t
                unsure, out = _verdict(row_ptr, V, t, m, xw, k, p, min_p, mask_ptr, masked,
                                       HAS_MASK, BLOCK)  # fmt: skip
                tries += 1
        if unsure:
            thr = tl.full((), float("-inf"), tl.float32)
            if (k < V) | (p < 1.0):
                _, thr = _stats(row_ptr, V, t, mask_ptr, masked, HAS_MASK, BLOCK)  # smallest x
                if HAS_TOP_K:
                    if k < V:
                        thr = _search(row_ptr, V, t, m, thr, m, k, mask_ptr, masked, HAS_MASK,
                                      False, SEARCH_BLOCK, NP)  # fmt: skip
                if HAS_TOP_P:
                    if p < 1.0:
                        thr = _search(row_ptr, V, t, m, thr, m, p, mask_ptr, masked, HAS_MASK,
                                      True, SEARCH_BLOCK, NP)  # fmt: skip
            idx, _, top = _race(row_ptr, V, t, key, thr, min_p, m, mask_ptr, masked, HAS_MASK,
                                True, True, FAST_LOG, BLOCK, 0, 0)  # fmt: skip
    _store_token(out_ptr + row, idx, top)


@triton.jit
def _store_token(out_ptr, idx, top):
    token = tl.where(top == float("-inf"), _EMPTY, idx.to(tl.int64))
    token = tl.where(top == float("inf"), _BAD, token)
    tl.store(out_ptr, token)


@triton.jit
def _mask_row(bitmask_ptr, mask_rows_ptr, mask_stride, row, HAS_MASK: tl.constexpr):
    """(pointer to row `row`'s bitmask words, whether it has a bitmask row): `_load_x`'s."""
    mrow = tl.full((), -1, tl.int32)
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    return bitmask_ptr + tl.maximum(mrow, 0).to(tl.int64) * mask_stride, mrow >= 0


@triton.jit(do_not_specialize=["id_offset"])
def _split_race_kernel(logits_ptr, stride, keys_ptr, temp_ptr, greedy_ptr, bitmask_ptr,
                       mask_rows_ptr, mask_stride, part_ptr, idx_ptr, V, chunk, id_offset,
                       HAS_GREEDY: tl.constexpr, HAS_MASK: tl.constexpr,
                       FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Program (row, s): the race over columns [s * chunk, (s + 1) * chunk) of the row (greedy
    rows: the plain argmax); column c is token id_offset + c. part [2, B, S] float32: best
    value, max logit; idx [B, S]."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    mask_ptr, masked = _mask_row(bitmask_ptr, mask_rows_ptr, mask_stride, row, HAS_MASK)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    greedy = tl.full((), 0, tl.int32)
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + row).to(tl.int32)
    if greedy != 0:
        idx, best, top = _race(row_ptr, hi, 1.0, 0, 0.0, 0.0, 0.0, mask_ptr, masked, HAS_MASK,
                               False, False, False, BLOCK, lo, 0)  # fmt: skip
    else:
        t = tl.load(temp_ptr + row)
        key = tl.load(keys_ptr + row).to(tl.uint32)
        idx, best, top = _race(row_ptr, hi, t, key, 0.0, 0.0, 0.0, mask_ptr, masked, HAS_MASK,
                               True, False, FAST_LOG, BLOCK, lo, id_offset)  # fmt: skip
    slot = row * num_splits + s
    tl.store(part_ptr + slot, best)
    tl.store(part_ptr + tl.num_programs(0) * num_splits + slot, top)
    tl.store(idx_ptr + slot, idx)


@triton.jit(do_not_specialize=["B", "num_splits", "id_offset"])
def _merge_kernel(part_ptr, idx_ptr, out_ptr, B, num_splits, id_offset, BLOCK_S: tl.constexpr,
                  RAW: tl.constexpr):  # fmt: skip
    """Per row: the first split holding the largest best value (so the first index on ties),
    and the largest max logit for the status. RAW (a vocabulary shard, race_shard): out is
    float64 [3, B], the best value, its token id (id_offset + index) and the max logit."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_splits
    base = row * num_splits
    best = tl.load(part_ptr + base + offs, mask=mask, other=float("-inf"))
    top = tl.max(tl.load(part_ptr + B * num_splits + base + offs, mask=mask, other=float("-inf")))
    value = tl.max(best)
    first = tl.min(tl.where(mask & (best == value), offs, BLOCK_S))
    first = tl.where(first == BLOCK_S, 0, first)  # every best -inf: split 0 (index 0 then)
    idx = tl.load(idx_ptr + base + first)
    if RAW:
        tl.store(out_ptr + row, value.to(tl.float64))
        tl.store(out_ptr + B + row, (idx + id_offset).to(tl.float64))
        tl.store(out_ptr + 2 * B + row, top.to(tl.float64))
    else:
        _store_token(out_ptr + row, idx, top)


# Whether the kernels above are compiled (triton.jit returns an InterpretedFunction instead when
# TRITON_INTERPRET=1 is set before triton is imported, as the CPU tests do).
_COMPILED = isinstance(_split_race_kernel, triton.runtime.JITFunction)


def _check_row_param(name: str, x: torch.Tensor | None, B: int, dtypes, device) -> None:
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if x is not None and (x.shape != (B,) or x.dtype not in dtypes or x.device != device):
        raise ValueError(f"{name} must be [{B}] {dtypes} on {device}, got {x.shape} {x.dtype}")


def _check_race_args(logits, keys, temperature, greedy) -> tuple[int, int]:
    """The checks `sample` and `race_shard` share; returns (B, V)."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if logits.dim() != 2 or logits.dtype not in floats or logits.stride(1) != 1:
        what = f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        raise ValueError(f"logits must be float [B, V], last dim contiguous, got {what}")
    B, V = logits.shape
    dev = logits.device
    _check_row_param("keys", keys, B, (torch.int64, torch.int32), dev)
    _check_row_param("temperature", temperature, B, torch.float32, dev)
    _check_row_param("greedy", greedy, B, (torch.bool, torch.int32), dev)
    return B, V


def _fast_log(logits: torch.Tensor) -> bool:
    """The race's FAST_LOG for a launch on `logits`: the module switch, where the kernels are
    compiled (not Triton's interpreter, which cannot run inline asm and, with TRITON_INTERPRET=1
    set at import, also takes CUDA tensors) for an NVIDIA GPU (lg2.approx is PTX; ROCm's torch
    also calls its devices cuda)."""
    return FAST_LOG and _COMPILED and logits.is_cuda and torch.version.hip is None


def _greedy_arg(greedy: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    if greedy is None:
        return dummy
    return greedy.view(torch.uint8) if greedy.dtype == torch.bool else greedy


def sample(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    bitmask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of logits [B, V] -> [B] int64, or a status (module doc).

    logits float32, or bfloat16 / float16 (read as float32: the same values); keys [B] int64 in
    [0, 2**32), or int32 holding the key's 32 bits (noise_keys of (seed, step)); temperature [B]
    float32 (> 0; ignored on greedy rows); greedy [B] bool or int32 (nonzero: greedy); top_k [B]
    int64 or int32 (>= V: off); top_p [B] float32 in (0, 1] (1: off); min_p [B] float32 in
    [0, 1] (0: off). None means off for every row. Grammar (module doc): bitmask [M, >= V / 32]
    int32, last dim contiguous, and bitmask_rows [B] int32 (row b's bitmask row, -1: none).
    """
    B, V = _check_race_args(logits, keys, temperature, greedy)
    dev = logits.device
    _check_row_param("top_k", top_k, B, (torch.int64, torch.int32), dev)
    _check_row_param("top_p", top_p, B, torch.float32, dev)
    _check_row_param("min_p", min_p, B, torch.float32, dev)
    _check_bitmask(bitmask, bitmask_rows, B, V, dev)
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out
    dummy = temperature  # never read where the matching HAS_* flag is off
    mask = (bitmask, bitmask_rows)
    block = min(BLOCK, triton.next_power_of_2(V))
    splits = race_splits(B, V, block)
    if top_k is None and top_p is None and min_p is None:
        return _split_race(logits, keys, temperature, greedy, dummy, out, splits, block, mask)
    win = torch.empty(3 * B, dtype=torch.float64, device=dev)
    _split_race(logits, keys, temperature, greedy, dummy, win, splits, block, mask, raw=True)
    # On the GPU tiles fit the registers; on CPU (the interpreter) fewer, larger steps are faster.
    search_block = SEARCH_BLOCK if logits.is_cuda else min(4096, triton.next_power_of_2(V))
    _sample_kernel[(B,)](
        logits, logits.stride(0), keys, temperature,
        _greedy_arg(greedy, dummy),
        dummy if top_k is None else top_k, dummy if top_p is None else top_p,
        dummy if min_p is None else min_p, *_mask_args(mask, dummy), win, out, V, B,
        HAS_GREEDY=greedy is not None, HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        HAS_MASK=bitmask is not None, FAST_LOG=_fast_log(logits), BLOCK=block,
        SEARCH_BLOCK=search_block, NP=NP, RETRIES=RETRIES, num_warps=8,
    )  # fmt: skip
    return out


def _check_bitmask(bitmask, rows, B: int, V: int, device) -> None:
    if (bitmask is None) != (rows is None):
        raise ValueError("bitmask and bitmask_rows must be given together")
    if bitmask is None:
        return
    if (
        bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.device != device
        or bitmask.shape[1] * 32 < V or bitmask.stride(1) != 1
    ):  # fmt: skip
        raise ValueError(
            f"bitmask must be int32 [M, >= {-(-V // 32)}] on {device}, last dim contiguous, "
            f"got {tuple(bitmask.shape)} {bitmask.dtype} strides {bitmask.stride()}"
        )
    _check_row_param("bitmask_rows", rows, B, torch.int32, device)


def _mask_args(mask, dummy) -> tuple:
    """The kernels' (bitmask_ptr, mask_rows_ptr, mask_stride) for `mask` (bitmask, rows) or
    (None, None)."""
    bitmask, rows = mask
    if bitmask is None:
        return dummy, dummy, 0
    return bitmask, rows, bitmask.stride(0)


def race_splits(B: int, V: int, block: int) -> int:
    """Column ranges per row for the split race: about SPLIT_PROGRAMS programs in all, each
    range a whole number of `block`s (1: unsplit)."""
    blocks = -(-V // block)
    return max(1, min(blocks, SPLIT_PROGRAMS // max(B, 1)))


def _split_race(
    logits, keys, temperature, greedy, dummy, out, splits: int, block: int,
    mask=(None, None), id_offset: int = 0, raw: bool = False,
):  # fmt: skip
    """The race over `splits` column ranges per row, merged into `out` (module doc, "Split
    rows"); `mask`: the grammar's (bitmask, bitmask rows) or (None, None); a shard (id_offset
    > 0) has none."""
    B, V = logits.shape
    blocks = -(-V // block)
    chunk = -(-blocks // splits) * block
    splits = -(-V // chunk)  # no empty range
    part = torch.empty(2 * B * splits, dtype=torch.float32, device=logits.device)
    idx = torch.empty(B * splits, dtype=torch.int32, device=logits.device)
    _split_race_kernel[(B, splits)](
        logits, logits.stride(0), keys, temperature, _greedy_arg(greedy, dummy),
        *_mask_args(mask, dummy), part, idx, V, chunk, id_offset,
        HAS_GREEDY=greedy is not None, HAS_MASK=mask[0] is not None,
        FAST_LOG=_fast_log(logits), BLOCK=block, num_warps=8,
    )  # fmt: skip
    # BLOCK_S from the most splits V allows, not this launch's: one compiled merge serves
    # every batch (per-step sizes are not specialized either: module doc, "Compiles")
    _merge_kernel[(B,)](
        part, idx, out, B, splits, id_offset, BLOCK_S=triton.next_power_of_2(blocks), RAW=raw
    )
    return out


def race_shard(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor | None,
    vocab_start: int,
) -> torch.Tensor:
    """The race of `sample` (rows without top-k, top-p or min-p) over one vocabulary shard:
    logits [B, Vs] whose column c is token vocab_start + c (drawing that token's noise) ->
    float64 [3, B]: each row's best race value (the raw logit on greedy rows), its token id
    and the shard's max logit (+inf if a logit is NaN or +inf). Over the shards of a row, the
    first one holding the largest best value has `sample`'s token of the whole row
    (sample/tensor_parallel.py distributed_race)."""
    B, V = _check_race_args(logits, keys, temperature, greedy)
    out = torch.empty(3 * B, dtype=torch.float64, device=logits.device)
    if B and V:
        block = min(BLOCK, triton.next_power_of_2(V))
        splits = race_splits(B, V, block)
        _split_race(logits, keys, temperature, greedy, temperature, out, splits, block,
                    id_offset=vocab_start, raw=True)  # fmt: skip
    elif B:  # an empty shard: nothing to win
        out.fill_(float("-inf"))
        out[B : 2 * B] = vocab_start
    return out.view(3, B)


def warm_up(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    vocab_start: int | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> None:
    """Compile what `sample` (given `vocab_start`: `race_shard`) runs on inputs of these dtypes
    and strides, with and without greedy rows, at one row and at all of `logits`' rows (where
    that many fill the GPU, the unsplit kernel), `sample` with and without a grammar bitmask,
    and given `top_k` and `top_p` (the rows' own arrays: their values are not read) the
    filtered search with top-p and with top-k and top-p, the filters clients set most (other
    combinations compile at their first step): an engine calls it at start, so that its first
    requests do not wait for compiles (module doc, "Compiles"). The results are not used."""
    B, V = logits.shape
    bitmask = torch.full((1, -(-V // 32)), -1, dtype=torch.int32, device=logits.device)
    for rows in sorted({1, B}):
        args = (logits[:rows], keys[:rows], temperature[:rows])
        for g in (None, greedy[:rows]):
            if vocab_start is not None:
                race_shard(*args, g, vocab_start)
                continue
            sample(*args, greedy=g)
            mask_rows = torch.zeros(rows, dtype=torch.int32, device=logits.device)
            sample(*args, greedy=g, bitmask=bitmask, bitmask_rows=mask_rows)
            if top_p is not None:
                sample(*args, greedy=g, top_p=top_p[:rows])
                sample(*args, greedy=g, top_k=top_k[:rows], top_p=top_p[:rows])
