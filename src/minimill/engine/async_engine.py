"""Asynchronous front end: the step loop runs in a background thread; callers on an asyncio
loop submit requests and iterate their TokenDeltas, never blocking the loop.

Commands (add, abort) go to the engine thread through a locked inbox; results come back with
one `call_soon_threadsafe` per step and event loop. A failure while processing one request
ends only that request (its iterator raises); the loop keeps serving the others.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from minimill.engine.config import EngineConfig
from minimill.engine.core import EngineCore
from minimill.engine.llm import load
from minimill.engine.params import (
    EngineError,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    TokenDelta,
)
from minimill.models.tokenizer import Tokenizer
from minimill.models.types import LoadedModel

_IDLE_WAIT_S = 0.5


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenDelta | BaseException]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    resume_token_ids: list[int]
    resume_text: str | None


class AsyncEngine:
    """The builtin engine for servers and workers: many concurrent streaming requests."""

    def __init__(self, model: str | LoadedModel, **config_overrides: Any) -> None:
        loaded, config = load(model, config_overrides)
        self._core = EngineCore(loaded, config)
        self._lock = threading.Lock()
        self._inbox: deque[_Add | str] = deque()  # str: a request id to abort
        self._streams: dict[str, _Stream] = {}  # every request not yet finished
        self._wake = threading.Event()
        self._closed = False
        self._tok_s = 0.0
        self._thread = threading.Thread(target=self._run, name="minimill-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._core.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self._core.config

    @property
    def max_num_seqs(self) -> int:
        return self._core.config.max_num_seqs

    @property
    def num_running(self) -> int:
        """Requests submitted and not finished (decoding or waiting for room)."""
        return len(self._streams)

    def recent_output_tok_s(self) -> float:
        """Output tokens per second the step loop measured over its last few tens of seconds."""
        return self._tok_s

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                 resume_token_ids: Seq[int] = (), resume_text: str | None = None
                 ) -> AsyncIterator[TokenDelta]:
        """Submit a request now (bad input raises InvalidRequestError here) and return its
        stream of deltas. Call from a running event loop.

        A text prompt is tokenized with the tokenizer's special tokens. `resume_token_ids`
        are tokens generated earlier: they are prefilled, not repeated in the deltas, and count
        towards max_tokens; sampling continues at output position len(resume_token_ids).
        `resume_text` is the text already handed out for them (a checkpoint's): the deltas
        continue it exactly as the uninterrupted request's would have (EngineCore.add_request).
        """
        if self._closed:
            raise EngineError("the engine is closed")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_ids = list(prompt)
        resume = list(resume_token_ids)
        loop = asyncio.get_running_loop()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            # Checks that need no scheduler state; the engine thread owns the rest.
            self._core.check_request(prompt_ids, resume)
            self._streams[request_id] = _Stream(loop, asyncio.Queue())
            self._inbox.append(_Add(request_id, prompt_ids, params, resume, resume_text))
        self._wake.set()
        return self._iterate(request_id)

    async def _iterate(self, request_id: str) -> AsyncIterator[TokenDelta]:
        stream = self._streams[request_id]
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its stream ends with finish_reason 'abort'. Unknown ids: no-op."""
        with self._lock:
            self._inbox.append(request_id)
        self._wake.set()

    def close(self) -> None:
        """Stop the step loop; unfinished requests' streams raise EngineError."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        with self._lock:
            streams, self._streams = dict(self._streams), {}
        for stream in streams.values():
            _post(stream, [EngineError("the engine was closed")])

    # The engine thread.

    def _run(self) -> None:
        core = self._core
        while not self._closed:
            with self._lock:
                commands, self._inbox = self._inbox, deque()
            out: dict[str, list[TokenDelta | BaseException]] = defaultdict(list)
            for command in commands:
                self._apply(command, out)
            if not core.has_unfinished:
                self._deliver(out)
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                result = core.step()
            except Exception as exc:  # a fault outside any one request: fail them all
                self._fail_all(exc, out)
            else:
                for delta in result.deltas:
                    out[delta.request_id].append(delta)
                for request_id, error in result.failures.items():
                    out[request_id].append(EngineError(f"request failed: {error}"))
                self._tok_s = core.recent_output_tok_s()
            self._deliver(out)

    def _apply(self, command: _Add | str, out: dict[str, list[TokenDelta | BaseException]]
               ) -> None:
        if isinstance(command, str):
            delta = self._core.abort_request(command)
            if delta is None:
                # Aborted before admission or already done: end the stream if still open.
                delta = TokenDelta(command, [], "", FinishReason.ABORT)
            out[command].append(delta)
            return
        try:
            self._core.add_request(command.request_id, command.prompt_token_ids,
                                   command.params, command.resume_token_ids, command.resume_text)
        except Exception as exc:
            out[command.request_id].append(exc)

    def _fail_all(self, exc: Exception, out: dict[str, list[TokenDelta | BaseException]]
                  ) -> None:
        for request_id in list(self._core.scheduler.requests):
            self._core.abort_request(request_id)
            out[request_id].append(EngineError(f"the engine step failed: {exc}"))

    def _deliver(self, out: dict[str, list[TokenDelta | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, list[Any]]]] = {}
        with self._lock:
            for request_id, items in out.items():
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if any(isinstance(i, BaseException) or i.finish_reason is not None
                       for i in items):
                    del self._streams[request_id]
                by_loop.setdefault(stream.loop, []).append((stream, items))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_post_batch, batch)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening any more


def _post(stream: _Stream, items: list[Any]) -> None:
    try:
        stream.loop.call_soon_threadsafe(_post_batch, [(stream, items)])
    except RuntimeError:
        pass


def _post_batch(batch: list[tuple[_Stream, list[Any]]]) -> None:
    for stream, items in batch:
        for item in items:
            stream.queue.put_nowait(item)
