"""The offline API: `LLM(model).generate(prompts, sampling_params)` and `chat(...)`."""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Sequence
from dataclasses import replace

from tqdm.auto import tqdm

from llm_inference.beam_search import BeamSearchOutput, beam_search
from llm_inference.config import EngineConfig
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.engine.data_parallel import DataParallelCore
from llm_inference.engine.llm_engine import LLMEngine
from llm_inference.entrypoints.chat_template import load_chat_template, render_chat
from llm_inference.gc_heap import freeze_startup_heap, thaw_heap
from llm_inference.models.loader import load_tokenizer
from llm_inference.outputs import RequestOutput
from llm_inference.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | list[int]
# vLLM's prompt dicts (its TextPrompt and TokensPrompt) are taken too: {"prompt": text} or
# {"prompt_token_ids": ids}.
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _as_token(t) -> int | None:
    """`t` as a plain int if it is an integer scalar (int, numpy or 0-d torch integer; not a
    bool), else None."""
    if isinstance(t, int):
        return None if isinstance(t, bool) else int(t)
    if isinstance(t, (str, bytes, float)) or not hasattr(t, "__index__"):
        return None
    if getattr(t, "ndim", 0) != 0 or str(getattr(t, "dtype", "")) in ("bool", "torch.bool"):
        return None  # an array of one element, or a numpy / torch boolean
    try:
        return operator.index(t)
    except TypeError:
        return None


def _token_list(ids) -> list:
    """A prompt of token ids as a new list, integer scalars made plain ints (anything else is
    kept for validate_request to report)."""
    if isinstance(ids, list) and set(map(type, ids)) <= {int}:
        return list(ids)  # the common case, at C speed: plain ints already
    out = []
    for t in ids:
        v = _as_token(t)
        out.append(t if v is None else v)
    return out


def _from_dict(p: dict, i: int) -> Prompt:
    """A vLLM-style prompt dict as a string or a list of token ids."""
    other = sorted(str(k) for k in p if k not in PROMPT_KEYS)
    if other:
        raise ValueError(f"prompt {i}: unsupported keys {other}; a prompt dict holds "
                         "'prompt' (text) or 'prompt_token_ids' (token ids)")  # fmt: skip
    if len(p) != 1:
        raise ValueError(f"prompt {i}: give 'prompt' or 'prompt_token_ids', not both or neither")
    if "prompt" in p:
        if not isinstance(p["prompt"], str):
            raise TypeError(f"prompt {i}: 'prompt' must be a string, not "
                            f"{type(p['prompt']).__name__}")  # fmt: skip
        return p["prompt"]
    ids = p["prompt_token_ids"]
    if not isinstance(ids, (list, tuple)):
        hint = "; use .tolist()" if hasattr(ids, "tolist") else ""
        raise TypeError(f"prompt {i}: 'prompt_token_ids' must be a list of token ids, not "
                        f"{type(ids).__name__}{hint}")  # fmt: skip
    return _token_list(ids)


