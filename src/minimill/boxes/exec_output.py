"""A running exec's output, posted to the control plane as it comes (`/output`).

The threads reading the exec's pipes hand their bytes to `write`. They are decoded as UTF-8
incrementally, per stream, so that a character split between two reads is sent whole and the
text sent is exactly the result's (which decodes the whole output at once, with the same
replacement of invalid bytes). What is waiting goes out every FLUSH_INTERVAL_S, or at once when
FLUSH_BYTES are waiting: one post at a time, in order, each chunk numbered so that a post sent
again after a lost answer is stored once. The sandbox keeps at most MAX_EXEC_OUTPUT_BYTES per
stream and only what it keeps comes here, so at most that much per stream is sent.

A refusal (the box or the operation is not this host's any more) ends the posting, not the
exec: its result is refused the same way.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import logging
import threading

from minimill.boxes.host_client import BoxHostClient, NotHeld
from minimill.transport.box_protocol import (
    MAX_CHUNK_CHARS,
    BoxOp,
    BoxOutputChunk,
    BoxOutputRequest,
    OutputStream,
)
from minimill.transport.client import SiteAuthError, retrying

log = logging.getLogger("minimill.boxes")
FLUSH_INTERVAL_S = 0.25
FLUSH_BYTES = 64 * 1024
# Chunks per post (the protocol's limit).
CHUNKS_PER_POST = 64
STREAMS: dict[str, OutputStream] = {"stdout": "stdout", "stderr": "stderr"}


class ExecOutput:
    """One exec's output on its way to the control plane. Create it on the event loop; `write`
    may be called from any thread."""

    def __init__(self, client: BoxHostClient, op: BoxOp) -> None:
        self._client = client
        self._op = op
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")(errors="replace")
                          for s in STREAMS}
        self._pending: list[tuple[OutputStream, str]] = []  # (stream, text), in the order written
        self._pending_bytes = 0
        self._due = asyncio.Event()
        self._closing = False
        self._refused = False
        self._seq = 0
        self._task = asyncio.create_task(self._run(), name=f"output-{op.op_id}")

    def write(self, stream: str, data: bytes) -> None:
        with self._lock:
            self._add(STREAMS[stream], self._decoders[stream].decode(data))
            self._pending_bytes += len(data)
            due = self._pending_bytes >= FLUSH_BYTES
        if due:
            with contextlib.suppress(RuntimeError):  # the loop is closing: nothing to send
                self._loop.call_soon_threadsafe(self._due.set)

    def _add(self, stream: OutputStream, text: str) -> None:
        if not text:
            return
        if self._pending and self._pending[-1][0] == stream:
            self._pending[-1] = (stream, self._pending[-1][1] + text)
        else:
            self._pending.append((stream, text))

    async def close(self) -> None:
        """The exec ended: post the rest, and return once all of it is posted (or refused)."""
        self._closing = True
        self._due.set()
        await self._task

    def abandon(self) -> None:
        """Stop posting; what is still waiting is dropped."""
        self._task.cancel()

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._due.wait(), FLUSH_INTERVAL_S)
            self._due.clear()
            await self._flush()
        with self._lock:
            for stream, decoder in self._decoders.items():
                # An output that ends inside a character: its end is replaced, as the result's.
                self._add(STREAMS[stream], decoder.decode(b"", final=True))
        await self._flush()

    async def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._pending_bytes = self._pending, [], 0
        if self._refused or not pending:
            return
        chunks: list[BoxOutputChunk] = []
        for stream, text in pending:
            for start in range(0, len(text), MAX_CHUNK_CHARS):
                self._seq += 1
                chunks.append(BoxOutputChunk(seq=self._seq, stream=stream,
                                             data=text[start:start + MAX_CHUNK_CHARS]))
        op = self._op
        for start in range(0, len(chunks), CHUNKS_PER_POST):
            ask = BoxOutputRequest(op_id=op.op_id, box_id=op.box_id, epoch=op.epoch,
                                   chunks=chunks[start:start + CHUNKS_PER_POST])
            try:
                await retrying(functools.partial(self._client.output, ask), "exec output")
            except (NotHeld, SiteAuthError) as exc:
                self._refused = True
                log.info("output of %s on box %s refused (%s): not sending more of it",
                         op.op_id, op.box_id, exc)
                return
            except Exception:
                # Streaming is an extra: whatever breaks it must not keep the result from
                # being posted (the result carries the whole output anyway).
                self._refused = True
                log.exception("cannot send the output of %s on box %s", op.op_id, op.box_id)
                return
