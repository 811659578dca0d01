"""SamplingParams: how one request picks its tokens (vLLM-compatible names).

Every field is checked in ``__post_init__``; an invalid value raises ``ValueError`` whose
message names the field and the range it allows. The objects are frozen: what validation
derives (`stop_strings`, `sampling_path`) is computed once, in ``__post_init__``, and a change
(a seed, the token ids of bad words) makes a new validated object
(`dataclasses.replace`). Lists given are stored as tuples, so one object can be shared by the
front end, the scheduler and the workers, and pickled to worker processes, as plain data.
"""

from __future__ import annotations

import dataclasses
import enum
import json as json_module  # (`json` is a field of StructuredOutputsParams)
import math
from dataclasses import dataclass, field
from typing import ClassVar

# Temperatures below this are treated as greedy (argmax), as vLLM does.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_text(x: object) -> bool:
    """A non-empty string the tokenizer can take: valid Unicode (JSON's \\ud800 escapes carry
    lone surrogates, which no UTF-8 encoder accepts)."""
    if not isinstance(x, str) or not x:
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class SamplingPath(enum.IntEnum):
    """How a request's tokens are sampled, decided once from its parameters when they are
    validated (`SamplingParams.sampling_path`). Each path needs everything the ones before it
    need; the engine core, the worker's input batch and the sampler all read this one value.

    STAGED: temperature, top-k, top-p, min-p and the seed only. The worker stages these
        numbers into the step's device buffers and the sampler reads them there, its logits
        untouched before the race (sample/staging.py); steps overlap (async scheduling).
    HOST: also min_tokens, logit_bias or allowed_token_ids. The sampler's inputs are built on
        the host each step from the parameters and the output count, which counts the sample
        still in flight (SamplingMetadata.build); steps still overlap.
    SYNC: also penalties, bad_words or logprobs. The sampler reads the output tokens
        themselves, or sends logprobs to the host: the request's steps run one at a time.

    Structured outputs are not a path: the grammar's token mask reaches the sampler on any of
    them (sample/grammar.py). The mask of a step depends on the token sampled before it, so the
    engine core launches such a step's forward, then fills its mask once the step before has
    its tokens, then samples (engine/engine_core.py).
    """

    STAGED = 0
    HOST = 1
    SYNC = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: the answer follows exactly one of these specs, then ends with
    a stop token (EOS):

    - `json`: a JSON schema (a dict, or its text); properties the schema does not name are not
      generated (xgrammar's strict mode, as vLLM);
    - `json_object`: True: any JSON object or array;
    - `regex`: a regular expression the whole answer matches;
    - `grammar`: an EBNF grammar as xgrammar reads it (GBNF: `rule ::= ...`, starting at
      `root`);
    - `choice`: one of these strings (stored as a tuple);
    - `structural_tag`: xgrammar's structural tag (a dict or its JSON text, stored as text):
      `{"type": "structural_tag", "format": {...}}`, or vLLM's older `{"structures": [{"begin",
      "schema", "end"}], "triggers": [...]}` (free text, each tag's content following its
      schema once a trigger starts it).

    `disable_any_whitespace`: JSON without whitespace between its tokens (vLLM's field).
    Only the spec's shape is checked here; whether xgrammar compiles it is checked when the
    request is added (structured_output.check_spec), a ValueError naming the problem."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object",
                                        "structural_tag")  # fmt: skip

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(self.KINDS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if isinstance(self.choice, (list, tuple)):
            object.__setattr__(self, "choice", tuple(self.choice))
        kind, value = given[0], getattr(self, given[0])
        if kind == "choice" and not (
            isinstance(value, tuple) and value and all(_is_text(c) for c in value)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of non-empty strings of "
                f"valid Unicode, got {value!r}"
            )
        if kind == "json" and not (isinstance(value, dict) or _is_text(value)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (a dict or its text), got {value!r}"
            )
        if kind == "json" and isinstance(value, dict):  # a copy of the caller's, as JSON
            try:
                object.__setattr__(self, "json", json_module.loads(json_module.dumps(value)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json is not JSON: {e}") from e
        if kind == "structural_tag":
            try:
                tag = json_module.loads(value) if isinstance(value, str) else value
                text = json_module.dumps(tag)
            except (TypeError, ValueError):
                tag = text = None
            if not isinstance(tag, dict):
                raise ValueError("structured_outputs.structural_tag must be a JSON object (a dict "
                                 f"or its text), got {value!r}")  # fmt: skip
            object.__setattr__(self, "structural_tag", text)
        if kind in ("regex", "grammar") and not _is_text(value):
            raise ValueError(
                f"structured_outputs.{kind} must be a non-empty string of valid Unicode, got "
                f"{value!r}"
            )
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be True, got {value!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be a bool, got "
                f"{self.disable_any_whitespace!r}"
            )

    @property
    def kind(self) -> str:
        """The name of the spec given: one of KINDS."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`): keep the `beam_width` best
    sequences by cumulative log-probability / length ** `length_penalty`, for at most
    `max_tokens` new tokens; a beam that samples EOS is complete unless `ignore_eos`.
    `temperature` is accepted as vLLM accepts it; the scores are the raw log-probabilities,
    so it does not change them. `include_stop_str_in_output`: vLLM's field, accepted (beam
    search has no stop strings)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= 2 * self.beam_width <= MAX_LOGPROBS:
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got "
                f"{self.beam_width!r}"
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name, low in (("temperature", 0.0), ("length_penalty", -math.inf)):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value >= low):
                allowed = "a finite number" + (" >= 0" if low == 0 else "")
                raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Per prompt token after the first: its log-probability given the tokens before it, and
    # the prompt_logprobs most likely tokens there (RequestOutput.prompt_logprobs).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (as vLLM's; no stop strings)
    # Added to the logits before sampling ({token id: bias in [-100, 100]}, OpenAI's range); a
    # copy of the dict given, which nothing changes.
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's field).
    allowed_token_ids: tuple[int, ...] | None = None
    # Keep only the prompt's last k tokens (left truncation); -1: the last max_model_len.
    truncate_prompt_tokens: int | None = None
    # Words the output may not contain (vLLM's): a word's last token is masked whenever the
    # tokens before it end the output (a one-token word: always).
    bad_words: tuple[str, ...] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # bad_words as token id sequences: set by the front end from its tokenizer
    # (`with_token_ids`), empty until then.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False, kw_only=True)
    # Derived in __post_init__:
    stop_strings: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())
    sampling_path: SamplingPath = field(
        init=False, repr=False, compare=False, default=SamplingPath.STAGED
    )

    def __post_init__(self) -> None:
        self._validate()  # the values as given, so that an error shows them so

        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        def as_tuple(value):
            return tuple(value) if isinstance(value, list) else value

        put("stop", as_tuple(self.stop))
        put("stop_strings", (self.stop,) if isinstance(self.stop, str) else self.stop or ())
        put("stop_token_ids", tuple(self.stop_token_ids or ()))
        put("logit_bias", None if self.logit_bias is None else dict(self.logit_bias) or None)
        put("allowed_token_ids", as_tuple(self.allowed_token_ids))
        put("bad_words", as_tuple(self.bad_words) or None)
        put("bad_words_token_ids", tuple(map(tuple, self.bad_words_token_ids)))
        put("sampling_path", self._sampling_path())

    def _sampling_path(self) -> SamplingPath:
        if (
            self.logprobs is not None
            or self.bad_words is not None
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        ):
            return SamplingPath.SYNC
        if self.min_tokens > 0 or self.logit_bias is not None or self.allowed_token_ids is not None:
            return SamplingPath.HOST
        return SamplingPath.STAGED

    def _validate(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not _is_number(getattr(self, name)):
                fail(name, "a number")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            fail("temperature", "finite and >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            fail("top_k", "-1 or 0 (disabled) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            fail("repetition_penalty", "> 0 (1 means no penalty)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                fail(name, "in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", "None or an integer")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "None or an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            fail("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            fail("prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        ids = self.stop_token_ids or ()
        if not (isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids)):
            fail("stop_token_ids", "a list of non-negative integers")
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop or ()
        if not (isinstance(stops, (list, tuple)) and all(_is_text(s) for s in stops)):
            fail("stop", "a non-empty string or a list of non-empty strings, of valid Unicode")
        if stops and not self.detokenize:
            fail("stop", "empty when detokenize=False (stop strings need the text)")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(_is_int(t) and t >= 0 for t in self.logit_bias)
            and all(_is_number(b) and -100.0 <= b <= 100.0 for b in self.logit_bias.values())
        ):
            fail("logit_bias", "None or a dict of non-negative token ids to numbers in [-100, 100]")
        if self.truncate_prompt_tokens is not None and not (
            _is_int(self.truncate_prompt_tokens)
            and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
        ):
            fail("truncate_prompt_tokens", "None, -1 (the model's length) or an integer >= 1")
        if self.bad_words is not None and not (
            isinstance(self.bad_words, (list, tuple))
            and all(_is_text(w) and w.strip() for w in self.bad_words)
        ):
            fail("bad_words", "None or a list of non-empty strings of valid Unicode")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", "None or a StructuredOutputsParams")
            if self.allowed_token_ids is not None:
                fail("allowed_token_ids", "None with structured_outputs")
            if self.min_tokens:  # EOS masked where the grammar may allow nothing else
                fail("min_tokens", "0 with structured_outputs (the grammar decides the end)")
            if self.ignore_eos and not self.stop_token_ids:
                fail("ignore_eos", "False with structured_outputs unless stop_token_ids are "
                     "given: the answer ends on a stop token")  # fmt: skip
        if self.allowed_token_ids is not None and not (
            isinstance(self.allowed_token_ids, (list, tuple))
            and self.allowed_token_ids
            and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", "None or a non-empty list of non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or below GREEDY_EPS)."""
        return self.temperature < GREEDY_EPS

    def with_token_ids(self, tokenizer) -> SamplingParams:
        """A validated copy with `bad_words_token_ids` from `tokenizer` (the front end's, once
        per request); itself without bad words.

        A bad word is tokenized alone and after a space (as vLLM does: the word at the start
        of the text and inside it), the second only when it is another sequence of the same
        length. Refused with ValueError: allowed_token_ids that are all one-token bad words
        (every token masked at the first step)."""
        if self.bad_words is None:
            return self
        seqs: list[tuple[int, ...]] = []
        for word in self.bad_words:
            alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            seqs.append(alone)
            if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
                seqs.append(spaced)
        bad_words = tuple(s for s in seqs if s)
        banned = {s[0] for s in bad_words if len(s) == 1}
        if self.allowed_token_ids is not None and set(self.allowed_token_ids) <= banned:
            raise ValueError(
                f"every token of allowed_token_ids {sorted(set(self.allowed_token_ids))} is a "
                "bad word: nothing could be generated"
            )
        return dataclasses.replace(self, bad_words_token_ids=bad_words)

    def replace(self, **changes) -> SamplingParams:
        """A validated copy with some fields changed (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)
