"""A Hugging Face checkpoint's `config.json` as a `ModelConfig`, and the tensors it implies.

- `load_hf_config(folder)`: `config.json`, with the end-of-sequence ids of
  `generation_config.json` added; `parse_hf_config(dict)`: the parsing itself, which names the
  key of any missing, mistyped, out-of-range or inconsistent value (CheckpointError);
  `hf_config_dict(config)` is its inverse (what `llm-inference convert` writes).
- The family (models/registry.py) comes from `architectures` (else `model_type`) and sets the
  config's hooks (`qkv_bias`, `qk_norm`); what a family has and the Llama layout lacks
  (sliding windows, attention biases of other layers) is refused by key.
- `expected_shapes(config)`: the Hugging Face tensor names and full shapes a checkpoint must
  hold; `check_shapes` compares a checkpoint's (safetensors headers or GGUF tensor infos)
  against them and reports every problem in one error, before any tensor is read.
- `check_sliding_window(config, max_model_len)`: a window shorter than the context is refused.
- `parse_quantization`: `quantization_config` -> the FP8 format (config.Fp8Format) of an FP8
  checkpoint, whose scale tensors `expected_shapes` then lists too; other formats are refused.
- `kv_scale_of(name)`: an FP8 KV cache scale's layer and kind from its tensor name (any
  safetensors checkpoint may hold them: none, or K's and V's of every layer, `kv_scale_shapes`).

Only the standard library and config.py: reading a config costs no torch import.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llm_inference.config import (
    CheckpointError,
    Fp8Format,
    ModelConfig,
    RopeScaling,
    YarnScaling,
    cdiv,
    is_int,
    is_number,
)
from llm_inference.models.registry import FAMILIES, SUPPORTED_ARCHITECTURES, Family

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
# What hf_config_dict writes for each family besides them: the switches its transformers
# class reads, all off (Mistral's sliding_window is the config's own).
_FAMILY_KEYS = {
    "llama": {"attention_bias": False, "mlp_bias": False},
    "mistral": {},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"attention_bias": False, "use_sliding_window": False},
}


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


def _family(d: dict[str, Any]) -> tuple[str, Family]:
    """The registered architecture of a config: the first of `architectures` that is
    registered (vLLM's rule), else the one of its `model_type`; its model_type must agree."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    names, model_type = d.get("architectures"), d.get("model_type")
    if names is None:
        found = [a for a, f in FAMILIES.items() if f.model_type == model_type]
        if not found:
            raise CheckpointError(
                f"unsupported model_type {model_type!r}; supported architectures: {supported}"
            )
        return found[0], FAMILIES[found[0]]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"architectures must be a list of names, not {names!r}")
    found = [n for n in names if n in FAMILIES]
    if not found:
        raise CheckpointError(f"unsupported architectures {names}; supported: {supported}")
    family = FAMILIES[found[0]]
    if model_type is not None and model_type != family.model_type:
        raise CheckpointError(
            f"model_type {model_type!r} is not {found[0]}'s ({family.model_type!r})"
        )
    return found[0], family


def _refuse_unsupported(d: dict[str, Any], family: Family) -> None:
    """Keys whose value would change the model in a way this decoder does not implement."""
    keys = ["mlp_bias"] + ([] if family.qkv_bias else ["attention_bias"])  # Qwen2: fixed
    for key in keys:
        if d.get(key):
            raise CheckpointError(f"{key}=true is not supported (bias-free only)")
    if d.get("use_sliding_window"):
        raise CheckpointError(
            "use_sliding_window=true is not supported: sliding-window attention is not "
            "implemented (released Qwen checkpoints have it false)"
        )
    layer_types = d.get("layer_types") or []
    if not isinstance(layer_types, list) or set(layer_types) - {"full_attention"}:
        raise CheckpointError(
            f"layer_types {layer_types!r} is not supported: only full_attention layers"
        )


