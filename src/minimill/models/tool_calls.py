"""Tool calls in a model family's own syntax: how a call is spelled, and parsing it back.

A family's calls are JSON objects `{"name": ..., "<arguments key>": {...}}` between a prefix that
opens them and a suffix that closes them:
- hermes (Qwen 2.5/3, Hermes, minimill's ChatML tool prompt): `<tool_call>\\n{...}\\n</tool_call>`;
- llama3 (Llama 3.1+ JSON tool calling): a bare `{"name": ..., "parameters": {...}}`;
- mistral: `[TOOL_CALLS][{...}, {...}]`.

`ToolCallParser` is fed the generated text piece by piece and returns only what is new: content
text (text outside calls, holding back anything that may open a call), a call's name once it is
known, and its arguments as they arrive, character for character as the model wrote them, so
that a stream's pieces add up to the final message's `arguments`. A call that turns out
malformed is given back as text by `parse_message`; a stream has shown its start already, as
every streaming tool parser must.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from minimill.models.grammar import ANY_OBJECT_SCHEMA, GuidedTag

ToolFormatName = Literal["hermes", "llama3", "mistral"]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one model family spells tool calls."""

    name: ToolFormatName
    prefix: str  # opens a call (or, with `list_body`, a list of calls)
    suffix: str  # closes it
    arguments_key: str  # "arguments" or "parameters"
    # The prefix is the start of the call's JSON itself (llama3), not a marker before it.
    prefix_in_body: bool = False
    # Calls come as one JSON list after the prefix (mistral), not one object per prefix.
    list_body: bool = False
    # Written between two calls when a grammar spells several.
    separator: str = "\n"

    def tag(self, name: str, parameters_schema: str | None) -> GuidedTag:
        """The grammar tag of a call of `name` whose arguments match `parameters_schema`."""
        head = f'{{"name": {json.dumps(name)}, "{self.arguments_key}": '
        open_, close = (self.prefix + "[", "]" + self.suffix) if self.list_body else (
            self.prefix, self.suffix)
        if self.prefix_in_body:
            open_ = ""
        return GuidedTag(begin=open_ + head, schema=parameters_schema or ANY_OBJECT_SCHEMA,
                         end="}" + close)

    @property
    def trigger(self) -> str:
        """What opens a call in free text (tool_choice "auto")."""
        return self.prefix


HERMES = ToolFormat("hermes", prefix="<tool_call>\n", suffix="\n</tool_call>",
                    arguments_key="arguments")
LLAMA3 = ToolFormat("llama3", prefix='{"name": ', suffix="", arguments_key="parameters",
                    prefix_in_body=True, separator="; ")
MISTRAL = ToolFormat("mistral", prefix="[TOOL_CALLS]", suffix="", arguments_key="arguments",
                     list_body=True, separator="")
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}


def format_of_template(template: str | None) -> ToolFormat | None:
    """The tool syntax a chat template writes, or None if it has none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ('"parameters"' in template and "tools" in template):
        return LLAMA3
    return None


# ------------------------------------------------------------------------------------------
# Parsing.

@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(slots=True)
class ParsedMessage:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ParseEvent = ContentDelta | CallStarted | ArgumentsDelta

class _JsonEnd:
    """Finds where one JSON value ends, fed a character at a time (strings, nesting)."""

    __slots__ = ("depth", "escape", "in_string", "started")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False

    def feed(self, ch: str) -> bool:
        """True when `ch` ends the value (an object, an array or a string)."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if ch == '"':
            self.in_string = True
            self.started = True
        elif ch in "{[":
            self.depth += 1
            self.started = True
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def _head_state(compact: str, key: str) -> int | None:
    """For a call's JSON so far, without whitespace: the length of the streamable head
    `{"name":"NAME","KEY":` if it is complete, -1 while it may still become one, None if it
    cannot (another key order: the call is then parsed once complete)."""
    start = '{"name":"'
    if len(compact) <= len(start):
        return -1 if start.startswith(compact) else None
    if not compact.startswith(start):
        return None
    i, escape = len(start), False
    while i < len(compact):
        ch = compact[i]
        if escape:
            escape = False
        elif ch == "\\":
            escape = True
        elif ch == '"':
            break
        i += 1
    else:
        return -1  # still inside the name
    rest = f',"{key}":'
    tail = compact[i + 1:]
    if len(tail) < len(rest):
        return -1 if rest.startswith(tail) else None
    return i + 1 + len(rest) if tail.startswith(rest) else None


_TEXT, _CALL, _SUFFIX, _LIST = range(4)


