"""Every registered family (models/registry.py) against transformers, on tiny random
checkpoints (float32, CPU; families.py draws the biases and norm weights at random too).

- logits of our forward equal transformers' (qkv bias, q/k norm, head_dim != hidden / heads,
  tied and untied embeddings, GQA ratios 1, 2 and 4, rope_theta 1e6, yarn beyond the original
  context, Mistral's window at the model's length);
- the engine's greedy tokens equal transformers' generate, with prefix caching hitting and
  requests preempted, at tensor_parallel_size 1 and 2 (gloo: qkv biases and KV heads
  replicated over the ranks, q/k norms on every rank);
- the hooks on the Triton kernels, under the interpreter (families_triton_checks.py: a paged
  prompt chunk and decode step; q/k norms at head_dim 128);
- what a family has and the decoder does not (sliding windows, other biases) is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from families import hf_family_model, hf_greedy, make_family_checkpoint
from families_triton_checks import CASES as TRITON_CASES
from interpreter import run_checks

from llm_inference import LLM, SamplingParams
from llm_inference.config import CheckpointError, YarnScaling
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.kernels import reference
from llm_inference.models.loader import load_model
from llm_inference.models.model_config import hf_config_dict, load_hf_config, parse_hf_config
from llm_inference.models.registry import FAMILIES, model_class

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "mistral_window_at_max": ("mistral", {"sliding_window": 512}),
    "qwen2": ("qwen2", {}),
    "qwen2_tied_theta_1e6": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen2_gqa4": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "qwen2_mha": ("qwen2", {"num_key_value_heads": 4}),
    "qwen3_head_dim_32": ("qwen3", {"head_dim": 32}),
    "qwen3_tied_gqa4": ("qwen3", {"tie_word_embeddings": True, "num_attention_heads": 8,
                                  "num_key_value_heads": 2, "head_dim": 24}),
    "qwen2_yarn": ("qwen2", {"rope_parameters": {"rope_theta": 1e6, **YARN}}),
    "qwen3_yarn_betas": ("qwen3", {"rope_parameters": {
        "rope_theta": 10000.0, **YARN, "beta_fast": 16.0, "beta_slow": 2.0,
        "attention_factor": 1.3}}),
}  # fmt: skip


def _checkpoint(tmp_path, name: str, **extra):
    family, overrides = CASES[name]
    return make_family_checkpoint(tmp_path / name, family, **{**overrides, **extra})


def _logits(model, ids, positions):
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, [len(ids)]))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    folder = _checkpoint(tmp_path, name)
    theirs, ours = hf_family_model(folder), load_model(folder, reference)
    assert ours.config.architecture == type(theirs).__name__
    ids = torch.randint(0, 320, (23,), generator=torch.Generator().manual_seed(1))
    # yarn: positions past the original context (128), where it differs from plain RoPE
    positions = torch.arange(300, 323) if "yarn" in name else torch.arange(23)
    with torch.no_grad():
        want = theirs(ids[None], position_ids=positions[None]).logits[0]
    err = (want - _logits(ours, ids, positions)).abs().max().item()
    assert err < 1e-4, f"max abs logit error {err}"


def test_hooks_and_yarn_change_the_logits(tmp_path):
    """The tests above would pass for a model that ignored a hook: each one matters."""
    ids = torch.randint(0, 320, (17,), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(300, 317)
    for name, off in [
        ("qwen2", {"qkv_bias": False}),
        ("qwen3_head_dim_32", {"qk_norm": False}),
        ("qwen2_yarn", {"rope_scaling": None}),
    ]:
        folder = _checkpoint(tmp_path, name)
        model = load_model(folder, reference)
        config = dataclasses.replace(model.config, **off)
        plain = model_class(config.architecture)(config, reference)
        state = {k: v for k, v in model.state_dict().items() if k in plain.state_dict()}
        plain.load_state_dict(state)
        diff = (_logits(model, ids, positions) - _logits(plain, ids, positions)).abs().max()
        assert diff > 1e-2, name


def test_config_round_trip_for_every_family(tmp_path):
    """hf_config_dict (what `convert` writes) reads back as the same config, in our parser and
    in transformers (the architecture and its switches)."""
    from transformers import AutoConfig

    for name in ("llama", "mistral", "qwen2_tied_theta_1e6", "qwen3_head_dim_32", "qwen2_yarn"):
        config = load_hf_config(_checkpoint(tmp_path, name))
        written = hf_config_dict(config, "float32")
        assert parse_hf_config(written) == config, name
        out = tmp_path / f"{name}_out"
        out.mkdir()
        (out / "config.json").write_text(json.dumps(written))
        theirs = AutoConfig.from_pretrained(out)
        assert theirs.architectures == [config.architecture]
        assert theirs.model_type == FAMILIES[config.architecture].model_type


def test_yarn_reads_as_transformers_does():
    """Qwen2.5's long-context form (transformers 4's `type`), transformers' defaults, DeepSeek's
    mscale form, and the positions the model then serves (original context x factor)."""
    base = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": 10,
            "max_position_embeddings": 32768}  # fmt: skip
    legacy = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    c = parse_hf_config({**base, "rope_scaling": legacy})
    assert c.rope_scaling == YarnScaling(4.0, 32768)
    assert c.max_position_embeddings == 131072
    assert c.rope_scaling.cos_sin_scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)) + 1)
    c = parse_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert c.rope_scaling.original_max_position_embeddings == 32768  # the config's
    deepseek = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5}
    c = parse_hf_config({**base, "max_position_embeddings": 4096, "rope_scaling": deepseek})
    want = (0.1 * torch.log(torch.tensor(40.0)) + 1) / (0.05 * torch.log(torch.tensor(40.0)) + 1)
    assert c.rope_scaling.cos_sin_scale == pytest.approx(want.item())
    for bad, message in [
        ({"rope_type": "yarn"}, "yarn rope scaling is missing key 'factor'"),
        ({"rope_type": "yarn", "factor": "4"}, r"rope_scaling\.factor must be a number"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, "beta_fast must be a positive"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": 1}, "truncate must be true or false"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            parse_hf_config({**base, "rope_scaling": bad})


QWEN = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": 10}  # fmt: skip


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ({"layer_types": ["sliding_attention"]}, r"layer_types \['sliding_attention'\] is not"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true is not supported"),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive"),
    ],
)
def test_what_the_decoder_lacks_is_refused_by_name(extra, message):
    with pytest.raises(CheckpointError, match=message):
        parse_hf_config({**QWEN, **extra})


def test_qwen2_switches_off_load():
    """Released Qwen2.5 configs: a sliding window that is off, layer types all full."""
    c = parse_hf_config({**QWEN, "use_sliding_window": False, "sliding_window": 32768,
                         "max_window_layers": 21, "layer_types": ["full_attention"]})  # fmt: skip
    assert c.qkv_bias and not c.qk_norm and c.sliding_window is None
    assert parse_hf_config({**QWEN, "model_type": "qwen3"}).qk_norm


def test_mistral_sliding_window_shorter_than_max_model_len_is_refused(tmp_path):
    """Mistral-7B-v0.1's window (4096 of 32768 positions): refused unless max_model_len stays
    within it, where full attention is what the window gives. Absent, transformers' default."""
    assert parse_hf_config({**QWEN, "model_type": "mistral"}).sliding_window == 4096
    folder = _checkpoint(tmp_path, "mistral", sliding_window=64)
    args = dict(model=str(folder), device="cpu")
    with pytest.raises(ValueError, match=r"sliding_window \(64 tokens\) is smaller than "
                       r"max_model_len \(512\).*use max_model_len=64 or less"):  # fmt: skip
        EngineArgs(**args).create_engine_config()
    with pytest.raises(ValueError, match=r"max_model_len \(65\)"):
        EngineArgs(**args, max_model_len=65).create_engine_config()
    assert EngineArgs(**args, max_model_len=64).create_engine_config().model.sliding_window == 64


