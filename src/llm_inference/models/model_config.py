"""A Hugging Face checkpoint's `config.json` as a `ModelConfig`, and the tensors it implies.

- `load_hf_config(folder)`: `config.json`, with the end-of-sequence ids of
  `generation_config.json` added; `parse_hf_config(dict)`: the parsing itself, which names the
  key of any missing, mistyped, out-of-range or inconsistent value (CheckpointError);
  `hf_config_dict(config)` is its inverse (what `llm-inference convert` writes).
- `expected_shapes(config)`: the Hugging Face tensor names and full shapes a checkpoint must
  hold; `check_shapes` compares a checkpoint's (safetensors headers or GGUF tensor infos)
  against them and reports every problem in one error, before any tensor is read.

Only the standard library and config.py: reading a config costs no torch import.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llm_inference.config import CheckpointError, ModelConfig, RopeScaling, is_int, is_number

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
# JSON side files (config.json, generation_config.json, the safetensors index) larger than
# this are refused before they are read.
MAX_JSON_BYTES = 64 << 20
_LISTED = 20  # names listed per kind of problem in one error message
# ModelConfig fields written to config.json under their own name.
_COPIED_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
)  # fmt: skip


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError (naming the file) if it is too large, not
    UTF-8, not JSON or not an object."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path} is too large ({size} bytes) for a {path.name} file")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {path.name} must hold a JSON object")
    return data


def _token_ids(value: Any, key: str) -> tuple[int, ...]:
    """`eos_token_id` as JSON spells it (null, an id, or a list of ids) as a tuple; `key`
    names it in the error."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(is_int(i) for i in ids):
        raise CheckpointError(f"{key} must be an integer or a list of integers, not {value!r}")
    return tuple(ids)


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The config of a Hugging Face folder: `config.json`, with the `eos_token_id` of
    `generation_config.json` (when present) added to `eos_token_ids` after config.json's own,
    as transformers' generate() and vLLM do (Llama 3 Instruct lists <|eot_id|> only there)."""
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"checkpoint path does not exist: {folder}")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"no config.json in checkpoint folder {folder}")
    data = read_json_object(cfg_file)
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        gen = read_json_object(gen_file)
        extra = _token_ids(gen.get("eos_token_id"), f"{gen_file}: eos_token_id")
        if extra:
            own = _token_ids(data.get("eos_token_id"), f"{cfg_file}: eos_token_id")
            merged = list(dict.fromkeys(own + extra))
            data = {**data, "eos_token_id": merged}
    return parse_hf_config(data, source=str(cfg_file))


def parse_hf_config(d: dict[str, Any], source: str = "config") -> ModelConfig:
    """A ModelConfig from a transformers config dict; CheckpointError, prefixed with `source`,
    naming the key of any missing, mistyped, out-of-range or inconsistent value."""
    try:
        return _parse(d)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None


