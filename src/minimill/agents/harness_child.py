"""The process a harness runs in (started by harness_process.py, in a sandbox).

It runs the tenant's `main(ctx, task)` with the `ctx` of runtime.py; every effect goes to the
runner over this process's stdin and stdout, one JSON object a line, and the runner performs
it with the lease's key (this process holds no key, no site token and no network). Only the
standard library and runtime.py are imported here: that is all a sandboxed harness can see.

The harness's own prints go to stderr (the runner logs them), so that stdout carries only the
protocol. What the runner sends: the start (code, task, journal, budget), answers to requests
(`{"id", "value"}` or `{"id", "error"}`) and `{"op": "hand_back"}`. What this process sends:
requests (`chat`, `box_create`, `box_call`, `journal`), `quiet` once handed back with nothing
in flight, and `done` with the outcome.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
import traceback
from typing import Any

from minimill.agents.runtime import (
    Budget,
    Ctx,
    EffectFailed,
    Effects,
    Run,
    Suspend,
    load_main,
)

# A start message carries the whole journal: it may be long.
MAX_LINE_BYTES = 256 * 1024 * 1024
_PR_SET_PDEATHSIG = 1


class Channel:
    """Requests to the runner and their answers."""

    def __init__(self, out_fd: int) -> None:
        self._out_fd = out_fd
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[Any]] = {}

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:  # the runner reads all the time: a full pipe drains soon
            data = data[os.write(self._out_fd, data):]

    async def request(self, op: str, **fields: Any) -> Any:
        self._next_id += 1
        request_id = self._next_id
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answer
        self.send({"id": request_id, "op": op, **fields})
        return await answer

    def answer(self, message: dict[str, Any]) -> None:
        waiting = self._waiting.pop(int(message["id"]), None)
        if waiting is None or waiting.done():
            return
        error = message.get("error")
        if error is not None:  # the API refused the effect
            waiting.set_exception(EffectFailed(str(error.get("message") or "")))
        else:
            waiting.set_result(message.get("value"))


class PipeEffects(Effects):
    """Effects performed by the runner on the other end of the pipe."""

    def __init__(self, channel: Channel, run_ref: list[Run]) -> None:
        self._channel = channel
        self._run_ref = run_ref

    async def chat(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        value = await self._channel.request("chat", body=body, key=key)
        return value if isinstance(value, dict) else {}

    async def box_create(self) -> str:
        return str(await self._channel.request("box_create"))

    async def box_call(self, box_id: str, op: str, args: dict[str, Any], key: str) -> Any:
        return await self._channel.request("box_call", box_id=box_id, call=op, args=args,
                                           key=key)

    async def journal(self, key: str, kind: str, value: Any) -> None:
        replayed = self._run_ref[0].take_replayed()
        await self._channel.request("journal", key=key, kind=kind, value=value,
                                    replayed=replayed)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def harness_traceback(exc: BaseException, filename: str) -> str:
    """The traceback a harness's author needs: the frames of their own file (minimill's
    frames say nothing to them), then the exception."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
    lines += traceback.format_exception_only(exc)
    return "".join(lines if frames else lines[1:])[-4000:]


async def _read_lines(channel: Channel, run: Run, reader: asyncio.StreamReader) -> None:
    while line := await reader.readline():
        message = json.loads(line)
        if message.get("op") == "hand_back":
            run.hand_back()
        elif "id" in message:
            channel.answer(message)
    os._exit(0)  # the runner is gone: nothing this run does could be journaled


async def _serve(start: dict[str, Any], reader: asyncio.StreamReader, channel: Channel) -> None:
    run_ref: list[Run] = []
    journal = start.get("journal") or []
    run = Run(effects=PipeEffects(channel, run_ref),
              journal={key: value for key, _kind, value in journal},
              model=str(start.get("model") or ""),
              budget=Budget.from_journal(start.get("budget_tokens"),
                                         [(kind, value) for _key, kind, value in journal]))
    run_ref.append(run)
    run.on_quiet = lambda: channel.send({"op": "quiet", "replayed": run.replayed})
    listener = asyncio.create_task(_read_lines(channel, run, reader))
    done: dict[str, Any]
    filename = str(start.get("filename") or "harness.py")
    try:
        main = load_main(str(start["code"]), filename)
        result = await main(Ctx(run), start.get("task"))
        done = {"outcome": "succeeded", "result": _jsonable(result)}
    except Suspend as sleep:
        done = {"outcome": "sleeping", "wake_at": sleep.wake_at}
    except Exception as exc:
        done = {"outcome": "failed", "message": harness_traceback(exc, filename)}
    channel.send({"op": "done", "replayed": run.replayed, "performed": run.performed, **done})
    listener.cancel()


def _die_with_runner() -> None:
    """Without a sandbox (whose bubblewrap dies with its parent) nothing else ends this
    process when its runner is killed."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


async def _main(out_fd: int) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    line = await reader.readline()
    if not line:
        return
    await _serve(json.loads(line), reader, Channel(out_fd))


def main() -> None:
    _die_with_runner()
    # The protocol keeps the real stdout; the harness's prints go to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    asyncio.run(_main(out_fd))


if __name__ == "__main__":
    main()
