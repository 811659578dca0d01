"""Skinny GEMM for decode steps: out[M, N] = x[M, K] @ W[N, K]^T for 1 <= M <= 64, W in
nn.Linear's layout, float32 accumulation; and the gate_up projection fused with SiLU-and-mul:
out[M, I] = silu(x @ Wg^T) * (x @ Wu^T), where W = [Wg; Wu] is [2I, K]. W is in x's dtype, or
FP8 (float8_e4m3fn) with a float32 scale per row (layers/fp8.py's layout).

At decode the weights are nearly all the bytes a step reads, so the kernel's job is to stream
W once at the memory bandwidth:

- Blocking. A program owns BLOCK_N output columns (rows of W) for all M rows and walks K in
  BLOCK_K tiles: per step one [BLOCK_N, BLOCK_K] tile of W and one [BLOCK_K, BLOCK_M] tile of
  x^T (loaded once, used for all BLOCK_N rows), one `tl.dot` into a [BLOCK_N, BLOCK_M] float32
  accumulator. W is the left operand, so the long side (BLOCK_N >= 64) is the MMA's M and the
  batch, padded with rows of zeros to BLOCK_M (16, 32 or 64: `block_m`), its N; the padding
  costs tensor-core work, never bytes.
  The fused variant loads the gate tile (rows n) and the up tile (rows I + n) of the same
  columns, keeps two accumulators and applies the activation in registers: no [M, 2I]
  intermediate, one launch fewer.
- Split-K. Few column blocks cannot fill the SMs, so K is cut into `split_k` contiguous ranges,
  program (n, s) covering range s. Partial sums go to a float32 workspace [split_k, M, N] (gate
  and up side by side when fused) and a second small kernel adds them in split order, then
  casts (and applies SiLU-and-mul): not atomics, whose order, and so rounding, changes from run
  to run.
- FP8 weights. Each W tile is loaded as FP8 (half the bytes) and goes to the tensor cores as
  it is: the x tile is quantized to FP8 in registers, a float32 scale per row of x and BLOCK_K
  columns (its largest magnitude to e4m3's 448), and each tile's FP8 x FP8 dot is scaled
  into the accumulator (the `_x_operand` and `_dot` helpers). Finer than vLLM's one scale
  per token, and nothing to launch before the GEMM; converting the W tiles to x's dtype
  instead (W8A16, `fp8_dot` False, envs.LLM_INFERENCE_FP8_DOT=0) costs more instructions
  than the streaming leaves time for: 8B decode 4.19 against 3.24 ms per step
  (benchmarks/DECISIONS.md). The row scales of W are constant along K, so they multiply the
  float32 sums once, at the end: before split-K's partial sums are stored (a sum of scaled
  partials is the scaled sum), which leaves the reduce kernel as it is and gives the unsplit
  fused variant its scaled gate and up for the activation. A weight in x's dtype is the same
  kernel with `scale_ptr` None: its conversion and scaling compile to nothing (the same PTX
  as before FP8). Triton converts e4m3 from compute capability 8.9 (TritonOps decides).
  x may come in FP8 already, quantized per token by the norm before the layer (`x_scale`,
  layers/fp8.py): its tiles then go to the dot as loaded, accumulating across K as bf16's
  do, and its row scales multiply the sums at the end, beside W's.
- Configs come from a fixed rule (`default_config`), not `triton.autotune`, so that every rank
  and run rounds alike: BLOCK_N 64, BLOCK_K 128 (clamped to small shapes), and split-K doubled
  while the programs fill less than FILL of the SMs and each range keeps MIN_K_PER_SPLIT.
  FP8 weights take the same tiles (BLOCK_K at least 32, the FP8 dot's) with twice the fill
  target: their tiles hold half the bytes, and twice the programs keep as many in flight
  (benchmarks/skinny_gemm.py --fp8 --sweep: larger BLOCK_K or more warps did not help them).

M, the batch, is not specialized (`do_not_specialize`): one compiled kernel per config and BLOCK_M
serves every decode bucket of its rows (1..16, 17..32, 33..64). The engine takes the skinny GEMM up
to 32 rows (envs.LLM_INFERENCE_SKINNY_ROWS: 16 or 64, to measure them). Rows beyond M are masked,
W's rows beyond N are clamped (read in bounds, never stored), and K needs masks only when it is not
a multiple of BLOCK_K * split_k (EVEN_K). float32 inputs (the interpreter tests) use IEEE dot
products.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llm_inference import envs
from llm_inference.kernels.device import num_sms
from llm_inference.kernels.pdl import launch_kwargs, wait_then_release
from llm_inference.kernels.reference import FP8_MAX, MIN_AMAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # the per-tile FP8 activations, as fp8_quant.py scales them
_MIN_AMAX = tl.constexpr(MIN_AMAX)

MAX_ROWS = 64  # the most rows (decode batch) a launch takes
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn  # weights with a float32 scale per row (layers/fp8.py's layout)
FILL = 0.8  # split K while the programs fill less than this fraction of the SMs
MIN_K_PER_SPLIT = 512  # ... and each K range keeps at least this many columns
MAX_SPLIT = 16
REDUCE_BLOCK = 512


def block_m(m: int) -> int:
    """The dot's padded M for a launch of m rows: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


