"""The front end's check of a structured-output spec (structured_output/spec.py), the grammar a
choice becomes, and the manager's bitmasks, on the tests' tokenizer (no engine)."""

from __future__ import annotations

import json
from concurrent.futures import Future

import numpy as np
import pytest
from helpers import _tokenizer_template

from llm_inference import StructuredOutputsParams as S
from llm_inference.structured_output import RequestGrammar, StructuredOutputManager, check_spec
from llm_inference.structured_output.spec import IGNORED_KEYWORDS, compile_grammar, grammar_key

xgr = pytest.importorskip("xgrammar")
EOS = 1  # the tests' tokenizer's <|eos|>


@pytest.fixture(scope="module")
def compiler():
    tok = _tokenizer_template()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, max_threads=1)


def accepts(compiler, so: S, text: str) -> bool:
    """Whether `text` is a whole answer of `so`'s grammar."""
    matcher = xgr.GrammarMatcher(compile_grammar(compiler, grammar_key(so)))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(
    "so, message",
    [
        (S(json="{not json"), "structured_outputs.json is not JSON: Expecting property name"),
        (S(json={"type": "foo"}), 'structured_outputs.json: Unsupported type "foo"'),
        (S(json={"$ref": "#/$defs/missing"}), "structured_outputs.json: Cannot find field"),
        (S(regex="(ab"), "structured_outputs.regex: Regex parsing error at position 4"),
        (S(grammar="root ::= thing"), 'structured_outputs.grammar: EBNF parser error at line 1, '
                                      'column 10: Rule "thing" is not defined'),
        (S(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
         "structured_outputs.json: `uniqueItems` at # is not supported (xgrammar would ignore"),
        (S(json={"properties": {"a": {"anyOf": [{"type": "string"}, {"not": {"const": 1}}]}}}),
         "`not` at #/properties/a/anyOf/1 is not supported"),
        (S(json={"$defs": {"x": {"type": "number", "multipleOf": 0.5}}, "$ref": "#/$defs/x"}),
         "`multipleOf` on a non-integer at #/$defs/x"),
        (S(json={"allOf": [{"type": "integer"}, {"minimum": 3}]}), "`allOf` of several schemas"),
        (S(json={"items": {"$ref": "https://example.com/s.json"}}),
         "`$ref` to another document (https://example.com/s.json) at #/items"),
        (S(json={"type": "string", "pattern": "^a+$", "maxLength": 2}),
         "`maxLength` with `pattern` at #"),
        (S(json={"properties": {"d": {"type": "string", "format": "date", "minLength": 1}}}),
         "`minLength` with `format` at #/properties/d"),
    ],
)  # fmt: skip
def test_check_spec_names_the_problem(so, message):
    with pytest.raises(ValueError) as info:
        check_spec(so)
    assert str(info.value).startswith(message) or message in str(info.value), info.value


def test_check_spec_takes_what_xgrammar_enforces():
    """Keywords as property names are names; the keywords xgrammar enforces pass."""
    for so in (
        S(json={"type": "object", "properties": {"not": {"type": "integer"}, "if": {}}}),
        S(json={"type": "integer", "multipleOf": 3, "minimum": 0}),
        S(json={"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "string"}}}),
        S(json='{"type": "string", "pattern": "^a{1,4}$"}'),
        S(json={"type": "string", "minLength": 2, "maxLength": 4}),
        S(json_object=True),
        S(regex=r"\d{3}-[a-z]+"),
        S(grammar='root ::= "(" [0-9]+ ")"'),
        S(choice=["a", "b"]),
        S(structural_tag={"type": "structural_tag", "format": {"type": "const_string",
                                                               "value": "ok"}}),
        S(structural_tag={"structures": [{"begin": "<f>", "schema": {"type": "object"},
                                          "end": "</f>"}], "triggers": ["<f"]}),
    ):  # fmt: skip
        check_spec(so)


@pytest.mark.parametrize("keyword", IGNORED_KEYWORDS)
def test_xgrammar_ignores_the_refused_keywords(compiler, keyword):
    """Why each IGNORED_KEYWORDS entry is refused: xgrammar takes an answer that breaks it.
    (When a new xgrammar enforces one, this fails: that keyword can leave the list.)"""
    integers = {"type": "array", "items": {"type": "integer"}}
    obj = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    cases = {
        "uniqueItems": ({**integers, "uniqueItems": True}, "[1,1]"),
        "contains": ({**integers, "contains": {"const": 3}}, "[1]"),
        "minContains": ({**integers, "contains": {"const": 3}, "minContains": 2}, "[3,1]"),
        "maxContains": ({**integers, "contains": {"const": 3}, "maxContains": 1}, "[3,3]"),
        "dependentRequired": ({**obj, "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
        "dependentSchemas": ({**obj, "dependentSchemas": {"a": {"required": ["b"]}}},
                             '{"a":1}'),
        "if": ({**obj, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a":1}'),
        "then": ({**obj, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a":1}'),
        "else": ({**obj, "if": {"required": ["a"]}, "else": {"required": ["a"]}}, "{}"),
        "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    }  # fmt: skip
    schema, breaks_it = cases[keyword]
    assert accepts(compiler, S(json=schema), breaks_it)


def test_choice_grammar_is_exactly_the_choices(compiler):
    """A choice's grammar takes each string whole, quotes, backslashes, newlines, control and
    non-ASCII characters included, and nothing else."""
    choices = ['say "hi"', "c:\\dir", "two\nlines", "\x01bell", "café 🙂", "no"]
    so = S(choice=choices)
    kind, text, _ = grammar_key(so)
    assert kind == "grammar" and text.startswith("root ::= ")
    for c in choices:
        assert accepts(compiler, so, c)
    for other in ("n", "no ", "say hi", "cafe 🙂", ""):
        assert not accepts(compiler, so, other)


def test_bitmask_rows_follow_each_answer(compiler):
    """The manager's rows: each matcher first accepts the output tokens it has not seen (one
    new token, or several), then allows exactly the tokens that continue its answer, and only
    the stop tokens at its end; a token its grammar rejects raises."""
    tok = _tokenizer_template()
    V = len(tok)
    so = S(choice=["yes", "no"])

    def grammar(stop=(EOS,)):
        done: Future = Future()
        done.set_result(compile_grammar(compiler, grammar_key(so)))
        return RequestGrammar(done, list(stop))

    class Req:
        def __init__(self, output):
            self.output_token_ids, self.grammar = output, grammar()

    manager = StructuredOutputManager(lambda: tok, V, (EOS,))
    yes = tok.encode("yes", add_special_tokens=False)
    reqs = {"a": Req([]), "b": Req(list(yes))}
    mask = manager.fill_bitmask(["a", "b"], reqs)
    assert mask.shape == (2, -(-V // 32)) and mask.dtype == np.int32
    allowed = [{v for v in range(V) if mask[r, v // 32] >> (v % 32) & 1} for r in (0, 1)]
    assert allowed[1] == {EOS}  # "yes" is complete: only the stop token
    for v in allowed[0]:  # every allowed first token starts "yes" or "no"
        text = tok.decode([v])
        assert "yes".startswith(text) or "no".startswith(text), text
    assert set(tok.encode("no", add_special_tokens=False)[:1]) <= allowed[0]
    assert EOS not in allowed[0]
    reqs["a"].output_token_ids = [tok.encode("x", add_special_tokens=False)[0]]
    with pytest.raises(RuntimeError, match="the grammar rejected token"):
        manager.fill_bitmask(["a"], reqs)
    other_stop = Req(list(yes))
    other_stop.grammar = grammar(stop=(7, 9))
    mask = manager.fill_bitmask(["c"], {"c": other_stop})
    assert {v for v in range(V) if mask[0, v // 32] >> (v % 32) & 1} == {7, 9}
    # one new token a step (accepted in one batch call) and several at once (one at a time)
    # leave the same matcher state
    steps = {"c": Req([]), "d": Req([])}
    for t in range(len(yes)):
        steps["c"].output_token_ids = list(yes[: t + 1])
        one_by_one = manager.fill_bitmask(["c"], steps)
    steps["d"].output_token_ids = list(yes)
    assert (manager.fill_bitmask(["d"], steps) == one_by_one).all()
    assert steps["c"].grammar.num_accepted == steps["d"].grammar.num_accepted == len(yes)
    # a request finished since it was scheduled (async scheduling): every token, no matcher
    mask = manager.fill_bitmask(["gone", "c"], {"c": other_stop})
    assert (mask[0] == -1).all() and (
        mask[1] == manager.fill_bitmask(["c"], {"c": other_stop})
    ).all()
    # filled where the executor's buffer says (the worker's staging buffer), else anew
    buffers = []

    def buffer(m, words):
        buffers.append(np.zeros((m, words), dtype=np.int32))
        return buffers[-1]

    in_place = StructuredOutputManager(lambda: tok, V, (EOS,), buffer)
    filled = in_place.fill_bitmask(["gone", "c"], {"c": Req(list(yes))})
    assert filled is buffers[0] and filled.shape == (2, -(-V // 32))
    assert (filled == manager.fill_bitmask(["gone", "c"], {"c": Req(list(yes))})).all()


def test_json_schema_answers_validate(compiler):
    """What the grammar of a schema takes is what jsonschema validates (a few by hand)."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2},
              "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
              "required": ["n"]}  # fmt: skip
    so = S(json=schema)
    cases = [
        ('{"n": 3}', True),
        ('{"n": 1}', False),
        ('{"n": 2, "tags": ["a"]}', True),
        ('{"tags": []}', False),
        ('{"n": 2, "tags": ["a", "b", "a"]}', False),
    ]
    for text, ok in cases:
        assert accepts(compiler, so, text) is ok, text
        valid = True
        try:
            jsonschema.validate(json.loads(text), schema)
        except jsonschema.ValidationError:
            valid = False
        assert valid is ok, text


def test_a_failed_compile_is_never_ready():
    """The scheduler admits a request once its grammar is ready: one whose compile failed must
    never be (the core finishes it), even when the failure lands between two steps."""
    pending, failed = Future(), Future()
    failed.set_exception(RuntimeError("no"))
    assert not RequestGrammar(pending, [EOS]).ready
    grammar = RequestGrammar(failed, [EOS])
    assert not grammar.ready and str(grammar.error) == "no"


def test_string_lengths_keep_control_characters_out(compiler):
    """xgrammar's own grammar for minLength/maxLength takes a raw tab (invalid JSON); as the
    spec compiles it, the lengths hold and the tab is refused, nested too."""
    short = {"type": "string", "minLength": 1, "maxLength": 3}
    assert xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(short))).accept_string(
        '"a\tb"'
    )
    for schema in (short, {"type": "object", "properties": {"s": short}, "required": ["s"]}):
        wrap = (lambda t: t) if schema is short else (lambda t: '{"s": ' + t + "}")
        so = S(json=schema)
        assert accepts(compiler, so, wrap('"abc"')) and accepts(compiler, so, wrap('"é"'))
        for bad in ('"a\tb"', '""', '"abcd"'):
            assert not accepts(compiler, so, wrap(bad)), (schema, bad)
