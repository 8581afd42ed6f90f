"""What a caller of the builtin engine holds, without the engine: per-request streams of
deltas, the checks a request passes before it reaches the step loop, and the commands sent to
the step loop. Nothing here imports torch, so a process whose engine runs in a child process
(engine_process.py) starts without paying for torch's import a second time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from minimill.engine.params import EngineError, InvalidRequestError, SamplingParams, TokenDelta
from minimill.models.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What a front end checks requests against: the engine's sizes."""

    max_num_seqs: int
    max_model_len: int
    vocab_size: int


def check_tokens(prompt: list[int], resume: list[int], limits: EngineLimits) -> None:
    """Raise InvalidRequestError for token ids outside the vocabulary or a request that
    leaves no room in the context for one new token (any thread)."""
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in (*prompt, *resume) if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})")
    if len(prompt) + len(resume) >= limits.max_model_len:
        what = "prompt" if not resume else "prompt plus resumed tokens"
        raise InvalidRequestError(
            f"the {what} has {len(prompt) + len(resume)} tokens, but this engine's context "
            f"holds {limits.max_model_len} tokens and at least one must be generated")


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


class StreamEngine(Protocol):
    """What a server holds of the builtin engine (fleet/builtin_engine.py): AsyncEngine and
    ProcessEngine, whose step loop runs in a thread or in a child process."""

    step_counts: tuple[int, int]  # (steps, sequences stepped) of the step loop so far

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    def recent_output_tok_s(self) -> float: ...

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                 resume_token_ids: Seq[int] = (), resume_text: str | None = None
                 ) -> AsyncIterator[TokenDelta]: ...

    def abort(self, request_id: str) -> None: ...

    def on_death(self, callback: Callable[[str], None]) -> None: ...

    def close(self) -> None: ...


class StreamFrontend:
    """Streams of deltas per request; subclasses run the step loop and call `deliver`."""

    def __init__(self, tokenizer: Tokenizer, limits: EngineLimits) -> None:
        self._tokenizer = tokenizer
        self.limits = limits
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # every request not yet finished
        self._closed = False
        self._tok_s = 0.0
        self.step_counts = (0, 0)  # (steps, sequences stepped) of the step loop so far
        # Why the step loop is gone for good (None while it runs or after a close), and who
        # wants to hear of it.
        self.death: str | None = None
        self._death_listeners: list[Callable[[str], None]] = []

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_num_seqs(self) -> int:
        return self.limits.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

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
            check_tokens(prompt_ids, resume, self.limits)
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
        """Cancel a request; its stream ends with finish_reason 'abort'. Unknown ids: no-op,
        and so is any abort once the step loop has died (nothing runs there any more)."""
        with self._lock:
            if self.death is not None:
                return
            try:
                self._submit(request_id)
            except EngineError:
                if self.death is None and not self._closed:
                    raise

    def _submit(self, command: AddRequest | str) -> None:
        """Hand a command (a request to add, or a request id to abort) to the step loop;
        called with the lock held."""
        raise NotImplementedError

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once when the step loop dies unasked (not on close), from
        whichever thread notices: at once if it has died already."""
        with self._lock:
            dead = self.death
            if dead is None:
                self._death_listeners.append(callback)
        if dead is not None:
            callback(dead)

    def died(self, reason: str) -> None:
        """The step loop is gone for good: tell the listeners, then fail every open stream."""
        with self._lock:
            if self.death is not None:
                return
            self.death = reason
            self._closed = True
            listeners, self._death_listeners = self._death_listeners, []
        for callback in listeners:
            callback(reason)
        self.fail_streams(EngineError(reason))

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


def _post(stream: _Stream, items: list[Any]) -> None:
    try:
        stream.loop.call_soon_threadsafe(_post_batch, [(stream, items)])
    except RuntimeError:
        pass


def _post_batch(batch: list[tuple[_Stream, list[Any]]]) -> None:
    for stream, items in batch:
        for item in items:
            stream.queue.put_nowait(item)
