"""config.json (and generation_config.json, the index, the tokenizer files) of a checkpoint
folder: every malformed value is one CheckpointError naming the key, before anything large is
allocated."""

from __future__ import annotations

import json

import pytest
from bounded import run_bounded
from helpers import make_checkpoint

from llm_inference.config import CheckpointError
from llm_inference.kernels import reference
from llm_inference.models import loader
from llm_inference.models.loader import load_model, load_tokenizer, safetensors_files
from llm_inference.models.model_config import load_hf_config, parse_hf_config

BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "eos_token_id": 2,
}


@pytest.fixture
def folder(tmp_path, tiny_ckpt):
    """A writable copy of the session's tiny checkpoint."""
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in tiny_ckpt.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def _edit(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_hidden_layers", 10**9, r"num_hidden_layers.*1000000000.*at most"),
        ("num_hidden_layers", 0, r"num_hidden_layers.*0.*at least 1"),
        ("num_hidden_layers", -2, r"num_hidden_layers.*-2"),
        ("num_hidden_layers", 2.0, r"num_hidden_layers must be an integer, not 2\.0"),
        ("num_hidden_layers", "2", r"num_hidden_layers must be an integer, not '2'"),
        ("num_hidden_layers", True, r"num_hidden_layers must be an integer, not True"),
        ("hidden_size", 10**12, r"hidden_size.*at most"),
        ("vocab_size", 2**40, r"vocab_size.*at most"),
        ("intermediate_size", -1, r"intermediate_size.*at least 1"),
        ("num_attention_heads", 0, r"num_attention_heads.*at least 1"),
        ("num_key_value_heads", 0, r"num_key_value_heads.*at least 1"),
        ("num_key_value_heads", 3, r"num_attention_heads \(4\) is not a multiple of num_key_v"),
        ("head_dim", 10**6, r"head_dim.*at most"),
        ("head_dim", 15, r"head_dim \(15\) must be even"),
        ("hidden_size", 66, r"hidden_size \(66\) is not divisible by num_attention_heads \(4\)"),
        ("max_position_embeddings", 10**12, r"max_position_embeddings.*at most"),
        ("rms_norm_eps", -1.0, r"rms_norm_eps"),
        ("rms_norm_eps", "small", r"rms_norm_eps must be a number"),
        ("rope_theta", 0, r"rope_theta"),
        ("tie_word_embeddings", "yes", r"tie_word_embeddings must be true or false"),
        ("rope_scaling", "linear", r"rope_scaling must be an object"),
        ("rope_parameters", [1], r"rope_parameters must be an object"),
        ("eos_token_id", [None], r"eos_token_id must be an integer or a list of integers"),
        ("eos_token_id", "2", r"eos_token_id must be an integer or a list of integers"),
        ("eos_token_id", -1, r"eos_token_id.*-1"),
        ("bos_token_id", [1], r"bos_token_id must be an integer"),
        ("torch_dtype", 16, r"torch_dtype must be a string"),
    ],
)
def test_bad_config_values_are_one_error_naming_the_key(key, value, message):
    with pytest.raises(CheckpointError, match=message):
        parse_hf_config({**BASE, key: value}, source="cfg.json")


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "llama3", "factor": "8"}, r"rope_scaling\.factor must be a number"),
        ({"rope_type": 3}, r"rope_scaling\.rope_type must be a string"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            r"high_freq_factor \(4\.0\) must be greater than low_freq_factor \(4\.0\)",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192.5,
            },
            r"original_max_position_embeddings must be an integer",
        ),
    ],
)
def test_bad_rope_scaling_is_one_error(scaling, message):
    with pytest.raises(CheckpointError, match=message):
        parse_hf_config({**BASE, "rope_scaling": scaling}, source="cfg.json")


def test_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(CheckpointError, match="config.json is not valid"):
        load_hf_config(tmp_path)


def test_huge_layer_count_fails_fast_before_allocation(folder):
    _edit(folder / "config.json", lambda c: c.update(num_hidden_layers=10**9))
    (result,) = run_bounded([("model", folder)], timeout=60)  # memory-bounded subprocess
    assert result["outcome"] == "CheckpointError" and result["seconds"] < 10, result
    assert "num_hidden_layers (1000000000) is at most 1024 here" in result["detail"]


@pytest.fixture
def no_allocation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was checked")

    monkeypatch.setattr(loader, "model_class", lambda architecture: refuse)


def test_config_inconsistent_with_weights_is_refused_before_allocation(folder, no_allocation):
    # Sane on its own, but the weight headers hold 2 layers of hidden size 64.
    _edit(folder / "config.json", lambda c: c.update(num_hidden_layers=3, vocab_size=1000))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.2\..*\(1000, 64\)"):
        load_model(folder, reference)


@pytest.mark.parametrize(
    "index, message",
    [
        ({"metadata": {}}, r"model\.safetensors\.index\.json has no 'weight_map'"),
        ({"weight_map": ["model.safetensors"]}, r"'weight_map' must be an object"),
        ({"weight_map": {"a": 3}}, r"'weight_map'.*'a'.*must be a file name"),
        ({"weight_map": {"a": "../model.safetensors"}}, r"'weight_map'.*must be a file name"),
        ([], r"model\.safetensors\.index\.json must hold a JSON object"),
    ],
)
def test_malformed_index_file(folder, index, message):
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message):
        safetensors_files(folder)
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json is not valid JSON"):
        safetensors_files(folder)


# ---- generation_config.json: end-of-turn ids -----------------------------------------------


def test_generation_config_eos_ids_are_merged(folder):
    eos = load_hf_config(folder).eos_token_ids
    assert len(eos) == 1
    # Llama 3 Instruct: config.json says <|end_of_text|>, generation_config.json adds <|eot_id|>
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos[0], 7, 9]}))
    assert load_hf_config(folder).eos_token_ids == (eos[0], 7, 9)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_hf_config(folder).eos_token_ids == (eos[0], 5)
    _edit(folder / "config.json", lambda c: c.pop("eos_token_id"))
    assert load_hf_config(folder).eos_token_ids == (5,)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert load_hf_config(folder).eos_token_ids == ()


def test_generation_config_errors_name_the_file(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [None]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json.*eos_token_id"):
        load_hf_config(folder)
    (folder / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"generation_config\.json is not valid JSON"):
        load_hf_config(folder)


# ---- tokenizer files -------------------------------------------------------------------------


def test_folder_without_tokenizer_files(folder):
    for f in folder.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    with pytest.raises(CheckpointError, match=r"no tokenizer files \(tokenizer\.json, tokeni"):
        load_tokenizer(folder)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(folder / "absent")


def test_folder_with_tokenizer_loads(tiny_ckpt):
    assert load_tokenizer(tiny_ckpt).eos_token == "<|eos|>"


def test_make_checkpoint_still_loads(tmp_path):
    model = load_model(make_checkpoint(tmp_path, num_hidden_layers=1), reference)
    assert len(model.layers) == 1
