"""Rendering a model's Jinja chat template the way HF transformers does.

Templates come from model files, so they are untrusted code: they run in jinja2's immutable
sandbox, with the same helpers transformers offers (`raise_exception`, `strftime_now`, a
`tojson` that does not HTML-escape, `{% generation %}` blocks, loop controls).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minimill.models.errors import ModelError


class ChatTemplateError(ModelError):
    """The chat template is missing, invalid, or rejected the conversation."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; rendering keeps the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension API declares it as a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages`; `special_tokens` gives bos_token, eos_token, ..."""
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(extra)
    try:
        return _compile(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ChatTemplateError(f"chat template failed on the conversation: {exc}") from exc
