"""FP8 checkpoints in the layouts real ones have, written from a tiny unquantized checkpoint:
the tensor names, dtypes, shapes and `quantization_config` of Hugging Face's "fp8" (block
scales `weight_scale_inv`, as Qwen3-*-FP8 and DeepSeek; per-tensor `weight_scale` with static
`input_scale`, as vLLM's and AutoFP8's) and of llm-compressor's "compressed-tensors"
(FP8_DYNAMIC: bf16 `weight_scale` [out, 1] per channel; FP8 static: per-tensor [1] scales).
Also `steady`, a random model that FP8 rounding disturbs as little as a trained one, and
`logits`, a model's logits over one prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from helpers import make_checkpoint
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (16, 16)
PROMPT = torch.tensor([1, 5, 9, 20, 33, 2, 70, 71, 15, 16, 100, 4])
# Static activation scales: q, k and v differ (the engine takes their maximum).
INPUT_SCALES = {"q_proj": 0.02, "k_proj": 0.025, "v_proj": 0.015}


def _compressed_tensors(strategy: str, static: bool) -> dict:
    float8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    acts = {**float8, "strategy": "tensor" if static else "token", "dynamic": not static}
    weights = {**float8, "strategy": strategy, "dynamic": False, "observer": "minmax"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts,
             "output_activations": None}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


# layout: (quantization_config, weight scales, scale dtype, static input scales)
LAYOUTS = {
    "fp8-block": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
         "weight_block_size": list(BLOCK)},
        "block", torch.float32, False,
    ),
    "fp8-tensor-static": (
        {"quant_method": "fp8", "activation_scheme": "static"}, "tensor", torch.float32, True,
    ),
    "ct-channel": (_compressed_tensors("channel", False), "channel", torch.bfloat16, False),
    "ct-tensor-static": (_compressed_tensors("tensor", True), "tensor", torch.float32, True),
}  # fmt: skip


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] as FP8 with one float32 scale per (bn, bk) block (edge blocks partial)."""
    out, inp = w.shape
    rows, cols = -(-out // bn), -(-inp // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:out, :inp] = w
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    per_element = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:out, :inp]
    return (w / per_element).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def write_fp8_checkpoint(src: Path, dst: Path, layout: str) -> dict[str, torch.Tensor]:
    """`src` copied to `dst` with its linear weights in `layout`; returns each quantized
    weight dequantized (float32, by Hugging Face name): what the engine must compute with."""
    config, scales, scale_dtype, static = LAYOUTS[layout]
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    dequantized = {}
    for name in [n for n in tensors if n.endswith(tuple(f"{p}.weight" for p in LINEAR))]:
        w, base = tensors[name].float(), name.removesuffix("weight")
        if scales == "block":
            q, scale = quantize_blocks(w, *BLOCK)
            tensors[base + "weight_scale_inv"] = scale
            per_element = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            dequantized[name] = q.float() * per_element[: w.shape[0], : w.shape[1]]
        else:
            amax = w.abs().amax(dim=1, keepdim=True) if scales == "channel" else w.abs().amax()
            scale = (amax / FP8_MAX).to(scale_dtype)
            q = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            stored = scale if scales == "channel" else scale.reshape(())
            if layout.startswith("ct-") and scales == "tensor":
                stored = stored.reshape(1)  # llm-compressor's [1]; vLLM's fp8 a scalar
            tensors[base + "weight_scale"] = stored
            dequantized[name] = q.float() * scale.float()
        tensors[name] = q
        if static:
            part = name.split(".")[-2]
            value = torch.tensor(INPUT_SCALES.get(part, 0.02))
            tensors[base + "input_scale"] = value.reshape(1) if layout.startswith("ct-") else value
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


def steady(folder, make=make_checkpoint, **overrides):
    """A random model whose residual stream outweighs each layer's update, as a trained
    model's does (small weights, embeddings scaled up): FP8's rounding then moves the logits a
    little. (With updates that dominate, a random model is chaotic: every rounding grows.)"""
    folder = make(folder, initializer_range=0.02, **overrides)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.embed_tokens.weight"] *= 100
    save_file(tensors, folder / "model.safetensors")
    return folder


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(PROMPT, torch.arange(len(PROMPT)), [len(PROMPT)])
        return model.compute_logits(hidden)
