"""Tools and structured output in a chat body: the function tools, tool_choice and
response_format models, OpenAI's rules between them, and the check that every schema compiles
in the grammar engine that will enforce it (the Responses API's own shapes, response_tools.py,
share the rules)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from minimill.control.body_rules import FUNCTION_NAME, StrictBody, type_tag
from minimill.control.errors import InvalidRequestError
from minimill.models.grammar import GrammarError, GuidedDecoding, check_grammar

MAX_TOOLS = 128


class FunctionCall(StrictBody):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="The call's arguments, as JSON text.")


class ToolCall(StrictBody):
    id: str = Field(min_length=1, max_length=200)
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    # A JSON schema of the arguments (absent: a function without parameters).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictBody):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(StrictBody):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(StrictBody):
    type: Literal["text"]


class ResponseFormatJsonObject(StrictBody):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(StrictBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[Annotated[ResponseFormatText, Tag("type=text")]
                           | Annotated[ResponseFormatJsonObject, Tag("type=json_object")]
                           | Annotated[ResponseFormatJsonSchema, Tag("type=json_schema")],
                           Discriminator(type_tag)]


def check_tools(tools: list[FunctionTool] | None,
                tool_choice: str | NamedToolChoice | None,
                parallel_tool_calls: bool | None) -> None:
    """OpenAI's rules for tools, tool_choice and parallel_tool_calls (errors name the
    parameter as `param: message`)."""
    if not tools:
        if tool_choice is not None:
            raise ValueError("tool_choice: only allowed when tools are specified")
        if parallel_tool_calls is not None:
            raise ValueError("parallel_tool_calls: only allowed when tools are specified")
        return
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice: the function {tool_choice.function.name!r} is not "
                         "in tools")


def mentions_json(messages: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a conversation asks for JSON in words: OpenAI refuses json_object output
    otherwise (a model told nothing about JSON may write whitespace until its limit)."""
    for message in messages:
        content = message.get("content")
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, Mapping) else part
            if isinstance(text, str) and "json" in text.lower():
                return True
    return False


def check_schemas(response_format: Any, tools: list[FunctionTool] | None) -> None:
    """Every schema a chat body gives (response_format, tools' parameters) compiles in the
    grammar engine that will enforce it; a 400 naming it otherwise."""
    checks: list[tuple[str, Any]] = []
    if isinstance(response_format, ResponseFormatJsonSchema):
        checks.append(("response_format.json_schema.schema",
                       response_format.json_schema.schema_ or {}))
    for i, tool in enumerate(tools or []):
        if tool.function.parameters is not None:
            checks.append((f"tools[{i}].function.parameters", tool.function.parameters))
    for param, schema in checks:
        check_schema(param, schema)


def check_schema(param: str, schema: Any) -> None:
    """A 400 naming `param` unless the grammar engine compiles `schema`."""
    try:
        check_grammar(GuidedDecoding(json_schema=json.dumps(schema)))
    except GrammarError as exc:
        raise InvalidRequestError(f"Invalid schema for '{param}': {exc}",
                                  param=param, code="invalid_json_schema") from None