class LLM:
    """An engine for offline batches. `model` and the keyword arguments are the fields of
    `EngineArgs` (engine/arg_utils.py); an unknown keyword is a TypeError naming it.

    While it is open, the objects alive when it started (torch, the model, the caller's) sit in
    the cyclic GC's permanent generation (`gc.freeze()`), so that full collections do not stall
    generate; `close()` (or leaving the `with` block, or the LLM being collected) calls
    `gc.unfreeze()`."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        config = EngineArgs(model=model, **engine_args).create_engine_config()
        self.tokenizer = load_tokenizer(config.model_path)
        # Data parallelism: the engine cores run in processes (engine/data_parallel.py).
        core = DataParallelCore(config) if config.parallel.data_parallel_size > 1 else None
        self.engine = LLMEngine(config, self.tokenizer, core=core)
        self._ids = itertools.count()
        # Frozen until close(), so full GC collections skip them (gc_heap.py).
        freeze_startup_heap()
        self._thaw = weakref.finalize(self, thaw_heap)  # at close(), or when collected

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
        if getattr(self, "_thaw", None) is not None:
            self._thaw()  # once: a finalizer runs at most once

    @property
    def config(self) -> EngineConfig:
        """The engine's config (max_model_len as fitted to the KV cache at start)."""
        return self._engine().config

    def get_tokenizer(self):
        """The model's tokenizer (a transformers tokenizer), as vLLM's `LLM.get_tokenizer()`."""
        return self.tokenizer

    def stats(self) -> dict[str, int]:
        return self._engine().stats()

    def start_profile(self, trace_dir: str | None = None) -> None:
        """Start the torch profiler on every rank (GPU kernels on CUDA, operators on the CPU);
        with `trace_dir`, `stop_profile` also writes a Chrome trace per rank there."""
        self._engine().core.start_profile(trace_dir)

    def stop_profile(self) -> list[dict]:
        """Stop the profiler; per rank: {"rank", "device", "total_ms", "kernels": {name:
        {"ms", "calls"}}}, kernels sorted by time."""
        return self._engine().core.stop_profile()

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("this LLM has been closed; create a new one")
        return self.engine

    # ---- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_new_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt: text, a list of token ids, or vLLM's prompt dicts
        ({"prompt": text}, {"prompt_token_ids": ids}). Without `sampling_params` decoding is
        greedy. Outputs come back in input order. A request the engine refuses is a ValueError
        naming the prompt, before any runs; one whose grammar then fails to compile comes back
        with finish reason "abort" and the error as its completions' `stop_reason`."""
        self._engine()
        prompt_list = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(prompt_list), max_new_tokens)
        token_ids = self._token_ids(prompt_list)
        texts = [p if isinstance(p, str) else None for p in prompt_list]
        return self._run(texts, token_ids, params, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (text, token ids or vLLM's prompt dicts), as vLLM's
        `LLM.beam_search`: each output's `sequences` are the `params.beam_width` best, best
        first (beam_search.py says how they are found and scored)."""
        self._engine()
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, not {type(params).__name__}")
        prompt_list = self._normalize_prompts(prompts)
        token_ids = self._token_ids(prompt_list)
        for i, ids in enumerate(token_ids):  # each checked first: its rounds are other requests
            try:  # max_tokens=1: beams stop at max_model_len
                self.engine.validate_request(ids, SamplingParams(max_tokens=1))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        return beam_search(self, token_ids, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        max_new_tokens: int | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, as the server does
        (`chat_template.render_chat`: what messages hold, ValueError naming what is refused),
        then generate. `continue_final_message`: the last (assistant) message is left open for
        the model to continue (as vLLM's); `chat_template_kwargs`: extra template variables
        (e.g. Llama 3's `date_string`); `tools`: OpenAI-format tool definitions;
        `chat_template`: a Jinja template (or a file of one) instead of the tokenizer's."""
        self._engine()
        template = load_chat_template(chat_template)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                prompts.append(render_chat(
                    self.tokenizer, conv, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=tools,
                    chat_template_kwargs=chat_template_kwargs, chat_template=template,
                ))  # fmt: skip
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from e
        token_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        params = self._normalize_params(sampling_params, len(prompts), max_new_tokens)
        return self._run(prompts, token_ids, params, use_tqdm)

    def _token_ids(self, prompt_list: list[Prompt]) -> list[list[int]]:
        """Each prompt's token ids: text tokenized, token ids as they are."""
        return [p if isinstance(p, list) else self.tokenizer(p).input_ids for p in prompt_list]

    @staticmethod
    def _normalize_prompts(prompts) -> list[Prompt]:
        """A string, a list of token ids, a prompt dict, or a list of those. Token ids may be
        any integer scalars (numpy or 0-d torch integers too): they become plain ints. Other
        values in a list of token ids are left for validate_request to name."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            hint = ""
            if hasattr(prompts, "tolist"):  # a numpy array or torch tensor
                hint = (
                    "; pass token ids as a list (array.tolist()): an array's shape would be "
                    "ambiguous (one prompt or a batch) and its dtype may not be integer"
                )
            raise TypeError(
                "prompts must be a string, a list of token ids, a prompt dict or a list of "
                f"those, not {type(prompts).__name__}{hint}"
            )
        if any(_as_token(t) is not None for t in prompts) and not any(
            isinstance(p, (str, list, tuple)) for p in prompts
        ):
            return [_token_list(prompts)]  # one prompt given as token ids
        out: list[Prompt] = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                p = _from_dict(p, i)
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, (list, tuple)):
                out.append(_token_list(p))
            elif _as_token(p) is not None:
                raise TypeError(
                    f"prompt {i} is a token id among strings or lists: give one prompt's token "
                    "ids as a list of integers only, or a list of prompts"
                )
            else:
                hint = "; use .tolist()" if hasattr(p, "tolist") else ""
                raise TypeError(f"prompt {i} must be a string, a list of token ids or a "
                                f"prompt dict, not {type(p).__name__}{hint}")  # fmt: skip
        return out

    @staticmethod
    def _normalize_params(sampling_params, n: int, max_new_tokens: int | None):
        if sampling_params is None:
            sampling_params = SamplingParams(temperature=0.0)
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them (one per prompt), "
                f"not {type(sampling_params).__name__}"
            )
        for i, p in enumerate(sampling_params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, not "
                                f"{type(p).__name__}")  # fmt: skip
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        if max_new_tokens is not None:
            if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
                raise TypeError(
                    f"max_new_tokens must be an integer, not {type(max_new_tokens).__name__}"
                )
            if max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
            sampling_params = [replace(p, max_tokens=max_new_tokens) for p in sampling_params]
        return list(sampling_params)

    def _run(self, texts, token_ids, params, use_tqdm: bool) -> list[RequestOutput]:
        prefix = f"{next(self._ids)}-"
        ids = [f"{prefix}{i}" for i in range(len(token_ids))]
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        try:
            for i, (rid, text, prompt_ids, p) in enumerate(zip(ids, texts, token_ids, params)):
                try:  # every prompt is added (and checked) before the first step
                    self.engine.add_request(rid, prompt_ids, p, prompt=text, stream=False)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from e
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            # Leave the engine usable: drop whatever this call still had in flight (when a
            # prompt is refused: those added before it, which have not run).
            self.engine.abort_request([rid for rid in ids if rid not in final])
            raise
        finally:
            bar.close()
        return [final[rid] for rid in ids]
