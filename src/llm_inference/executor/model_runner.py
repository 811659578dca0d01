"""ModelRunner: turns a SchedulerOutput into input tensors and AttentionMetadata, runs the
model, and samples. It owns the model and the paged KV cache of its rank."""

from __future__ import annotations

import torch

from llm_inference.config import EngineConfig
from llm_inference.core.kv_cache_manager import slot_mapping
from llm_inference.core.outputs import ModelRunnerOutput, SchedulerOutput
from llm_inference.distributed.parallel_state import get_tp_rank
from llm_inference.executor.cuda_graph import DecodeGraphs
from llm_inference.kernels import get_ops
from llm_inference.layers.attention import AttentionMetadata, PrefillSeq
from llm_inference.layers.sampler import Sampler, SamplingMetadata
from llm_inference.models.loader import load_model

CPU_DEFAULT_KV_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = getattr(torch, config.dtype)
        use_triton = device.type == "cuda" and config.kernel_backend != "reference"
        # The reference kernels sync with the host, which a graph capture forbids.
        self.use_cuda_graphs = use_triton and not config.enforce_eager
        self.model = load_model(
            config.model_path, device, self.dtype, get_ops(use_triton), config.model
        )
        # kernel_backend='reference' keeps the PyTorch sampler on CUDA too; else auto by device.
        self.sampler = Sampler(use_triton=False if config.kernel_backend == "reference" else None)
        self.block_size = config.cache.block_size
        self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None

    # ---- KV cache -------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        attn = self.model.attention_layers()
        per_layer = 2 * self.block_size * attn[0].num_kv_heads * attn[0].head_dim
        return per_layer * len(attn) * self.dtype.itemsize

    def determine_num_blocks(self) -> int:
        """Blocks that fit in `kv_cache_memory_bytes`, or in the memory left on the device
        (`gpu_memory_utilization` of it) after a warm-up forward of a full token budget."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_memory(cache.gpu_memory_utilization)
        else:
            sched = self.config.scheduler
            want = sched.max_num_seqs * sched.max_model_len // self.block_size + 1
            budget = min(CPU_DEFAULT_KV_BYTES, want * self.kv_bytes_per_block())
        return max(0, budget // self.kv_bytes_per_block())

    @torch.inference_mode()
    def _profile_free_memory(self, utilization: float) -> int:
        sched = self.config.scheduler
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = sched.max_num_batched_tokens
        lens = [min(sched.max_model_len, n - i) for i in range(0, n, sched.max_model_len)]
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(m, device=self.device) for m in lens])
        hidden = self.model(ids, pos, lens)
        rows = min(sched.max_num_seqs, n)
        self.model.compute_logits(hidden[:rows]).float()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        del hidden
        torch.cuda.empty_cache()
        return int(total * utilization - peak - max(0, others))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        for attn in self.model.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.use_cuda_graphs:
            sched = self.config.scheduler
            self.graphs = DecodeGraphs(
                self.model, sched.max_num_seqs, sched.max_model_len, self.block_size, self.device
            )
            self.graphs.capture()

    def release(self) -> None:
        self.graphs = None
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        del self.model

    # ---- one step ---------------------------------------------------------------------------

    def _forward(self, so: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run the model on the step's tokens; hidden states and the rows to sample from."""
        ids, positions, slots, logits_idx = [], [], [], []
        prefills: list[PrefillSeq] = []
        dec_idx, dec_tables, dec_lens = [], [], []
        for r in so.scheduled:
            start, n = r.start_position, len(r.token_ids)
            t0 = len(ids)
            ids += r.token_ids
            positions += range(start, start + n)
            slots += slot_mapping(r.block_ids, start, n, self.block_size)
            if n == 1:
                dec_idx.append(t0)
                dec_tables.append(r.block_ids)
                dec_lens.append(start + 1)
            else:
                table = torch.tensor(r.block_ids, dtype=torch.int32, device=self.device)
                prefills.append(PrefillSeq(t0, n, start, table))
            if r.needs_sample:
                logits_idx.append(len(ids) - 1)
        if not prefills and self.graphs is not None and self.graphs.can_run(len(dec_idx)):
            return self.graphs.run(ids, positions, slots, dec_tables, dec_lens), logits_idx
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), prefills=prefills
        )
        if dec_idx:
            width = max(len(t) for t in dec_tables)
            tables = [t + [0] * (width - len(t)) for t in dec_tables]
            md.decode_indices = torch.tensor(dec_idx, dtype=torch.long, device=dev)
            md.decode_block_tables = torch.tensor(tables, dtype=torch.int32, device=dev)
            md.decode_seq_lens = torch.tensor(dec_lens, dtype=torch.int32, device=dev)
            md.decode_max_seq_len = max(dec_lens)
            md.all_decode = not prefills
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return self.model(input_ids, pos, md), logits_idx

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        hidden, logits_idx = self._forward(so)
        req_ids = [r.request_id for r in so.scheduled]
        sampled: list[list[int]] = [[] for _ in so.scheduled]
        if not logits_idx:
            return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))
        logits = self.model.compute_logits(hidden[logits_idx])
        if get_tp_rank() != 0:
            return None  # sampling happens on rank 0 only
        rows = [r for r in so.scheduled if r.needs_sample]
        smd = SamplingMetadata.build(
            [r.sampling_params for r in rows],
            [r.prompt_token_ids for r in rows],
            [r.output_token_ids for r in rows],
            [r.sampling_params.seed for r in rows],
            self.config.model.eos_token_ids,
            self.config.model.vocab_size,
            self.device,
        )
        out = self.sampler(logits, smd)
        tokens = out.token_ids.tolist()
        logprobs: list[object | None] = [None] * len(req_ids)
        k = 0
        for i, r in enumerate(so.scheduled):
            if r.needs_sample:
                sampled[i] = [tokens[k]]
                if out.logprobs is not None:
                    logprobs[i] = out.logprobs[k]
                k += 1
        return ModelRunnerOutput(req_ids, sampled, logprobs)
