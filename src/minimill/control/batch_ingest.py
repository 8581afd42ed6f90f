"""Reading a batch input file: an unusable file fails as a whole, a bad line fails alone.

Pure functions over the file's content as a stream of chunks (no store access), in bounded
memory: `split_lines` cuts lines across chunk boundaries (a line over the limit is reported, not
kept), `scan` decides whether the file is usable at all, and `LineParser` turns each line into a
queued request or a line error. A file is unusable when it is empty, not UTF-8, over the line
limit, or has no JSON object line at all (not JSONL); every other problem (invalid JSON, a line
over the size limit, unknown model, bad parameters, duplicate or missing custom_id, wrong url or
method) belongs to one line, which then lands in the error file. Lines are a tenant's input:
whatever a line makes the parser raise (a line nested too deep for the JSON decoder raises
RecursionError, not ValueError) is that line's error, never the ingest's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from minimill.control.bodies import parse_body, prepare_body
from minimill.control.body_rules import PreparedBody
from minimill.control.embeddings import parse_embedding_body, prepare_embedding
from minimill.control.errors import ControlError
from minimill.control.records import ENDPOINT_KINDS, Kind
from minimill.control.response_bodies import prepare_batch_line

# How many line errors an unusable-file report lists at most.
MAX_REPORTED_ERRORS = 10
log = logging.getLogger("minimill.batches")


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
    # The prepared body as the JSON the row stores (encoded once, here: a body that cannot be
    # encoded is the line's error, not its group's insert's).
    body_json: str | None = None


@dataclass(frozen=True, slots=True)
class Line:
    line_no: int  # 1-based
    end: int  # byte offset just past the line and its newline: where the next line starts
    data: bytes | None  # None: longer than the limit, so not kept


def split_lines(chunks: Iterable[bytes], max_line_bytes: int, offset: int = 0,
                line_no: int = 0) -> Iterator[Line]:
    """The lines of content that starts at byte `offset`, the start of line `line_no + 1`."""
    carry = bytearray()
    carry_len = 0  # bytes of the unfinished line so far (kept in `carry` unless too long)
    for chunk in chunks:
        start = 0
        while True:
            newline = chunk.find(b"\n", start)
            if newline < 0:
                rest = len(chunk) - start
                if carry_len + rest <= max_line_bytes:
                    carry += chunk[start:]
                else:
                    carry.clear()
                carry_len += rest
                break
            length = carry_len + newline - start
            line_no += 1
            offset += length + 1
            if length > max_line_bytes:
                yield Line(line_no, offset, None)
            elif carry_len:
                carry += chunk[start:newline]
                yield Line(line_no, offset, bytes(carry))
            else:
                yield Line(line_no, offset, chunk[start:newline])
            carry.clear()
            carry_len = 0
            start = newline + 1
    if carry_len:
        yield Line(line_no + 1, offset + carry_len,
                   bytes(carry) if carry_len <= max_line_bytes else None)


def _json_object(text: str, line_no: int) -> tuple[dict[str, Any] | None, LineError | None]:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return None, LineError(line_no, "invalid_json", f"line {line_no} is not valid JSON: {exc}")
    except RecursionError:
        return None, LineError(line_no, "invalid_json",
                               f"line {line_no} is nested too deeply to be read")
    if not isinstance(obj, dict):
        return None, LineError(line_no, "invalid_json", f"line {line_no} is not a JSON object")
    return obj, None


def scan(chunks: Iterable[bytes], max_lines: int, max_line_bytes: int) -> int:
    """Read the whole file once; returns its number of requests (non-blank lines), or raises
    UnusableFileError when the file cannot be a batch."""
    count, over_at, found_object = 0, 0, False
    not_objects: list[LineError] = []
    for line in split_lines(chunks, max_line_bytes):
        text = ""
        if line.data is not None:
            try:
                text = line.data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UnusableFileError([LineError(
                    line.line_no, "invalid_encoding",
                    f"the file is not UTF-8 text ({exc.reason})")]) from None
            if not text.strip():
                continue
        count += 1
        if count == max_lines + 1:
            over_at = line.line_no
        if not found_object and line.data is not None:
            obj, error = _json_object(text, line.line_no)
            found_object = obj is not None
            if error is not None and len(not_objects) < MAX_REPORTED_ERRORS:
                not_objects.append(error)
    if not count:
        raise UnusableFileError([LineError(None, "empty_file", "the input file has no lines")])
    if over_at:
        raise UnusableFileError([LineError(
            over_at, "too_many_lines",
            f"the input file has {count} requests; the limit is {max_lines}")])
    if not found_object:
        raise UnusableFileError([LineError(None, "invalid_file",
                                           "the input file is not JSONL: no line is a JSON "
                                           "object"), *not_objects])
    return count


def custom_id_key(custom_id: str) -> bytes:
    """What the duplicate check remembers of a custom_id: a digest, so that 50,000 long ids
    do not all stay in memory."""
    return hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class LineParser:
    """Parses the lines of one batch in order; remembers the custom_ids seen (as digests)."""

    def __init__(self, endpoint: str, served_models: tuple[str, ...],
                 seen: set[bytes] | None = None) -> None:
        self.endpoint = endpoint
        self.served_models = served_models
        self.seen = seen if seen is not None else set()

    def parse(self, line: Line, max_line_bytes: int) -> ParsedLine | None:
        """The parsed line; None for a blank one."""
        if line.data is None:
            return ParsedLine(line.line_no, None, None, LineError(
                line.line_no, "line_too_large",
                f"line {line.line_no} is longer than the limit of {max_line_bytes} bytes"))
        text = line.data.decode("utf-8", "replace")
        if not text.strip():
            return None
        try:
            parsed = self._parse_text(text, line.line_no)
            if parsed.prepared is not None:
                parsed = replace(parsed, body_json=json.dumps(parsed.prepared.body))
        except Exception as exc:  # any other surprise is the line's too
            log.info("batch line %d could not be parsed: %s: %s", line.line_no,
                     type(exc).__name__, str(exc)[:200])
            return ParsedLine(line.line_no, None, None, LineError(
                line.line_no, "invalid_request",
                f"line {line.line_no} could not be read ({type(exc).__name__})"))
        return parsed

    def _parse_text(self, text: str, line_no: int) -> ParsedLine:
        def bad(code: str, message: str, custom_id: str | None = None,
                param: str | None = None) -> ParsedLine:
            return ParsedLine(line_no, custom_id, None, LineError(line_no, code, message, param))

        obj, error = _json_object(text, line_no)
        if obj is None:
            return ParsedLine(line_no, None, None, error)
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or "\x00" in custom_id:
            return bad("missing_custom_id", "custom_id must be a non-empty string without NUL",
                       param="custom_id")
        key = custom_id_key(custom_id)
        if key in self.seen:
            return bad("duplicate_custom_id",
                       f"custom_id {custom_id!r} appears more than once in the file", custom_id,
                       "custom_id")
        self.seen.add(key)
        if obj.get("method") != "POST":
            return bad("invalid_method", f"method must be POST, got {obj.get('method')!r}",
                       custom_id, "method")
        if obj.get("url") != self.endpoint:
            return bad("invalid_url", f"url must be the batch's endpoint {self.endpoint}, got "
                       f"{obj.get('url')!r}", custom_id, "url")
        kind = ENDPOINT_KINDS[self.endpoint]
        try:
            if kind == Kind.RESPONSE:
                prepared = prepare_batch_line(obj.get("body"), self.served_models)
            elif kind == Kind.EMBEDDING:
                prepared = prepare_embedding(parse_embedding_body(obj.get("body")),
                                             self.served_models)
            else:
                prepared = prepare_body(kind, parse_body(kind, obj.get("body")),
                                        self.served_models)
        except ControlError as exc:
            return bad(exc.code or "invalid_request", exc.message, custom_id,
                       f"body.{exc.param}" if exc.param else "body")
        if prepared.stream:
            return bad("invalid_request", "stream is not supported inside a batch", custom_id,
                       "body.stream")
        return ParsedLine(line_no, custom_id, prepared, None)


def parse_batch_file(content: bytes, endpoint: str, served_models: tuple[str, ...],
                     max_lines: int, max_line_bytes: int = 2**62) -> list[ParsedLine]:
    """Every non-blank line of a file held in memory, parsed; raises UnusableFileError when
    the file is unusable (the store-side ingest streams the same steps)."""
    scan([content], max_lines, max_line_bytes)
    parser = LineParser(endpoint, served_models)
    parsed = (parser.parse(line, max_line_bytes) for line in split_lines([content],
                                                                          max_line_bytes))
    return [p for p in parsed if p is not None]
