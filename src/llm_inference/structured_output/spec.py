"""A request's structured-output spec as xgrammar takes it, and the front end's check of it.

`grammar_key` reduces StructuredOutputsParams to (kind, text, any_whitespace): plain strings,
the key a compile is cached by and what `compile_grammar` compiles. `check_spec` is the check
the front end runs when a request is added (engine/llm_engine.py): it builds the spec's
grammar without a tokenizer (xgrammar's parse of a schema, a regex or EBNF, without the
token-level work, which the engine core does off its step loop), so a spec that does not
parse, or a JSON schema keyword that xgrammar would ignore, is a ValueError naming the problem
before the request runs. xgrammar (and transformers with it) is imported on first use: an
engine that never sees a structured request does not pay for it.
"""

from __future__ import annotations

import functools
import json
import re

from llm_inference.sampling_params import StructuredOutputsParams

# JSON Schema keywords xgrammar accepts and ignores: an answer could break them, so a schema
# that uses one is refused (tests/structured_output/test_spec.py shows each one ignored).
IGNORED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "dependentRequired",
                    "dependentSchemas", "if", "then", "else", "not")  # fmt: skip
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties",
        "unevaluatedItems", "propertyNames")  # fmt: skip
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")

# (kind: json, json_object, regex, grammar or structural_tag; text; any whitespace)
GrammarKey = tuple[str, str, bool]


def grammar_key(so: StructuredOutputsParams) -> GrammarKey:
    """What to compile for `so`: a choice is the EBNF grammar of its strings (a JSON string
    literal, non-ASCII kept as is, is an EBNF string literal to xgrammar)."""
    kind = so.kind
    if kind == "json":
        text = so.json if isinstance(so.json, str) else json.dumps(so.json)
        try:
            text = json.dumps(_length_patterns(json.loads(text)))
        except ValueError:
            pass  # not JSON: check_spec says so
    elif kind == "choice":
        kind, text = "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                       for c in so.choice)  # fmt: skip
    elif kind == "json_object":
        text = ""
    else:
        text = getattr(so, kind)
    return kind, text, not so.disable_any_whitespace


# The characters of a JSON string that need no escape: xgrammar's grammar for a string with
# minLength/maxLength lets raw control characters in (invalid JSON), its patterns do not.
_PLAIN_CHAR = '[^"\\\\\\x00-\\x1f]'


def _length_patterns(schema: object) -> object:
    """`schema` with each string's minLength/maxLength (and no pattern or format) as the same
    bounds on a pattern of plain characters (xgrammar allows no escapes there either)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    bounds = (out.get("minLength"), out.get("maxLength"))
    plain = "pattern" not in out and "format" not in out
    if out.get("type") == "string" and bounds != (None, None) and plain:
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_CHAR}{{{low},{'' if high is None else high}}}$"
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = _length_patterns(out[k])
    for k in _LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_length_patterns(s) for s in out[k]]
    for k in _MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _length_patterns(s) for name, s in out[k].items()}
    return out


def compile_grammar(compiler, key: GrammarKey):
    """`key`'s xgrammar CompiledGrammar (`compiler`: an xgrammar GrammarCompiler, which caches
    what it compiled by its arguments)."""
    kind, text, any_whitespace = key
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(*_structural_tag_args(text))
    return compiler.compile_grammar(text)


def _structural_tag_args(text: str) -> tuple:
    """xgrammar's arguments for a structural tag: its JSON text, or for vLLM's older form
    ({"structures": [{"begin", "schema", "end"}], "triggers"}) the tags and the triggers."""
    import xgrammar as xgr

    tag = json.loads(text)
    if "structures" not in tag:
        return (text,)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], end=s["end"],
                                       schema=json.dumps(s["schema"]))
                 for s in tag["structures"]]  # fmt: skip
        return items, list(tag["triggers"])
    except (KeyError, TypeError) as e:
        raise ValueError(
            '"structures" must be a list of {begin, schema, end}, with '
            f'"triggers": a list of strings ({type(e).__name__}: {e})'
        ) from e


def check_spec(so: StructuredOutputsParams) -> None:
    """Raise ValueError, naming the spec and the problem, unless xgrammar can take `so`."""
    kind, text, any_whitespace = grammar_key(so)
    name = f"structured_outputs.{so.kind}"
    if kind == "json":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{name} is not JSON: {e}") from e
        where = _ignored_keyword(schema, "#")
        if where is not None:
            raise ValueError(f"{name}: {where} is not supported (xgrammar would ignore it)")
    error = _parse_error(kind, text, any_whitespace)
    if error is not None:
        raise ValueError(f"{name}: {error}")


@functools.lru_cache(maxsize=256)
def _parse_error(kind: str, text: str, any_whitespace: bool) -> str | None:
    """xgrammar's error for the spec's grammar, without its source location; None if it
    parses. Cached: the server checks a request's spec, then the engine does again."""
    import xgrammar as xgr

    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(*_structural_tag_args(text))
    except (RuntimeError, ValueError, TypeError) as e:
        # "[12:00:00] /project/cpp/x.cc:12: Check failed: (...) is false: what went wrong"
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
        return re.sub(r"^Check failed: .*? is false: ", "", message)
    return None


def _ignored_keyword(schema: object, path: str) -> str | None:
    """The first IGNORED_KEYWORDS use in `schema`, or another construct xgrammar does not
    enforce (multipleOf on a non-integer, allOf of several schemas, a $ref outside the
    document), as "`keyword` at path"; None if there is none."""
    if not isinstance(schema, dict):
        return None
    for key in IGNORED_KEYWORDS:
        if key in schema:
            return f"`{key}` at {path}"
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    other = next((k for k in ("pattern", "format") if k in schema), None)
    if lengths and other:
        return f"`{lengths[0]}` with `{other}` at {path}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"`multipleOf` on a non-integer at {path}"
    if len(schema.get("allOf", ())) > 1:
        return f"`allOf` of several schemas at {path}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"`$ref` to another document ({ref}) at {path}"
    found = [(f"{path}/{k}", schema[k]) for k in _ONE if isinstance(schema.get(k), dict)]
    for k in _LISTS:
        if isinstance(schema.get(k), list):
            found += [(f"{path}/{k}/{i}", s) for i, s in enumerate(schema[k])]
    for k in _MAPS:
        if isinstance(schema.get(k), dict):
            found += [(f"{path}/{k}/{name}", s) for name, s in schema[k].items()]
    return next((w for p, s in found if (w := _ignored_keyword(s, p)) is not None), None)
