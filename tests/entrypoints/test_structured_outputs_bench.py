"""benchmarks/structured_outputs.py on the CPU: its whole run for our engine on the tiny
checkpoint (both kinds timed, each unconstrained request as long as its constrained twin,
every answer ended by stop valid, the host's phases timed and the engine left as it was), and
the JSON-capable tokenizer it gives a named shape, on which answers drawn at random from
xgrammar's masks follow the benchmark's schema."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_outputs.py"
# Short answers ({"s": "a", "n": 3}), so that the tiny model's end by stop within few tokens.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"s": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["s", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def so():
    return load_script(SCRIPT)


def test_run_ours_on_the_tiny_checkpoint(so, tiny_ckpt, monkeypatch):
    monkeypatch.setattr(so, "SCHEMA", SMALL_SCHEMA)
    args = so.build_parser().parse_args(
        ["--model", str(tiny_ckpt), "--device", "cpu", "--dtype", "float32",
         "--num-requests", "4", "--max-tokens", "24", "--rounds", "1", "--phases"]
    )  # fmt: skip
    from llm_inference.engine.engine_core import EngineCore
    from llm_inference.sample.sampler import Sampler

    step, forward = EngineCore.step, Sampler.forward
    res = so.run(args)
    assert EngineCore.step is step and Sampler.forward is forward  # --phases put them back
    json.dumps(res)  # the --json file
    assert [r["kind"] for r in res["runs"]] == ["unconstrained", "json"]
    plain, constrained = res["runs"]
    assert plain["requests"] == constrained["requests"] == 4
    assert plain["output_tokens"] == constrained["output_tokens"] > 4  # twins' lengths
    assert constrained["stop"] + constrained["cut"] == 4 and constrained["stop"] > 0
    assert constrained["valid"] == constrained["stop"], constrained["invalid"]
    assert res["answers"] == {k: constrained[k] for k in ("stop", "valid", "cut")}
    table = so.format_table(res)
    assert "| ours 0.1.0 | json | 4 |" in table and "| ours 0.1.0 | unconstrained | 4 |" in table
    phases = res["phases"]
    steps = phases["json"]["engine core call (a step)"]["calls"]
    assert steps >= 3 and phases["json"]["bitmask fill"]["calls"] >= steps - 2
    assert phases["json"]["sampling launch (constrained)"]["calls"] > 0
    assert "bitmask fill" not in phases["unconstrained"]
    for kind in phases.values():  # the sampler's own phase, in both kinds: nearly every step
        calls = kind["engine core call (a step)"]["calls"]
        assert kind["sampler launch (Sampler.forward)"]["calls"] >= calls - 2
    assert all(p["median_ms"] > 0 for kind in phases.values() for p in kind.values())
    assert "| bitmask fill | " in table


def test_make_prompts_end_on_the_instruction(so, tiny_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    prompts = so.make_prompts(tiny_ckpt, 3)
    assert prompts == so.make_prompts(tiny_ckpt, 3)  # seeded: both engines get these
    for p in prompts:
        ids = p["prompt_token_ids"]
        assert len(ids) == so.PROMPT_LEN and max(ids) < len(tok)
        assert tok.decode(ids).endswith(so.INSTRUCTION) and "\ufffd" not in tok.decode(ids[-5:])


def test_json_checkpoint_tokenizer_writes_the_schema(so, tmp_path):
    """The named shape's weights linked beside a byte-level tokenizer of the whole vocabulary;
    xgrammar reads it as such, and random walks through its masks end by EOS, well within
    --max-tokens, on answers that validate."""
    from transformers import AutoTokenizer

    folder = tmp_path / "shape"
    folder.mkdir()
    config = {"vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer.json").write_text("{}")  # the word-level one: not linked
    out = so.json_checkpoint(folder)
    assert out == tmp_path / "shape-json" and so.json_checkpoint(folder) == out
    assert (out / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert (out / "tokenizer.json").read_text() != "{}"
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 128256 and (tok.bos_token_id, tok.eos_token_id) == (128000, 128001)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=128256, stop_token_ids=[128001])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(so.SCHEMA), any_whitespace=False
    )
    bitmask = xgr.allocate_token_bitmask(1, 128256)
    for seed in range(3):
        rng, matcher, ids = np.random.default_rng(seed), xgr.GrammarMatcher(grammar), []
        while True:
            matcher.fill_next_token_bitmask(bitmask)
            bits = np.unpackbits(bitmask.numpy()[0].view(np.uint8), bitorder="little")
            token = int(rng.choice(np.flatnonzero(bits[:128256])))
            if token == 128001:
                break
            assert matcher.accept_token(token) and len(ids) < 256
            ids.append(token)
        jsonschema.validate(json.loads(tok.decode(ids)), so.SCHEMA)
