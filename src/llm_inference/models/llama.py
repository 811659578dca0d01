"""The Llama layout as a composition of tensor-parallel layers: the decoder of every family in
models/registry.py (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5, Qwen3), whose differences are two
hooks of the config: `qkv_bias` (Qwen2: the q, k and v projections have a bias) and `qk_norm`
(Qwen3: each q and k head is RMS-normalized before RoPE; its head_dim is its own).

`forward(input_ids, positions, attn)` takes a flat batch: 1-D `input_ids` and `positions`
holding the tokens of several sequences back to back, and either an `AttentionMetadata` or the
list of sequence lengths (then attention is causal within each sequence, with no KV cache).
It returns hidden states [T, hidden]; `compute_logits` maps selected rows to the vocabulary.

Every kernel runs through `ops` (kernels.get_ops), every matmul through its layer's linear
method (layers/quantization; `quant_config` None: unquantized).
"""

from __future__ import annotations

import torch
from torch import nn

from llm_inference.config import ModelConfig
from llm_inference.kernels import KernelOps
from llm_inference.layers.attention import Attention, AttentionBackend, AttentionMetadata
from llm_inference.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llm_inference.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from llm_inference.layers.norm import RMSNorm
from llm_inference.layers.quantization import QuantizationConfig
from llm_inference.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: KernelOps,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.qkv_proj = QKVParallelLinear(
            c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, ops,
            quant_config, bias=c.qkv_bias,
        )  # fmt: skip
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = c.head_dim
        self.o_proj = RowParallelLinear(  # summed over the ranks in the norm after it
            c.num_attention_heads * c.head_dim, c.hidden_size, ops, quant_config,
            reduce_results=False,
        )  # fmt: skip
        self.qk_norm = c.qk_norm
        if c.qk_norm:  # one weight of head_dim for every head: replicated on every rank
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, ops)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, ops)
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, c.head_dim, c.head_dim**-0.5, backend
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm:  # rows of one head each (a copy: q and k are views into qkv)
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # RoPE in the attention backend, fused with the KV-cache store.
        out = self.attn(q, k, v, md, positions, self.rotary.cos_sin_cache)
        return self.o_proj(out.reshape(-1, q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, ops: KernelOps, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [i, i], ops, quant_config
        )
        self.down_proj = RowParallelLinear(  # summed in the next norm, as o_proj
            i, config.hidden_size, ops, quant_config, reduce_results=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up and SiLU-and-mul, one kernel where the linear method fuses them
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: KernelOps,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend, ops, quant_config)
        self.mlp = LlamaMLP(config, ops, quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, x, residual, md):
        """x: the embeddings (first layer, `residual` None) or the previous layer's MLP output,
        a per-rank partial sum; returns this layer's partial MLP output and the residual. Each
        norm quantizes its output where the FP8 layer after it would (`quantize`)."""
        quantize = self.self_attn.qkv_proj.takes_quantized(x)
        if residual is None:
            residual = x
            x = self.input_layernorm(x, quantize=quantize)
        else:
            x, residual = self.input_layernorm(x, residual, partial=True, quantize=quantize)
        x = self.self_attn(positions, x, md)
        quantize = self.mlp.gate_up_proj.takes_quantized(x)
        x, residual = self.post_attention_layernorm(x, residual, partial=True, quantize=quantize)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # Checkpoint name -> (our fused parameter, shard id).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: ModelConfig, ops: KernelOps, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = AttentionBackend(ops)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            ops,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, self.attn_backend, ops, quant_config)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # The norms that sum partial outputs, in forward order: consecutive numbers.
        for i, layer in enumerate(self.layers):
            layer.input_layernorm.fuse_index = 2 * i - 1  # (unused in layer 0)
            layer.post_attention_layernorm.fuse_index = 2 * i
        self.norm.fuse_index = 2 * len(self.layers) - 1
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ops)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | list[int],
    ) -> torch.Tensor:
        md = attn if isinstance(attn, AttentionMetadata) else AttentionMetadata.dense(list(attn))
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        x, _ = self.norm(x, residual, partial=True)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]
