"""A checkpoint's FP8 KV cache scales (as vLLM reads them): each layout real checkpoints have
loads its per-layer K and V scales into the attention layers; the engine with
kv_cache_dtype="fp8" computes with them (logits near the unquantized cache's on a model whose
K and V a scale of 1 would flush to zero or saturate), at TP=1 and TP=2; kv_cache_dtype="auto"
keeps the model dtype and leaves them unread; malformed scales and schemes are refused by name.
(Scales in the kernels themselves: tests/models/test_fp8_kv_cache.py, tests/kernels.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fp8_testfiles import write_fp8_checkpoint
from helpers import make_checkpoint, needs_fp8
from safetensors.torch import load_file, save_file

from llm_inference import LLM, SamplingParams
from llm_inference.config import CheckpointError, Fp8Format
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.kernels.reference import ReferenceOps
from llm_inference.models.loader import load_model, load_model_config

# llm-compressor's kv_cache_scheme (compressed-tensors QuantizationArgs, as saved).
CT_KV = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
         "strategy": "tensor", "dynamic": False, "observer": "minmax"}  # fmt: skip
# layout: (the weights' layout in fp8_testfiles, None: unquantized; kv_cache_scheme; the name
# of a layer's K / V scale, "{}" for k or v; the stored shape; all float32)
KV_LAYOUTS = {
    "fp8": ("fp8-tensor-static", "static", "self_attn.{}_scale", ()),  # AMD's -FP8-KV
    "ct": ("ct-channel", CT_KV, "self_attn.{}_scale", (1,)),  # llm-compressor
    "ct-output-scale": ("ct-tensor-static", CT_KV, "self_attn.{}_proj.output_scale", (1,)),
    "unquantized": (None, None, "self_attn.{}_scale", ()),  # no scheme declared: optional
}
LAYERS = 2  # helpers.tiny_config's


def write_kv_checkpoint(src: Path, dst: Path, layout: str, k_scales, v_scales) -> Path:
    """`src` copied to `dst` in `layout`'s weights, with one K and one V scale per layer."""
    weights, scheme, name, shape = KV_LAYOUTS[layout]
    if weights is None:
        shutil.copytree(src, dst)
    else:
        write_fp8_checkpoint(src, dst, weights)
    tensors = load_file(dst / "model.safetensors")
    for i, scales in enumerate(zip(k_scales, v_scales)):
        for kind, value in zip("kv", scales):
            tensors[f"model.layers.{i}." + name.format(kind)] = torch.tensor(value).reshape(shape)
    save_file(tensors, dst / "model.safetensors")
    if scheme is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"]["kv_cache_scheme"] = scheme
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("layout", sorted(KV_LAYOUTS))
def test_layout_loads_its_kv_scales(tiny, tmp_path, layout):
    k_scales, v_scales = [0.0625, 0.2], [1.5, 0.0137]
    folder = write_kv_checkpoint(tiny, tmp_path / layout, layout, k_scales, v_scales)
    quantization = load_model_config(folder).quantization
    assert (quantization is not None and quantization.kv_cache_scales) == (layout != "unquantized")
    model = load_model(folder, ReferenceOps())
    stored = lambda x: torch.tensor(x).item()  # noqa: E731  (float32, as the file holds it)
    for attn, k, v in zip(model.attention_layers(), k_scales, v_scales, strict=True):
        assert type(attn.k_scale) is type(attn.v_scale) is float  # the kernels take floats
        assert (attn.k_scale, attn.v_scale) == (stored(k), stored(v))


# The engine test's model: K 1e-4 and V 1e4 times a plain model's (q and o scaled inversely:
# the same function; q 100 times more, so that attention depends on K). A scale of 1 flushes
# K to zero and saturates V at 448; the checkpoint's bring them to an RMS of about 16 and 40.
K_FACTOR, V_FACTOR, SHARP = 1e-4, 1e4, 100.0
K_SCALE, V_SCALE = K_FACTOR * 0.01, V_FACTOR * 0.004
PROMPT = [5 + (i * 7) % 250 for i in range(40)]


@pytest.fixture(scope="module")
def far_kv(tmp_path_factory):
    """(the checkpoint with its KV scales, the same without them), FP8 weights."""
    base = tmp_path_factory.mktemp("far_kv")
    src = make_checkpoint(base / "src", initializer_range=0.02)
    tensors = load_file(src / "model.safetensors")
    factors = {"q_proj": SHARP / K_FACTOR, "k_proj": K_FACTOR, "v_proj": V_FACTOR,
               "o_proj": 1 / V_FACTOR}  # fmt: skip
    for name in tensors:
        part = name.split(".")[-2]
        if name.endswith("_proj.weight") and part in factors:
            tensors[name] *= factors[part]
    save_file(tensors, src / "model.safetensors")
    scaled = write_kv_checkpoint(src, base / "ct", "ct", [K_SCALE] * LAYERS, [V_SCALE] * LAYERS)
    write_fp8_checkpoint(src, base / "plain", "ct-channel")
    return scaled, base / "plain"


