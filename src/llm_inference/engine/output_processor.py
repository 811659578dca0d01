"""The front end's per-request state: text, stop strings, logprobs and `n` fan-in.

It reads only the core's plain `EngineCoreOutput` records, never scheduler state, so it can
run on another thread or process than the core. For each user request it keeps one
`_Completion` per sample (n); core requests are the completions, named `request_id` when
n == 1 and `request_id#j` otherwise. `process_outputs` turns one step's records into a
`RequestOutput` for every user request that advanced, and returns the ids of completions that
a stop string ended, which the engine must finish in the core (`finish_requests`).

The core reports every step's new tokens for every request; the output kind of each request
(outputs.RequestOutputKind) decides what is emitted. CUMULATIVE outputs copy the completions'
text, token ids and logprobs so far every step (O(n) per step); DELTA outputs carry only what
the step added, for the completions that advanced (the lists of the core's records, not
copies), with the completions' running `cumulative_logprob`; FINAL_ONLY builds one cumulative
output when the request finishes: until then a step only collects its tokens (and logprobs),
and without stop strings the text is made once, at the end (detokenizer.py, `deferred`).

Text handed out is never taken back: a tail that could still grow into a stop string is held
back until the request goes on past it or finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_inference.core.outputs import EngineCoreOutput
from llm_inference.engine.detokenizer import IncrementalDetokenizer
from llm_inference.outputs import CompletionOutput, Logprobs, RequestOutput, RequestOutputKind
from llm_inference.sampling_params import SamplingParams

_CUMULATIVE, _DELTA, _FINAL = RequestOutputKind  # (CUMULATIVE, DELTA, FINAL_ONLY)


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
    cumulative_logprob: float | None = None  # DELTA: the running sum
    # DELTA: what the last step added (nothing is kept beyond it)
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[Logprobs] | None = None

    def delta_output(self) -> CompletionOutput:
        lps = self.new_logprobs
        if lps is None and self.params.logprobs is not None:
            lps = []
        return CompletionOutput(self.index, self.new_text, self.new_token_ids,
                                self.finish_reason, lps, self.stop_reason,
                                self.cumulative_logprob)  # fmt: skip

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
    kind: RequestOutputKind = _CUMULATIVE
    prompt_logprobs: list | None = None
    prompt_logprobs_new: bool = False  # arrived this step (DELTA outputs carry them once)

    @property
    def finished(self) -> bool:
        if len(self.completions) == 1:
            return self.completions[0].finish_reason is not None
        return all(c.finish_reason is not None for c in self.completions)

    def delta_output(self, advanced: list[_Completion]) -> RequestOutput:
        """The DELTA output of the completions that advanced (their delta fields)."""
        if len(advanced) > 1:
            advanced = sorted(advanced, key=lambda c: c.index)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.delta_output() for c in advanced], self.finished,
                             self._take_new_prompt_logprobs())  # fmt: skip

    def _take_new_prompt_logprobs(self) -> list | None:
        new, self.prompt_logprobs_new = self.prompt_logprobs_new, False
        return self.prompt_logprobs if new else None

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[c.output() for c in self.completions],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
        )


def _quiet(c: _Completion) -> bool:
    """Whether a FINAL_ONLY completion needs only its finishing record: no logprobs, and no
    text to follow before the end (no detokenizer, or a deferred one: no stop strings)."""
    p = c.params
    no_text = c.detokenizer is None or c.detokenizer.deferred
    return no_text and p.logprobs is None and p.prompt_logprobs is None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self._owner: dict[str, tuple[_RequestState, _Completion]] = {}  # core id -> state
        # Core ids of FINAL_ONLY completions that need nothing before their finishing record
        # (`_quiet`): process_outputs drops their other records unread.
        self._quiet: set[str] = set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        child_params: list[SamplingParams],
        stream: bool = True,
        output_kind: RequestOutputKind | None = None,
    ) -> list[str]:
        """Register a user request with one SamplingParams per completion; returns the core
        request ids of its completions. `output_kind` defaults to CUMULATIVE, or FINAL_ONLY
        with `stream=False` (its output is built only when it finishes: an offline batch needs
        no per-step outputs)."""
        kind = output_kind or (_CUMULATIVE if stream else _FINAL)
        n = len(child_params)
        deferred = kind is _FINAL
        completions = [
            _Completion(
                j,
                p,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p, deferred=deferred)
                if p.detokenize
                else None,
            )
            for j, p in enumerate(child_params)
        ]
        state = _RequestState(request_id, prompt, list(prompt_token_ids), completions, kind)
        self.requests[request_id] = state
        ids = [child_id(request_id, j, n) for j in range(n)]
        for cid, completion in zip(ids, completions):
            self._owner[cid] = (state, completion)
            if kind is _FINAL and _quiet(completion):
                self._quiet.add(cid)
        return ids

    def core_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        if state is None:
            return []
        n = len(state.completions)
        return [child_id(request_id, j, n) for j in range(n)]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a user request, marking its unfinished completions aborted; returns its
        final output (None if unknown): for a DELTA request, a delta of the completions it
        aborted (text held back so far, no tokens)."""
        for cid in self.core_ids(request_id):
            self._owner.pop(cid, None)
            self._quiet.discard(cid)
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        aborted = []
        for c in state.completions:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                tail = ""
                if c.detokenizer is not None:
                    if c.detokenizer.deferred:  # it has not seen the tokens yet
                        c.detokenizer.add_tokens(c.token_ids)
                    tail = c.detokenizer.get_delta(finished=True)
                if state.kind is _DELTA:
                    c.new_text, c.new_token_ids, c.new_logprobs = tail, [], None
                    aborted.append(c)
                else:  # text not yet handed out (held or not streamed)
                    c.text += tail
        if state.kind is _DELTA:
            return state.delta_output(aborted)
        return state.output()

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """(one RequestOutput per user request that advanced, core ids a stop string ended)."""
        advanced: dict[str, tuple[_RequestState, list[_Completion]]] = {}
        stopped: list[str] = []
        results = []
        quiet = self._quiet
        if quiet:  # their finishing records carry every output token: skip the others
            outputs = [
                o for o in outputs if o.finish_reason is not None or o.request_id not in quiet
            ]
        for out in outputs:
            owner = self._owner.get(out.request_id)
            if owner is None:
                continue  # aborted in the front end since
            state, completion = owner
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs, state.prompt_logprobs_new = out.prompt_logprobs, True
            if self._advance(completion, out, state.kind) and out.finish_reason is None:
                stopped.append(out.request_id)
            done = completion.finish_reason is not None
            if done:
                self._owner.pop(out.request_id, None)
                quiet.discard(out.request_id)
            if state.kind is _DELTA and len(state.completions) == 1:  # the server's requests
                results.append(RequestOutput(state.request_id, state.prompt,
                                             state.prompt_token_ids,
                                             [completion.delta_output()], done,
                                             state._take_new_prompt_logprobs()))  # fmt: skip
                if done:
                    del self.requests[state.request_id]
                continue
            if state.kind is not _FINAL or state.finished:
                advanced.setdefault(state.request_id, (state, []))[1].append(completion)
        for rid, (state, completions) in advanced.items():
            delta = state.kind is _DELTA
            results.append(state.delta_output(completions) if delta else state.output())
            if state.finished:
                del self.requests[rid]
        return results, stopped

    def _advance(self, c: _Completion, out: EngineCoreOutput, kind=_CUMULATIVE) -> bool:
        """Apply one record; True when a stop string ended the completion here. DELTA: the
        completion keeps only this step's additions. A deferred detokenizer (FINAL_ONLY, no
        stop strings) gets every token at once, when the completion finishes."""
        if kind is _DELTA:
            c.new_token_ids = out.new_token_ids
            c.new_logprobs = out.new_logprobs
        elif out.output_token_ids is not None:  # a finishing record: the whole output, a
            c.token_ids = out.output_token_ids  # list the core made for this record alone
        else:
            c.token_ids.extend(out.new_token_ids)
        if kind is not _DELTA and out.new_logprobs:
            c.logprobs.extend(out.new_logprobs)
        stop = self._detokenize(c, out, kind)
        if kind is _DELTA and c.new_logprobs:
            start = c.cumulative_logprob or 0.0  # summed in order, as `output` sums
            c.cumulative_logprob = sum((lp.logprob for lp in c.new_logprobs), start)
        return stop

    @staticmethod
    def _detokenize(c: _Completion, out: EngineCoreOutput, kind) -> bool:
        """The text of `out`'s tokens (`_advance`); True when a stop string ended it. A record
        of several steps (a front end that lagged: `merge_steps`) may hold tokens after the
        one that completed the stop string: they are dropped, as one step at a time would."""
        detokenizer = c.detokenizer
        if detokenizer is None:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
            return False
        if not detokenizer.deferred:
            text_ids = out.new_token_ids
        elif out.finish_reason is None:
            return False  # nothing to read before the end
        else:
            text_ids = c.token_ids
        if isinstance(out.stop_reason, int) and not c.params.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # a stop token's text is not part of the output
        read = len(detokenizer.token_ids)
        stop = detokenizer.add_tokens(text_ids)
        if stop is not None:
            c.finish_reason, c.stop_reason = "stop", stop
            after = len(out.new_token_ids) - (len(detokenizer.token_ids) - read)
            if after:  # (stop strings never defer: text_ids are the record's new tokens)
                if kind is _DELTA:
                    c.new_token_ids = c.new_token_ids[:-after]
                    c.new_logprobs = c.new_logprobs and c.new_logprobs[:-after]
                else:
                    c.token_ids = c.token_ids[:-after]
                    c.logprobs = c.logprobs[: len(c.token_ids)] if out.new_logprobs else c.logprobs
        elif out.finish_reason is not None:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        if kind is _DELTA:
            c.new_text = detokenizer.get_delta(finished=c.finish_reason is not None)
        elif kind is _CUMULATIVE or c.finish_reason is not None:
            c.text += detokenizer.get_delta(finished=c.finish_reason is not None)
        return stop is not None
