"""Structured outputs (vLLM's `StructuredOutputsParams`) through xgrammar: `spec` turns a
request's spec into what xgrammar compiles and checks it in the front end; `manager` compiles
grammars off the engine core's step loop and fills each step's token bitmask, which the
sampler applies on the device (sample/grammar.py)."""

from llm_inference.structured_output.manager import RequestGrammar, StructuredOutputManager
from llm_inference.structured_output.spec import check_spec, grammar_key

__all__ = ["RequestGrammar", "StructuredOutputManager", "check_spec", "grammar_key"]