@dataclass(frozen=True)
class GemmConfig:
    """One launch's tiling. `split_k` is an upper bound: the launcher never makes empty
    K ranges."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    # Load the first weight tile before the input (always so with PDL: the weights stream
    # while the previous kernel finishes; kernels/pdl.py).
    prefetch: bool = False
    # FP8 weights only: x quantized to FP8 per tile for an FP8 x FP8 dot (BLOCK_K >= 32),
    # else the weight tiles converted to x's dtype (W8A16).
    fp8_dot: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"split_k must be in [1, 64], got {self.split_k}")


@functools.cache
def default_config(n: int, k: int, sms: int, fp8: bool = False, fp8_dot: bool = True) -> GemmConfig:
    """The rule: BLOCK_N 64 and BLOCK_K 128, clamped to small shapes; split-K doubled while
    the cdiv(n, BLOCK_N) column blocks times the split fill less than FILL of `sms` (twice
    that for `fp8` weights, whose tiles hold half the bytes) and each K range keeps
    MIN_K_PER_SPLIT columns. `n` is the output width (I when fused). Cached: launches without
    a config ask for it on every call (a decode step that is not a CUDA graph's replay)."""
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(128, max(32 if fp8 else 16, triton.next_power_of_2(k)))
    blocks, fill = triton.cdiv(n, block_n), FILL * sms * (2 if fp8 else 1)
    split = 1
    while split < MAX_SPLIT and blocks * split < fill and k // (2 * split) >= MIN_K_PER_SPLIT:
        split *= 2
    return GemmConfig(block_n, block_k, split, fp8_dot=fp8_dot)


def launch_config(n: int, k: int, device: torch.device, fp8: bool) -> GemmConfig:
    """The config of a launch given none: the rule's for the device, the FP8 dot as
    envs.LLM_INFERENCE_FP8_DOT says (read on FP8 weights only)."""
    return default_config(n, k, num_sms(device), fp8, fp8 and envs.LLM_INFERENCE_FP8_DOT)


@triton.jit
def _x_operand(xt, FP8_DOT: tl.constexpr, X_FP8: tl.constexpr):
    """The x^T tile [BLOCK_K, BLOCK_M] as the dot takes it, with a scale per row of x
    ([BLOCK_M]): FP8_DOT (and x not FP8 already, X_FP8), quantized to FP8 (each row's largest
    magnitude to 448); else x itself, scale 1."""
    if FP8_DOT and not X_FP8:
        x32 = xt.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x32), axis=0), _MIN_AMAX) / _FP8_MAX
        return (x32 / scale[None, :]).to(tl.float8e4nv), scale
    else:  # both returns under the constexpr branch: Triton compiles only the one taken
        return xt, tl.full((xt.shape[1],), 1.0, tl.float32)