def _parse(d: dict[str, Any]) -> ModelConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"the config must be a JSON object, not {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type != "llama":
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; only 'llama' "
            f"({', '.join(SUPPORTED_ARCHITECTURES)}) is supported"
        )
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise CheckpointError(f"{key}=true is not supported (bias-free only)")

    def integer(key: str, default: Any = None) -> int:
        value = d.get(key)
        if value is None:
            if default is None:
                raise CheckpointError(f"missing required config key {key!r}")
            return default
        if not is_int(value):
            raise CheckpointError(f"{key} must be an integer, not {value!r}")
        return value

    def number(key: str, default: float) -> float:
        value = d.get(key)
        if value is None:
            return default
        if not is_number(value):
            raise CheckpointError(f"{key} must be a number, not {value!r}")
        try:
            return float(value)
        except OverflowError:
            raise CheckpointError(f"{key} is out of range: {value!r}") from None

    hidden = integer("hidden_size")
    heads = integer("num_attention_heads")
    if d.get("head_dim") is None:
        if heads < 1:
            raise CheckpointError(f"num_attention_heads must be at least 1, not {heads}")
        if hidden % heads:
            raise CheckpointError(
                f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                "and the config has no head_dim"
            )
    head_dim = integer("head_dim", hidden // max(heads, 1))
    rope_theta, rope_scaling = _parse_rope(d)
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CheckpointError(f"tie_word_embeddings must be true or false, not {tie!r}")
    bos = d.get("bos_token_id")
    if bos is not None and not is_int(bos):
        raise CheckpointError(f"bos_token_id must be an integer or null, not {bos!r}")
    dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
    if not isinstance(dtype, str):
        raise CheckpointError(f"torch_dtype must be a string, not {dtype!r}")
    return ModelConfig(
        hidden_size=hidden,
        num_hidden_layers=integer("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=integer("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=integer("intermediate_size"),
        vocab_size=integer("vocab_size"),
        rms_norm_eps=number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
        max_position_embeddings=integer("max_position_embeddings", 2048),
        bos_token_id=bos,
        eos_token_ids=_token_ids(d.get("eos_token_id"), "eos_token_id"),
        torch_dtype=dtype,
    )


def _parse_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling, from `rope_scaling` (transformers 4) or `rope_parameters`
    (transformers 5)."""
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise CheckpointError(f"{key} must be an object (or null), not {d[key]!r}")
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or None
    theta = d.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta")
    if theta is None:
        theta = 10000.0
    if not is_number(theta) or not math.isfinite(theta) or theta <= 0:
        raise CheckpointError(f"rope_theta must be a positive finite number, not {theta!r}")
    theta = float(theta)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if not scaling:
        return theta, None
    where = "rope_scaling" if scaling is d.get("rope_scaling") else "rope_parameters"
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if not isinstance(kind, str):
        raise CheckpointError(f"{where}.rope_type must be a string, not {kind!r}")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"unsupported rope scaling type {kind!r}; supported: none, 'llama3'")
    values = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in scaling:
            raise CheckpointError(f"llama3 rope scaling is missing key {key!r}")
        if not is_number(scaling[key]):
            raise CheckpointError(f"{where}.{key} must be a number, not {scaling[key]!r}")
        values[key] = float(scaling[key])
    orig = scaling.get("original_max_position_embeddings")
    if orig is None:
        raise CheckpointError(
            "llama3 rope scaling is missing key 'original_max_position_embeddings'"
        )
    if not is_int(orig):
        raise CheckpointError(
            f"{where}.original_max_position_embeddings must be an integer, not {orig!r}"
        )
    return theta, RopeScaling(original_max_position_embeddings=orig, **values)


def hf_config_dict(config: ModelConfig, dtype: str) -> dict:
    """A transformers `config.json` for `config` (LlamaForCausalLM, bias-free, SiLU), which
    `parse_hf_config` reads back as `config` with `torch_dtype=dtype`."""
    eos = list(config.eos_token_ids)
    scaling = config.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        **{key: getattr(config, key) for key in _COPIED_KEYS},
        # rope_theta + rope_scaling: read by transformers 4.x and 5.x (and by parse_hf_config)
        "rope_scaling": None if scaling is None else dataclasses.asdict(scaling),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype,
    }


# ---- the tensors a config implies ------------------------------------------------------------


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and full (unsharded) shapes a checkpoint must hold."""
    h, i = c.hidden_size, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (c.q_size, h),
            p + "self_attn.k_proj.weight": (c.kv_size, h),
            p + "self_attn.v_proj.weight": (c.kv_size, h),
            p + "self_attn.o_proj.weight": (h, c.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def ignored_tensor(name: str, c: ModelConfig) -> bool:
    """A checkpoint tensor that is neither expected nor loaded: rotary inverse frequencies,
    and lm_head.weight of a tied model (some tied checkpoints still carry it: it equals the
    embedding)."""
    return name.endswith("rotary_emb.inv_freq") or (
        c.tie_word_embeddings and name == "lm_head.weight"
    )


def _listing(items: list[str], sep: str = ", ") -> str:
    shown = sep.join(items[:_LISTED])
    return shown if len(items) <= _LISTED else f"{shown}{sep}... ({len(items)} in all)"


def check_shapes(
    found: dict[str, tuple[int, ...]],
    c: ModelConfig,
    source: str,
    other_problems: Iterable[str] = (),
) -> None:
    """Raise one CheckpointError listing every missing, unexpected and wrongly shaped tensor
    (Hugging Face names, full shapes) plus `other_problems`; nothing if all is as `c` says."""
    want = expected_shapes(c)
    missing = sorted(set(want) - set(found))
    unexpected = sorted(n for n in set(found) - set(want) if not ignored_tensor(n, c))
    wrong = sorted(
        f"{n}: checkpoint {tuple(found[n])}, expected {want[n]}"
        for n in set(want) & set(found)
        if tuple(found[n]) != want[n]
    )
    problems = list(other_problems)
    if missing:
        problems.append(f"missing tensors: {_listing([f'{n} {want[n]}' for n in missing])}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if wrong:
        problems.append(f"wrongly shaped tensors: {_listing(wrong, '; ')}")
    if problems:
        raise CheckpointError(f"{source}: " + " | ".join(problems))
