"""Server-sent events for `stream: true`: the row's checkpoint chunks become deltas.

The worker checkpoints streaming leases often, each checkpoint holding only what is new. On
every wake the stream reads the chunks after the last one it read (never the whole text again)
and sends what it has not sent, as one chunk per choice in OpenAI's chunk format. Once the
request ends, the rest comes from its result; the last chunks carry finish reasons, then (with
`stream_options.include_usage`) a usage chunk, then `data: [DONE]`. A failure after the stream
started is sent as an error event, as OpenAI does.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request

from minimill.api.progress import ProgressWatcher, Watch
from minimill.control.records import Kind, RequestRecord, RequestStatus
from minimill.control.render import (
    assistant_message,
    chat_logprobs,
    completion_logprobs,
    error_body,
    render_chunk,
    tool_call_id,
    usage_dict,
)
from minimill.control.requests import cancel_request, read_stream
from minimill.control.store import Store
from minimill.models.tool_calls import (
    FORMATS,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ParseEvent,
    ToolCallParser,
)


@dataclass(slots=True)
class _Sent:
    chars: int = 0
    logprobs: int = 0


def sse_event(payload: dict[str, Any] | str, event_id: str | None = None) -> str:
    """One server-sent event: JSON (or a bare string such as [DONE]), with the `id` a client
    resumes from if given."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {data}\n\n"


SSE_DONE = sse_event("[DONE]")


def _choices(record: RequestRecord) -> list[dict[str, Any]]:
    """The final choices of a succeeded request (None of a running one)."""
    source = record.result if record.status == RequestStatus.SUCCEEDED else None
    choices = (source or {}).get("choices") or []
    return sorted(choices, key=lambda c: int(c.get("index", 0)))


def num_choices(kind: Kind, body: dict[str, Any]) -> int:
    n = int(body.get("n") or 1)
    prompt = body.get("prompt")
    if kind == Kind.COMPLETION and isinstance(prompt, list) and prompt \
            and isinstance(prompt[0], str | list):
        return n * len(prompt)
    return n


