"""What a chat body says its output must be, and the grammar that enforces it on this site.

`tools`, `tool_choice`, `parallel_tool_calls` and `response_format` (the control plane has
validated them; a site still reads them defensively) become a `GuidedDecoding` in the syntax of
the site's model (`ToolFormat`):
- `response_format` json_schema / json_object: one JSON value of the schema;
- tool_choice "required": one call or more (exactly one without parallel_tool_calls), nothing
  else; a named function: exactly one call of it;
- "auto" (the default with tools): free text, and wherever the model opens a call, a well
  formed call of one of the tools; with a response_format too, a JSON value or calls;
- "none": no constraint from the tools (the model still sees them, as with OpenAI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from minimill.models.grammar import ANY_OBJECT_SCHEMA, GuidedDecoding
from minimill.models.tool_calls import ToolFormat


class RulesError(ValueError):
    """A body whose output rules this site cannot read; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class OutputRules:
    """A chat body's output rules (see the module docstring)."""

    tools: tuple[dict[str, Any], ...] = ()  # OpenAI function tools, as sent
    tool_choice: str | None = None  # "none" | "auto" | "required" | None (auto with tools)
    named_tool: str | None = None  # tool_choice {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    json_schema: str | None = None  # response_format's schema (json_object: any object)

    @property
    def calls_tools(self) -> bool:
        """Whether the output may hold tool calls (to be parsed)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        return self.calls_tools or self.json_schema is not None


def _schema_text(schema: Any, param: str) -> str:
    if not isinstance(schema, dict | bool):
        raise RulesError("a JSON schema must be an object", param)
    return json.dumps(schema)


def read_rules(body: dict[str, Any]) -> OutputRules:
    """The output rules of a chat body."""
    raw_tools = body.get("tools") or []
    if not isinstance(raw_tools, list):
        raise RulesError("tools must be a list", "tools")
    tools = []
    for i, tool in enumerate(raw_tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RulesError("each tool needs a function with a name", f"tools[{i}]")
        tools.append(tool)
    choice = body.get("tool_choice")
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise RulesError("tool_choice names no function", "tool_choice")
        choice = None
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise RulesError(f"unknown tool_choice {choice!r}", "tool_choice")
    schema = None
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RulesError("response_format.json_schema needs a schema",
                             "response_format.json_schema.schema")
        schema = _schema_text(spec["schema"], "response_format.json_schema.schema")
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        schema = ANY_OBJECT_SCHEMA
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RulesError("unknown response_format", "response_format")
    return OutputRules(tools=tuple(tools), tool_choice=choice, named_tool=named,
                       parallel_tool_calls=body.get("parallel_tool_calls") is not False,
                       json_schema=schema)


def guided_decoding(rules: OutputRules, fmt: ToolFormat | None) -> GuidedDecoding | None:
    """The grammar of `rules` in the syntax `fmt` (None: the model has no tool syntax)."""
    if not rules.calls_tools:
        return None if rules.json_schema is None else GuidedDecoding(
            json_schema=rules.json_schema)
    if fmt is None:
        raise RulesError("this model has no syntax for tool calls", "tools")
    tags = []
    for tool in rules.tools:
        fn = tool["function"]
        if rules.named_tool is not None and fn["name"] != rules.named_tool:
            continue
        params = fn.get("parameters")
        tags.append(fmt.tag(fn["name"], None if params is None else
                            _schema_text(params, "tools.function.parameters")))
    if not tags:
        raise RulesError(f"tool_choice names {rules.named_tool!r}, which is not in tools",
                         "tool_choice")
    if rules.named_tool is not None:
        return GuidedDecoding(tags=tuple(tags), parallel_calls=False, separator=fmt.separator)
    if rules.tool_choice == "required":
        return GuidedDecoding(tags=tuple(tags), parallel_calls=rules.parallel_tool_calls,
                              separator=fmt.separator)
    if rules.json_schema is not None:  # auto with a format: the answer or calls
        return GuidedDecoding(json_schema=rules.json_schema, tags=tuple(tags),
                              parallel_calls=rules.parallel_tool_calls,
                              separator=fmt.separator)
    return GuidedDecoding(tags=tuple(tags), trigger=fmt.trigger,
                          parallel_calls=rules.parallel_tool_calls)
