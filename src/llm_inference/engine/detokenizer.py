"""Incremental detokenization with stop strings.

With a fast (Rust) tokenizer, text grows through `tokenizers`' DecodeStream, primed with the
prompt's last tokens: one cheap call per token, which holds back bytes of a UTF-8 character
split across tokens. Otherwise a short window of tokens is decoded twice (the prefix/read
offsets of vLLM and TGI): `decode(ids[prefix:])` minus `decode(ids[prefix:read])` is the new
text, taken only when it does not end in U+FFFD. Either way the window starts in the prompt's
last tokens so tokenizers whose decoding depends on context (leading spaces) decode the first
output token right.

Invariants: `_text` only grows until a stop string cuts it; `_sent <= len(output_text)`;
text handed out by `get_delta` is never taken back, because the tail that could still
become the start of a stop string is held back.
"""

from __future__ import annotations

from llm_inference.sampling_params import SamplingParams

# How many prompt tokens precede the first output token in the decoding window.
_PROMPT_CONTEXT = 5


def _decode_stream(tokenizer, context: list[int], params: SamplingParams):
    """(DecodeStream primed with `context`, the Rust tokenizer), or (None, None)."""
    rust = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None, None
    if not isinstance(rust, Tokenizer):
        return None, None
    stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
    if context:
        stream.step(rust, list(context))
    return stream, rust


class IncrementalDetokenizer:
    """Turns one completion's token ids into text, finding stop strings as they appear.

    `deferred=True` (a completion nobody reads before it finishes, with no stop strings): the
    tokens are only collected, and the text is made once, at `get_delta(finished=True)`, by
    one decode of the window and the output; the same text as token by token (where the two
    could differ, on an incomplete UTF-8 sequence or a window whose text the output changes,
    it goes token by token)."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        deferred: bool = False,
    ):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.stop_string: str | None = None  # the stop string that ended the text, if any
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])  # context + output ids
        self._prefix = 0
        self._read = len(self._ids)
        self._text = ""
        self._sent = 0  # characters of the text already returned by get_delta
        self.deferred = deferred and not params.stop_strings
        self._stream = self._rust = None
        if not self.deferred:
            self._stream, self._rust = _decode_stream(tokenizer, self._ids, params)

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def finished(self) -> bool:
        return self.stop_string is not None

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append sampled tokens; return the stop string if one now appears (the text is
        then cut at it, or just after it with include_stop_str_in_output), else None.
        Tokens after a stop are ignored."""
        if self.deferred:
            self.token_ids.extend(token_ids)
            return None
        for token_id in token_ids:
            if self.stop_string is not None:
                break
            self.token_ids.append(token_id)
            if self._stream is not None:
                new_text = self._stream.step(self._rust, token_id) or ""
            else:
                self._ids.append(token_id)
                new_text = self._decode_new()
            if new_text:
                self._text += new_text
                if self.params.stop_strings and len(self.token_ids) > self.params.min_tokens:
                    self._check_stop(len(new_text))
        return self.stop_string

    def get_delta(self, finished: bool = False) -> str:
        """Text added since the last call. While the request runs, a tail that could still
        grow into a stop string is held back; `finished=True` (or a stop) releases it.
        Deferred: '' until finished."""
        if self.deferred:
            if not finished:
                return ""
            self._decode_deferred()
        end = len(self._text)
        if not finished and self.stop_string is None:
            end -= self._held_back()
        end = max(end, self._sent)
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def _decode_deferred(self) -> None:
        """The whole output's text at once; token by token where one decode could differ."""
        self.deferred = False
        ids, self.token_ids = self.token_ids, []
        head = self._decode(self._ids)
        full = self._decode(self._ids + ids)
        if full.startswith(head) and "\ufffd" not in full:  # no byte left dangling
            self.token_ids = ids
            self._ids += ids
            self._text = full[len(head) :]
            return
        self._stream, self._rust = _decode_stream(self.tokenizer, self._ids, self.params)
        self.add_tokens(ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_new(self) -> str:
        """New complete text from the last appended token(s); '' while a character is
        incomplete (the bytes stay in the window until it completes)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def _check_stop(self, num_new_chars: int) -> None:
        """Search the new text plus len(stop) - 1 characters before it; the earliest match
        wins (the longest one among matches at the same place)."""
        best: tuple[int, int, str] | None = None
        for stop in self.params.stop_strings:
            start = max(0, len(self._text) - num_new_chars - len(stop) + 1)
            idx = self._text.find(stop, start)
            if idx >= 0 and (best is None or (idx, -len(stop)) < (best[0], best[1])):
                best = (idx, -len(stop), stop)
        if best is None:
            return
        idx, _, stop = best
        cut = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self._text = self._text[:cut]
        self.stop_string = stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        held = 0
        for stop in self.params.stop_strings:
            for k in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:k]):
                    held = k
                    break
        return held
