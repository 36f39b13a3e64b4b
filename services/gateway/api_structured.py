"""The request fields of structured output and tool calling, in the OpenAI API's shapes:
`response_format` (text, json_object, json_schema), `tools`, `tool_choice`, and the `tool_calls` an
assistant message carries back in a conversation. What they become is in structured.py."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a schema's and a function's name


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FormatType(StrEnum):
    TEXT = "text"
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"


class JsonSchemaFormat(_Lenient):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field(pattern=NAME)
    description: str | None = None
    # `schema` is BaseModel's own attribute: the field takes the API's name by alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: FormatType
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == FormatType.JSON_SCHEMA and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object: {"name": ..., "schema": {...}}')
        return self


class FunctionDef(_Lenient):
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: no arguments
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Lenient):
    name: str
    arguments: str  # JSON text, as the API returns it


class ToolCall(_Lenient):
    """A call an earlier assistant turn made, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
