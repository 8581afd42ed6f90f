"""Asynchronous front ends: callers on an asyncio loop submit requests and iterate their
TokenDeltas, never blocking the loop; the step loop runs elsewhere.

- `AsyncEngine`: the step loop in a thread of this process (tests, embedding).
- `ProcessEngine` (engine_process.py): the step loop in a child process, so that the
  caller's own Python work (HTTP, checkpoints, JSON) never competes with it for the GIL.

Both share `StreamFrontend`: per-request streams, results handed to each stream's event loop
with one `call_soon_threadsafe` per step and loop. A failure while processing one request ends
only that request (its iterator raises); the loop keeps serving the others.
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

Outcome = TokenDelta | BaseException


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Outcome]


@dataclass(slots=True)
class AddRequest:
    """A command to the step loop: admit this request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    resume_token_ids: list[int]
    resume_text: str | None


class StreamFrontend:
    """Streams of deltas per request; subclasses run the step loop and call `deliver`."""

    def __init__(self, tokenizer: Tokenizer, config: EngineConfig, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._config = config
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # every request not yet finished
        self._closed = False
        self._tok_s = 0.0
        self.step_counts = (0, 0)  # (steps, sequences stepped) of the step loop so far

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def max_num_seqs(self) -> int:
        return self._config.max_num_seqs

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
            prompt_ids = self._tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_ids = list(prompt)
        resume = list(resume_token_ids)
        loop = asyncio.get_running_loop()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running")
            # Checks that need no scheduler state; the step loop does the rest.
            EngineCore.check_tokens(prompt_ids, resume, self._vocab_size,
                                    self._config.max_model_len)
            self._streams[request_id] = _Stream(loop, asyncio.Queue())
            self._submit(AddRequest(request_id, prompt_ids, params, resume, resume_text))
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
            self._submit(request_id)

    def _submit(self, command: AddRequest | str) -> None:
        """Hand a command (a request to add, or a request id to abort) to the step loop;
        called with the lock held."""
        raise NotImplementedError

    def fail_streams(self, error: BaseException) -> None:
        """End every open stream with `error` (the step loop is gone)."""
        with self._lock:
            streams, self._streams = dict(self._streams), {}
        for stream in streams.values():
            _post(stream, [error])

    def deliver(self, out: dict[str, list[Outcome]]) -> None:
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


class AsyncEngine(StreamFrontend):
    """The builtin engine with its step loop in a thread of this process."""

    def __init__(self, model: str | LoadedModel, **config_overrides: Any) -> None:
        loaded, config = load(model, config_overrides)
        self._core = EngineCore(loaded, config)
        super().__init__(loaded.tokenizer, config, loaded.config.vocab_size)
        self._inbox: deque[AddRequest | str] = deque()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minimill-engine", daemon=True)
        self._thread.start()

    def _submit(self, command: AddRequest | str) -> None:
        self._inbox.append(command)
        self._wake.set()

    def close(self) -> None:
        """Stop the step loop; unfinished requests' streams raise EngineError."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.fail_streams(EngineError("the engine was closed"))

    def _run(self) -> None:
        core = self._core
        while not self._closed:
            with self._lock:
                commands, self._inbox = self._inbox, deque()
            out: dict[str, list[Outcome]] = defaultdict(list)
            for command in commands:
                apply_command(core, command, out)
            if not core.has_unfinished:
                self.deliver(out)
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            step_into(core, out)
            self._tok_s = core.recent_output_tok_s()
            self.step_counts = (core.num_steps, core.num_step_seqs)
            self.deliver(out)
        core.close()


def apply_command(core: EngineCore, command: AddRequest | str,
                  out: dict[str, list[Outcome]]) -> None:
    """Admit or abort a request in the step loop's thread; results go to `out`."""
    if isinstance(command, str):
        delta = core.abort_request(command)
        if delta is None:
            # Aborted before admission or already done: end the stream if still open.
            delta = TokenDelta(command, [], "", FinishReason.ABORT)
        out[command].append(delta)
        return
    try:
        core.add_request(command.request_id, command.prompt_token_ids, command.params,
                         command.resume_token_ids, command.resume_text)
    except Exception as exc:
        out[command.request_id].append(exc)


def step_into(core: EngineCore, out: dict[str, list[Outcome]]) -> None:
    """One step; its deltas and per-request failures go to `out`."""
    try:
        result = core.step()
    except Exception as exc:  # a fault outside any one request: fail them all
        for request_id in list(core.scheduler.requests):
            core.abort_request(request_id)
            out[request_id].append(EngineError(f"the engine step failed: {exc}"))
        return
    for delta in result.deltas:
        out[delta.request_id].append(delta)
    for request_id, error in result.failures.items():
        out[request_id].append(EngineError(f"request failed: {error}"))


def _post(stream: _Stream, items: list[Any]) -> None:
    try:
        stream.loop.call_soon_threadsafe(_post_batch, [(stream, items)])
    except RuntimeError:
        pass


def _post_batch(batch: list[tuple[_Stream, list[Any]]]) -> None:
    for stream, items in batch:
        for item in items:
            stream.queue.put_nowait(item)
