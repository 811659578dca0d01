"""The FP8 linear method: quantization round trips within e4m3's rounding, each layer's output
within the error bound that rounding implies, checkpoint scales (per tensor, per block) turned
into per-row scales, and (CUDA, compute capability 8.9+) torch._scaled_mm against the
reference at 8B-like sizes.

e4m3 keeps 3 mantissa bits: a value in the normal range is rounded to within half a step,
EPS = 2^-4 of itself; below 2^-6 (subnormals) steps are 2^-9, so within 2^-10 absolute (in
units of the scale). For y = x . w with x' = x + dx and w' = w + dw, |y' - y| <=
|dx| . |w| + |x| . |dw| + |dx| . |dw|: that is the bound the tests check, element by element."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import needs_fp8

from llm_inference.config import Fp8Format
from llm_inference.kernels.reference import FP8, FP8_MAX, ReferenceOps, quantize_rows
from llm_inference.layers.fp8 import Fp8Activation, Fp8Config, fp8_linear, scaled_mm_supported
from llm_inference.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from llm_inference.layers.norm import RMSNorm

EPS, SUBNORMAL = 2.0**-4, 2.0**-10


def rounding_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest |dequantize(quantize(x)) - x| e4m3 allows, element by element."""
    return EPS * x.abs() + SUBNORMAL * scale


