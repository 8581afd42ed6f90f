"""Following a response as it runs: waiting for its end, or streaming its events.

The events are a pure function of the stored row (control/response_render.py), numbered from 0,
so a stream sends whatever part of that list it has not sent yet each time the row changes, and
a stream opened with `starting_after` (a client that lost its connection) starts after that
number: no gap and no repeat, from any control-plane process, across restarts. On each wake a
stream reads the row without its body and only the checkpoint chunks it has not read yet (as
chat streams do), so a long answer is read from the store once, not once per wake.

A client that goes away cancels a response only when nobody else can come back for it: a
foreground (not background) response it created. Background responses run on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request

from minimill.api.progress import ProgressWatcher, Watch
from minimill.control.checkpoints import assemble
from minimill.control.config import ControlConfig
from minimill.control.errors import NotFoundError, RequestTimeoutError
from minimill.control.records import RequestRecord
from minimill.control.requests import cancel_request, get_request, read_stream
from minimill.control.response_render import response_events
from minimill.control.store import Store

# The OpenAPI description of a streamed answer: server-sent events, one JSON event each.
EVENT_STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {200: {"content": {
    "text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}}}


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def _reload(store: Store, record: RequestRecord, whole: bool) -> RequestRecord | None:
    """The row now (`whole`: with its body and checkpoint; else only its state, what a
    waiter reads on every wake); None once it is deleted."""
    try:
        return await anyio.to_thread.run_sync(functools.partial(
            get_request, store, record.tenant_id, record.id, with_body=whole,
            with_checkpoint=whole))
    except NotFoundError:
        return None


async def _cancel(store: Store, record: RequestRecord, reason: str) -> None:
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(cancel_request, store, record.id, time.time(), reason)


async def wait_for_end(request: Request, store: Store, watcher: ProgressWatcher,
                       record: RequestRecord, config: ControlConfig) -> RequestRecord | None:
    """The row once terminal; None if the client went away (the response is then cancelled)
    or the row was deleted meanwhile."""
    watch = watcher.watch(record.id)
    current: RequestRecord | None = record
    try:
        while current is not None and not current.terminal:
            if not await watch.changed(request.is_disconnected):
                await _cancel(store, current, "the client went away")
                return None
            current = await _reload(store, current, whole=False)
            # The janitor expires the row at its deadline; this is the backstop without one.
            if current is not None and not current.terminal \
                    and time.time() > current.created_at + config.realtime_timeout_s + 5.0:
                await _cancel(store, current, "no worker finished the response in time")
                raise RequestTimeoutError("No worker finished the response in time; try "
                                          "again later.", code="timeout")
        if current is None or current is record:
            return current
        return await _reload(store, current, whole=True)  # once, to render it
    finally:
        watcher.unwatch(watch)


class ResponseEventStream:
    """One stream of a response's events, from `starting_after` + 1 on."""

    def __init__(self, request: Request, store: Store, watcher: ProgressWatcher,
                 record: RequestRecord, *, starting_after: int, cancel_on_disconnect: bool) -> None:
        self.request, self.store, self.watcher = request, store, watcher
        self.record = record
        self.next_seq = starting_after + 1
        self.cancel_on_disconnect = cancel_on_disconnect
        # The checkpoint's chunks read so far, and the seq of the last (seqs only grow).
        self._chunks: list[dict[str, Any]] = []
        self._after_seq = 0

    async def _advance(self) -> RequestRecord | None:
        """The row now, its checkpoint assembled from the chunks read so far plus the new
        ones; None once it is deleted."""
        try:
            row, new = await anyio.to_thread.run_sync(
                read_stream, self.store, self.record.tenant_id, self.record.id,
                self._after_seq)
        except NotFoundError:
            return None
        for seq, chunk in new:
            self._chunks.append(chunk)
            self._after_seq = seq
        checkpoint = None
        if row.progress is not None and self._chunks:
            checkpoint = assemble(self._chunks).model_dump(mode="json")
        # The body (the response's parameters) never changes: kept from the first read.
        return dataclasses.replace(row, body=self.record.body, checkpoint=checkpoint)

    async def events(self) -> AsyncIterator[str]:
        finished = False
        watch: Watch = self.watcher.watch(self.record.id)
        try:
            while True:
                for event in response_events(self.record, self.next_seq):
                    yield _sse(event)
                    self.next_seq = event["sequence_number"] + 1
                if self.record.terminal:
                    finished = True
                    return
                if not await watch.changed(self.request.is_disconnected):
                    return
                current = await self._advance()
                if current is None:
                    finished = True  # deleted: nothing left to stream or to cancel
                    return
                self.record = current
        finally:
            self.watcher.unwatch(watch)
            if self.cancel_on_disconnect and not finished:
                await _cancel(self.store, self.record, "the client closed the stream")
