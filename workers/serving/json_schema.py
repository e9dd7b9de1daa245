"""A response_format's JSON schema as the grammar engine (llguidance) reads it: its canonical text
and its grammar. No tokenizer and no torch are needed, so the ingress refuses a schema that cannot be
compiled before any replica sees it; the engine compiles the same text per tokenizer (`grammar.py`)."""

from __future__ import annotations

import functools
import json

import llguidance

from workers.serving.sampling import InvalidRequest

# compact JSON; oneOf (Pydantic's discriminated unions) enforced as anyOf: a document that matches
# two alternatives is not refused
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "coerce_one_of": True}
JSON_OBJECT = '{"type":"object"}'  # what `response_format: {"type": "json_object"}` asks for
CACHE_SIZE = 256  # compiled schemas kept per engine
EXACT_INTEGERS = 2**53  # llguidance reads a schema's numbers as 64-bit floats: larger integers change
ANNOTATIONS = frozenset({"default", "examples", "description", "title", "$comment"})  # constrain nothing
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class InvalidSchema(InvalidRequest):
    """A response_format whose schema cannot be compiled (the 400 names `response_format`)."""

    param = "response_format"


def canonical_schema(schema: dict) -> str:
    """The schema's cache key and what crosses to the engine: compact JSON, key order kept."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@functools.lru_cache(maxsize=CACHE_SIZE)  # a failure is not cached: raised again each time
def grammar_of(schema: str) -> str:
    """The llguidance grammar of a canonical schema; InvalidSchema says why there is none. Needs no
    tokenizer, so the ingress refuses a bad schema before any replica sees it (once per schema)."""
    inexact = _inexact_integer(json.loads(schema))
    if inexact is not None:
        raise InvalidSchema(
            f"the JSON schema holds the integer {inexact}, beyond +-2**53: the grammar engine reads numbers "
            "as 64-bit floats, so it could not hold the output to it"
        )
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise InvalidSchema(f"the JSON schema cannot be read: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidSchema(f"the JSON schema cannot be compiled: {error}")
    return grammar


def _inexact_integer(node: object, names: bool = False) -> int | None:
    """The first integer in a schema that a 64-bit float does not hold exactly (a bound of 10**30
    became 1e30, and an integer range was clamped to 64 bits: output outside the schema), skipping
    annotations; None when there is none. `names`: node maps names to schemas (`properties`, ...)."""
    if isinstance(node, bool):
        return None
    if isinstance(node, int):
        return node if abs(node) > EXACT_INTEGERS else None
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        if names or key not in ANNOTATIONS:
            found = _inexact_integer(child, not names and key in NAMED_SCHEMAS)
            if found is not None:
                return found
    return None
