"""FP8 models on the CPU: each supported checkpoint layout loads into the weights it stores
(tensor names, dtypes and quantization_config as real checkpoints have them: fp8_testfiles.py)
and its logits stay near the unquantized model's; `quantization="fp8"` quantizes at load and
greedy decoding keeps the unquantized engine's tokens; other layouts are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from fp8_testfiles import LAYOUTS, logits, steady, write_fp8_checkpoint
from helpers import assert_greedy_close, make_sharp_checkpoint, needs_fp8, random_prompts

from llm_inference import LLM, SamplingParams
from llm_inference.config import CheckpointError, Fp8Format
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.kernels.reference import ReferenceOps
from llm_inference.models.loader import load_model, load_model_config
from llm_inference.models.model_config import parse_hf_config

FP8 = torch.float8_e4m3fn
EPS = 2.0**-4  # e4m3: 3 mantissa bits, round to nearest: half a step, relative


@pytest.fixture(scope="module")
def steady_ckpt(tmp_path_factory):
    return steady(tmp_path_factory.mktemp("steady"))


def dequantized(layer) -> torch.Tensor:
    return layer.weight.float() * layer.weight_scale[:, None]


def assert_near_unquantized(fp8_logits: torch.Tensor, ref: torch.Tensor) -> None:
    """Rounding x and W to e4m3 (relative RMS error about 2.7% each) leaves each matmul about
    4% off; a steady model's layers add updates of about a hundredth of its residual stream, so
    the logits must move by less than a tenth of one matmul's error."""
    err = (fp8_logits - ref).norm() / ref.norm()
    assert err < 0.004, f"relative logit error {err:.4f}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoint_layout_loads_its_weights(steady_ckpt, tmp_path, layout):
    expected = write_fp8_checkpoint(steady_ckpt, tmp_path / layout, layout)
    model = load_model(tmp_path / layout, ReferenceOps())
    block = LAYOUTS[layout][1] == "block"
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        fused = {
            layer.self_attn.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            layer.self_attn.o_proj: ["self_attn.o_proj"],
            layer.mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
            layer.mlp.down_proj: ["mlp.down_proj"],
        }
        for module, names in fused.items():
            assert module.weight.dtype == FP8 and module.weight_scale.dtype == torch.float32
            want = torch.cat([expected[p + n + ".weight"] for n in names])
            got = dequantized(module)
            if block:  # requantized per row: within half an FP8 step (or a subnormal one)
                row_scale = module.weight_scale[:, None]
                assert ((got - want).abs() <= EPS * want.abs() + 2.0**-10 * row_scale).all()
            else:  # the stored FP8 values and scales, as they are
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            if LAYOUTS[layout][3]:  # static input scales: the largest of the fused parts'
                static = 0.025 if names[0].endswith("q_proj") else 0.02
                assert module.input_scale.item() == pytest.approx(static)
            else:
                assert module.input_scale is None
    assert model.lm_head.weight.dtype == model.embed_tokens.weight.dtype == torch.float32
    assert_near_unquantized(logits(model), logits(load_model(steady_ckpt, ReferenceOps())))


def test_online_quantization_keeps_embeddings_and_head(steady_ckpt):
    config = dataclasses.replace(load_model_config(steady_ckpt), quantization=Fp8Format("online"))
    model = load_model(steady_ckpt, ReferenceOps(), config=config)
    ref = load_model(steady_ckpt, ReferenceOps())
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.weight.shape[0],)
    w = ref.layers[0].self_attn.qkv_proj.weight
    assert (
        (dequantized(qkv) - w).abs() <= EPS * w.abs() + 2.0**-10 * qkv.weight_scale[:, None]
    ).all()
    assert model.lm_head.weight.dtype == torch.float32
    torch.testing.assert_close(model.lm_head.weight, ref.lm_head.weight, rtol=0, atol=0)
    assert_near_unquantized(logits(model), logits(ref))


def test_engine_option_and_checkpoint_format(steady_ckpt, tmp_path):
    assert EngineArgs(str(steady_ckpt)).create_engine_config().model.quantization is None
    online = EngineArgs(str(steady_ckpt), quantization="fp8").create_engine_config()
    assert online.model.quantization == Fp8Format("online")
    write_fp8_checkpoint(steady_ckpt, tmp_path / "ct", "ct-channel")
    for quantization in (None, "fp8"):  # an FP8 checkpoint runs as it is stored
        cfg = EngineArgs(str(tmp_path / "ct"), quantization=quantization).create_engine_config()
        assert cfg.model.quantization == Fp8Format("channel")
    with pytest.raises(ValueError, match="quantization must be 'fp8' or None, got 'int4'"):
        EngineArgs(str(steady_ckpt), quantization="int4").create_engine_config()


