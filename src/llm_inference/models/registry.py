"""The model families: a config.json `architectures` name -> its family, as vLLM's registry.

Every family here is the Llama layout (models/llama.py) with hooks its config turns on, so one
decoder serves them all: Mistral is Llama (its sliding window is refused where it would
matter: model_config.check_sliding_window); Qwen2 and Qwen2.5 add a bias to the q, k and v
projections; Qwen3 RMS-normalizes each q and k head before RoPE and has a head_dim of its own.
A family with another decoder (mixture of experts, say) adds its module and one line here.

Only the standard library: model_config.py reads the table without importing torch;
`model_class` imports the model's module when a model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    gguf_architecture: str | None  # llama.cpp's general.architecture (Mistral's files: llama)
    qkv_bias: bool = False
    qk_norm: bool = False
    model: tuple[str, str] = ("llama", "LlamaForCausalLM")  # module under models/, class


FAMILIES = {
    "LlamaForCausalLM": Family("llama", "llama"),
    "MistralForCausalLM": Family("mistral", None),
    "Qwen2ForCausalLM": Family("qwen2", "qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family("qwen3", "qwen3", qk_norm=True),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
GGUF_ARCHITECTURES = {f.gguf_architecture: a for a, f in FAMILIES.items() if f.gguf_architecture}


def model_class(architecture: str) -> type:
    """The model class of a registered architecture."""
    module, name = FAMILIES[architecture].model
    return getattr(importlib.import_module(f"llm_inference.models.{module}"), name)
