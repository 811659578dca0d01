"""Bad checkpoints give errors that name the problem; config parsing."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_checkpoint
from safetensors.torch import load_file, save_file

from llm_inference.config import CheckpointError
from llm_inference.kernels import reference
from llm_inference.models.loader import load_model
from llm_inference.models.model_config import parse_hf_config

BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def _rewrite_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _edit_config(folder, edit):
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor(tmp_path):
    folder = make_checkpoint(tmp_path)
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        load_model(folder, reference)


def test_unexpected_tensor(tmp_path):
    folder = make_checkpoint(tmp_path)
    _rewrite_weights(folder, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.extra\.weight"):
        load_model(folder, reference)


def test_wrong_shape(tmp_path):
    folder = make_checkpoint(tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(folder, lambda t: t.update({name: torch.zeros(7, 64)}))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight: checkpoint \(7, 64\), expected"):
        load_model(folder, reference)


def test_missing_config_key(tmp_path):
    folder = make_checkpoint(tmp_path)
    _edit_config(folder, lambda c: c.pop("num_hidden_layers"))
    with pytest.raises(CheckpointError, match="missing required config key 'num_hidden_layers'"):
        load_model(folder, reference)


SUPPORTED = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]},
         rf"unsupported architectures \['GPT2LMHeadModel'\]; supported: {SUPPORTED}$"),
        ({"architectures": None, "model_type": "gpt2"},
         rf"unsupported model_type 'gpt2'; supported architectures: {SUPPORTED}$"),
        ({"model_type": "mistral"}, r"model_type 'mistral' is not LlamaForCausalLM's \('llama'\)"),
        ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of names"),
    ],
)  # fmt: skip
def test_unsupported_architecture(tmp_path, edit, message):
    folder = make_checkpoint(tmp_path)
    _edit_config(folder, lambda c: c.update(edit))
    with pytest.raises(CheckpointError, match=message):
        load_model(folder, reference)


def test_first_registered_architecture_is_taken():
    d = {**BASE, "architectures": ["LlamaForCausalLMv9", "LlamaForCausalLM"]}
    assert parse_hf_config(d).architecture == "LlamaForCausalLM"
    assert parse_hf_config({**BASE, "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize("key", ["attention_bias", "mlp_bias"])
def test_bias_refused(tmp_path, key):
    folder = make_checkpoint(tmp_path)
    _edit_config(folder, lambda c: c.update({key: True}))
    with pytest.raises(CheckpointError, match=f"{key}=true is not supported"):
        load_model(folder, reference)


def test_unknown_rope_scaling(tmp_path):
    folder = make_checkpoint(tmp_path)
    _edit_config(folder, lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    with pytest.raises(
        CheckpointError, match="unsupported rope scaling type 'dynamic'; supported: none, 'llama3'"
    ):
        load_model(folder, reference)


def test_bin_only_folder_refused(tmp_path):
    folder = make_checkpoint(tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*convert the checkpoint to safet"):
        load_model(folder, reference)


def test_folder_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope", reference)


def test_config_reads_rope_scaling_and_eos_list():
    d = {
        **BASE,
        "eos_token_id": [7, 9],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    c = parse_hf_config(d)
    assert c.eos_token_ids == (7, 9)
    assert c.head_dim == 16
    assert c.rope_theta == 500000.0
    assert c.rope_scaling.factor == 32.0
    # transformers 5 writes the same under rope_parameters.
    d2 = dict(d, rope_parameters={**d.pop("rope_scaling"), "rope_theta": 500000.0})
    d2.pop("rope_theta")
    assert parse_hf_config(d2) == c
