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
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise InvalidSchema(f"the JSON schema cannot be read: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidSchema(f"the JSON schema cannot be compiled: {error}")
    return grammar