def _parse(d: dict[str, Any]) -> ModelConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"the config must be a JSON object, not {type(d).__name__}")
    architecture, family = _family(d)
    _refuse_unsupported(d, family)

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
    max_positions = integer("max_position_embeddings", 2048)
    rope_theta, rope_scaling = _parse_rope(d, max_positions)
    window = None
    if family.model_type == "mistral":  # absent: transformers' MistralConfig default
        window = d.get("sliding_window", 4096)
        if window is not None and (not is_int(window) or window < 1):
            raise CheckpointError(
                f"sliding_window must be a positive integer or null, not {window!r}"
            )
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
        max_position_embeddings=scaled_positions(max_positions, rope_scaling),
        bos_token_id=bos,
        eos_token_ids=_token_ids(d.get("eos_token_id"), "eos_token_id"),
        torch_dtype=dtype,
        model_type=family.model_type,
        architecture=architecture,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        sliding_window=window,
        quantization=parse_quantization(d.get("quantization_config")),
    )


SUPPORTED_QUANTIZATION = (
    "quant_method 'fp8' (e4m3 weights with per-tensor or weight_block_size scales, dynamic or "
    "static activation scales; kv_cache_scheme 'static') and 'compressed-tensors' FP8 (float "
    "8-bit weights with channel or tensor scales, float 8-bit activations dynamic per token or "
    "static per tensor; a kv_cache_scheme of float 8-bit static per-tensor scales)"
)
# Modules an FP8 checkpoint may leave unquantized: those that are never quantized here.
_UNQUANTIZED = {"lm_head"}


