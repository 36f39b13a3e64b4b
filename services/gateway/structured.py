"""`response_format` and `tools` into what the engine and the reply need: the grammar every sampled
token keeps to (llguidance's, common/engine/grammar.py), the tools the chat template lists, and how
the answer is read back. Checked at the door: a schema that is not valid JSON Schema, or that the
grammar engine cannot enforce, is a 400 naming the field, before anything is queued.

JSON comes in one spacing, Python's `json.dumps` one (`{"a": 1, "b": [2, 3]}`): a grammar that
allowed any whitespace would let a model fill its answer with it (random-weight checkpoints do).

Tool calls take the format of the chat templates that define them (Qwen2.5-VL, Qwen3-VL, Hermes):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call, a newline between.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import jsonschema
import llguidance

from common.errors import APIError
from services.gateway.api_structured import FormatType, NamedToolChoice, ResponseFormat, Tool, ToolChoice

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
ERROR_CHARS = 300  # of a validator's message, in the 400


class ToolMode(StrEnum):
    NONE = "none"  # no tools, or tool_choice "none": the answer is text
    AUTO = "auto"  # the model may call: its answer is parsed for calls
    REQUIRED = "required"  # one call or more, enforced by the grammar
    NAMED = "named"  # exactly one call of the named function, enforced by the grammar


@dataclass(frozen=True)
class Constraint:
    """What a request's structured-output fields come to."""

    grammar: str | None = None  # for SamplingParams.grammar
    tools: tuple[dict, ...] = ()  # for the chat template
    mode: ToolMode = ToolMode.NONE

    @property
    def parses_tools(self) -> bool:
        return self.mode != ToolMode.NONE


def constraint(fmt: ResponseFormat | None, tools: list[Tool] | None, choice: ToolChoice | None) -> Constraint:
    """The grammar and tool handling a request asks for; APIError 400 naming the field that is wrong.
    Compiles the grammar once to check it (up to a few ms a schema): call it off the event loop."""
    mode = _mode(tools, choice)
    listed = tuple(t.model_dump(exclude_none=True) for t in tools or ())
    forced = mode in (ToolMode.REQUIRED, ToolMode.NAMED)
    if forced and fmt is not None and fmt.type != FormatType.TEXT:
        raise APIError(
            400,
            f"response_format {fmt.type.value} and tool_choice {_choice_name(choice)} both fix the "
            "answer's form; send one of them",
            param="response_format",
        )
    if forced:
        return Constraint(_tool_grammar(tools, choice, mode), listed, mode)
    return Constraint(response_grammar(fmt), listed, mode)


def response_grammar(fmt: ResponseFormat | None) -> str | None:
    """The grammar of a response_format; None for text."""
    if fmt is None or fmt.type == FormatType.TEXT:
        return None
    if fmt.type == FormatType.JSON_OBJECT:
        return _compiled({"type": "object"}, "response_format")
    return _compiled(fmt.json_schema.json_schema, "response_format.json_schema.schema")


def _mode(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolMode:
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools to choose from; send them", param="tool_choice")
        return ToolMode.NONE
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: the function name {twice!r} is given twice", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(
                400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})", param="tool_choice.function.name",
            )  # fmt: skip
        return ToolMode.NAMED
    return ToolMode(choice or "auto")


def _choice_name(choice: ToolChoice | None) -> str:
    return choice.function.name if isinstance(choice, NamedToolChoice) else str(choice)


def _tool_grammar(tools: list[Tool], choice: ToolChoice | None, mode: ToolMode) -> str:
    """One call of the named function, or one call or more of any tool, in the template's format."""
    calls = []
    for i, tool in enumerate(tools):
        fn = tool.function
        if mode == ToolMode.NAMED and fn.name != choice.function.name:
            continue
        arguments = fn.parameters if fn.parameters is not None else NO_ARGUMENTS
        _check_schema(arguments, f"tools.{i}.function.parameters")
        calls.append({
            "type": "object",
            "properties": {"name": {"const": fn.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })  # fmt: skip
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    body = json.dumps(_styled(call))
    repeat = '("\\n" call)*' if mode == ToolMode.REQUIRED else ""
    lark = f"start: call {repeat}\ncall: {json.dumps(CALL_OPEN)} %json {body} {json.dumps(CALL_CLOSE)}\n"
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


def _compiled(schema: dict[str, Any], param: str) -> str:
    _check_schema(schema, param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_styled(schema))
    except ValueError as exc:
        raise APIError(400, f"{param}: {str(exc)[:ERROR_CHARS]}", param=param, code="invalid_schema") from exc
    return _checked(grammar, param)


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_STYLE}


def _check_schema(schema: dict[str, Any], param: str) -> None:
    """A valid JSON Schema (of the draft it names, 2020-12 if none), or a 400 naming where not."""
    try:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = ".".join([param, *(str(p) for p in exc.absolute_path)])
        raise APIError(
            400, f"{where}: not a valid JSON Schema: {exc.message[:ERROR_CHARS]}", param=where,
            code="invalid_schema",
        ) from None  # fmt: skip
    except RecursionError:
        message = f"{param}: the schema nests too deeply"
        raise APIError(400, message, param=param, code="invalid_schema") from None


def _checked(grammar: str, param: str) -> str:
    """The grammar, once the grammar engine has compiled it; a 400 with its reason otherwise (a
    keyword it does not enforce, a regex it cannot run, a $ref that points nowhere)."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(
            400, f"{param}: this schema cannot be enforced: {error[:ERROR_CHARS]}", param=param,
            code="unsupported_schema",
        )  # fmt: skip
    return grammar
