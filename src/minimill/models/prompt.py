"""A chat request's prompt: messages (and tool definitions) through the model's chat template.

One function for everyone who needs a prompt's tokens: the worker that runs the request and the
control plane that counts what it bills, so both see the same tokens.

Tools reach the model through its own template when the template has a tool syntax (the
`tools` argument HF templates take, with assistant `tool_calls` and `tool` messages in HF's
convention). A template without one (SmolLM2's) gets minimill's tool prompt in the
Hermes/ChatML convention instead: the tool signatures in the system message inside
`<tools></tools>`, earlier calls written back as `<tool_call>` blocks in the assistant's text,
tool results as `<tool_response>` blocks in a user turn; calls are then parsed as `hermes`.
A conversation without tools renders exactly as before, token for token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from minimill.models.chat_template import ChatTemplateError
from minimill.models.tool_calls import HERMES, ToolFormat, format_of_template

if TYPE_CHECKING:
    from minimill.models.tokenizer import Tokenizer

_HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{signatures}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _text(content: Any) -> str:
    """Message content as text: a list of parts becomes the concatenation of its text parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type", "text") in ("text", "input_text",
                                                                             "output_text"))
    return "" if content is None else str(content)


def _arguments(raw: Any) -> Any:
    """A call's arguments as templates expect them: an object where the JSON text is one."""
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        return value if isinstance(value, dict) else raw
    return raw


def uses_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> bool:
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def tool_format(tokenizer: Tokenizer) -> ToolFormat | None:
    """The syntax this model's tool calls are written and parsed in; None if it has none."""
    own = format_of_template(tokenizer.chat_template)
    if own is not None:
        return own
    if tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template:
        return HERMES  # minimill's tool prompt (module docstring)
    return None


def _hf_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages in HF's tool convention (the model's own template renders them)."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                names[str(call.get("id", ""))] = fn.get("name", "")
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": fn.get("name", ""),
                                           "arguments": _arguments(fn.get("arguments"))}})
            message["tool_calls"] = calls
        if m["role"] == "tool":
            message["tool_call_id"] = m.get("tool_call_id")
            message["name"] = m.get("name") or names.get(str(m.get("tool_call_id")), "")
        out.append(message)
    return out


def _hermes_messages(messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """OpenAI messages rewritten into plain turns in the Hermes convention (module docstring)."""
    out: list[dict[str, Any]] = []
    rest = list(messages)
    system = ""
    if rest and rest[0].get("role") in ("system", "developer"):
        system = _text(rest.pop(0).get("content"))
    if tools:
        block = _HERMES_TOOLS_PROMPT.format(
            signatures="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        system = f"{system}\n\n{block}" if system else block
    if system:
        out.append({"role": "system", "content": system})
    for m in rest:
        role = m.get("role")
        if role == "tool":
            response = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
            continue
        text = _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                body = json.dumps({"name": fn.get("name", ""),
                                   "arguments": _arguments(fn.get("arguments"))},
                                  ensure_ascii=False)
                blocks.append(f"<tool_call>\n{body}\n</tool_call>")
            text = "\n".join(([text] if text else []) + blocks)
        out.append({"role": "developer" if role == "developer" else role, "content": text})
    for message in out:
        message.pop("_tool_results", None)
    return out


def render_chat_prompt(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Any] | None = None) -> list[int]:
    """The prompt's token ids for `messages` (OpenAI shape) and `tools` (OpenAI's function
    tools: {"type": "function", "function": {...}}), ready for the assistant's answer."""
    if not uses_tools(messages, tools):
        flat = [{**m, "content": _text(m.get("content"))} for m in messages]
        text = tokenizer.apply_chat_template(flat, add_generation_prompt=True)
    elif format_of_template(tokenizer.chat_template) is not None:
        text = tokenizer.apply_chat_template(_hf_messages(messages), add_generation_prompt=True,
                                             tools=list(tools or []) or None)
    elif tool_format(tokenizer) is HERMES:
        text = tokenizer.apply_chat_template(_hermes_messages(messages, tools),
                                             add_generation_prompt=True)
    else:
        raise ChatTemplateError("this model's chat template has no syntax for tools, and "
                                "it is not a ChatML template minimill's tool prompt fits")
    # The template spells out its special tokens: encode it without adding more.
    return tokenizer.encode(text, add_special_tokens=False)
