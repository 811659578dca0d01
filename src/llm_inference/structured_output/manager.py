"""The engine core's side of structured outputs: grammars compiled off the step loop, and each
step's token bitmask (ARCHITECTURE.md, "Structured outputs").

`add(request)` gives a request its `RequestGrammar` and starts compiling its spec on a thread
pool (xgrammar's compiler releases the GIL while it works, and caches what it compiled by spec:
n completions of a request, or requests with one schema, compile once). The scheduler admits
the request only once `grammar.ready`, so a compile never holds up other requests' steps. For
each step, `fill_bitmask` writes the bitmask for the requests the scheduler listed (those with
a grammar that sample in it): each one's matcher first accepts the output tokens it has not
seen (the usual one new token each: in one batch call), then xgrammar fills all their rows
in one call. The engine core calls it once every token before the step is known (under async
scheduling, after the step's forward is launched and the step before's tokens are read:
engine/engine_core.py). A listed request that has finished since (the step before's token
ended it) gets a row allowing every token: its sample is discarded, and its matcher, perhaps
terminated, sees nothing more. The matcher follows the request's output tokens alone;
preemption keeps them (the request recomputes them), so no matcher ever goes back.

A grammar that fails to compile (the front end's `check_spec` lets through only specs that
parse, so this is xgrammar failing) is reported by `take_failed`: the core finishes such a
request, never runs it unconstrained.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

from llm_inference.structured_output.spec import compile_grammar, grammar_key

# Compiled grammars xgrammar keeps for reuse (least recently used ones go beyond): vLLM's
# default. Without a bound a server of many distinct schemas would grow without end.
CACHE_LIMIT_BYTES = 512 << 20
# Threads of xgrammar's batch fill of a step's bitmask rows (one C++ call for all rows, the GIL
# released): benchmarks/grammar_fill.py measures the choice (DECISIONS.md).
FILL_THREADS = 1


class RequestGrammar:
    """One request's grammar: its compile (a Future), then its matcher, which has accepted
    the request's first `num_accepted` output tokens and ends on `stop_token_ids`."""

    def __init__(self, compiled: Future, stop_token_ids: list[int]) -> None:
        self.compiled = compiled
        self._stop_token_ids = stop_token_ids
        self._matcher = None
        self.num_accepted = 0

    @property
    def ready(self) -> bool:
        """Compiled: the request may run. (One whose compile failed never is: `take_failed`
        reports it, and the core finishes it.)"""
        return self.compiled.done() and self.compiled.exception() is None

    @property
    def error(self) -> BaseException | None:
        """The compile's error, once it failed."""
        return self.compiled.exception() if self.compiled.done() else None

    def matcher(self):
        """The request's matcher, made on first use (once compiled)."""
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(
                self.compiled.result(), override_stop_tokens=self._stop_token_ids
            )
        return self._matcher

    def advance(self, output_token_ids: list[int]):
        """Accept the output tokens not yet seen; return the matcher, for the step's bitmask
        fill. A token the grammar rejects raises: the sampler draws only tokens of the mask, so
        that would be a bug, not the model's doing."""
        matcher = self.matcher()
        for token in output_token_ids[self.num_accepted :]:
            _check_accepted(matcher.accept_token(token), token)
            self.num_accepted += 1
        return matcher


def _check_accepted(accepted: bool, token: int) -> None:
    if not accepted:
        raise RuntimeError(f"the grammar rejected token {token} of its own mask")


class StructuredOutputManager:
    """Compiles the grammars of `add`ed requests and fills the steps' bitmasks; see the module
    docstring. `load_tokenizer()` gives the model's tokenizer (loaded on the first structured
    request, on the pool's thread); the bitmask covers `vocab_size` tokens, the model's, and
    is filled where `bitmask_buffer(rows, words)` says (Executor.grammar_bitmask_buffer: the
    worker's own buffer), or in a new array where it says None."""

    def __init__(
        self,
        load_tokenizer: Callable[[], object],
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        bitmask_buffer: Callable[[int, int], np.ndarray | None] = lambda m, words: None,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self._bitmask_buffer = bitmask_buffer
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.threads = max(1, min((os.cpu_count() or 1) // 2, 8))  # as vLLM
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
        self._lock = threading.Lock()  # the compiler is built once, by the first compile
        self._compiling: dict[str, object] = {}  # request id -> Request, until compiled
        self._filler = None  # xgrammar's batch matcher: every row's fill in one call

    def add(self, request) -> None:
        """Start compiling `request`'s grammar (its sampling params have structured outputs)
        and set `request.grammar`."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grammar")
        key = grammar_key(request.sampling_params.structured_outputs)
        compiled = self._pool.submit(lambda: compile_grammar(self._get_compiler(), key))
        request.grammar = RequestGrammar(compiled, sorted(request.stop_token_set))
        self._compiling[request.request_id] = request

    def _get_compiler(self):
        """The xgrammar compiler for the model's tokenizer, built by the first compile."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._load_tokenizer(), vocab_size=self.vocab_size,
                    stop_token_ids=list(self.eos_token_ids),
                )  # fmt: skip
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self.threads, cache_limit_bytes=CACHE_LIMIT_BYTES
                )
            return self._compiler

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def wait(self, timeout: float) -> None:
        """Wait until a grammar being compiled is done, at most `timeout` seconds: an engine
        with nothing else to run waits here instead of spinning."""
        wait([r.grammar.compiled for r in self._compiling.values()], timeout, FIRST_COMPLETED)

    def take_failed(self) -> list[tuple[object, BaseException]]:
        """(request, error) for each unfinished request whose grammar failed to compile since
        the last call; requests compiled or finished are forgotten."""
        failed = []
        for rid, request in list(self._compiling.items()):
            if request.is_finished or request.grammar.compiled.done():
                del self._compiling[rid]
                if not request.is_finished and request.grammar.error is not None:
                    failed.append((request, request.grammar.error))
        return failed

    def fill_bitmask(self, request_ids: list[str], requests: dict) -> np.ndarray:
        """The token bitmask of a step: row i for request `request_ids[i]` (`requests`: the
        scheduler's unfinished ones, by id; a request not there gets every token),
        int32 [len(request_ids), ceil(vocab_size / 32)]. In the worker's buffer where
        `bitmask_buffer` gives one: valid until the next step's fill."""
        import xgrammar as xgr

        shape = len(request_ids), -(-self.vocab_size // 32)
        bitmask = self._bitmask_buffer(*shape)
        if bitmask is None:
            bitmask = np.empty(shape, dtype=np.int32)
        matchers, rows, accepting, tokens = [], [], [], []
        for row, rid in enumerate(request_ids):
            request = requests.get(rid)
            if request is None:  # finished since it was scheduled: its sample is discarded
                bitmask[row] = -1
                continue
            grammar, outputs = request.grammar, request.output_token_ids
            if len(outputs) == grammar.num_accepted + 1:  # the usual one new token
                accepting.append(grammar.matcher())
                tokens.append(outputs[-1])
                grammar.num_accepted += 1
                matchers.append(accepting[-1])
            else:
                matchers.append(grammar.advance(outputs))
            rows.append(row)
        if accepting:  # one C++ call for every one-token advance
            for ok, token in zip(xgr.BatchGrammarMatcher.batch_accept_token(accepting, tokens),
                                 tokens):  # fmt: skip
                _check_accepted(ok, token)
        if matchers:
            if self._filler is None:
                self._filler = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
            self._filler.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