# ---- the engine: greedy tokens, prefix caching, preemption, tensor parallelism --------------


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 300) for _ in range(n)]


BASE = _tokens(0, 40)
FIRST = [BASE[:36] + _tokens(1, 3)]
# Full blocks of FIRST again (prefix cache hits), and enough tokens to preempt in 6 blocks.
SECOND = [BASE[:33] + _tokens(2, 4), BASE[:20] + _tokens(3, 9), BASE[:36], _tokens(4, 11)]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _run_engine(folder, **kw) -> tuple[list[list[int]], dict]:
    c = load_hf_config(folder)
    kv_heads = max(1, c.num_key_value_heads // kw.get("tensor_parallel_size", 1))  # per rank
    block_bytes = c.num_hidden_layers * 2 * 16 * kv_heads * c.head_dim * 4
    with LLM(str(folder), device="cpu", dtype="float32", max_model_len=64,
             kv_cache_memory_bytes=6 * block_bytes, enable_prefix_caching=True,
             **kw) as llm:  # fmt: skip
        outs = llm.generate(FIRST, GREEDY, use_tqdm=False)
        outs += llm.generate(SECOND, GREEDY, use_tqdm=False)
        return [o.token_ids for o in outs], llm.stats()


@pytest.mark.parametrize("name", ["qwen2", "qwen3_head_dim_32", "mistral", "qwen2_yarn"])
def test_engine_greedy_equals_transformers(tmp_path, name):
    folder = _checkpoint(tmp_path, name)
    got, stats = _run_engine(folder, max_num_batched_tokens=32)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] >= 32
    assert got == hf_greedy(folder, FIRST + SECOND, NEW_TOKENS)


@pytest.mark.parametrize(
    "name, extra",
    [("qwen2", {"num_key_value_heads": 1}), ("qwen3_head_dim_32", {})],
    ids=["qwen2_kv_heads_replicated", "qwen3"],
)
def test_tensor_parallel_greedy_equals_transformers(tmp_path, name, extra):
    folder = _checkpoint(tmp_path, name, **extra)
    got, stats = _run_engine(folder, tensor_parallel_size=2)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] >= 32
    assert got == hf_greedy(folder, FIRST + SECOND, NEW_TOKENS)


def test_hooks_on_the_triton_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    results, log = run_checks(Path(__file__).parent / "families_triton_checks.py")
    assert results == {case: "ok" for case in TRITON_CASES}, log[-8000:]


# The config.json of released checkpoints (their keys as published).
RELEASED = {
    "Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
        "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
        "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    },
    "Mistral-7B-Instruct-v0.3": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 32768,
    },
}  # fmt: skip


def test_released_configs_read():
    qwen25 = parse_hf_config(RELEASED["Qwen2.5-7B-Instruct"])
    assert (qwen25.qkv_bias, qwen25.head_dim, qwen25.sliding_window) == (True, 128, None)
    long = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    qwen25_long = parse_hf_config({**RELEASED["Qwen2.5-7B-Instruct"], "rope_scaling": long})
    assert qwen25_long.max_position_embeddings == 131072  # Qwen's "processing long texts"
    qwen3 = parse_hf_config(RELEASED["Qwen3-8B"])
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.q_size) == (True, 128, 4096)
    mistral = parse_hf_config(RELEASED["Mistral-7B-Instruct-v0.3"])
    assert mistral.architecture == "MistralForCausalLM" and mistral.sliding_window is None
