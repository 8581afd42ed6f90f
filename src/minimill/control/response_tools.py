"""Responses API function tools, tool_choice and `text.format`, and the chat body fields that
carry them to a worker.

A response runs as a chat (response_bodies.py), so its tools become the chat body's `tools`,
`tool_choice` and `parallel_tool_calls`, and its `text.format` the chat body's
`response_format`: the worker enforces them as it does for chat completions. What a response
echoes back (`tools`, `tool_choice`, `parallel_tool_calls`, `text.format`) is kept beside them.

Only function tools exist here; hosted tools (web search, file search, code interpreter, MCP,
custom tools...) are refused, naming `tools[i].type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from minimill.control.body_rules import FUNCTION_NAME, StrictBody, type_tag
from minimill.control.tool_bodies import MAX_TOOLS, check_schema

TOOL_CHOICE_MODES = ("none", "auto", "required")
TEXT_FORMAT_TYPES = ("text", "json_object", "json_schema")


class FunctionToolParam(StrictBody):
    """A function tool in the Responses shape: the function's fields at the top level."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    # A JSON schema of the arguments (absent: a function without parameters).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Deferred loading, asynchronous calls and programmatic callers are hosted-tool
    # features: refused.
    defer_loading: Literal[False] | None = Field(
        None, description="Not supported: every tool is loaded.")
    async_: Literal[False] | None = Field(None, alias="async", description="Not supported.")
    allowed_callers: None = Field(None, description="Not supported.")
    output_schema: None = Field(None, description="Not supported.")


class FunctionToolChoice(StrictBody):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormatText(StrictBody):
    type: Literal["text"]


class TextFormatJsonObject(StrictBody):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictBody):
    type: Literal["json_schema"]
    name: str = Field(pattern=FUNCTION_NAME)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


# One of the formats, validated (TextFormat is the same union as the body's field).
AnyTextFormat = TextFormatText | TextFormatJsonObject | TextFormatJsonSchema
TextFormat = Annotated[Annotated[TextFormatText, Tag("type=text")]
                       | Annotated[TextFormatJsonObject, Tag("type=json_object")]
                       | Annotated[TextFormatJsonSchema, Tag("type=json_schema")],
                       Discriminator(type_tag)]
ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice
Tools = Annotated[list[FunctionToolParam], Field(max_length=MAX_TOOLS)]


def refuse_unsupported_tools(raw: dict[str, Any]) -> None:
    """Hosted tools, tool choices and text formats this server does not have, named by their
    path (run on the raw body, before field validation, so that the message says what is
    missing rather than which union member failed)."""
    tools = raw.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tools[{i}].type: {kind!r} tools are not supported by this "
                                 "server; only function tools are")
    choice = raw.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise ValueError(f"tool_choice: {choice.get('type')!r} is not supported by this "
                         "server; use none, auto, required or {\"type\": \"function\", "
                         "\"name\": ...}")
    text = raw.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in TEXT_FORMAT_TYPES:
        raise ValueError(f"text.format.type: {fmt.get('type')!r} is not supported; use "
                         f"{', '.join(TEXT_FORMAT_TYPES)}")


def check_tool_fields(tools: list[FunctionToolParam] | None,
                      tool_choice: str | FunctionToolChoice | None) -> None:
    """OpenAI's rules for tools and tool_choice (a validator's `param: message` errors).
    Without tools, "none" and "auto" mean the same as no tool_choice (no call can be made)
    and are accepted, as OpenAI does; a call that is required or named needs its tool."""
    names = [t.name for t in tools or []]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if tool_choice == "required" and not names:
        raise ValueError("tool_choice: 'required' needs at least one tool in tools")
    if isinstance(tool_choice, FunctionToolChoice) and tool_choice.name not in names:
        raise ValueError(f"tool_choice: the function {tool_choice.name!r} is not in tools")


def check_tool_schemas(tools: list[FunctionToolParam] | None,
                       text_format: AnyTextFormat | None) -> None:
    """Every schema compiles in the grammar engine that will enforce it (a 400 naming it)."""
    if isinstance(text_format, TextFormatJsonSchema):
        check_schema("text.format.schema", text_format.schema_)
    for i, tool in enumerate(tools or []):
        if tool.parameters is not None:
            check_schema(f"tools[{i}].parameters", tool.parameters)


def chat_fields(tools: list[FunctionToolParam] | None,
                tool_choice: str | FunctionToolChoice | None,
                parallel_tool_calls: bool | None,
                text_format: AnyTextFormat | None) -> dict[str, Any]:
    """The chat body's `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`."""
    fields: dict[str, Any] = {}
    if tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(
            include={"name", "description", "parameters", "strict"}, exclude_none=True)}
            for tool in tools]
        if isinstance(tool_choice, FunctionToolChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": tool_choice.name}}
        elif tool_choice is not None:
            fields["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = parallel_tool_calls
    if isinstance(text_format, TextFormatJsonObject):
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(text_format, TextFormatJsonSchema):
        spec = text_format.model_dump(include={"name", "description", "strict"},
                                      exclude_none=True)
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {**spec, "schema": text_format.schema_}}
    return fields


def echoed(tools: list[FunctionToolParam] | None, tool_choice: str | FunctionToolChoice | None,
           parallel_tool_calls: bool | None,
           text_format: AnyTextFormat | None) -> dict[str, Any]:
    """What the response object shows of them (OpenAI's defaults filled in)."""
    choice: Any = (tool_choice.model_dump() if isinstance(tool_choice, FunctionToolChoice)
                   else tool_choice or "auto")
    return {
        "tools": [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters, "strict": t.strict is not False}
                  for t in tools or []],
        "tool_choice": choice,
        "parallel_tool_calls": parallel_tool_calls is not False,
        "text_format": (text_format.model_dump(by_alias=True, exclude_none=True)
                        if text_format is not None else {"type": "text"}),
    }
