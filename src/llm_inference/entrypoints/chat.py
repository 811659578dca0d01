"""`llm-inference chat`: a terminal chat that streams each answer as the engine steps.

The history is templated whole for every turn; when it outgrows max_model_len (with room for
max_tokens), the oldest turns are dropped, the system prompt kept. Ctrl-C aborts the running
answer and leaves with status 130.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import TextIO

from llm_inference.entrypoints.chat_template import render_chat
from llm_inference.entrypoints.llm import LLM
from llm_inference.sampling_params import SamplingParams

_ids = itertools.count()


def fit_history(tokenizer, history: list[dict], max_model_len: int, reserve: int):
    """Token ids of the templated history, after dropping its oldest turns (never the system
    prompt nor the last message) until `reserve` more tokens fit; None if even that fails.
    Dropped turns are removed from `history` only when it fits: a message too long to send
    leaves the conversation as it was."""
    first = 1 if history and history[0]["role"] == "system" else 0
    trial = list(history)
    while True:
        text = render_chat(tokenizer, trial)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) + reserve <= max_model_len:
            history[:] = trial
            return ids
        if len(trial) - first <= 1:
            return None
        del trial[first]  # the oldest message; its answer goes with it
        while len(trial) - first > 1 and trial[first]["role"] != "user":
            del trial[first]


def stream_reply(llm: LLM, prompt_ids: list[int], params: SamplingParams, out: TextIO) -> str:
    """Generate one answer, writing its text as each step extends it; aborted if interrupted."""
    engine = llm.engine
    rid = f"chat-{next(_ids)}"
    engine.add_request(rid, prompt_ids, params)
    text, done = "", False
    try:
        while not done and engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid:
                    out.write(o.text[len(text) :])
                    out.flush()
                    text, done = o.text, o.finished
    finally:
        if not done:
            engine.abort_request(rid)
    out.write("\n")
    return text


def run_chat(
    llm: LLM,
    params: SamplingParams,
    system: str | None = None,
    read: Callable[[str], str] | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """The chat loop: 0 on EOF or /exit, 130 on Ctrl-C. `read` defaults to input()."""
    read = read or input
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    max_len = llm.config.scheduler.max_model_len
    try:
        while True:
            try:
                line = read("> ")
            except EOFError:
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            ids = fit_history(llm.tokenizer, history, max_len, params.max_tokens or 1)
            if ids is None:
                history.pop()
                msg = f"max_model_len={max_len} tokens with max_tokens={params.max_tokens}"
                print(f"error: this message does not fit in {msg}; try a shorter one",
                      file=sys.stderr)  # fmt: skip
                continue
            reply = stream_reply(llm, ids, params, out)
            history.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        return 130
