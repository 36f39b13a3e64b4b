"""response_format and tools at the door: what becomes a grammar, what the chat template is given,
and what is refused with a 400 naming the field and saying why."""

from __future__ import annotations

import pytest

from common.errors import APIError
from services.gateway.api_models import ChatCompletionRequest
from services.gateway.structured import ToolMode, constraint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}


def asked(**fields):
    hello = [{"role": "user", "content": "hi"}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": hello, **fields})
    return constraint(body.response_format, body.tools, body.tool_choice)


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as caught:
        asked(**fields)
    assert caught.value.status == 400
    return caught.value


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_what_each_field_becomes():
    assert asked() == asked(response_format={"type": "text"}) == asked(tools=[], tool_choice="none")
    assert asked().grammar is None and asked().mode == ToolMode.NONE
    assert asked(response_format={"type": "json_object"}).grammar
    one = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = asked(response_format=schema_format(one))
    assert '"a"' in schema.grammar and "x-guidance" in schema.grammar  # one spacing, json.dumps's
    auto = asked(tools=[WEATHER, NOOP])
    assert auto.mode == ToolMode.AUTO and auto.grammar is None and auto.tools[0] == WEATHER
    assert asked(tools=[WEATHER], tool_choice="none").mode == ToolMode.NONE
    required = asked(tools=[WEATHER, NOOP], tool_choice="required")
    assert required.mode == ToolMode.REQUIRED
    assert "get_weather" in required.grammar and "noop" in required.grammar
    named = asked(tools=[WEATHER, NOOP], tool_choice={"type": "function", "function": {"name": "noop"}})
    assert named.mode == ToolMode.NAMED and "noop" in named.grammar and "get_weather" not in named.grammar


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "nope"}}})},
         "response_format.json_schema.schema.properties.a.type", "not a valid JSON Schema"),
        ({"response_format": schema_format({"type": "object", "required": "a"})},
         "response_format.json_schema.schema.required", "not a valid JSON Schema"),
        ({"response_format": schema_format({"type": "string", "pattern": "(?<=x)a"})},
         "response_format.json_schema.schema", "cannot be enforced"),
        ({"response_format": schema_format({"$ref": "#/$defs/missing"})},
         "response_format.json_schema.schema", "cannot be enforced"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
         "tool_choice.function.name", "not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
          "tool_choice": "required"}, "tools.0.function.parameters.type", "not a valid JSON Schema"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "send one of them"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_is_a_400_naming_the_field(fields, param, words):
    error = refused(**fields)
    assert error.param == param and words in error.message, error.message
    assert len(error.message) < 500
