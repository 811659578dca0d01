"""The offline API: `LLM(model).generate(prompts, sampling_params)` and `chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from llm_inference.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from llm_inference.engine.llm_engine import LLMEngine, RequestState
from llm_inference.models.loader import load_model_config, load_tokenizer
from llm_inference.outputs import CompletionOutput, RequestOutput
from llm_inference.sampling_params import SamplingParams

Prompt = str | list[int]


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> str:
    """ "auto": the checkpoint's half-precision type on CUDA (bfloat16 for float32 checkpoints),
    float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        return dtype
    if device.type != "cuda":
        return "float32"
    return "float16" if config.torch_dtype == "float16" else "bfloat16"


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        device: str | None = None,
        dtype: str | torch.dtype = "auto",
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        kernel_backend: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        from llm_inference.models.default_model import resolve_model

        model_path = str(resolve_model(model))
        model_config = load_model_config(model_path)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        max_len = max_model_len or model_config.max_position_embeddings
        if max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{model_config.max_position_embeddings}"
            )
        if kernel_backend not in ("auto", "reference"):
            raise ValueError(
                f"kernel_backend must be 'auto' or 'reference', not {kernel_backend!r}"
            )
        self.config = EngineConfig(
            model_path=model_path,
            model=model_config,
            cache=CacheConfig(block_size, kv_cache_memory_bytes, gpu_memory_utilization),
            scheduler=SchedulerConfig(
                max_num_seqs, max_num_batched_tokens or max(8192, max_num_seqs), max_len
            ),
            parallel=ParallelConfig(tensor_parallel_size),
            device=str(dev),
            dtype=resolve_dtype(dtype, model_config, dev),
            kernel_backend=kernel_backend,
            enforce_eager=enforce_eager,
            seed=seed,
        )
        self.tokenizer = load_tokenizer(model_path)
        self.engine = LLMEngine(self.config, self.tokenizer)
        self._ids = itertools.count()

    # ---- context manager ----------------------------------------------------------------------

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the model, the KV cache and any worker processes."""
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    # ---- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_new_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids). Without `sampling_params`
        decoding is greedy. Outputs come back in input order."""
        prompt_list = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(prompt_list), max_new_tokens)
        token_ids = [p if isinstance(p, list) else self.tokenizer(p).input_ids for p in prompt_list]
        self._validate(token_ids, params)
        texts = [p if isinstance(p, str) else None for p in prompt_list]
        return self._run(texts, token_ids, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_new_tokens: int | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            for conv in conversations
        ]
        token_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        params = self._normalize_params(sampling_params, len(prompts), max_new_tokens)
        self._validate(token_ids, params)
        return self._run(prompts, token_ids, params, use_tqdm)

    @staticmethod
    def _normalize_prompts(prompts) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return [p if isinstance(p, str) else list(p) for p in prompts]

    @staticmethod
    def _normalize_params(sampling_params, n: int, max_new_tokens: int | None):
        if sampling_params is None:
            sampling_params = SamplingParams(temperature=0.0)
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        if max_new_tokens is not None:
            if max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
            sampling_params = [replace(p, max_tokens=max_new_tokens) for p in sampling_params]
        return list(sampling_params)

    def _validate(self, token_ids: list[list[int]], params: list[SamplingParams]) -> None:
        max_len = self.config.scheduler.max_model_len
        vocab = self.config.model.vocab_size
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= max_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens, which leaves no room to generate "
                    f"within max_model_len={max_len}"
                )
            if p.max_tokens is not None and len(ids) + p.max_tokens > max_len:
                raise ValueError(
                    f"prompt {i}: {len(ids)} prompt tokens + max_tokens={p.max_tokens} = "
                    f"{len(ids) + p.max_tokens} exceeds max_model_len={max_len}"
                )
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")

    def _run(self, texts, token_ids, params, use_tqdm: bool) -> list[RequestOutput]:
        prefix = f"{next(self._ids)}-"
        ids_by_prompt: list[list[str]] = []
        prompt_of: dict[str, int] = {}
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            children = []
            for j in range(p.n):
                rid = f"{prefix}{i}-{j}"
                child = p if p.n == 1 else replace(p, n=1, seed=_child_seed(p.seed, j))
                self.engine.add_request(rid, ids, child)
                children.append(rid)
                prompt_of[rid] = i
            ids_by_prompt.append(children)
        done: dict[str, RequestState] = {}
        bar = tqdm(total=len(token_ids), desc="Generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for state in self.engine.step():
                    done[state.request.request_id] = state
                    siblings = ids_by_prompt[prompt_of[state.request.request_id]]
                    if all(c in done for c in siblings):
                        bar.update(1)
        except BaseException:
            # Leave the engine usable: drop whatever this call still had in flight.
            self.engine.abort_request([c for cs in ids_by_prompt for c in cs if c not in done])
            raise
        finally:
            bar.close()
        return [
            RequestOutput(
                request_id=f"{prefix}{i}",
                prompt=texts[i],
                prompt_token_ids=token_ids[i],
                outputs=[_completion(j, done[c]) for j, c in enumerate(children)],
                finished=True,
            )
            for i, children in enumerate(ids_by_prompt)
        ]


def _child_seed(seed: int | None, index: int) -> int | None:
    if seed is None:
        return None
    return seed if index == 0 else (seed * 1_000_003 + index) % (1 << 63)


def _completion(index: int, state: RequestState) -> CompletionOutput:
    r = state.request
    logprobs = state.logprobs if r.sampling_params.logprobs is not None else None
    cumulative = sum(lp.logprob for lp in logprobs) if logprobs else None
    return CompletionOutput(
        index=index,
        text=state.detokenizer.output_text,
        token_ids=list(r.output_token_ids),
        finish_reason=r.finish_reason,
        logprobs=logprobs,
        stop_reason=r.stop_reason,
        cumulative_logprob=cumulative,
    )
