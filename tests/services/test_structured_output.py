"""Structured output through deployed services (the shared EPD and E+P+D deployments, tiny-llava):
the official openai client's `chat.completions.parse` with a Pydantic model gets its model back,
json_schema and json_object answers parse streamed and whole, and what cannot be enforced or
rendered is a 400 that names the field. The breadth (ten schemas, every method, a decoder killed
mid-answer) is in tests/stages/test_structured.py; tools on the families whose chat templates
define them, in tests/services/test_model_families.py."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.chat import client_for
from tests.helpers.schemas import MAX_TOKENS, SCHEMAS, valid

# Random weights pick among the allowed tokens at random: every string and list is bounded, so the
# answer completes within MAX_TOKENS.


class Item(BaseModel):
    sku: Annotated[str, Field(max_length=6)]
    qty: Annotated[int, Field(ge=1, le=99)]


class Invoice(BaseModel):
    number: Annotated[str, Field(pattern=r"^INV-[0-9]{4}$")]
    currency: Literal["EUR", "USD", "GBP"]
    items: Annotated[list[Item], Field(min_length=1, max_length=2)]
    paid: bool


def with_image(image_urls, text: str = "Read the invoice in the picture") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": image_urls[0]}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def test_the_openai_clients_parse_gets_its_pydantic_model_back(e_p_d, image_urls):
    client = client_for(e_p_d)
    completion = client.chat.completions.parse(
        model="tiny-llava", messages=with_image(image_urls), response_format=Invoice, max_tokens=MAX_TOKENS,
        temperature=0,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Invoice) and choice.message.parsed.items


@pytest.mark.parametrize("name", ["nested", "boxes"])
def test_a_json_schema_answer_validates_streamed_and_whole(epd, image_urls, name):
    client = client_for(epd)
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    asked = {"model": "tiny-llava", "messages": with_image(image_urls), "response_format": fmt,
             "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 7}  # fmt: skip
    whole = client.chat.completions.create(**asked)
    valid(schema, json.loads(whole.choices[0].message.content))
    chunks = list(client.chat.completions.create(**asked, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # the same seed: the same answer
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_json_object_answer_is_an_object(epd, image_urls):
    reply = client_for(epd).chat.completions.create(
        model="tiny-llava", messages=with_image(image_urls), response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # a free-form object may run to max_tokens on random weights
        assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format.json_schema.schema.type", "invalid_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}}},
         "response_format.json_schema.schema", "unsupported_schema"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools_unsupported"),
        ({"messages": [{"role": "user", "content": "hi"},
                       {"role": "tool", "content": "1", "tool_call_id": "c"}]},
         "messages.1.role", "tools_unsupported"),
    ],
)  # fmt: skip
def test_what_cannot_be_enforced_or_rendered_is_a_400_naming_the_field(epd, fields, param, code):
    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    resp = httpx.post(epd.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    with pytest.raises(openai.BadRequestError):
        client_for(epd).chat.completions.create(**body)