def wide_range(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values over six decades, signs mixed, so that subnormals and the top of the range occur."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 10 ** (6 * torch.rand(*shape, generator=g) - 3)


def test_quantize_rows_round_trip():
    x = wide_range(64, 300)
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (64, 1) and scale.dtype == torch.float32
    assert (q.float().abs().amax(dim=1) == FP8_MAX).all()  # each row's maximum maps to 448
    dq = q.float() * scale
    assert ((dq - x).abs() <= rounding_bound(x, scale)).all()
    q2, scale2 = quantize_rows(dq)  # dequantized values are on the grid: a fixed point
    torch.testing.assert_close(scale2, scale, rtol=1e-6, atol=0)
    assert torch.equal(q2.float(), q.float())


def test_static_scale_saturates_and_zero_rows_stay_finite():
    x = torch.tensor([[1.0, -2.0, 1000.0, -1000.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_rows(x, torch.tensor(0.5))
    assert q.float().tolist()[0] == [2.0, -4.0, FP8_MAX, -FP8_MAX] and scale.shape == (2, 1)
    q, scale = quantize_rows(x[1:])
    assert torch.isfinite(scale).all() and (q.float() == 0).all()


ONLINE = Fp8Format("online")


def fp8_layer(cls, *args, fmt=ONLINE, **kw):
    return cls(*args, ReferenceOps(), Fp8Config(fmt), **kw)


def test_online_linear_within_the_rounding_bound():
    torch.manual_seed(0)
    w, x = torch.randn(48, 64) * 0.05, wide_range(7, 64, seed=1)
    layer = fp8_layer(ColumnParallelLinear, 64, 48)
    assert layer.weight.dtype == torch.float32  # the model dtype until loaded
    layer.weight_loader(layer.weight, w)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (48,)
    y = layer(x)
    x_err = rounding_bound(x, x.abs().amax(1, keepdim=True) / FP8_MAX)
    w_err = rounding_bound(w, w.abs().amax(1, keepdim=True) / FP8_MAX)
    bound = x_err @ w.abs().T + x.abs() @ w_err.T + x_err @ w_err.T
    assert ((y - x @ w.T).abs() <= bound * (1 + 1e-5) + 1e-7).all()
    assert (y - x @ w.T).abs().max() > 0  # it did quantize


def test_prompt_steps_quantize_activations_with_the_ops():
    """Steps past the skinny GEMM quantize x through the ops object (one Triton kernel on the
    Triton ops), with the static input scale where the checkpoint has one."""
    calls = []

    class Spy(ReferenceOps):
        def quantize_rows(self, x, scale=None):
            calls.append((tuple(x.shape), scale))
            return quantize_rows(x, scale)

    fmt = Fp8Format("tensor", static_input_scale=True)
    layer = ColumnParallelLinear(64, 48, Spy(), Fp8Config(fmt))
    layer.weight_loader(layer.weight, (torch.randn(48, 64) * 8).to(FP8))
    layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(0.01))
    layer.input_scale.weight_loader(layer.input_scale, torch.tensor(0.05))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(20, 64)
    torch.testing.assert_close(
        layer(x),
        fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, scaled_mm=False),
    )
    assert calls == [((20, 64), layer.input_scale)]


def test_gate_up_silu_and_row_parallel():
    torch.manual_seed(0)
    gate, up, down = torch.randn(32, 16), torch.randn(32, 16), torch.randn(16, 32)
    x = torch.randn(5, 16)
    gate_up = fp8_layer(MergedColumnParallelLinear, 16, [32, 32])
    gate_up.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight_loader(gate_up.weight, up, 1)
    row = fp8_layer(RowParallelLinear, 32, 16)
    row.weight_loader(row.weight, down)
    for layer in (gate_up, row):
        layer.quant_method.process_weights_after_loading(layer)
    # off the skinny GEMM, gate_up hands down_proj its activation quantized per token
    h = gate_up.forward_silu_and_mul(x)
    assert isinstance(h, Fp8Activation) and h.dtype == x.dtype
    q, scale = ReferenceOps().silu_and_mul_quant(gate_up(x))
    assert torch.equal(h.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(h.scale, scale)
    dense = h.q.float() * h.scale
    ref = F.silu(x @ gate.T) * (x @ up.T)
    assert (dense - ref).norm() / ref.norm() < 6 * EPS  # the weights' rounding and x's
    assert (row(h) - dense @ down.T).norm() / (dense @ down.T).norm() < 4 * EPS
    # a static input scale (the checkpoint's) is down_proj's to apply: gate_up hands on x
    static = fp8_layer(
        MergedColumnParallelLinear, 16, [32, 32], fmt=Fp8Format("tensor", static_input_scale=True)
    )
    for part, w in enumerate((gate, up)):
        static.weight_loader(static.weight, (w * 100).clamp(-448, 448).to(FP8), part)
        static.weight_scale.weight_loader(static.weight_scale, torch.tensor(0.01), part)
        static.input_scale.weight_loader(static.input_scale, torch.tensor([0.02]), part)
    static.quant_method.process_weights_after_loading(static)
    h = static.forward_silu_and_mul(x)
    assert isinstance(h, torch.Tensor)
    torch.testing.assert_close(h, ReferenceOps().silu_and_mul(static(x)), rtol=0, atol=0)


def test_silu_and_mul_quant_is_silu_and_mul_then_quantize_rows_in_float32():
    x = torch.randn(6, 40, dtype=torch.bfloat16) * 3
    x[2] = 0  # an all-zero row: the smallest scale, zeros
    q, scale = ReferenceOps().silu_and_mul_quant(x)
    gate, up = x.float().chunk(2, dim=-1)
    want_q, want = quantize_rows(F.silu(gate) * up)
    assert q.shape == (6, 20) and q.dtype == FP8 and scale.shape == (6, 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want) and not q[2].float().any()


def test_per_tensor_scales_of_fused_parts_and_static_input_scale():
    """q, k and v each come with their own scale: their rows keep it; the static input scale
    of the fused layer is the largest of theirs."""
    fmt = Fp8Format("tensor", static_input_scale=True)
    qkv = fp8_layer(QKVParallelLinear, 16, 4, 4, 2, fmt=fmt, bias=True)
    torch.manual_seed(0)
    parts = {
        s: (torch.randn(n, 16) * 100).clamp(-448, 448).to(FP8) for s, n in zip("qkv", (16, 8, 8))
    }
    for (sid, w), scale, x_scale in zip(parts.items(), (0.1, 0.2, 0.3), (0.05, 0.07, 0.06)):
        qkv.weight_loader(qkv.weight, w, sid)
        qkv.weight_scale.weight_loader(qkv.weight_scale, torch.tensor(scale), sid)
        qkv.input_scale.weight_loader(qkv.input_scale, torch.tensor([x_scale]), sid)
        qkv.weight_loader(qkv.bias, torch.full((w.shape[0],), scale), sid)
    qkv.quant_method.process_weights_after_loading(qkv)
    want = torch.tensor([0.1] * 16 + [0.2] * 8 + [0.3] * 8)
    torch.testing.assert_close(qkv.weight_scale.data, want)
    assert qkv.input_scale.item() == pytest.approx(0.07)
    x = torch.randn(3, 16)
    xq = (x / 0.07).clamp(-448, 448).to(FP8).float() * 0.07
    w = torch.cat([parts[s].float() for s in "qkv"]) * want[:, None]
    torch.testing.assert_close(qkv(x), xq @ w.T + want, rtol=1e-5, atol=1e-5)


def test_block_scales_become_row_scales():
    bn, bk = 8, 16
    layer = fp8_layer(MergedColumnParallelLinear, 40, [16, 8], fmt=Fp8Format("block", (bn, bk)))
    torch.manual_seed(0)
    full = {}
    for sid, rows in ((0, 16), (1, 8)):
        q = (torch.randn(rows, 40) * 50).to(FP8)
        scale = torch.rand(rows // bn, 3) + 0.5  # [out / 8, ceil(40 / 16)] blocks
        layer.weight_loader(layer.weight, q, sid)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, sid)
        per_element = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:, :40]
        full[sid] = q.float() * per_element
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight_scale_inv") and layer.weight_scale.shape == (24,)
    want = torch.cat([full[0], full[1]])
    got = layer.weight.float() * layer.weight_scale[:, None]
    assert ((got - want).abs() <= rounding_bound(want, layer.weight_scale[:, None])).all()


def test_block_shards_must_hold_whole_blocks():
    with pytest.raises(ValueError, match=r"\[12, 12\] output rows .* weight_block_size \[8, 8\]"):
        fp8_layer(MergedColumnParallelLinear, 16, [12, 12], fmt=Fp8Format("block", (8, 8)))


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("tokens", [1, 16, 333, 2048])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_scaled_mm_matches_the_reference(tokens, n, k):
    """Llama 3 8B's projections (qkv, o, gate_up, down) in bfloat16: the same quantized
    operands, so only the accumulation order and the output's bf16 rounding differ; the
    activations quantized by the Triton kernel give the same output as by the reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, k, device="cuda", generator=g, dtype=torch.bfloat16)
    q, scale = quantize_rows(w)
    scale = scale.view(-1)
    assert scaled_mm_supported(q)
    fast = fp8_linear(x, q, scale, None, scaled_mm=True)
    ref = fp8_linear(x, q, scale, None, scaled_mm=False)
    assert fast.dtype == ref.dtype == torch.bfloat16
    from llm_inference.kernels.triton_ops import quantize_rows as triton_quantize

    # The Triton quantization is the reference's, bit for bit: the same product.
    assert torch.equal(fp8_linear(x, q, scale, None, True, triton_quantize), fast)
    torch.testing.assert_close(
        fast.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().std().item()
    )
    static = torch.tensor(0.02, device="cuda")
    fast = fp8_linear(x, q, scale, static, scaled_mm=True)
    ref = fp8_linear(x, q, scale, static, scaled_mm=False)
    assert torch.equal(fp8_linear(x, q, scale, static, True, triton_quantize), fast)
    torch.testing.assert_close(
        fast.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().std().item()
    )


def test_rms_norm_quant_is_rms_norm_then_quantize_rows_in_float32():
    x, res = torch.randn(6, 40, dtype=torch.bfloat16) * 3, torch.randn(6, 40, dtype=torch.bfloat16)
    x[2], res[2] = 0, 0  # an all-zero row: the smallest scale, zeros
    weight = torch.rand(40) + 0.5
    q, scale, new_res = ReferenceOps().rms_norm_quant(x, weight, 1e-5, res.clone())
    summed = (x.float() + res.float()).to(torch.bfloat16)
    rows = summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    want_q, want = quantize_rows(rows * weight)
    assert torch.equal(new_res, summed)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want) and not q[2].float().any()


def test_norms_hand_qkv_and_gate_up_their_input_quantized():
    """A decoder's RMSNorm before an FP8 layer quantizes its output in the same op
    (`rms_norm_quant`) where the layer would quantize its input (float32 here: the same
    product as norm, then the layer's own quantization), before a decode step's skinny GEMM
    too (it takes the FP8 values and scales); not where a static input scale is the layer's
    to apply."""
    calls = []

    class Spy(ReferenceOps):
        skinny = False

        def quantize_rows(self, x, scale=None):
            calls.append("quantize_rows")
            return quantize_rows(x, scale)

        def skinny_applies(self, x, weight):
            return self.skinny

    ops = Spy()
    torch.manual_seed(0)
    layer = QKVParallelLinear(64, 16, 4, 2, ops, Fp8Config(ONLINE))
    layer.weight_loader(layer.weight, torch.randn(64, 64) * 0.1, "q")
    layer.weight_loader(layer.weight, torch.randn(32, 64) * 0.1, "k")
    layer.weight_loader(layer.weight, torch.randn(32, 64) * 0.1, "v")
    layer.quant_method.process_weights_after_loading(layer)
    norm = RMSNorm(64, 1e-5, ops)
    norm.weight.data = torch.rand(64) + 0.5
    x, res = torch.randn(20, 64), torch.randn(20, 64)
    want_h, want_res = norm(x, res.clone())  # the norm alone
    want = layer(want_h)
    assert calls == ["quantize_rows"]
    assert layer.takes_quantized(x)
    h, new_res = norm(x, res.clone(), quantize=True)
    assert isinstance(h, Fp8Activation) and h.dtype == x.dtype and torch.equal(new_res, want_res)
    assert torch.equal(layer(h), want) and calls == ["quantize_rows"]  # none more
    ops.skinny = True  # a decode step: the skinny GEMM takes x quantized too
    assert layer.takes_quantized(x)
    static = QKVParallelLinear(
        64, 16, 4, 2, ops, Fp8Config(Fp8Format("tensor", static_input_scale=True))
    )
    ops.skinny = False
    assert not static.takes_quantized(x)
    assert not QKVParallelLinear(64, 16, 4, 2, ops).takes_quantized(x)  # unquantized
