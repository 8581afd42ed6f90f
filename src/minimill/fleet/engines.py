"""The engine adapter interface a worker drives (engine_factory.py picks one by name).

An adapter turns a `ChoiceJob` into a stream of `ChoiceUpdate`s. Two adapters exist: the builtin
engine (token ids; checkpoints carry ids and text) and any OpenAI-compatible server over HTTP
(text; checkpoints carry text). Both resume from a checkpoint's `ChoiceProgress`: the builtin
one from its token ids (or, when a text-only checkpoint came from an HTTP site, the text's
tokenization), the HTTP one from its text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from minimill.fleet.choices import ChoiceJob
from minimill.models.tool_calls import ToolFormat


class EngineStartError(RuntimeError):
    """The engine could not be started or reached (bad model, unreachable server)."""


class EngineUnavailableError(RuntimeError):
    """The engine failed, not the request (a remote server down, 5xx): another site may run it."""


class EngineDiedError(RuntimeError):
    """The site's engine is gone for good (`EngineAdapter.on_death`): the worker has handed
    its leases back and exits, for its supervisor to start the site again."""


class JobError(Exception):
    """One job failed for a reason that belongs to the request; `code` is OpenAI's error code."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(slots=True)
class ChoiceUpdate:
    """New output of one choice since the previous update."""

    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # How many tokens this update adds; equals len(new_token_ids) when ids are known.
    num_new_tokens: int = 0
    # One dict per new token: token_id (if known), token, logprob, top_logprobs.
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None  # "stop" | "length" on the last update
    num_prompt_tokens: int = 0  # 0 when not known yet
    num_cached_tokens: int = 0  # of those, served from the engine's KV cache
    # An embedding job's vector, on its last update (it has no tokens).
    embedding: list[float] | None = None


class EngineAdapter(Protocol):
    """What the worker needs from an engine."""

    @property
    def models(self) -> list[str]:
        """Model names this engine serves (the names the control plane routes by)."""
        ...

    @property
    def capacity(self) -> int:
        """Sequences it can run at once with a full batch (the worker leases up to this)."""
        ...

    @property
    def default_max_tokens(self) -> int:
        """Limit used when a request sets none (the rest of the context)."""
        ...

    @property
    def tool_format(self) -> ToolFormat | None:
        """The syntax this engine's model writes tool calls in; None: it has none."""
        ...

    @property
    def guides(self) -> bool:
        """Whether it enforces a grammar on outputs (tools, response_format)."""
        ...

    @property
    def embeds(self) -> bool:
        """Whether it computes embeddings (jobs of kind "embedding")."""
        ...

    def generate(self, job: ChoiceJob) -> AsyncIterator[ChoiceUpdate]:
        """Run one choice from its resume point; raise JobError for request-level failures."""
        ...

    def abort(self, engine_request_id: str) -> None:
        """Stop a running job; its iterator ends (or raises) soon after."""
        ...

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once, from any thread, if the engine is gone for good (its
        process died): the site cannot serve without it. An engine that may come back (a
        remote server) never calls it."""
        ...

    def tokens_per_s(self) -> float | None:
        """Output tokens/s measured recently, or None before any measurement."""
        ...

    async def close(self) -> None:
        """Release the engine (stop its loop, close connections)."""
        ...
