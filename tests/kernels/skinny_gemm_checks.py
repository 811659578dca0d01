"""Checks of the skinny GEMM (kernels/skinny_gemm.py), shared by the CPU and GPU tests.

Each `check_*` draws fresh inputs, writes into a NaN-poisoned output that is a column slice of
a wider buffer (so a store past N, or a missed one, fails), and compares with float64 math.
The CPU tests run this file in a child process under TRITON_INTERPRET=1 (`python
skinny_gemm_checks.py [CHECK ...]`, one `RESULT <check> ok|FAIL` line each): the kernels at
small sizes that are not multiples of the blocks, split-K on and off.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}
INTERPRETER_CHECKS = ("gemm", "gemm_split", "silu", "silu_split")


def _inputs(device, dtype, m, n, k, seed):
    """x [m, k] (a view with a row stride > k) and W [n, k] scaled so outputs are ~N(0, 1)."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k + 3, generator=g, device=device).to(dtype)[:, :k]
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    return x, w


def _poisoned(m, n, device, dtype):
    """A NaN buffer [m, n + 5] and its first n columns, the output."""
    buf = torch.full((m, n + 5), float("nan"), device=device, dtype=dtype)
    return buf, buf[:, :n]


def _assert_close(got, want, buf, n, dtype, what):
    assert torch.isfinite(got).all(), f"{what}: unwritten (NaN) or non-finite outputs"
    assert buf[:, n:].isnan().all(), f"{what}: stores past column {n}"
    err = (got.double() - want).abs().max().item()
    tol = TOL[dtype] * max(1.0, want.abs().max().item())
    assert err <= tol, f"{what}: max abs error {err:.3e} > {tol:.3e}"


def check_gemm(device, dtype, m, n, k, config=None, seed=0, want_split=None):
    from llm_inference.kernels import skinny_gemm as sg

    x, w = _inputs(device, dtype, m, n, k, seed)
    buf, out = _poisoned(m, n, device, dtype)
    got = sg.skinny_gemm(x, w, out=out, config=config)
    assert got.data_ptr() == out.data_ptr()
    what = f"skinny_gemm {dtype} M={m} N={n} K={k} {config}"
    if want_split is not None:
        assert sg.split_plan(k, config or sg.default_config(n, k, sg.num_sms(x.device)))[0] == (
            want_split
        ), what
    _assert_close(got, x.double() @ w.double().T, buf, n, dtype, what)


def check_silu(device, dtype, m, inter, k, config=None, seed=0, want_split=None):
    from llm_inference.kernels import skinny_gemm as sg

    x, w = _inputs(device, dtype, m, 2 * inter, k, seed)
    buf, out = _poisoned(m, inter, device, dtype)
    got = sg.skinny_gemm_silu(x, w, out=out, config=config)
    y = x.double() @ w.double().T
    want = F.silu(y[:, :inter]) * y[:, inter:]
    what = f"skinny_gemm_silu {dtype} M={m} I={inter} K={k} {config}"
    if want_split is not None:
        cfg = config or sg.default_config(inter, k, sg.num_sms(x.device))
        assert sg.split_plan(k, cfg)[0] == want_split, what
    _assert_close(got, want, buf, inter, dtype, what)


# ---- the interpreter cases -----------------------------------------------------------------


def run_interpreter(check: str) -> None:
    from llm_inference.kernels.skinny_gemm import GemmConfig

    small = GemmConfig(block_n=32, block_k=32)
    for i, dtype in enumerate((torch.float32, torch.float16)):
        for m in (1, 3, 8, 16):
            seed = 10 * i + m
            if check == "gemm":  # one K range; masked K (300) and even K (256)
                check_gemm("cpu", dtype, m, 100, 300, small, seed, want_split=1)
                check_gemm("cpu", dtype, m, 64, 256, GemmConfig(16, 64), seed, want_split=1)
            elif check == "gemm_split":  # ragged last range; even ranges; the rule's choice
                check_gemm("cpu", dtype, m, 70, 200, GemmConfig(16, 32, 3), seed, want_split=3)
                check_gemm("cpu", dtype, m, 48, 256, GemmConfig(32, 32, 4), seed, want_split=4)
                check_gemm("cpu", dtype, m, 40, 1100, None, seed, want_split=2)
            elif check == "silu":
                check_silu("cpu", dtype, m, 50, 300, small, seed, want_split=1)
                check_silu("cpu", dtype, m, 32, 128, GemmConfig(16, 64), seed, want_split=1)
            elif check == "silu_split":
                check_silu("cpu", dtype, m, 50, 200, GemmConfig(16, 32, 3), seed, want_split=3)
                check_silu("cpu", dtype, m, 24, 1100, None, seed, want_split=2)
            else:
                raise ValueError(check)


def main(checks: list[str]) -> None:
    """Run each check; print one `RESULT <check> ok|FAIL` line each."""
    import traceback

    for check in checks:
        try:
            run_interpreter(check)
            print(f"RESULT {check} ok", flush=True)
        except Exception:
            traceback.print_exc()
            print(f"RESULT {check} FAIL", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(INTERPRETER_CHECKS))
