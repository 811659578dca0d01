"""Tiny random checkpoints of each registered family, written by transformers (float32), with
the tokenizer of helpers.py. Biases and norm weights are drawn at random too: transformers
initializes them to zeros and ones, which a model that ignored them would match."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import _tokenizer_template

# The transformers config class of each family, and its switches off (no sliding window).
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"use_sliding_window": False, "attention_bias": False}),
}


def family_config(family: str, **overrides):
    import transformers

    name, switches = FAMILY_CONFIGS[family]
    tok = _tokenizer_template()
    kw = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **switches,
    )  # fmt: skip
    kw.update(overrides)
    return getattr(transformers, name)(**kw)


def make_family_checkpoint(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Write a random tiny checkpoint of `family` (float32) plus tokenizer to `folder`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder, safe_serialization=True)
    _tokenizer_template().save_pretrained(folder)
    return Path(folder)


def hf_family_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (EOS ignored)."""
    model = hf_family_model(folder)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(ids[0, len(p) :].tolist())
    return out
