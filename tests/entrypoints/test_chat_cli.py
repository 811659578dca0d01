"""`llm-inference chat`: answers stream per step and equal LLM.chat's; a history that outgrows
max_model_len drops its oldest turns (the system prompt stays); Ctrl-C exits 130 cleanly."""

from __future__ import annotations

import io

import pytest

from llm_inference import LLM, SamplingParams
from llm_inference.entrypoints.chat import fit_history, run_chat
from llm_inference.entrypoints.cli import main


@pytest.fixture(scope="module")
def small_llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu", max_model_len=96, kv_cache_memory_bytes=1 << 20) as llm:
        yield llm


def _reader(lines):
    it = iter(lines)

    def read(_prompt: str) -> str:
        line = next(it, None)
        if line is None:
            raise EOFError
        if isinstance(line, BaseException):
            raise line
        return line

    return read


class _Writes(io.StringIO):
    """Counts writes; raises `interrupt_at` on that write (a Ctrl-C mid-answer)."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        super().__init__()
        self.count, self.interrupt_at = 0, interrupt_at

    def write(self, s: str) -> int:
        self.count += 1
        if self.count == self.interrupt_at:
            raise KeyboardInterrupt
        return super().write(s)


def test_chat_streams_the_same_answer_as_llm_chat(small_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = _Writes()
    assert run_chat(small_llm, params, "Be brief.", _reader(["Hi", "/exit"]), out) == 0
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = small_llm.chat(msgs, params, use_tqdm=False)[0].text
    assert out.getvalue() == want + "\n"
    assert out.count > 2  # written piece by piece, not at once


def test_long_history_drops_oldest_turns(small_llm, capsys):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    lines = [f"message number {i} is here" for i in range(8)]
    out = _Writes()
    assert run_chat(small_llm, params, "Sys", _reader(lines), out) == 0  # read to the end
    assert "error" not in capsys.readouterr().err  # every turn answered
    history = [{"role": "system", "content": "Sys"}]
    for i in range(8):
        history += [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": "ok"}]
    history.append({"role": "user", "content": "last"})
    ids = fit_history(small_llm.tokenizer, history, 96, 8)
    assert len(ids) + 8 <= 96 and history[0]["role"] == "system"
    assert history[-1]["content"] == "last" and len(history) < 18
    assert history[1]["role"] == "user"
    assert (
        fit_history(small_llm.tokenizer, [{"role": "user", "content": "x " * 200}], 96, 8) is None
    )
    # A message too long even alone leaves the conversation before it as it was.
    kept = history + [{"role": "assistant", "content": "ok"}]  # "last" answered
    before = list(kept) + [{"role": "user", "content": "x " * 200}]
    attempt = list(before)
    assert fit_history(small_llm.tokenizer, attempt, 96, 8) is None and attempt == before


def test_ctrl_c_mid_answer_returns_130_and_aborts(small_llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    out = _Writes(interrupt_at=3)
    assert run_chat(small_llm, params, None, _reader(["Hi"]), out) == 130
    assert not small_llm.engine.has_unfinished_requests()
    assert small_llm.stats()["num_free_kv_blocks"] == small_llm.stats()["num_kv_blocks"]


def test_cli_chat_ctrl_c_at_prompt_exits_130_without_traceback(tiny_ckpt, monkeypatch, capsys):
    def interrupted(_prompt):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    assert main(["chat", "--model", str(tiny_ckpt), "--device", "cpu"]) == 130
    assert "Traceback" not in capsys.readouterr().err
