"""Adapter for the builtin engine in a worker: its step loop in a child process
(`ProcessEngine`), so that the worker's own Python (HTTP, checkpoints, JSON) never holds the
GIL the step loop needs; in the worker's process (`AsyncEngine`) when asked."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from minimill.engine.frontend import StreamEngine
from minimill.engine.params import EngineError, InvalidRequestError, TokenLogprob
from minimill.fleet.choices import ChoiceJob
from minimill.fleet.engines import (
    ChoiceUpdate,
    EngineStartError,
    EngineUnavailableError,
    JobError,
)
from minimill.fleet.startup import StartClock
from minimill.models.chat_template import ChatTemplateError
from minimill.models.prompt import render_chat_prompt
from minimill.models.prompt import tool_format as model_tool_format
from minimill.models.tool_calls import ToolFormat

# Context length used when the engine does not say; SmolLM2 and most small models have >= 2048.
_FALLBACK_CONTEXT = 2048


def error_code(exc: InvalidRequestError) -> str:
    """OpenAI's code for an engine rejection: too-long prompts get their own code."""
    text = str(exc).lower()
    if "context" in text or "too long" in text or "exceeds" in text:
        return "context_length_exceeded"
    return "invalid_request_error"


def flatten_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose content is a list of parts become plain text, as chat templates expect."""
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            text = "".join(p.get("text", "") for p in content
                           if isinstance(p, dict) and p.get("type", "text") == "text")
            message = {**message, "content": text}
        elif content is None:
            message = {**message, "content": ""}
        flat.append(message)
    return flat


class BuiltinEngineAdapter:
    """Runs every choice as one request of a shared engine (continuous batching)."""

    def __init__(self, engine: StreamEngine, model_names: list[str]) -> None:
        self._engine = engine
        self._models = model_names
        self._tokenizer = engine.tokenizer
        self._tool_format = model_tool_format(self._tokenizer)

    @classmethod
    async def start(cls, *, model: str, dtype: str, clock: StartClock | None = None,
                    options: dict[str, Any] | None = None,
                    in_process: bool = False) -> BuiltinEngineAdapter:
        """Start the engine for `model` (loaded from its warm weights cache when there is
        one) with `options` (EngineConfig fields): in a child process, or in this one with
        `in_process`; `clock` marks each phase."""
        clock = clock or StartClock()
        from minimill.engine.kernel_cache import kernel_cache_dir
        from minimill.fleet.kernel_lock import stale_kernel_locks_cleared
        from minimill.models.types import ModelError

        clock.mark("engine imports")
        try:
            with stale_kernel_locks_cleared(kernel_cache_dir()):
                engine = await _in_daemon_thread(_start_engine, model, dtype, options or {},
                                                 in_process, clock)
        except (ModelError, EngineError, ValueError, OSError) as exc:
            raise EngineStartError(f"cannot start the builtin engine for {model!r}: {exc}") \
                from exc
        return cls(engine, [model])

    @property
    def models(self) -> list[str]:
        return list(self._models)

    @property
    def capacity(self) -> int:
        return self._engine.max_num_seqs

    @property
    def default_max_tokens(self) -> int:
        # The engine stops with "length" when the context is full, so the context is the limit.
        value = self._engine.max_model_len
        return value if value > 0 else _FALLBACK_CONTEXT

    @property
    def tool_format(self) -> ToolFormat | None:
        return self._tool_format

    @property
    def guides(self) -> bool:
        return True

    @property
    def embeds(self) -> bool:
        return True

    def _prompt(self, job: ChoiceJob) -> str | list[int]:
        if job.kind == "chat":
            assert job.messages is not None  # choice_jobs sets messages for chat
            return render_chat_prompt(self._tokenizer, job.messages, job.rules.tools)
        assert job.prompt is not None  # choice_jobs sets prompt for completions
        return job.prompt

    def _resume_ids(self, job: ChoiceJob) -> list[int]:
        if job.resume is None:
            return []
        if job.resume.token_ids:
            return list(job.resume.token_ids)
        # A checkpoint written by an HTTP-engine site carries only text.
        return list(self._tokenizer.encode(job.resume.text)) if job.resume.text else []

    def _logprob_dicts(self, items: list[TokenLogprob]) -> list[dict[str, Any]]:
        # Each token's own text, specials included, as OpenAI's logprobs show it.
        def decode(ids: list[int]) -> str:
            return str(self._tokenizer.token_to_str(ids[0]))

        return [{
            "token_id": lp.token_id,
            "token": decode([lp.token_id]),
            "logprob": lp.logprob,
            "top_logprobs": [{"token_id": t, "token": decode([t]), "logprob": v}
                             for t, v in lp.top],
        } for lp in items]

    async def generate(self, job: ChoiceJob) -> AsyncIterator[ChoiceUpdate]:
        try:
            prompt = self._prompt(job)
            # The checkpoint's text is what was handed out for its tokens: the deltas continue
            # it exactly (a split character or a held-back stop prefix is not repeated).
            stream = self._engine.generate(
                job.engine_request_id, prompt, job.params,
                resume_token_ids=self._resume_ids(job),
                resume_text=job.resume.text if job.resume is not None else None)
            async for delta in stream:
                reason = delta.finish_reason.value if delta.finish_reason is not None else None
                yield ChoiceUpdate(
                    new_token_ids=list(delta.new_token_ids), new_text=delta.new_text,
                    num_new_tokens=len(delta.new_token_ids),
                    logprobs=self._logprob_dicts(delta.logprobs) if delta.logprobs else None,
                    finish_reason=reason, num_prompt_tokens=delta.num_prompt_tokens,
                    num_cached_tokens=delta.num_cached_tokens, embedding=delta.embedding)
        except InvalidRequestError as exc:
            raise JobError(error_code(exc), str(exc)) from exc
        except ChatTemplateError as exc:  # the conversation does not fit the model's template
            raise JobError("invalid_request_error", str(exc), "messages") from exc
        except EngineError as exc:  # the engine (its process) failed, not the request
            raise EngineUnavailableError(str(exc)) from exc

    def abort(self, engine_request_id: str) -> None:
        self._engine.abort(engine_request_id)

    def on_death(self, callback: Callable[[str], None]) -> None:
        self._engine.on_death(callback)

    def tokens_per_s(self) -> float | None:
        value = self._engine.recent_output_tok_s()
        return float(value) if value else None

    def step_counts(self) -> tuple[int, int]:
        """(engine steps, sequences those steps ran) so far: their ratio is the mean batch."""
        return self._engine.step_counts

    async def close(self) -> None:
        # close() joins the engine thread: keep the event loop free meanwhile.
        await asyncio.to_thread(self._engine.close)


_T = TypeVar("_T")


async def _in_daemon_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """asyncio.to_thread, in a daemon thread of its own: a worker stopped while its engine
    starts exits at once, where asyncio.run would wait at its end for the default executor's
    thread, i.e. for the engine to finish starting.

    The thread outlives the call, parked until the process exits: the engine child's
    parent-death signal (PR_SET_PDEATHSIG) fires when the *thread* that started it ends."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting task
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)
        threading.Event().wait()

    threading.Thread(target=run, name="minimill-engine-start", daemon=True).start()
    return await done


def _start_engine(model: str, dtype: str, options: dict[str, Any], in_process: bool,
                  clock: StartClock) -> StreamEngine:
    if not in_process:
        from minimill.engine.engine_process import ProcessEngine

        child = ProcessEngine(model, dtype=dtype, **options)
        inside = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in child.start_phases)
        # The child's phases; the rest of its time is its interpreter and the spawn.
        clock.mark(f"engine process ({inside})")
        return child
    from minimill.engine.async_engine import AsyncEngine
    from minimill.engine.config import EngineConfig
    from minimill.models.loader import load_model

    loaded = load_model(model, EngineConfig(dtype=dtype).torch_dtype)
    clock.mark(f"model load ({loaded.extra.get('warm_cache', 'no warm cache')})")
    engine = AsyncEngine(loaded, dtype=dtype, **options)
    clock.mark("engine")
    return engine
