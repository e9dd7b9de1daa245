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
DATA_KEYS = frozenset({"const", "enum"})  # their values are JSON data, not schemas
INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_OPTIONAL_PROPERTIES = 500  # of one object: llguidance's parser rows hold 2,000 items, ~4 per optional property
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
    inexact = _inexact_integer(tree)
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


def _inexact_integer(node: object, names: bool = False, data: bool = False) -> int | float | None:
    """The first number in a schema that the grammar engine would not hold the output to, None when
    there is none: an integer a 64-bit float does not hold exactly (a bound of 10**30 became 1e30),
    and a float bound of an integer schema past 64-bit integers (its range was clamped: `minimum:
    1e30` gave 9223372036854775807). Annotations are skipped, but not the JSON values of `const`
    and `enum` (`data`), whatever their keys. `names`: node maps names to schemas (`properties`)."""
    if isinstance(node, bool):
        return None
    if isinstance(node, int):
        return node if abs(node) > EXACT_INTEGERS else None
    if isinstance(node, dict) and not data and _integer_typed(node):
        bound = next((v for k in INTEGER_BOUNDS if isinstance(v := node.get(k), float) and abs(v) >= 2.0**63), None)
        if bound is not None:
            return bound
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        if data or names or key not in ANNOTATIONS:
            found = _inexact_integer(child, not names and not data and key in NAMED_SCHEMAS, data or key in DATA_KEYS)
            if found is not None:
                return found
    return None


def _integer_typed(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "integer" or (isinstance(kind, list) and "integer" in kind)


def _crowded_object(node: object, names: bool = False, data: bool = False) -> int | None:
    """The most optional properties of one object schema in the schema, when more than the grammar
    engine parses (MAX_OPTIONAL_PROPERTIES: llguidance's rows of 2,000 items fail at 501, on the
    first token of the object, after the request was admitted); None otherwise."""
    if data or not isinstance(node, dict | list):
        return None
    if isinstance(node, dict) and not names and isinstance(node.get("properties"), dict):
        required = node.get("required") if isinstance(node.get("required"), list) else []
        optional = len(set(node["properties"]) - set(required))
        if optional > MAX_OPTIONAL_PROPERTIES:
            return optional
    children = node.items() if isinstance(node, dict) else enumerate(node)
    for key, child in children:
        if names or key not in ANNOTATIONS:
            found = _crowded_object(child, not names and key in NAMED_SCHEMAS, key in DATA_KEYS and not names)
            if found is not None:
                return found
    return None