def test_greedy_tokens_follow_the_unquantized_engine(tmp_path):
    """A steady model with a peaked next-token distribution: FP8's error flips the argmax
    only at near ties."""
    folder = steady(tmp_path / "peaked", make_sharp_checkpoint, factor=100, num_hidden_layers=2)
    prompts = [[1, 5, 9, 20], [3, 4, 7, 8, 9, 10], list(range(40, 60)), [11] * 5, [7, 300, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    runs = {}
    for quantization in (None, "fp8"):
        with LLM(str(folder), device="cpu", quantization=quantization) as llm:
            runs[quantization] = llm.generate(prompts, params, use_tqdm=False)
    # where they part, the unquantized model saw a near tie
    assert_greedy_close(runs["fp8"], runs[None], near_tie=0.25, who="FP8")


BASE = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
}  # fmt: skip
CT = LAYOUTS["ct-channel"][0]
CT_GROUP = CT["config_groups"]["group_0"]
KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _ct(**group) -> dict:
    return {**CT, "config_groups": {"group_0": {**CT_GROUP, **group}}}


@pytest.mark.parametrize(
    "quantization_config, reason",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme 'weird'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two"),
        ({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]},
         "unquantized modules"),
        ({**CT, "format": "pack-quantized"}, "format 'pack-quantized'"),
        ({"quant_method": "fp8", "kv_cache_scheme": "dynamic"},
         "kv_cache_scheme 'dynamic' is not 'static'"),
        ({**CT, "kv_cache_scheme": "fp8"}, "kv_cache_scheme must be an object or null"),
        ({**CT, "kv_cache_scheme": {**KV, "num_bits": 4}}, "kv_cache_scheme must be 8-bit floats"),
        ({**CT, "kv_cache_scheme": {**KV, "type": "int"}}, "kv_cache_scheme must be 8-bit floats"),
        ({**CT, "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
         "kv_cache_scheme.strategy must be 'tensor' .*, not None"),
        ({**CT, "kv_cache_scheme": {**KV, "strategy": "attn_head"}},
         "kv_cache_scheme.strategy must be 'tensor' .*, not 'attn_head'"),
        ({**CT, "kv_cache_scheme": {**KV, "dynamic": True}}, "symmetric, with static scales"),
        ({**CT, "kv_cache_scheme": {**KV, "symmetric": False}}, "symmetric, with static scales"),
        (_ct(weights={**CT_GROUP["weights"], "type": "int"}), "weights must be 8-bit floats"),
        (_ct(weights={**CT_GROUP["weights"], "strategy": "group", "group_size": 128}),
         "strategy in"),
        (_ct(input_activations=None), "input_activations must be 8-bit floats"),
        (_ct(input_activations={**CT_GROUP["input_activations"], "dynamic": False}),
         "dynamic per token or static per tensor"),
    ],
)  # fmt: skip
def test_unsupported_quantization_refused(quantization_config, reason):
    with pytest.raises(CheckpointError, match=reason) as e:
        parse_hf_config({**BASE, "quantization_config": quantization_config})
    assert "supported: quant_method 'fp8'" in str(e.value)
    assert "'compressed-tensors' FP8" in str(e.value)


def test_fp8_tensors_need_the_config_and_their_scales(steady_ckpt, tmp_path):
    folder = tmp_path / "ct"
    write_fp8_checkpoint(steady_ckpt, folder, "ct-channel")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has dtype F8_E4M3"):
        load_model(folder, ReferenceOps())
    config["quantization_config"] = LAYOUTS["fp8-block"][0]  # a block layout: other scales
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensors: .*q_proj\.weight_scale_inv"):
        load_model(folder, ReferenceOps())


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
def test_cuda_engine_runs_scaled_mm(tmp_path, eager):
    """The engine on CUDA (Triton kernels, bfloat16, CUDA graphs or not) with its linear layers
    through torch._scaled_mm: greedy tokens as the unquantized engine's up to near ties, wider
    than on the CPU: bfloat16 rounds the activations before they are quantized, and this
    checkpoint's logits are ~30 in size, where FP8's few percent of error is ~1 nat (seen on the
    H200: first differences at steps 14 and 16 with gaps of 1.0)."""
    folder = steady(tmp_path / "peaked", make_sharp_checkpoint, factor=100, num_hidden_layers=2)
    prompts = random_prompts((1, 7, 33, 120, 250))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    runs = {}
    for quantization in (None, "fp8"):
        with LLM(str(folder), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
                 enforce_eager=eager, quantization=quantization) as llm:  # fmt: skip
            model = llm.engine.executor.workers[0].model_runner.model
            down = model.layers[0].mlp.down_proj
            assert (down.weight.dtype == FP8) == (quantization == "fp8")
            if quantization:
                assert down.quant_method.scaled_mm
            runs[quantization] = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_close(runs["fp8"], runs[None], near_tie=1.5, who="FP8 on CUDA")
