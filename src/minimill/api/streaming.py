"""Server-sent events for `stream: true`: successive checkpoints of the row become deltas.

The worker checkpoints streaming leases often; each new checkpoint's text beyond what was sent
becomes one chunk per choice, in OpenAI's chunk format. The last chunks carry finish reasons,
then (with `stream_options.include_usage`) a usage chunk, then `data: [DONE]`. A failure after
the stream started is sent as an error event, as OpenAI does.
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
    chat_logprobs,
    completion_logprobs,
    error_body,
    render_chunk,
    usage_dict,
)
from minimill.control.requests import cancel_request, get_request
from minimill.control.store import Store

# Longest wait between two reads of the row when nothing wakes the stream.
WAKE_S = 0.5


@dataclass(slots=True)
class _Sent:
    chars: int = 0
    logprobs: int = 0


def _event(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


def _choices(record: RequestRecord) -> list[dict[str, Any]]:
    source = record.result if record.status == RequestStatus.SUCCEEDED else record.checkpoint
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
                 first: RequestRecord, include_usage: bool) -> None:
        self.request, self.store, self.watcher, self.watch = request, store, watcher, watch
        self.record = first
        self.kind = first.kind or Kind.CHAT
        self.include_usage = include_usage
        self.sent: dict[int, _Sent] = {}

    def _chunk(self, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None) -> str:
        r = self.record
        return _event(render_chunk(self.kind, r.id, r.model or "", r.created_at, r.tier, choices,
                                   usage=usage, with_usage_field=self.include_usage))

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

    def _new_output(self) -> list[str]:
        out = []
        for choice in _choices(self.record):
            index = int(choice.get("index", 0))
            sent = self.sent.setdefault(index, _Sent())
            text = str(choice.get("text", ""))[sent.chars:]
            all_lps = choice.get("logprobs")
            lps = None if all_lps is None else all_lps[sent.logprobs:]
            if text or lps:
                out.append(self._chunk([self._delta(index, text, lps, sent.chars)]))
                sent.chars += len(text)
                sent.logprobs += len(lps or [])
        return out

    async def events(self) -> AsyncIterator[str]:
        finished = False
        try:
            if self.kind == Kind.CHAT:
                for index in range(num_choices(self.kind, self.record.body or {})):
                    yield self._chunk([{"index": index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            while True:
                for event in self._new_output():
                    yield event
                r = self.record
                if r.terminal:
                    finished = True
                    if r.status == RequestStatus.SUCCEEDED:
                        for choice in _choices(r):
                            yield self._chunk([self._finish(int(choice.get("index", 0)),
                                                            choice.get("finish_reason")
                                                            or "stop")])
                        if self.include_usage:
                            yield self._chunk([], usage_dict(
                                r.prompt_tokens, r.completion_tokens, r.billed_usd,
                                r.cached_tokens))
                    else:
                        yield _event(error_body(r.error or {"code": r.status.value,
                                                            "message": f"request {r.status}"}))
                    yield _event("[DONE]")
                    return
                await self.watch.wait(WAKE_S)
                if await self.request.is_disconnected():
                    return
                self.record = await anyio.to_thread.run_sync(
                    get_request, self.store, self.record.tenant_id, self.record.id)
        finally:
            self.watcher.unwatch(self.watch)
            if not finished:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(cancel_request, self.store, self.record.id,
                                                   time.time(), "the client closed the stream")
