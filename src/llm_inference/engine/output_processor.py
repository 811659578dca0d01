"""The front end's per-request state: text, stop strings, logprobs and `n` fan-in.

It reads only the core's plain `EngineCoreOutput` records, never scheduler state, so it can
run on another thread or process than the core. For each user request it keeps one
`_Completion` per sample (n); core requests are the completions, named `request_id` when
n == 1 and `request_id#j` otherwise. `process_outputs` turns one step's records into a
`RequestOutput` for every user request that advanced, and returns the ids of completions that
a stop string ended, which the engine must finish in the core (`finish_requests`).

Text handed out is never taken back: a tail that could still grow into a stop string is held
back until the request goes on past it or finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_inference.core.outputs import EngineCoreOutput
from llm_inference.engine.detokenizer import IncrementalDetokenizer
from llm_inference.outputs import CompletionOutput, Logprobs, RequestOutput
from llm_inference.sampling_params import SamplingParams


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass
class _Completion:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None: detokenize=False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        want_lp = self.params.logprobs is not None
        lps = list(self.logprobs) if want_lp else None
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            logprobs=lps,
            stop_reason=self.stop_reason,
            cumulative_logprob=sum(lp.logprob for lp in lps) if lps else None,
        )


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    stream: bool = True  # False: an output only once finished

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[c.output() for c in self.completions],
            finished=self.finished,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self._owner: dict[str, tuple[_RequestState, _Completion]] = {}  # core id -> state

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        child_params: list[SamplingParams],
        stream: bool = True,
    ) -> list[str]:
        """Register a user request with one SamplingParams per completion; returns the core
        request ids of its completions. With `stream=False` its output is built only when it
        finishes (an offline batch needs no per-step outputs)."""
        n = len(child_params)
        completions = [
            _Completion(
                j,
                p,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p, deferred=not stream)
                if p.detokenize
                else None,
            )
            for j, p in enumerate(child_params)
        ]
        state = _RequestState(request_id, prompt, list(prompt_token_ids), completions, stream)
        self.requests[request_id] = state
        ids = [child_id(request_id, j, n) for j in range(n)]
        for cid, completion in zip(ids, completions):
            self._owner[cid] = (state, completion)
        return ids

    def core_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        if state is None:
            return []
        n = len(state.completions)
        return [child_id(request_id, j, n) for j in range(n)]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a user request, marking its unfinished completions aborted; returns its
        final output (None if unknown)."""
        for cid in self.core_ids(request_id):
            self._owner.pop(cid, None)
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for c in state.completions:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                if c.detokenizer is not None:  # text not yet handed out (held or not streamed)
                    c.text += c.detokenizer.get_delta(finished=True)
        return state.output()

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """(one RequestOutput per user request that advanced, core ids a stop string ended)."""
        advanced: dict[str, _RequestState] = {}
        stopped: list[str] = []
        for out in outputs:
            owner = self._owner.get(out.request_id)
            if owner is None:
                continue  # aborted in the front end since
            state, completion = owner
            if self._advance(completion, out, state.stream) and out.finish_reason is None:
                stopped.append(out.request_id)
            if completion.finish_reason is not None:
                self._owner.pop(out.request_id, None)
            if state.stream or state.finished:
                advanced[state.request_id] = state
        results = []
        for rid, state in advanced.items():
            results.append(state.output())
            if state.finished:
                del self.requests[rid]
        return results, stopped

    def _advance(self, c: _Completion, out: EngineCoreOutput, stream: bool = True) -> bool:
        """Apply one record; True when a stop string ended the completion here. Without
        `stream` the text is collected only when the completion finishes."""
        c.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            c.logprobs.extend(out.new_logprobs)
        if c.detokenizer is None:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
            return False
        text_ids = out.new_token_ids
        if isinstance(out.stop_reason, int) and not c.params.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # a stop token's text is not part of the output
        stop = c.detokenizer.add_tokens(text_ids)
        if stop is not None:
            c.finish_reason, c.stop_reason = "stop", stop
        elif out.finish_reason is not None:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        if stream or c.finish_reason is not None:
            c.text += c.detokenizer.get_delta(finished=c.finish_reason is not None)
        return stop is not None
