"""ModelRunner: applies each SchedulerOutput diff to its input batch, builds the step's inputs
and attention metadata, runs the model, and samples. It owns the model and the paged KV cache
of its rank.

Start: `determine_num_blocks` (buffers sized by the config's max_model_len, an upper bound),
then `allocate_kv_cache(num_blocks, max_model_len)` with the engine's final max_model_len, which
the CUDA graphs and the warm-up are built for (`self.max_model_len`, the scheduler's value)."""

from __future__ import annotations

import numpy as np
import torch

from llm_inference.config import EngineConfig, cdiv
from llm_inference.core.outputs import ModelRunnerOutput, SchedulerOutput
from llm_inference.distributed.parallel_state import get_tp_rank, get_tp_size
from llm_inference.executor.cuda_graph import CudaGraphs, mixed_graph_sizes
from llm_inference.executor.input_batch import InputBatch, InputBuffers, StepInputs
from llm_inference.executor.pending import PendingOutput, TokenSlots
from llm_inference.executor.warm_up import run_warm_up
from llm_inference.kernels import get_ops
from llm_inference.models.loader import load_model
from llm_inference.sample.grammar import GrammarMask, MaskStaging
from llm_inference.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from llm_inference.sample.tensor_parallel import sample_tensor_parallel
from llm_inference.sampling_params import MAX_LOGPROBS, SamplingParams

