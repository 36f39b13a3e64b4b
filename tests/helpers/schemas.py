"""Ten JSON schemas of the extraction kind (nested objects, arrays, enums, numbers, $ref, anyOf),
bounded so that a random-weight model, which picks among the allowed tokens at random, completes
each within MAX_TOKENS; and the grammar the gateway makes of each."""

from __future__ import annotations

import jsonschema

from services.gateway.api_structured import ResponseFormat
from services.gateway.structured import response_grammar

MAX_TOKENS = 160  # the longest answer below is about 110 tokens on the tiny tokenizers


def closed(properties: dict, required: list[str] | None = None) -> dict:
    """An object of exactly these properties, all required unless said (OpenAI's strict form)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS = {
    "person": closed({"name": text(10), "age": integer(0, 120), "tags": {
        "type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}),
    "invoice": closed({
        "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "total": {"type": "number", "minimum": 0, "maximum": 10000, "multipleOf": 0.25},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "paid": {"type": "boolean"},
    }),
    "nested": closed({"customer": closed({
        "name": text(8),
        "address": closed({"city": {"enum": ["Paris", "Lyon", "Nice"]},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    })}),
    "line_items": closed({"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": closed({
        "sku": text(6), "qty": integer(1, 99)})}}),
    "label": closed({"label": {"enum": ["cat", "dog", "bird", "other"]},
                     "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125}}),
    "form": closed({"fields": {"type": "array", "maxItems": 4, "items": closed({
        "key": {"enum": ["name", "date", "amount"]}, "value": text(12)})}, "valid": {"type": "boolean"}}),
    "boxes": closed({"boxes": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "items": integer(0, 1000), "minItems": 4, "maxItems": 4}}}),
    "nullable": closed({"note": {"anyOf": [text(10), {"type": "null"}]}, "score": integer(-5, 5)}),
    "points": {
        "$defs": {"point": closed({"x": integer(-99, 99), "y": integer(-99, 99)})},
        **closed({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
    },
    "event": closed({"kind": {"const": "event"}, "priority": {"enum": [1, 2, 3]},
                     "title": text(12)}, required=["kind", "priority"]),
}  # fmt: skip


def grammar(schema: dict) -> str:
    """The grammar the gateway makes of `schema` sent as a strict json_schema response_format."""
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    )
    return response_grammar(fmt)


def valid(schema: dict, answer: object) -> None:
    """Raises unless `answer` validates against `schema` (its multipleOf are binary fractions, which
    the validator's float division checks exactly)."""
    jsonschema.validate(answer, schema, format_checker=jsonschema.FormatChecker())