class ChunkStream:
    """One streaming response; owns its watch and cancels the request if the client leaves."""

    def __init__(self, request: Request, store: Store, watcher: ProgressWatcher, watch: Watch,
                 first: RequestRecord, include_usage: bool, num_choices: int) -> None:
        self.request, self.store, self.watcher, self.watch = request, store, watcher, watch
        self.record = first
        self.kind = first.kind or Kind.CHAT
        self.include_usage = include_usage
        self.num_choices = num_choices
        self.sent: dict[int, _Sent] = {}
        self.after_seq = 0  # the last checkpoint chunk read
        # Choices of a request with tools: their text parsed into content and calls.
        self.parsers: dict[int, ToolCallParser] = {}

    def _chunk(self, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None) -> str:
        r = self.record
        return sse_event(render_chunk(self.kind, r.id, r.model or "", r.created_at, r.tier,
                                      choices, usage=usage,
                                      with_usage_field=self.include_usage))

    def _delta(self, index: int, text: str, logprobs: list[dict[str, Any]] | None,
               offset: int) -> dict[str, Any]:
        if self.kind == Kind.CHAT:
            return {"index": index, "delta": {"content": text},
                    "logprobs": chat_logprobs(logprobs), "finish_reason": None}
        return {"index": index, "text": text,
                "logprobs": completion_logprobs(logprobs, offset), "finish_reason": None}

    def _finish(self, index: int, reason: str) -> dict[str, Any]:
        if self.kind == Kind.CHAT:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def _new_output(self, chunks: list[tuple[int, dict[str, Any]]]) -> list[str]:
        """Events for what the chunks (and, once succeeded, the result) add to what was sent.
        Each piece says which lengths it extends, so overlaps are skipped."""
        texts: dict[int, list[str]] = {}
        lps: dict[int, list[dict[str, Any]]] = {}
        ahead: dict[int, tuple[int, int]] = {}  # index -> (chars, logprobs) once these are sent

        def take(index: int, base_chars: int, text: str, base_lps: int,
                 logprobs: list[dict[str, Any]] | None, tool_format: Any = None) -> None:
            fmt = FORMATS.get(str(tool_format))
            if fmt is not None and index not in self.parsers and self.kind == Kind.CHAT:
                self.parsers[index] = ToolCallParser(fmt)
            sent = self.sent.setdefault(index, _Sent())
            chars, num_lps = ahead.get(index, (sent.chars, sent.logprobs))
            new_text = text[max(chars - base_chars, 0):]
            new_lps = (logprobs or [])[max(num_lps - base_lps, 0):]
            if new_text:
                texts.setdefault(index, []).append(new_text)
            if new_lps:
                lps.setdefault(index, []).extend(new_lps)
            ahead[index] = (max(chars, base_chars + len(text)),
                            max(num_lps, base_lps + len(logprobs or [])))

        for seq, chunk in chunks:
            for c in chunk.get("choices", []):
                take(int(c.get("index", 0)), int(c.get("base_chars", 0)), str(c.get("text", "")),
                     int(c.get("base_logprobs", 0)), c.get("logprobs"), c.get("tool_format"))
            self.after_seq = seq
        for choice in _choices(self.record):
            take(int(choice.get("index", 0)), 0, str(choice.get("text", "")), 0,
                 choice.get("logprobs"), choice.get("tool_format"))
        out = []
        for index in sorted(set(texts) | set(lps)):
            sent = self.sent[index]
            text, new_lps = "".join(texts.get(index, [])), lps.get(index)
            parser = self.parsers.get(index)
            if parser is None:
                out.append(self._chunk([self._delta(index, text, new_lps, sent.chars)]))
            else:
                out.extend(self._parsed(index, parser.feed(text), new_lps))
            sent.chars += len(text)
            sent.logprobs += len(new_lps or [])
        return out

    def _parsed(self, index: int, events: list[ParseEvent],
                logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        """Chunks for a tools request's parsed text: content, and each call's name, then its
        arguments in pieces (as the openai client's stream helpers accumulate them)."""
        out: list[str] = []
        pending_lps = logprobs
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        if content or pending_lps:
            out.append(self._chunk([{"index": index, "delta": {"content": content},
                                     "logprobs": chat_logprobs(pending_lps),
                                     "finish_reason": None}]))
        args: dict[int, list[str]] = {}

        def flush() -> None:
            for call, pieces in args.items():
                out.append(self._chunk([{"index": index, "delta": {"tool_calls": [
                    {"index": call, "function": {"arguments": "".join(pieces)}}]},
                    "logprobs": None, "finish_reason": None}]))
            args.clear()

        for event in events:
            if isinstance(event, CallStarted):
                flush()
                out.append(self._chunk([{"index": index, "delta": {"tool_calls": [
                    {"index": event.index, "id": tool_call_id(self.record.id, index,
                                                                 event.index),
                     "type": "function",
                     "function": {"name": event.name, "arguments": ""}}]},
                    "logprobs": None, "finish_reason": None}]))
            elif isinstance(event, ArgumentsDelta):
                args.setdefault(event.index, []).append(event.text)
        flush()
        return out

    async def events(self) -> AsyncIterator[str]:
        finished = False
        try:
            if self.kind == Kind.CHAT:
                for index in range(self.num_choices):
                    yield self._chunk([{"index": index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            while True:
                self.record, chunks = await anyio.to_thread.run_sync(
                    read_stream, self.store, self.record.tenant_id, self.record.id,
                    self.after_seq)
                for event in self._new_output(chunks):
                    yield event
                r = self.record
                if r.terminal:
                    finished = True
                    if r.status == RequestStatus.SUCCEEDED:
                        for choice in _choices(r):
                            index = int(choice.get("index", 0))
                            parser = self.parsers.get(index)
                            if parser is not None:
                                for event in self._parsed(index, parser.finish()):
                                    yield event
                            reason = (assistant_message(r.id, choice)[1]
                                      if self.kind == Kind.CHAT
                                      else choice.get("finish_reason") or "stop")
                            yield self._chunk([self._finish(index, reason)])
                        if self.include_usage:
                            yield self._chunk([], usage_dict(
                                r.prompt_tokens, r.completion_tokens, r.billed_usd,
                                r.cached_tokens))
                    else:
                        yield sse_event(error_body(r.error or {
                            "code": r.status.value, "message": f"request {r.status}"}))
                    yield SSE_DONE
                    return
                if not await self.watch.changed(self.request.is_disconnected):
                    return
        finally:
            self.watcher.unwatch(self.watch)
            if not finished:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(cancel_request, self.store, self.record.id,
                                                   time.time(), "the client closed the stream")