CPU_DEFAULT_KV_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = getattr(torch, config.dtype)
        self.kv_dtype = getattr(torch, config.cache.kv_cache_dtype)  # dtype, or FP8
        # Every kernel choice (skinny GEMM, PDL, attention variants) is the ops object's.
        self.ops = get_ops(config.kernel_backend, device)
        # The reference kernels sync with the host, which a graph capture forbids.
        self.use_cuda_graphs = config.kernel_backend == "triton" and not config.enforce_eager
        self.model = load_model(config.model_path, self.ops, device, self.dtype, config.model)
        self.sampler = Sampler(self.ops)
        self.block_size = config.cache.block_size
        sched = config.scheduler
        self.input_batch = InputBatch(
            sched.max_num_seqs, sched.max_model_len, self.block_size, config.model.vocab_size
        )
        self.buffers = InputBuffers(
            max(sched.max_num_batched_tokens, sched.max_num_seqs),
            sched.max_num_seqs,
            cdiv(sched.max_model_len, self.block_size),
            device,
        )
        self.num_blocks = 0
        self.max_model_len = 0  # the engine's final value, set by allocate_kv_cache
        self.graphs: CudaGraphs | None = None
        # The last sampling step's tokens, on the device (InputBatch.prev_sample: whose).
        self.prev_tokens = torch.zeros(0, dtype=torch.long, device=device)
        # Pinned host buffers the sampled tokens are copied into, reused in turn.
        self.token_slots = TokenSlots(sched.max_num_seqs) if device.type == "cuda" else None
        # A step launched with execute_model(sample=False): what sample_tokens samples.
        self._unsampled: tuple | None = None
        # Where structured outputs' bitmasks go to the device from (allocated on first use).
        self.mask_staging = MaskStaging(device)

    # ---- KV cache -------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        attn = self.model.attention_layers()
        per_layer = 2 * self.block_size * attn[0].num_kv_heads * attn[0].head_dim
        return per_layer * len(attn) * self.kv_dtype.itemsize

    def determine_num_blocks(self) -> int:
        """Blocks that fit in `kv_cache_memory_bytes`, or on CUDA in what the memory profile
        leaves of `gpu_memory_utilization` (`_profile_free_memory`)."""
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

    def _profile_free_memory(self, utilization: float) -> int:
        """Bytes for the KV cache, as vLLM's `determine_available_memory`: run the largest step
        the scheduler can make, then give the KV cache `utilization * total` less the memory
        torch reserved at that step's peak (weights, activations, logits, sampler), the memory
        outside torch (CUDA context, NCCL) and the CUDA graphs' pool. The pool is private to
        the graphs, so eager steps and the sampler never reuse it: it comes on top of the
        peak. It keeps the activations of the largest mixed graph's forward (logits are taken
        outside the graphs), scaled from the profiled forward's: every kernel's memory is
        linear in the tokens. Reserved, not allocated, bytes: the segments a step's tensors
        come in are what the device lends (a fifth more at 16k tokens on the 8B shape)."""
        dev = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_reserved(dev)  # the weights
        hidden = self._profile_forward()
        forward = torch.cuda.max_memory_reserved(dev) - before
        self._profile_sampler(hidden)
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        peak = torch.cuda.max_memory_reserved(dev)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(dev))
        tokens = len(hidden)
        del hidden
        torch.cuda.empty_cache()
        sizes = self.mixed_graph_sizes()
        graph_pool = forward * sizes[-1] // tokens if sizes else 0
        return int(total * utilization) - peak - non_torch - graph_pool

    @torch.inference_mode()
    def _profile_forward(self) -> torch.Tensor:
        """The forward of the largest step: max_num_batched_tokens prompt tokens in sequences
        of up to max_model_len (at most max_num_seqs of them), through the input buffers and
        the kernels of real steps, over a KV cache of one block that no token writes (slot
        -1) and every sequence reads (a zero block table). So attention allocates what it
        does in a real step of these sizes. Returns the hidden states."""
        sched, buffers = self.config.scheduler, self.buffers
        n, longest = sched.max_num_batched_tokens, sched.max_model_len
        lens = [min(longest, n - i) for i in range(0, n, longest)][: sched.max_num_seqs]
        num_seqs, tokens, width = len(lens), sum(lens), cdiv(lens[0], self.block_size)
        b = buffers.np
        b.input_ids[:tokens] = 0
        b.positions[:tokens] = np.concatenate([np.arange(m) for m in lens])
        b.slot_mapping[:tokens] = -1
        b.query_start_loc[: num_seqs + 1] = np.cumsum([0, *lens])
        b.seq_lens[:num_seqs] = lens
        buffers.table_rows(num_seqs, width)[:] = 0
        buffers.to_device(num_seqs, width)
        md = self.model.attn_backend.metadata(
            buffers.attention, tokens, num_seqs, lens[0], lens[0], width
        )
        layers = self.model.attention_layers()
        shape = (1, self.block_size, layers[0].num_kv_heads, layers[0].head_dim)
        block = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for attn in layers:
            attn.k_cache = attn.v_cache = block
        try:
            return self.model(buffers.dev.input_ids[:tokens], buffers.dev.positions[:tokens], md)
        finally:
            for attn in layers:
                attn.k_cache = attn.v_cache = None

    @torch.inference_mode()
    def _profile_sampler(self, hidden: torch.Tensor) -> None:
        """The sampler's most demanding step: the logits of max_num_seqs rows (a step samples
        at most one row per sequence) on the host path with penalties, top-p, min-p and
        logprobs, whose float32 [rows, vocab] temporaries are the sampler's memory."""
        rows = min(self.config.scheduler.max_num_seqs, len(hidden))
        params = SamplingParams(
            top_p=0.9, min_p=0.01, repetition_penalty=1.1, presence_penalty=0.1,
            frequency_penalty=0.1, logprobs=MAX_LOGPROBS,
        )  # fmt: skip
        md = SamplingMetadata.build(
            [params] * rows, [[0]] * rows, [[0]] * rows, [0] * rows, (),
            self.config.model.vocab_size, self.device,
        )  # fmt: skip
        self.sampler(self.model.compute_logits(hidden[:rows]), md)

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the KV cache; `max_model_len`: the engine's final value, at most the
        config's (which sized the buffers)."""
        assert 0 < max_model_len <= self.config.scheduler.max_model_len, max_model_len
        self.num_blocks, self.max_model_len = num_blocks, max_model_len
        for attn in self.model.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        # Steps no graph holds run eagerly (with graphs: mixed steps past the buckets), and
        # their decodes' split counts follow their own sizes: warm them up in either case.
        self._warm_up_eager()
        if self.use_cuda_graphs:
            sched = self.config.scheduler
            self.graphs = CudaGraphs(
                self.model, self.buffers, sched.max_num_seqs, self.max_model_len,
                self.mixed_graph_sizes(),
            )  # fmt: skip
            self.graphs.capture()
        if self.device.type == "cuda" and self.sampler.fused:
            self._warm_up_sampler()

    def _warm_up_eager(self) -> None:
        """Compile what eager steps of any size launch before the first request: an
        all-padding forward per step shape the kernel ops list (executor/warm_up.py)."""
        attn, sched = self.model.attention_layers()[0], self.config.scheduler
        steps = self.ops.warm_up_shapes(
            attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim,
            self.block_size, sched.max_num_seqs, self.max_model_len,
            sched.max_num_batched_tokens,
        )  # fmt: skip
        run_warm_up(self.model, self.buffers, sched.max_num_seqs, steps)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _warm_up_sampler(self) -> None:
        """Compile the fused sampler's kernels for the staged sampling inputs on the model's
        logits and for the slow path's (rows with logprobs, penalties or a logit bias sample a
        float32 copy: sample/sampler.py), and the LM head at every power-of-two row count and
        at all rows, before the first request, as the graph capture does the model's
        (kernels/sampling.py, "Compiles"). The logits are taken outside the graphs, and a small
        batch's LM head takes the skinny GEMM, a variant per row count padded to a power of two
        (16, 32, 64): without these, the first step to sample 17-32 rows compiled one, mid-run
        (benchmarks/DECISIONS.md)."""
        rows, staged = self.config.scheduler.max_num_seqs, self.buffers.dev.sampling
        lm_head = self.model.lm_head
        hidden = torch.zeros(rows, lm_head.weight.shape[1], dtype=self.dtype, device=self.device)
        tp = get_tp_size() > 1  # no collective: each rank its own slice
        head = lm_head.compute_local_logits if tp else self.model.compute_logits
        if self.device.type == "cuda":  # where kernels compile
            for n in (1 << i for i in range(rows.bit_length())):
                head(hidden[:n])
        logits = head(hidden)
        # The slow path's rows sample a float32 copy, with SamplingMetadata.build's tensors:
        # int64 keys, bool greedy flags and temperatures each in an allocation of its own
        # (Triton specializes on a pointer's 16-byte alignment, which the staged temperatures,
        # a view into the staging buffer, lack): another compiled variant.
        built = (staged.keys.long() & 0xFFFFFFFF, staged.temperature.clone(), staged.greedy.bool())
        vocab_start = lm_head.vocab_start if tp else None
        # The staged rows' filtered search too (top-p; top-k and top-p), on their own arrays,
        # top-k off (each step's staging copy overwrites them); at TP > 1 those rows gather.
        filters = () if tp else (staged.top_k.fill_(1 << 30), staged.top_p)
        self.sampler.warm_up(
            logits, staged.keys, staged.temperature, staged.greedy, vocab_start, *filters
        )
        self.sampler.warm_up(logits.float(), *built, vocab_start)

    def mixed_graph_sizes(self) -> list[int]:
        """Token buckets of the mixed-step graphs (none without CUDA graphs)."""
        if not self.use_cuda_graphs:
            return []
        return mixed_graph_sizes(self.config.scheduler.max_num_batched_tokens)

    def release(self) -> None:
        self.graphs = None
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        del self.model

    # ---- one step ---------------------------------------------------------------------------

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """Run the model on the step's tokens (inputs already in the host buffers): replay the
        smallest CUDA graph that holds the step (padded to it), or run it eagerly."""
        num_seqs, width = step.num_seqs, step.block_width
        key = self.graphs.select(step) if self.graphs is not None else None
        if key is not None:
            self.graphs.pad(key, step.num_tokens, num_seqs)
        self.buffers.to_device(num_seqs, width)
        self._fill_placeholders(len(step.placeholder_tokens), step.placeholders_in_place)
        if key is not None:
            return self.graphs.replay(key, step.num_tokens)
        md = self.model.attn_backend.metadata(
            self.buffers.attention, step.num_tokens, num_seqs, step.max_query_len,
            step.max_seq_len, width,
        )  # fmt: skip
        dev, n = self.buffers.dev, step.num_tokens
        return self.model(dev.input_ids[:n], dev.positions[:n], md)

    def _fill_placeholders(self, m: int, in_place: bool = False) -> None:
        """On the device: input_ids[dst] = previous step's sampled tokens[src]; `in_place`
        (dst and src both 0..m-1): one copy instead of five small ops."""
        if not m:
            return
        dev = self.buffers.dev
        if in_place:
            dev.input_ids[:m].copy_(self.prev_tokens[:m])
            return
        dst = dev.placeholder_dst[:m].long()
        tokens = self.prev_tokens.index_select(0, dev.placeholder_src[:m].long())
        dev.input_ids.index_copy_(0, dst, tokens.to(torch.int32))

    def _keep_sampled(
        self, req_ids: list[str], step: StepInputs, out: SamplerOutput, prompt_lps=None
    ) -> PendingOutput | None:
        """The step's tokens stay on the device for the next step's placeholders (at TP > 1
        every rank holds the same tensor and fills its own); rank 0 starts their copy to the
        host."""
        self.prev_tokens = out.token_ids
        self.input_batch.set_sampled(step.sample_batch_rows)
        if get_tp_rank() != 0:
            return None
        pending = PendingOutput.launch(req_ids, step.sample_rows, out, self.token_slots)
        pending.prompt_logprobs = prompt_lps
        return pending

    # logits rows at a time: [128, V] float32 is 66 MB at V=128k, a few of them at once (less
    # than the profiled sampler step holds at max_num_seqs >= 128 rows)
    PROMPT_LOGPROB_ROWS = 128

    def _prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs) -> dict | None:
        """ModelRunnerOutput.prompt_logprobs of the step (rank 0; other ranks None). Collective
        at TP > 1 (the logits are gathered over the ranks), so every rank calls it. Waits for
        the device: a request that asks for prompt logprobs costs its steps the overlap."""
        from llm_inference.outputs import Logprobs

        entries = step.prompt_logprobs
        flat = torch.from_numpy(np.concatenate([e[2] for e in entries])).to(self.device)
        targets = torch.from_numpy(np.concatenate([e[3] for e in entries])).to(self.device)
        k = max(e[4] for e in entries)
        chosen, top_values, top_ids = [], [], []
        for s in range(0, len(flat), self.PROMPT_LOGPROB_ROWS):
            rows = flat[s : s + self.PROMPT_LOGPROB_ROWS]
            lp = self.model.compute_logits(hidden.index_select(0, rows)).float().log_softmax(-1)
            chosen.append(lp.gather(1, targets[s : s + len(rows), None])[:, 0])
            if k:
                values, ids = lp.topk(k, dim=-1)
                top_values.append(values)
                top_ids.append(ids)
        if get_tp_rank() != 0:
            return None
        chosen = torch.cat(chosen).tolist()
        top_values = torch.cat(top_values).tolist() if k else None
        top_ids = torch.cat(top_ids).tolist() if k else None
        out, i = {}, 0
        for rid, start, positions, tokens, req_k in entries:
            lps = []
            for j, token in enumerate(tokens.tolist()):
                top = (
                    {}
                    if not req_k
                    else dict(zip(top_ids[i + j][:req_k], top_values[i + j][:req_k]))
                )
                lps.append(Logprobs(token, chosen[i + j], top))
            out[rid] = (start, lps)
            i += len(positions)
        return out

    def sampling_metadata(self, step: StepInputs, ks: list[int] | None = None) -> SamplingMetadata:
        """Sampling inputs of the step's sample rows `ks` (default: all), in that order: as
        staged on the device when they were, else built from the input batch's rows."""
        if ks is None and step.sampling is not None:
            return self.buffers.dev.sampling.as_metadata(
                len(step.sample_rows), step.sampling, self.config.model.vocab_size,
                canonical=not self.sampler.fused,
            )  # fmt: skip
        rows, num_outputs = step.sample_batch_rows.tolist(), step.num_outputs
        if ks is not None:
            rows, num_outputs = [rows[k] for k in ks], [num_outputs[k] for k in ks]
        return self.input_batch.sampling.metadata(
            rows, num_outputs, self.config.model.eos_token_ids, self.device
        )

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, sync: bool = True, sample: bool = True
    ) -> PendingOutput | None:
        """Run one step. The sampled tokens stay on the device for the next step (async
        scheduling) and come to the host by one non-blocking copy: `result()` of the
        returned PendingOutput waits for them. Ranks other than 0 return None.

        `sample=False` (a step with constrained sample rows, under async scheduling) launches
        the forward and the logits only and returns None: `sample_tokens` samples them once
        the engine core has filled the grammar bitmask, which needs the step before's tokens."""
        self.input_batch.apply(so)
        req_ids = so.request_ids
        if so.is_empty:
            return PendingOutput.done(ModelRunnerOutput(req_ids, [[] for _ in req_ids]))
        step = self.input_batch.prepare(so, self.buffers)
        hidden = self._forward(step)
        prompt_lps = None if step.prompt_logprobs is None else self._prompt_logprobs(hidden, step)
        if not step.sample_rows:
            empty = ModelRunnerOutput(
                req_ids, [[] for _ in req_ids], [None] * len(req_ids), prompt_lps
            )
            return PendingOutput.done(empty)
        num_samples = len(step.sample_rows)
        if num_samples == step.num_tokens:  # every token samples (decodes): rows 0..n-1
            hidden_rows = hidden[:num_samples]
        else:
            hidden_rows = hidden.index_select(0, self.buffers.dev.logits_indices[:num_samples])
        if get_tp_size() > 1:  # each rank its vocabulary slice (sample/tensor_parallel.py)
            logits = self.model.lm_head.compute_local_logits(hidden_rows)
        else:
            logits = self.model.compute_logits(hidden_rows)
        if not sample:
            self._unsampled = (so, step, logits, prompt_lps)
            return None
        return self._sample(so, step, logits, prompt_lps, so.grammar_bitmask, sync)

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask) -> PendingOutput | None:
        """Sample the step `execute_model(sample=False)` launched, its constrained rows masked
        by `grammar_bitmask` (rows in the order of its `structured_output_request_ids`), as
        `execute_model(sync=False)` would have. Every rank calls it (collective at TP > 1)."""
        so, step, logits, prompt_lps = self._unsampled
        self._unsampled = None
        return self._sample(so, step, logits, prompt_lps, grammar_bitmask, sync=False)

    def _sample(
        self, so: SchedulerOutput, step: StepInputs, logits: torch.Tensor, prompt_lps,
        grammar_bitmask, sync: bool,
    ) -> PendingOutput | None:  # fmt: skip
        """Sample a step's logits (at TP > 1 this rank's vocabulary slice) and keep the
        tokens (`_keep_sampled`)."""
        grammar = self._grammar_mask(so, step, grammar_bitmask)
        if get_tp_size() > 1:  # tensor parallel: sample across the vocabulary shards
            lm_head = self.model.lm_head
            out = sample_tensor_parallel(
                self.sampler, logits, lm_head.vocab_start, lm_head.vocab_size,
                None if step.sampling is None else self.sampling_metadata(step),
                self.input_batch.sampling.argmax_only(step.sample_batch_rows),
                lambda ks: self.sampling_metadata(step, ks), grammar,
            )  # fmt: skip
        else:
            smd = self.sampling_metadata(step)
            smd.grammar = grammar
            out = self.sampler(logits, smd, sync=sync)
        return self._keep_sampled(step.request_ids, step, out, prompt_lps)

    def grammar_bitmask_buffer(self, m: int, words: int):
        """Where the engine core may fill a step's bitmask of m rows (MaskStaging.bitmask_buffer:
        the buffer it goes to the device from)."""
        return self.mask_staging.bitmask_buffer(m, words, self.config.scheduler.max_num_seqs)

    def _grammar_mask(self, so: SchedulerOutput, step: StepInputs, bitmask) -> GrammarMask | None:
        """The step's grammar bitmask (structured outputs) on the device, for the sample rows
        of the requests the engine core filled it for (in batch order, as the sample rows)."""
        if bitmask is None:
            return None
        ids = set(so.structured_output_request_ids)
        rows = [k for k, b in enumerate(step.sample_rows) if step.request_ids[b] in ids]
        return self.mask_staging.build(bitmask, rows, len(step.sample_rows))