@triton.jit
def _dot(w, xo, x_scale, acc, PRECISION: tl.constexpr, FP8_DOT: tl.constexpr, X_FP8: tl.constexpr):
    """acc + w @ x^T, w [BLOCK_N, BLOCK_K] in x's dtype or FP8, (xo, x_scale) _x_operand's:
    an FP8 x FP8 dot on a tile quantized here, whose sums take its scales, or a dot in x's
    dtype (`.to` is no instruction when w is in it already: FP8 x FP8 where x is FP8)."""
    if FP8_DOT and not X_FP8:
        acc += tl.dot(w, xo) * x_scale[None, :]
    else:
        acc = tl.dot(w.to(xo.dtype), xo, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    stride_os, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FUSED: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, FP8_DOT: tl.constexpr, X_FP8: tl.constexpr,
):  # fmt: skip
    """Program (n, s): columns [n * BLOCK_N, +BLOCK_N) over K range s. N is the output width
    (I when FUSED: up rows start N rows below gate rows). PARTIAL: store float32 sums to the
    workspace slice s (up sums at column N + n), else the result in out's dtype. PREFETCH:
    the first weight tile is loaded before the previous kernel is waited for (PDL) and before
    the input, the first K step peeled off the loop. `scale_ptr` None: W is in x's dtype (its
    `.to` is no instruction); else W is FP8, the dot FP8 x FP8 on x quantized per tile
    (FP8_DOT) or in x's dtype, and the sums are multiplied by their row's scale. X_FP8: x is
    FP8 already, quantized per token (`x_scale_ptr`, a float32 scale per row of x, multiplies
    the sums as W's row scales do), and the dot is FP8 x FP8 on the tiles as loaded."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N  # in bounds: rows past N compute garbage that is never stored
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    k0 = pid_s * k_per_split
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :]
    # x^T tile [BLOCK_K, BLOCK_M]: the right operand of the dot.
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]
    up_ptrs = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    start = 0
    if PREFETCH:  # weights are never written by a kernel: no need to wait for them
        k_mask = k0 + offs_k < K
        w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        w_up = w
        if FUSED:
            w_up = tl.load(up_ptrs, mask=k_mask[None, :], other=0.0)
        if PDL:
            wait_then_release()
        xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        xo, xs = _x_operand(xt, FP8_DOT, X_FP8)
        acc = _dot(w, xo, xs, acc, PRECISION, FP8_DOT, X_FP8)
        if FUSED:
            acc_up = _dot(w_up, xo, xs, acc_up, PRECISION, FP8_DOT, X_FP8)
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        start = BLOCK_K
    elif PDL:
        wait_then_release()
    for k in range(start, k_per_split, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            w = tl.load(w_ptrs)
            if FUSED:
                w_up = tl.load(up_ptrs)
        else:
            k_mask = k0 + k + offs_k < K
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
            if FUSED:
                w_up = tl.load(up_ptrs, mask=k_mask[None, :], other=0.0)
        xo, xs = _x_operand(xt, FP8_DOT, X_FP8)
        acc = _dot(w, xo, xs, acc, PRECISION, FP8_DOT, X_FP8)
        if FUSED:
            acc_up = _dot(w_up, xo, xs, acc_up, PRECISION, FP8_DOT, X_FP8)
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if scale_ptr is not None:  # per output column: on each K range's sum, as on their total
        acc *= tl.load(scale_ptr + rows)[:, None]
        if FUSED:
            acc_up *= tl.load(scale_ptr + rows + N)[:, None]
    if X_FP8:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
        acc *= x_scale
        if FUSED:
            acc_up *= x_scale
    out_ptrs = out_ptr + pid_s * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = (offs_n < N)[:, None] & m_mask[None, :]
    if PARTIAL:
        tl.store(out_ptrs, acc, mask=mask)
        if FUSED:
            tl.store(out_ptrs + N, acc_up, mask=mask)
    else:
        if FUSED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["split"])
def _reduce_kernel(
    ws_ptr, out_ptr, N, split, stride_ws, stride_wm, stride_om,
    FUSED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m, cols] = the sum over splits of ws[s, m, cols] (FUSED: silu(gate sum) * up sum,
    the up sums at column N + col), in split order."""
    if PDL:
        wait_then_release()
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    ptrs = ws_ptr + m * stride_wm + cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(split):
        acc += tl.load(ptrs + s * stride_ws, mask=mask, other=0.0)
        if FUSED:
            acc_up += tl.load(ptrs + s * stride_ws + N, mask=mask, other=0.0)
    if FUSED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, x_scale: torch.Tensor | None
) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    if x_scale is not None:
        if x.dtype != FP8 or weight.dtype != FP8 or scale is None:
            raise ValueError(f"x_scale takes x and weight in {FP8} (with weight_scale): {x.dtype}")
        _check_scale("x_scale", x_scale, x)
    elif x.dtype not in DTYPES or weight.dtype != (x.dtype if scale is None else FP8):
        raise ValueError(
            f"x must have a dtype of {DTYPES} and weight the same, or {FP8} with weight_scale: "
            f"{x.dtype}, {weight.dtype}"
        )
    if scale is not None:
        _check_scale("weight_scale", scale, weight)
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, weight on {weight.device}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last dim")
    return x.shape[0], x.shape[1], weight.shape[0]