def parse_quantization(q: Any) -> Fp8Format | None:
    """config.json's `quantization_config` (None: an unquantized checkpoint) as its FP8
    format: Hugging Face's and vLLM's "fp8", or llm-compressor's "compressed-tensors" with
    float8 weights and activations. Anything else is refused, naming what is supported."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"quantization_config must be an object, not {q!r}")
    method = q.get("quant_method")
    try:
        if method == "fp8":
            return _hf_fp8(q)
        if method == "compressed-tensors":
            return _compressed_tensors(q)
        raise CheckpointError(f"quant_method {method!r} is not supported")
    except CheckpointError as e:
        raise CheckpointError(
            f"quantization_config: {e}; supported: {SUPPORTED_QUANTIZATION}"
        ) from None


def _hf_fp8(q: dict[str, Any]) -> Fp8Format:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise CheckpointError(f"activation_scheme {scheme!r} is not 'dynamic' or 'static'")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"fmt {q['fmt']!r} is not 'e4m3'")
    _check_unquantized(q.get("modules_to_not_convert") or q.get("ignored_layers"))
    kv = q.get("kv_cache_scheme")  # "static" in AMD's "-FP8-KV" checkpoints
    if kv not in (None, "static"):
        raise CheckpointError(f"kv_cache_scheme {kv!r} is not 'static' (stored scales)")
    block = q.get("weight_block_size")
    if block is None:
        static = scheme == "static"
        return Fp8Format("tensor", static_input_scale=static, kv_cache_scales=kv == "static")
    if not isinstance(block, list) or len(block) != 2 or not all(is_int(b) for b in block):
        raise CheckpointError(f"weight_block_size must be two integers, not {block!r}")
    if scheme == "static":
        raise CheckpointError("block scales (weight_block_size) with static activations")
    return Fp8Format("block", tuple(block), kv_cache_scales=kv == "static")


def _compressed_tensors(q: dict[str, Any]) -> Fp8Format:
    if q.get("format") not in ("float-quantized", "naive-quantized"):
        raise CheckpointError(f"format {q.get('format')!r} is not 'float-quantized'")
    kv_scales = _kv_cache_scheme(q.get("kv_cache_scheme"))
    _check_unquantized(q.get("ignore"))
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise CheckpointError(f"config_groups must hold one group, not {groups!r}")
    group = next(iter(groups.values()))
    if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
        raise CheckpointError(f"the config group must target ['Linear']: {group!r}")
    weights, acts = group.get("weights"), group.get("input_activations")

    def fp8(args: Any, what: str, strategies: tuple[str, ...]) -> str:
        if not isinstance(args, dict) or args.get("type") != "float" or args.get("num_bits") != 8:
            raise CheckpointError(f"{what} must be 8-bit floats: {args!r}")
        if not args.get("symmetric", True) or args.get("strategy") not in strategies:
            raise CheckpointError(f"{what} must be symmetric with strategy in {strategies}")
        return args["strategy"]

    strategy = fp8(weights, "weights", ("channel", "tensor"))
    if weights.get("dynamic"):
        raise CheckpointError("weights with dynamic scales")
    static = fp8(acts, "input_activations", ("token", "tensor")) == "tensor"
    if acts.get("dynamic") == static:
        raise CheckpointError("activations must be dynamic per token or static per tensor")
    return Fp8Format(strategy, static_input_scale=static, kv_cache_scales=kv_scales)


def _kv_cache_scheme(kv: Any) -> bool:
    """compressed-tensors' `kv_cache_scheme`: None, or the FP8 KV cache whose scales the
    checkpoint stores, one per layer for K and one for V (as vLLM reads it)."""
    if kv is None:
        return False
    if not isinstance(kv, dict):
        raise CheckpointError(f"kv_cache_scheme must be an object or null, not {kv!r}")
    if kv.get("type") != "float" or kv.get("num_bits") != 8:
        raise CheckpointError(f"kv_cache_scheme must be 8-bit floats: {kv!r}")
    if kv.get("strategy") != "tensor":
        raise CheckpointError(
            f"kv_cache_scheme.strategy must be 'tensor' (one scale per layer for K and for V), "
            f"not {kv.get('strategy')!r}"
        )
    if not kv.get("symmetric", True) or kv.get("dynamic", False):
        raise CheckpointError(f"kv_cache_scheme must be symmetric, with static scales: {kv!r}")
    return True


def _check_unquantized(names: Any) -> None:
    """The modules a checkpoint leaves unquantized: only those never quantized here."""
    if names and not (isinstance(names, list) and set(names) <= _UNQUANTIZED):
        raise CheckpointError(
            f"unquantized modules {names!r}: linear layers that mix FP8 and the model dtype are "
            f"not supported (only {sorted(_UNQUANTIZED)} may be listed)"
        )


def scaled_positions(max_positions: int, scaling: RopeScaling | YarnScaling | None) -> int:
    """The positions a model serves: with yarn, the original context times the factor where
    that is more than the config's max_position_embeddings (vLLM's rule; Qwen's long-context
    configs keep max_position_embeddings at the original context)."""
    if not isinstance(scaling, YarnScaling):
        return max_positions
    return max(max_positions, int(scaling.original_max_position_embeddings * scaling.factor))


def _parse_rope(
    d: dict[str, Any], max_positions: int
) -> tuple[float, RopeScaling | YarnScaling | None]:
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
    if kind not in ("llama3", "yarn"):
        raise CheckpointError(
            f"unsupported rope scaling type {kind!r}; supported: none, 'llama3', 'yarn'"
        )

    def number(key: str, required: bool = False) -> float | None:
        value = scaling.get(key)
        if value is None:
            if required:
                raise CheckpointError(f"{kind} rope scaling is missing key {key!r}")
            return None
        if not is_number(value):
            raise CheckpointError(f"{where}.{key} must be a number, not {value!r}")
        return float(value)

    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        values = [number(k, True) for k in keys]
    orig = scaling.get("original_max_position_embeddings")
    if orig is None and kind == "llama3":
        raise CheckpointError(
            "llama3 rope scaling is missing key 'original_max_position_embeddings'"
        )
    orig = max_positions if orig is None else orig  # yarn: transformers' default
    if not is_int(orig):
        raise CheckpointError(
            f"{where}.original_max_position_embeddings must be an integer, not {orig!r}"
        )
    if kind == "llama3":
        return theta, RopeScaling(*values, orig)
    factor, attention = number("factor", True), number("attention_factor")
    mscale, mscale_all_dim = number("mscale"), number("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:  # DeepSeek's form, as transformers

        def get_mscale(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

        attention = get_mscale(mscale) / get_mscale(mscale_all_dim)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(f"{where}.truncate must be true or false, not {truncate!r}")
    beta_fast, beta_slow = number("beta_fast") or 32.0, number("beta_slow") or 1.0
    return theta, YarnScaling(factor, orig, beta_fast, beta_slow, attention, truncate)


def hf_config_dict(config: ModelConfig, dtype: str) -> dict:
    """A transformers `config.json` for `config` (its architecture, SiLU), which
    `parse_hf_config` reads back as `config` with `torch_dtype=dtype`."""
    eos = list(config.eos_token_ids)
    scaling = config.rope_scaling
    window = {"sliding_window": config.sliding_window} if config.model_type == "mistral" else {}
    return {
        "architectures": [config.architecture],
        "model_type": config.model_type,
        "hidden_act": "silu",
        **_FAMILY_KEYS[config.model_type],
        **window,
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
        if c.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (c.q_size,)}
            shapes |= {p + f"self_attn.{x}_proj.bias": (c.kv_size,) for x in "kv"}
        if c.qk_norm:
            shapes |= {p + f"self_attn.{x}_norm.weight": (c.head_dim,) for x in "qk"}
    if c.quantization is not None and c.quantization.weight_scale != "online":
        shapes |= _fp8_scale_shapes(shapes, c.quantization)
    return shapes


def _fp8_scale_shapes(shapes: dict[str, tuple[int, ...]], f: Fp8Format) -> dict:
    """The scale tensors of an FP8 checkpoint's linear weights (() is a scalar, also stored as
    [1])."""
    scales = {}
    for name, shape in shapes.items():
        if not name.endswith("_proj.weight"):
            continue
        (out, inp), base = shape, name.removesuffix("weight")
        if f.weight_scale == "block":
            bn, bk = f.weight_block_size
            scales[base + "weight_scale_inv"] = (cdiv(out, bn), cdiv(inp, bk))
        else:
            scales[base + "weight_scale"] = (out, 1) if f.weight_scale == "channel" else ()
        if f.static_input_scale:
            scales[base + "input_scale"] = ()
    return scales


# An attention layer's FP8 KV cache scale, one float for K and one for V (vLLM reads both
# names): `self_attn.k_scale` (llm-compressor) or `self_attn.k_proj.output_scale` (older
# compressed-tensors).
_KV_SCALE = re.compile(
    r"model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)"
)


def kv_scale_of(name: str) -> tuple[int, str] | None:
    """(layer, "k_scale" or "v_scale") of an FP8 KV cache scale's tensor name, else None."""
    m = _KV_SCALE.fullmatch(name)
    return None if m is None else (int(m[1]), f"{m[2] or m[3]}_scale")


