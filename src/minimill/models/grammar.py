"""What a request may generate, as plain data, and its grammar for the grammar engine.

`GuidedDecoding` is what travels with a request's sampling parameters: one JSON value of a
schema (`response_format`, Responses `text.format`), or tool calls in a model family's syntax
(`tool_choice` "required", a named function, or "auto": free text until the model opens a
call). `to_grammar` turns it into a grammar for llguidance (Lark with inline JSON schemas);
nothing else in minimill knows the grammar language. The engine compiles and caches it; the
control plane calls `check_grammar` at admission so that a schema the library cannot compile
is a 400 before any site sees it.

JSON is generated with the separators `json.dumps` uses (", " and ": "), the spelling models
were trained on, and no free whitespace: a small model given free whitespace can spend its
whole budget on newlines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance

# The grammar library's limits on what one request's grammar may cost to build and to run:
# schemas come from tenants, so size and lexer work are bounded (llguidance's defaults are
# sized for trusted callers).
_LIMITS = llguidance.LLParserLimits(max_grammar_size=500_000, max_lexer_states=250_000,
                                    step_lexer_fuel=2_000_000, initial_lexer_fuel=10_000_000)
# x-guidance options of every JSON schema in a grammar (see the module docstring).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
# Any JSON object: response_format {"type": "json_object"}, and a tool without parameters.
ANY_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A schema or grammar the grammar engine cannot compile (the message says why)."""


@dataclass(frozen=True, slots=True)
class GuidedTag:
    """One tool's call syntax: `begin`, then a JSON value matching `schema`, then `end`."""

    begin: str  # e.g. '<tool_call>\n{"name": "get_weather", "arguments": '
    schema: str  # JSON text of a JSON schema
    end: str  # e.g. '}\n</tool_call>'


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """Constraints on a request's output, enforced token by token by the grammar engine.

    With only `json_schema`, the output is one JSON value; with only `tags`, tool calls; with
    both (no trigger), either one JSON value or calls (tool_choice "auto" with a
    response_format)."""

    # The whole output is one JSON value matching this schema (JSON text).
    json_schema: str | None = None
    # Tool calls: each output call is one of these tags.
    tags: tuple[GuidedTag, ...] = ()
    # With tags: free text is allowed before, between and after calls, and a call starts only
    # where the model writes `trigger` (tool_choice "auto"). Without: only calls.
    trigger: str | None = None
    # With tags and no trigger: one call or more (parallel_tool_calls), else exactly one.
    parallel_calls: bool = True
    # Written between two calls.
    separator: str = "\n"

    def __post_init__(self) -> None:
        if self.json_schema is None and not self.tags:
            raise GrammarError("guided decoding needs a JSON schema or tool tags")
        if self.json_schema is not None and self.tags and self.trigger is not None:
            raise GrammarError("a JSON answer or calls: calls cannot be triggered in free text")
        if self.trigger is not None and not all(t.begin.startswith(self.trigger)
                                                for t in self.tags):
            raise GrammarError("every tag must begin with the trigger")


def _schema_with_options(schema_text: str) -> str:
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the schema is not valid JSON: {exc}") from None
    if isinstance(schema, bool):  # true / false are valid JSON schemas
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object or a boolean")
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a /regex/ of the grammar."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x80 and not c.isalnum() else c
                   for c in text)


def _tags_grammar(spec: GuidedDecoding) -> str:
    rules = []
    bodies = []
    for i, tag in enumerate(spec.tags):
        rest = tag.begin[len(spec.trigger):] if spec.trigger is not None else tag.begin
        head = _literal(rest) if rest else ""
        rules.append(f"tag_{i}: {head} %json {_schema_with_options(tag.schema)} "
                     f"{_literal(tag.end) if tag.end else ''}")
        bodies.append(f"tag_{i}")
    alternatives = " | ".join(bodies)
    if spec.trigger is not None:
        # The trigger is lazy: the free text before a call ends where the trigger first
        # appears, and from there the call's grammar holds. Free text may come before, between
        # and after calls; the trigger opens a call wherever it appears (so text outside calls
        # never contains it, and a call that opens is well formed). Without parallel calls,
        # nothing after the one call opens another.
        calls = "call+" if spec.parallel_calls else "call"
        trigger = _literal(spec.trigger)
        lines = ["%llguidance {}",
                 f"start: TAIL | {calls} TAIL",
                 "call: call_trigger (" + alternatives + ")",
                 f"call_trigger[lazy]: TEXT {trigger}",
                 r"TEXT: /(.|\n)*/",
                 rf"TAIL: /(.|\n)*/ & ~/(.|\n)*{_regex_literal(spec.trigger)}(.|\n)*/"]
    else:
        sep = _literal(spec.separator) if spec.separator else ""
        calls = f"call ({sep} call)*" if spec.parallel_calls else "call"
        if spec.json_schema is not None:
            calls = f"answer | {calls}"
            rules.append(f"answer: %json {_schema_with_options(spec.json_schema)}")
        lines = [f"start: {calls}", f"call: {alternatives}"]
    return "\n".join(lines + rules) + "\n"


@lru_cache(maxsize=1024)
def _grammar_cached(spec: GuidedDecoding) -> str:
    if not spec.tags and spec.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(
            _schema_with_options(spec.json_schema))
    return llguidance.LLMatcher.grammar_from_lark(_tags_grammar(spec))


def to_grammar(spec: GuidedDecoding) -> str:
    """The grammar-engine definition of `spec` (a string the engine compiles)."""
    return _grammar_cached(spec)


@lru_cache(maxsize=1024)
def check_grammar(spec: GuidedDecoding) -> None:
    """Raise GrammarError if the grammar engine cannot compile `spec` (no tokenizer needed)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        to_grammar(spec), None, limits=_LIMITS)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar does not compile")


def parser_limits() -> llguidance.LLParserLimits:
    """The limits every matcher runs under (the engine builds its matchers with them)."""
    return _LIMITS