def _check_scale(name: str, scale: torch.Tensor, of: torch.Tensor) -> None:
    """A float32 scale per row of `of`, contiguous on its device."""
    if (
        scale.shape != of.shape[:1] or scale.dtype != torch.float32 or scale.stride(0) != 1
        or scale.device != of.device
    ):  # fmt: skip
        raise ValueError(
            f"{name} must be float32 [{of.shape[0]}] contiguous on {of.device}, "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )


def _output(
    out: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor, dtype: torch.dtype | None
) -> torch.Tensor:
    """The result's tensor: `out`, checked, or a new one in `dtype` (None: x's)."""
    dtype = dtype or x.dtype
    if dtype not in DTYPES:
        raise ValueError(f"the result's dtype must be one of {DTYPES} (out_dtype, for x in FP8)")
    if out is None:
        return torch.empty(shape, dtype=dtype, device=x.device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != x.device:
        raise ValueError(f"out must be {shape} {dtype}, got {tuple(out.shape)} {out.dtype}")
    if out.stride(1) != 1:
        raise ValueError("out must be contiguous in its last dim")
    return out


def split_plan(k: int, config: GemmConfig) -> tuple[int, int]:
    """(K ranges, columns per range): at most config.split_k ranges of whole BLOCK_K tiles,
    none empty; the last may be short."""
    k_tiles = triton.cdiv(k, config.block_k)
    k_per_split = triton.cdiv(k_tiles, min(config.split_k, k_tiles)) * config.block_k
    return triton.cdiv(k, k_per_split), k_per_split


def _launch(
    x, x_scale, weight, scale, out, n: int, fused: bool, config: GemmConfig | None, pdl: bool
) -> torch.Tensor:
    m, k = x.shape
    cfg = config or launch_config(n, k, x.device, fp8=scale is not None)
    fp8_dot = scale is not None and cfg.fp8_dot
    if (fp8_dot or x_scale is not None) and cfg.block_k < 32:
        raise ValueError(f"the FP8 dot takes block_k >= 32, got {cfg.block_k}")
    split, k_per_split = split_plan(k, cfg)
    blocks = triton.cdiv(n, cfg.block_n)
    partial = split > 1
    width = 2 * n if fused else n
    dest = torch.empty((split, m, width), dtype=torch.float32, device=x.device) if partial else out
    stride_om, stride_os = (width, m * width) if partial else (out.stride(0), 0)
    _skinny_gemm_kernel[(blocks, split)](
        x, x_scale, weight, scale, dest, m, n, k, x.stride(0), weight.stride(0), stride_om,
        stride_os, k_per_split, BLOCK_M=block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        FUSED=fused, PARTIAL=partial, EVEN_K=split * k_per_split == k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl,
        PREFETCH=cfg.prefetch or pdl, FP8_DOT=fp8_dot, X_FP8=x_scale is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl),
    )  # fmt: skip
    if partial:
        _reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK))](
            dest, out, n, split, stride_os, width, out.stride(0),
            FUSED=fused, BLOCK=REDUCE_BLOCK, PDL=pdl, num_warps=4, **launch_kwargs(pdl),
        )  # fmt: skip
    return out


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype, 1 <= M <= MAX_ROWS, accumulated in
    float32. `weight_scale` [N] float32: weight is FP8 and stands for weight * weight_scale[:,
    None]. `x_scale` [M] float32: x is FP8 too, quantized per token, standing for x *
    x_scale[:, None], and the result is in `out_dtype`. `config` None: `default_config` for
    the shape and device. `pdl`: launch with programmatic dependent launch (kernels/pdl.py)."""
    m, _, n = _check(x, weight, weight_scale, x_scale)
    out = _output(out, (m, n), x, out_dtype)
    return _launch(x, x_scale, weight, weight_scale, out, n, False, config, pdl)


def skinny_gemm_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) -> [M, I], where weight = [gate; up] is [2I, K] (the
    gate_up projection's layout; reference.silu_and_mul of skinny_gemm, in one kernel);
    `weight_scale` [2I] as in skinny_gemm, each half scaled by its own rows' scales; `x_scale`
    and `out_dtype` as in skinny_gemm."""
    m, _, two_i = _check(x, weight, weight_scale, x_scale)
    if two_i % 2:
        raise ValueError(f"weight must be [2*I, K] (gate then up), got {tuple(weight.shape)}")
    inter = two_i // 2
    out = _output(out, (m, inter), x, out_dtype)
    return _launch(x, x_scale, weight, weight_scale, out, inter, True, config, pdl)