def prompt_logprobs(folder: Path, kv_cache_dtype: str, **engine) -> torch.Tensor:
    """The log-probability of each prompt token after the first, prefilled in chunks of 16."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    engine = {"device": "cpu", **engine}
    with LLM(str(folder), kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16,
             **engine) as llm:  # fmt: skip
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])


def test_engine_computes_with_the_checkpoint_scales(far_kv):
    """With the checkpoint's scales the FP8 cache's log-probabilities stay within 0.06 of the
    float32 cache's (measured: 0.021); with scales of 1 (the same weights without KV scales),
    or with either of K's and V's ignored, they move by more than 0.2 (each measured)."""
    scaled, plain = far_kv
    ref = prompt_logprobs(scaled, "auto")
    config = EngineArgs(str(scaled), device="cpu").create_engine_config()
    assert config.cache.kv_cache_dtype == "float32"
    torch.testing.assert_close(prompt_logprobs(plain, "auto"), ref, rtol=0, atol=0)  # unread
    err = (prompt_logprobs(scaled, "fp8") - ref).abs().max().item()
    assert 0 < err < 0.06, f"FP8 cache with the checkpoint's scales: {err:.4f}"
    ignored = (prompt_logprobs(plain, "fp8") - ref).abs().max().item()
    assert ignored > 0.15, f"the test model does not need its scales: {ignored:.4f}"


def test_tensor_parallel_ranks_use_the_same_scales(far_kv):
    """TP=2 (gloo): each rank reads every scale whole; its half of the KV heads rounds as at
    TP=1."""
    scaled, _ = far_kv
    ref = prompt_logprobs(scaled, "auto")
    err = (prompt_logprobs(scaled, "fp8", tensor_parallel_size=2) - ref).abs().max().item()
    assert err < 0.06, f"TP=2 FP8 cache with the checkpoint's scales: {err:.4f}"


K0, V1 = "model.layers.0.self_attn.k_scale", "model.layers.1.self_attn.v_scale"


@pytest.mark.parametrize(
    "change, message",
    [
        ({K0: torch.tensor([0.5, 0.5])},
         rf"wrongly shaped tensors: {K0}: checkpoint \(2,\), expected \(\)"),
        ({K0: torch.tensor(0.0)}, rf"{K0}: an FP8 KV cache scale must be a positive finite "
                                  r"number, not 0\.0"),
        ({V1: torch.tensor(-0.5)}, rf"{V1}: .* not -0\.5"),
        ({V1: torch.tensor(float("inf"))}, rf"{V1}: .* not inf"),
        ({K0: torch.tensor(float("nan"))}, rf"{K0}: .* not nan"),
        ({V1: None}, rf"missing tensors: {V1} \(\)"),
        ({"model.layers.0.self_attn.k_proj.output_scale": torch.tensor(0.5)},
         rf"unexpected tensors: {K0}"),  # two names for one scale
        ({"model.layers.2.self_attn.k_scale": torch.tensor(0.5)},
         r"unexpected tensors: model\.layers\.2\.self_attn\.k_scale"),  # no layer 2
        ({"model.layers.0.self_attn.q_proj.output_scale": torch.tensor(0.5)},
         "unexpected tensors"),  # FP8 attention's q scale: not implemented
    ],
    ids=["not_scalar", "zero", "negative", "inf", "nan", "v_missing", "twice", "no_layer",
         "q_scale"],
)  # fmt: skip
def test_malformed_kv_scales_refused(tiny, tmp_path, change, message):
    folder = write_kv_checkpoint(tiny, tmp_path / "kv", "unquantized", [0.5] * 2, [0.5] * 2)
    tensors = load_file(folder / "model.safetensors")
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_model(folder, ReferenceOps())


def test_declared_kv_scales_must_be_there(tiny, tmp_path):
    """A kv_cache_scheme without the scales it declares is refused, naming every one (vLLM
    would quietly use 1.0)."""
    folder = write_kv_checkpoint(tiny, tmp_path / "ct", "ct", [0.5] * 2, [0.5] * 2)
    tensors = load_file(folder / "model.safetensors")
    kept = {n: t for n, t in tensors.items() if not n.endswith(("k_scale", "v_scale"))}
    save_file(kept, folder / "model.safetensors")
    names = [f"model.layers.{i}.self_attn.{x}_scale ()" for i in range(LAYERS) for x in "kv"]
    with pytest.raises(CheckpointError, match="missing tensors: ") as e:
        load_model(folder, ReferenceOps())
    assert all(name in str(e.value) for name in names)


def test_online_quantization_has_no_kv_scales():
    with pytest.raises(CheckpointError, match="online FP8 quantization has no static input or KV"):
        Fp8Format("online", kv_cache_scales=True)


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
def test_cuda_engine_computes_with_the_checkpoint_scales(far_kv, eager):
    """The same on CUDA (Triton kernels, bfloat16, CUDA graphs or not): the scales reach the
    kernels. bfloat16 adds its own error to both runs, so the bound is relative: with the
    checkpoint's scales, a quarter of the error of scales of 1 (a twelfth on the CPU)."""
    scaled, plain = far_kv
    cuda = {"device": "cuda", "dtype": "bfloat16", "kv_cache_memory_bytes": 16 << 20,
            "enforce_eager": eager}  # fmt: skip
    ref = prompt_logprobs(scaled, "auto", **cuda)
    err = (prompt_logprobs(scaled, "fp8", **cuda) - ref).abs().max().item()
    ignored = (prompt_logprobs(plain, "fp8", **cuda) - ref).abs().max().item()
    assert err < ignored / 4, f"with the checkpoint's scales {err:.4f}, without {ignored:.4f}"
