"""The command line: generate prints the engine's completion; convert writes a loadable folder;
errors print a message and exit 1."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from gguf_testfiles import write_llama_gguf  # noqa: E402

from llm_inference import LLM  # noqa: E402
from llm_inference.entrypoints.cli import main  # noqa: E402
from llm_inference.kernels import reference
from llm_inference.models.loader import load_model  # noqa: E402


def test_generate_prints_greedy_completion(tiny_ckpt, capsys):
    rc = main(["generate", "Hello world", "--model", str(tiny_ckpt), "--device", "cpu",
               "--max-new-tokens", "6"])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        want = llm.generate("Hello world", max_new_tokens=6, use_tqdm=False)[0].text
    assert printed == want + "\n"


def test_generate_chat_uses_template(tiny_ckpt, capsys):
    args = ["generate", "Hi", "--chat", "--model", str(tiny_ckpt), "--device", "cpu"]
    assert main(args + ["--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        msgs = [{"role": "user", "content": "Hi"}]
        want = llm.chat(msgs, max_new_tokens=5, use_tqdm=False)[0].text
    assert printed == want + "\n"


def test_convert_then_load(tiny_ckpt, tmp_path, capsys):
    gguf = write_llama_gguf(tmp_path / "tiny.gguf", tiny_ckpt)
    out = tmp_path / "hf"
    assert main(["convert", str(gguf), str(out), "--dtype", "float32"]) == 0
    assert str(out) in capsys.readouterr().out
    ids = torch.arange(3, 12)
    a, b = load_model(out, reference), load_model(tiny_ckpt, reference)
    with torch.no_grad():
        la = a.compute_logits(a(ids, torch.arange(9), [9]))
        lb = b.compute_logits(b(ids, torch.arange(9), [9]))
    assert (la - lb).abs().max() < 1e-4


def test_bad_model_path_is_a_clean_error(tmp_path, capsys):
    rc = main(["generate", "x", "--model", str(tmp_path / "missing"), "--device", "cpu"])
    assert rc == 1
    assert "does not exist" in capsys.readouterr().err