class ToolCallParser:
    """Incremental parser of one choice's text; see the module docstring."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[ParsedCall] = []
        self.malformed = False
        self._content: list[str] = []
        self._pending = ""  # text not decided on yet
        self._held = ""  # trailing whitespace of the content so far, not shown yet
        self._state = _TEXT
        self._list_opened = False  # mistral: the list's "[" was read
        # The current call: its JSON so far, where its arguments start in it (-1: not
        # streamed, parsed once complete), and the scanners of the arguments and the whole.
        self._body = ""
        self._compact = ""
        self._args_at: int | None = None
        self._args = _JsonEnd()
        self._whole = _JsonEnd()

    @property
    def content(self) -> str:
        return "".join(self._content)

    def feed(self, text: str) -> list[ParseEvent]:
        self._pending += text
        events: list[ParseEvent] = []
        while self._pending and not self.malformed:
            before = (self._state, len(self._pending))
            if self._state == _TEXT:
                self._step_text(events)
            elif self._state == _CALL:
                self._step_call(events)
            elif self._state == _SUFFIX:
                self._step_suffix()
            else:
                self._step_list()
            if (self._state, len(self._pending)) == before:
                break  # waiting for more text
        return events

    def finish(self) -> list[ParseEvent]:
        """The end of the text: what was held back is content, or the call is malformed."""
        events: list[ParseEvent] = []
        if self._state in (_CALL, _LIST) or (self._state == _SUFFIX and self.fmt.suffix.strip()):
            self.malformed = True
        elif not self.malformed:
            self._emit_content(self._pending, events)
            self._pending = ""
            if self._held and not self.calls:
                self._content.append(self._held)
                events.append(ContentDelta(self._held))
            self._held = ""
        return events

    # -- outside calls
    def _step_text(self, events: list[ParseEvent]) -> None:
        fmt, pending = self.fmt, self._pending
        at = pending.find(fmt.prefix)
        if at >= 0:
            self._emit_content(pending[:at], events)
            if fmt.list_body:
                self._pending = pending[at + len(fmt.prefix):]
                self._state = _LIST
                self._list_opened = False
            else:
                self._pending = pending[at:] if fmt.prefix_in_body else \
                    pending[at + len(fmt.prefix):]
                self._open_call()
            return
        # Hold back a tail that may be the start of the prefix.
        keep = next((n for n in range(min(len(fmt.prefix) - 1, len(pending)), 0, -1)
                     if fmt.prefix.startswith(pending[-n:])), 0)
        self._emit_content(pending[:len(pending) - keep], events)
        self._pending = pending[len(pending) - keep:]

    def _emit_content(self, text: str, events: list[ParseEvent]) -> None:
        # Trailing whitespace is held back: before a call it is not content (the final
        # message's content is stripped when it has calls), so a stream must not show it.
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        # Around calls, whitespace and separators are not content.
        if not body or (self.calls and not body.strip(" \n\t;")):
            return
        self._content.append(body)
        events.append(ContentDelta(body))

    def _open_call(self) -> None:
        self._held = ""
        self._state = _CALL
        self._body = self._compact = ""
        self._args_at = None
        self._args = _JsonEnd()
        self._whole = _JsonEnd()

    # -- mistral's list of calls: [ {...}, {...} ]
    def _step_list(self) -> None:
        stripped = self._pending.lstrip()
        if not stripped:
            self._pending = ""
            return
        if not self._list_opened:
            if stripped[0] != "[":
                self.malformed = True
                return
            self._list_opened = True
            self._pending = stripped[1:]
            self._open_call()
        elif stripped[0] == ",":
            self._pending = stripped[1:]
            self._open_call()
        elif stripped[0] == "]":
            self._pending = stripped[1:]
            self._state = _TEXT
        else:
            self.malformed = True

    # -- inside a call
    def _step_call(self, events: list[ParseEvent]) -> None:
        index = len(self.calls)
        for used, ch in enumerate(self._pending, 1):
            if not self._whole.started and ch.isspace():
                continue
            self._body += ch
            if self._args_at is None:
                if not ch.isspace():
                    self._compact += ch
                head = _head_state(self._compact, self.fmt.arguments_key)
                if head is None:
                    self._args_at = -1
                elif head >= 0:
                    self._args_at = len(self._body)
                    events.append(CallStarted(index, self._name_of_head()))
            elif self._args_at >= 0 and not (self._args.started and self._args.depth == 0
                                             and not self._args.in_string):
                if not self._args.started and ch.isspace():
                    pass
                elif not self._args.started and ch == '"':
                    self._args_at = -1  # arguments as a JSON string: parsed once complete
                else:
                    self._args.feed(ch)
                    events.append(ArgumentsDelta(index, ch))
            if self._whole.feed(ch):
                self._pending = self._pending[used:]
                self._close_call(events, index)
                return
        self._pending = ""

    def _name_of_head(self) -> str:
        start = self._body.index('"name"') + len('"name"')
        value = self._body[self._body.index('"', start):]
        end = _JsonEnd()
        for i, ch in enumerate(value):
            if end.feed(ch):
                return str(json.loads(value[:i + 1]))
        return ""

    def _close_call(self, events: list[ParseEvent], index: int) -> None:
        try:
            obj = json.loads(self._body)
        except json.JSONDecodeError:
            self.malformed = True
            return
        key = self.fmt.arguments_key
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get(key, {}), dict | str):
            self.malformed = True
            return
        args = obj.get(key, {})
        streamed = self._args_at is not None and self._args_at >= 0
        if isinstance(args, str):
            arguments = args
        elif streamed:
            arguments = self._body[self._args_at:self._body.rstrip().rfind("}")].strip()
        else:
            arguments = json.dumps(args)
        if not streamed:
            events.append(CallStarted(index, obj["name"]))
            events.append(ArgumentsDelta(index, arguments))
        self.calls.append(ParsedCall(obj["name"], arguments))
        self._state = _LIST if self.fmt.list_body else _SUFFIX

    def _step_suffix(self) -> None:
        suffix = self.fmt.suffix.strip()
        stripped = self._pending.lstrip()
        if not suffix:
            self._pending = stripped
            self._state = _TEXT
            return
        if stripped.startswith(suffix):
            self._pending = stripped[len(suffix):]
            self._state = _TEXT
        elif suffix.startswith(stripped):
            self._pending = stripped  # wait for the rest of the suffix
        else:
            self.malformed = True


def parse_message(fmt: ToolFormat, text: str) -> ParsedMessage:
    """Content and calls of a finished choice; a malformed call leaves the whole text as
    content and no calls."""
    parser = ToolCallParser(fmt)
    parser.feed(text)
    parser.finish()
    if parser.malformed:
        return ParsedMessage(text or None, [])
    content = parser.content
    if parser.calls:
        content = content.strip()
    return ParsedMessage(content or None, parser.calls)
