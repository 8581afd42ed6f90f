"""Reading a batch input file: an unusable file fails as a whole, a bad line fails alone.

Pure functions of the file's bytes (no store access), so ingest speed is easy to measure. A file
is unusable when it is empty, not UTF-8, over the line limit, or has no JSON object line at all
(not JSONL); every other problem (invalid JSON, unknown model, bad parameters, duplicate or
missing custom_id, wrong url or method) belongs to one line, which then lands in the error file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from minimill.control.bodies import PreparedBody, parse_body, prepare_body
from minimill.control.errors import ControlError
from minimill.control.records import ENDPOINT_KINDS, Kind
from minimill.control.response_bodies import prepare_batch_line

# How many line errors an unusable-file report lists at most.
MAX_REPORTED_ERRORS = 10


@dataclass(frozen=True, slots=True)
class LineError:
    line: int | None  # 1-based line number in the input file
    code: str
    message: str
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


class UnusableFileError(Exception):
    """The whole file cannot be a batch; `errors` says which line and why."""

    def __init__(self, errors: list[LineError]) -> None:
        super().__init__("; ".join(f"line {e.line}: {e.message}" if e.line else e.message
                                   for e in errors))
        self.errors = errors


@dataclass(frozen=True, slots=True)
class ParsedLine:
    line_no: int
    custom_id: str | None
    prepared: PreparedBody | None  # None when the line is bad
    error: LineError | None


def _decode(content: bytes) -> str:
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = content[:exc.start].count(b"\n") + 1
        raise UnusableFileError([LineError(line, "invalid_encoding",
                                           f"the file is not UTF-8 text ({exc.reason})")]) from None


def _parse_line(text: str, line_no: int, endpoint: str, served_models: tuple[str, ...],
                seen: set[str]) -> ParsedLine:
    def bad(code: str, message: str, custom_id: str | None = None,
            param: str | None = None) -> ParsedLine:
        return ParsedLine(line_no, custom_id, None, LineError(line_no, code, message, param))

    try:
        obj = json.loads(text)
    except ValueError as exc:
        return bad("invalid_json", f"line {line_no} is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return bad("invalid_json", f"line {line_no} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or "\x00" in custom_id:
        return bad("missing_custom_id", "custom_id must be a non-empty string without NUL",
                   param="custom_id")
    if custom_id in seen:
        return bad("duplicate_custom_id",
                   f"custom_id {custom_id!r} appears more than once in the file", custom_id,
                   "custom_id")
    seen.add(custom_id)
    if obj.get("method") != "POST":
        return bad("invalid_method", f"method must be POST, got {obj.get('method')!r}",
                   custom_id, "method")
    if obj.get("url") != endpoint:
        return bad("invalid_url", f"url must be the batch's endpoint {endpoint}, got "
                   f"{obj.get('url')!r}", custom_id, "url")
    kind = ENDPOINT_KINDS[endpoint]
    try:
        prepared = (prepare_batch_line(obj.get("body"), served_models) if kind == Kind.RESPONSE
                    else prepare_body(kind, parse_body(kind, obj.get("body")), served_models))
    except ControlError as exc:
        return bad(exc.code or "invalid_request", exc.message, custom_id,
                   f"body.{exc.param}" if exc.param else "body")
    if prepared.stream:
        return bad("invalid_request", "stream is not supported inside a batch", custom_id,
                   "body.stream")
    return ParsedLine(line_no, custom_id, prepared, None)


def parse_batch_file(content: bytes, endpoint: str, served_models: tuple[str, ...],
                     max_lines: int) -> list[ParsedLine]:
    """Every non-blank line, parsed; raises UnusableFileError when the file is unusable."""
    lines = _decode(content).split("\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise UnusableFileError([LineError(None, "empty_file", "the input file has no lines")])
    if len(numbered) > max_lines:
        raise UnusableFileError([LineError(
            numbered[max_lines][0], "too_many_lines",
            f"the input file has {len(numbered)} requests; the limit is {max_lines}")])
    seen: set[str] = set()
    parsed = [_parse_line(text, line_no, endpoint, served_models, seen)
              for line_no, text in numbered]
    if all(p.error is not None and p.error.code == "invalid_json" for p in parsed):
        errors = [p.error for p in parsed[:MAX_REPORTED_ERRORS] if p.error is not None]
        raise UnusableFileError([LineError(None, "invalid_file",
                                           "the input file is not JSONL: no line is a JSON "
                                           "object"), *errors])
    return parsed
