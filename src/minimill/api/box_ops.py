"""Waiting for a box operation: its failure as the error the API answers, and a streamed
exec (`POST /v1/boxes/{box_id}/exec` with `"stream": true`) as server-sent events.

A streamed exec sends `{"type": "stdout" | "stderr", "data": ...}` as its host sends output,
then `{"type": "exit", ...}` with what the non-streamed ExecResult carries besides the output
(exit_code, duration_s, timed_out, error, output_truncated), then `data: [DONE]`. One that
cannot end that way (its host was lost, the box was deleted, no host answered in time) ends
with `{"type": "error", "status": N, "error": {...}}`, the HTTP status and the OpenAI error
object the non-streamed call answers, then [DONE].

Every output event has an `id`: the position after it. A client that lost the stream sends
the same request again with the same Idempotency-Key and that id as `Last-Event-ID`, and gets
what follows, each piece once, from any control-plane process: the position is all in the id,
the output in the store. While the exec runs its output is read from its chunks (the
run's epoch and the chunk's number); once it ended, from its result (the characters of each
stream sent so far). If the exec is run again from the start (its host handed it back
unfinished), a `{"type": "restart"}` event says so and its output starts again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request

from minimill.api.box_schemas import ExecResult
from minimill.api.box_wakeup import POLL_INTERVAL_S, BoxWakeups
from minimill.api.streaming import SSE_DONE, sse_event
from minimill.control import boxes
from minimill.control.box_records import OpRecord, OpStatus, OutputChunk
from minimill.control.errors import ControlError, InvalidRequestError, RequestTimeoutError
from minimill.control.store import Store

log = logging.getLogger("minimill.api")
# A box without a host may wait this long for one, on top of the operation's own time.
PLACEMENT_GRACE_S = 120.0
# Errors a host reports that are the caller's doing (400), not the service's.
CALLER_ERRORS = {"invalid_path", "path_escape", "symlink", "not_found", "file_too_large",
                 "invalid_archive", "archive_too_large", "disk_quota_exceeded", "not_a_file",
                 "snapshot_refused"}
# A stream that sent nothing for this long sends an SSE comment, so that proxies and clients
# with a read timeout do not take a quiet command for a dead connection.
KEEPALIVE_S = 15.0


class OpFailed(ControlError):
    """An operation its host could not run: the host's code and message."""


def op_failure(op: OpRecord) -> OpFailed:
    """The error a failed operation answers."""
    error = op.error or {}
    code = str(error.get("code") or "box_error")
    exc = OpFailed(str(error.get("message") or "the operation failed"), code=code)
    if code not in CALLER_ERRORS:
        # The box's state or its host, not the request: deleted meanwhile, host lost.
        exc.status_code = 409
    return exc


def box_timeout(box_id: str) -> RequestTimeoutError:
    return RequestTimeoutError(f"box {box_id} did not answer in time", code="box_timeout")


@dataclass(slots=True)
class Position:
    """Where a reader of an exec's output is: the run (epoch) and the last chunk read of it,
    and the characters of each stream sent of that run."""

    op_id: str
    epoch: int = 0
    seq: int = 0
    stdout: int = 0
    stderr: int = 0

    @property
    def event_id(self) -> str:
        return f"{self.op_id}:{self.epoch}:{self.seq}:{self.stdout}:{self.stderr}"

    @classmethod
    def parse(cls, text: str) -> Position:
        parts = text.strip().split(":")
        try:
            if len(parts) != 5:
                raise ValueError(text)
            numbers = [int(p) for p in parts[1:]]
            if min(numbers) < 0 or max(numbers) > 2**31 - 1:
                raise ValueError(text)
        except ValueError:
            raise InvalidRequestError(
                "Last-Event-ID must be the id of an event of this exec's stream",
                param="Last-Event-ID", code="invalid_last_event_id") from None
        return cls(parts[0], *numbers)

    def sent(self, stream: str) -> int:
        return self.stdout if stream == "stdout" else self.stderr

    def add(self, stream: str, chars: int) -> None:
        if stream == "stdout":
            self.stdout += chars
        else:
            self.stderr += chars

    def start_run(self, epoch: int) -> bool:
        """Follow run `epoch` from its start; True if output of another run was sent."""
        restarted = bool(self.stdout or self.stderr)
        self.epoch, self.seq, self.stdout, self.stderr = epoch, 0, 0, 0
        return restarted


def _error_event(exc: ControlError) -> str:
    return sse_event({"type": "error", "status": exc.status_code, "error": {
        "message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}})


_RESTART = sse_event({"type": "restart", "message": "the box's host handed this exec back "
                      "unfinished; it runs again from the start"})


class ExecStream:
    """One streamed exec, from `position` on; `events` ends with exit or error, then [DONE]."""

    def __init__(self, request: Request, store: Store, wakeups: BoxWakeups, box_id: str,
                 position: Position, deadline: float) -> None:
        self.request, self.store, self.wakeups = request, store, wakeups
        self.box_id = box_id
        self.position = position
        self.deadline = deadline  # time.monotonic() after which it ends with box_timeout

    async def events(self) -> AsyncIterator[str]:
        pos = self.position
        last_sent = time.monotonic()
        try:
            while True:
                op, chunks = await anyio.to_thread.run_sync(
                    boxes.read_output, self.store, pos.op_id, pos.epoch, pos.seq)
                for chunk in chunks:
                    for event in self._output(chunk):
                        yield event
                    last_sent = time.monotonic()
                if op.terminal:
                    for event in self._end(op):
                        yield event
                    return
                if time.monotonic() >= self.deadline:
                    yield _error_event(box_timeout(self.box_id))
                    yield SSE_DONE
                    return
                if time.monotonic() - last_sent >= KEEPALIVE_S:
                    yield ": keep-alive\n\n"
                    last_sent = time.monotonic()
                await self.wakeups.output.wait(POLL_INTERVAL_S)
                if await self.request.is_disconnected():
                    return
        except ControlError as exc:
            yield _error_event(exc)
            yield SSE_DONE
        except Exception:
            # The status line is sent already: the client gets an error event, not a 500.
            log.exception("streamed exec %s on box %s failed", pos.op_id, self.box_id)
            yield _error_event(ControlError("The server had an error while processing your "
                                            "request.", code="server_error"))
            yield SSE_DONE
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(boxes.finish_wait, self.store, pos.op_id)

    def _output(self, chunk: OutputChunk) -> list[str]:
        pos = self.position
        out = []
        if chunk.epoch != pos.epoch and pos.start_run(chunk.epoch):
            out.append(_RESTART)
        pos.seq = chunk.seq
        pos.add(chunk.stream, len(chunk.data))
        out.append(sse_event({"type": chunk.stream, "data": chunk.data}, pos.event_id))
        return out

    def _end(self, op: OpRecord) -> list[str]:
        """The rest of the output from the result (what its chunks did not bring: they are
        dropped when it ends), then exit; or the operation's error."""
        if op.status == OpStatus.FAILED:
            return [_error_event(op_failure(op)), SSE_DONE]
        pos = self.position
        out = []
        if op.epoch is not None and op.epoch != pos.epoch and pos.start_run(op.epoch):
            out.append(_RESTART)
        result = ExecResult.model_validate(op.result or {})
        for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            rest = text[pos.sent(stream):]
            if rest:
                pos.add(stream, len(rest))
                out.append(sse_event({"type": stream, "data": rest}, pos.event_id))
        exit_event: dict[str, Any] = {"type": "exit", **result.model_dump(
            exclude={"object", "stdout", "stderr"})}
        return [*out, sse_event(exit_event), SSE_DONE]