def kv_scale_shapes(names: Iterable[str], c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The FP8 KV cache scales a checkpoint holding tensors `names` must have: none, or a
    scalar for K and one for V in every layer (all of them when its config declares them,
    `kv_cache_scales`), each under the first of its names found there, else `self_attn.k_scale`
    (a second name for the same scale is then an unexpected tensor)."""
    found: dict[tuple[int, str], str] = {}
    for name in names:
        where = kv_scale_of(name)
        if where is not None and where[0] < c.num_hidden_layers:
            found.setdefault(where, name)
    if not found and not (c.quantization is not None and c.quantization.kv_cache_scales):
        return {}
    return {
        found.get((i, kind), f"model.layers.{i}.self_attn.{kind}"): ()
        for i in range(c.num_hidden_layers)
        for kind in ("k_scale", "v_scale")
    }


def check_sliding_window(c: ModelConfig, max_model_len: int) -> None:
    """Sliding-window attention is implemented nowhere here (nor in the Triton kernels): a
    model whose window is shorter than the context it would serve is refused (ValueError).
    Within its window a model attends to every earlier token, which full attention does."""
    if c.sliding_window is not None and c.sliding_window < max_model_len:
        raise ValueError(
            f"the model's sliding_window ({c.sliding_window} tokens) is smaller than "
            f"max_model_len ({max_model_len}): sliding-window attention is not implemented; "
            f"use max_model_len={c.sliding_window} or less"
        )


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
    want = expected_shapes(c) | kv_scale_shapes(sorted(found), c)
    missing = sorted(set(want) - set(found))
    unexpected = sorted(n for n in set(found) - set(want) if not ignored_tensor(n, c))
    wrong = sorted(
        f"{n}: checkpoint {tuple(found[n])}, expected {want[n]}"
        for n in set(want) & set(found)
        if tuple(found[n]) != want[n] and not (want[n] == () and tuple(found[n]) == (1,))
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
