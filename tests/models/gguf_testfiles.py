"""Write small GGUF files for tests the way llama.cpp's converter does: its tensor names, its
row permutation of Q and K (llama files only), its metadata keys, quantized with gguf.quants."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from safetensors.numpy import load_file

# Hugging Face name part -> GGUF name part (llama.cpp's tensor names for LLM_ARCH_LLAMA, and
# QWEN2 / QWEN3's q/k norms).
GGUF_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
GGUF_GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBALS:
        return GGUF_GLOBALS[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_PARTS[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotary halves -> interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def read_checkpoint(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((folder / "config.json").read_text())
    return config, load_file(str(folder / "model.safetensors"))


def _add_tokenizer(w: GGUFWriter, folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[cfg["bos_token"]])
    w.add_eos_token_id(vocab[cfg["eos_token"]])
    template = cfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    w.add_chat_template(template)


def write_llama_gguf(
    path: Path,
    folder: Path,
    qtypes: dict[str, Q] | None = None,
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    arch: str = "llama",
    metadata: dict | None = None,
    tokenizer: bool = True,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write the checkpoint in `folder` (transformers format) as a GGUF of `arch` at `path`
    (llama, qwen2 or qwen3: Q and K rows permuted for llama only, as llama.cpp does).

    qtypes: HF name -> quantization type (default F32); raw: HF name -> (already quantized
    bytes, type), replacing that weight; extra_tensors: GGUF name -> float32 array; drop: HF
    names of tensors left out.
    """
    config, state = read_checkpoint(folder)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = GGUFWriter(str(path), arch)
    hidden = config["hidden_size"]
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or hidden // heads
    w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(config["vocab_size"])
    for key, value in (metadata or {}).items():
        w.add_key_value(key, value[0], value[1])
    if tokenizer:
        _add_tokenizer(w, folder)
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        if name in drop:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            tensor = llama_cpp_permute(tensor, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            tensor = llama_cpp_permute(tensor, kv_heads)
        if raw and name in raw:
            data, qtype = raw[name]
        else:
            qtype = (qtypes or {}).get(name, Q.F32)
            data = quants.quantize(np.ascontiguousarray(tensor, np.float32), qtype)
        w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    for name, tensor in (extra_tensors or {}).items():
        w.add_tensor(name, tensor.astype(np.float32), raw_dtype=Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def constant_k_blocks(qtype: Q, rows: int, cols: int, seed: int = 0):
    """K-quant bytes for a `[rows, cols]` tensor (cols a multiple of 256) whose every block of 256
    holds one value, plus that value array. Built from the llama.cpp block layouts:
      Q4_K: d, dmin (f16), 12 bytes of 6-bit (scale, min) pairs, 128 bytes of 4-bit quants;
            value = d * scale * q - dmin * min
      Q5_K: as Q4_K plus 32 bytes holding each quant's fifth bit before the 4-bit quants
      Q6_K: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d (f16);
            value = d * scale * (q - 32)
    With equal quants, scales and mins inside a block the bit layout cannot reorder anything.
    """
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    d = rng.uniform(0.001, 0.02, n).astype(np.float16)
    q = rng.integers(0, {Q.Q4_K: 16, Q.Q5_K: 32, Q.Q6_K: 64}[qtype], n)
    blocks = []
    for i in range(n):
        lo, hi = q[i] & 0xF, q[i] >> 4
        if qtype == Q.Q6_K:
            scale = 3
            parts = [
                np.full(128, lo | lo << 4, np.uint8),
                np.full(64, hi | hi << 2 | hi << 4 | hi << 6, np.uint8),
                np.full(16, scale, np.int8).view(np.uint8),
                np.array([d[i]], np.float16).view(np.uint8),
            ]
            value = float(d[i]) * scale * (int(q[i]) - 32)
        else:
            scale, mn, dmin = 5, 2, np.float16(0.01)
            head = np.array([d[i], dmin], np.float16).view(np.uint8)
            packed = np.array([scale] * 4 + [mn] * 4 + [scale | mn << 4] * 4, np.uint8)
            parts = [head, packed]
            if qtype == Q.Q5_K:
                parts.append(np.full(32, 0xFF if hi else 0, np.uint8))
            parts.append(np.full(128, lo | lo << 4, np.uint8))
            value = float(d[i]) * scale * int(q[i]) - float(dmin) * mn
        blocks.append((np.concatenate(parts), value))
    data = np.stack([b for b, _ in blocks]).reshape(rows, -1)
    values = np.repeat(np.array([v for _, v in blocks], np.float32), 256).reshape(rows, cols)
    return data, values


# ---- raw GGUF headers, for malformed files --------------------------------------------------


def u32(n: int) -> bytes:
    return int(n).to_bytes(4, "little")


def u64(n: int) -> bytes:
    return int(n).to_bytes(8, "little")


def gguf_str(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return u64(len(data)) + data


def raw_gguf(kvs: list[bytes], tensors: list[bytes] = (), tensor_count=None, kv_count=None):
    """GGUF v3 header bytes: magic, version, counts (the real ones unless given), the
    already-encoded key/value entries and tensor infos; no data."""
    n_t = len(tensors) if tensor_count is None else tensor_count
    n_kv = len(kvs) if kv_count is None else kv_count
    return b"GGUF" + u32(3) + u64(n_t) + u64(n_kv) + b"".join(kvs) + b"".join(tensors)


def kv_string(key: str, value: str | bytes) -> bytes:
    return gguf_str(key) + u32(8) + gguf_str(value)


def kv_array(key: str, item_type: int, count: int, payload: bytes = b"") -> bytes:
    return gguf_str(key) + u32(9) + u32(item_type) + u64(count) + payload


def tensor_info(name: str, dims: list[int], qtype: int, offset: int) -> bytes:
    return (
        gguf_str(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(qtype) + u64(offset)
    )
