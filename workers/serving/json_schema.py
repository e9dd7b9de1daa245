"""A response_format's JSON schema as the grammar engine (llguidance) reads it: its canonical text
and its grammar. No tokenizer and no torch are needed, so the ingress refuses a schema that cannot be
compiled before any replica sees it; the engine compiles the same text per tokenizer (`grammar.py`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator

import llguidance

from workers.serving.sampling import InvalidRequest

# compact JSON; oneOf (Pydantic's discriminated unions) enforced as anyOf: a document that matches
# two alternatives is not refused
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "coerce_one_of": True}
JSON_OBJECT = '{"type":"object"}'  # what `response_format: {"type": "json_object"}` asks for
CACHE_SIZE = 256  # compiled schemas kept per engine
EXACT_INTEGERS = 2**53  # llguidance reads a schema's numbers as 64-bit floats: larger integers change
ANNOTATIONS = frozenset({"default", "examples", "description", "title", "$comment"})  # constrain nothing
DATA_KEYS = frozenset({"const", "enum"})  # their values are JSON data, not schemas
INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_OPTIONAL_PROPERTIES = 498  # of one object: llguidance's parser rows hold 2,000 items, 4 per optional property and 7
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
    tree = json.loads(schema)
    inexact = _inexact_number(tree)
    if inexact is not None:
        raise InvalidSchema(
            f"the JSON schema holds the number {inexact}, beyond what the grammar engine holds exactly (integers "
            "within +-2**53; an integer schema's bounds within 64-bit integers), so it could not hold the output to it"
        )
    crowded = _crowded_object(tree)
    if crowded is not None:
        raise InvalidSchema(
            f"an object in the JSON schema has {crowded} optional properties, more than the grammar engine parses "
            f"({MAX_OPTIONAL_PROPERTIES}); list more of them in `required`, or split the object"
        )
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise InvalidSchema(f"the JSON schema cannot be read: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidSchema(f"the JSON schema cannot be compiled: {error}")
    return grammar


def _values(node: object, names: bool = False, data: bool = False) -> Iterator[tuple[object, bool]]:
    """Every value in a schema, with whether it is a schema itself (not a map of names to schemas
    such as `properties`, and not JSON data: the values of `const` and `enum`, whatever their keys).
    Annotations are skipped: they constrain nothing."""
    yield node, not (names or data)
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        if data or names or key not in ANNOTATIONS:
            yield from _values(
                child, not (names or data) and key in NAMED_SCHEMAS, data or (not names and key in DATA_KEYS)
            )


def _inexact_number(tree: object) -> int | float | None:
    """The first number in a schema that the grammar engine would not hold the output to: an
    integer a 64-bit float does not hold exactly (a bound of 10**30 became 1e30), and a float bound
    of an integer schema past 64-bit integers (its range was clamped: `minimum: 1e30` gave
    9223372036854775807); None when there is none."""
    for value, schema in _values(tree):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > EXACT_INTEGERS:
            return value
        if schema and isinstance(value, dict) and _integer_typed(value):
            for key in INTEGER_BOUNDS:
                bound = value.get(key)
                if isinstance(bound, float) and abs(bound) >= 2.0**63:
                    return bound
    return None


def _integer_typed(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "integer" or (isinstance(kind, list) and "integer" in kind)


def _crowded_object(tree: object) -> int | None:
    """The optional properties of an object schema that has more than the grammar engine parses
    (MAX_OPTIONAL_PROPERTIES: llguidance's rows of 2,000 items fail at 499, on the first token of
    the object, after the request was admitted); None when none has."""
    for value, schema in _values(tree):
        if schema and isinstance(value, dict) and isinstance(value.get("properties"), dict):
            required = value.get("required") if isinstance(value.get("required"), list) else []
            optional = len(set(value["properties"]) - set(required))
            if optional > MAX_OPTIONAL_PROPERTIES:
                return optional
    return None
