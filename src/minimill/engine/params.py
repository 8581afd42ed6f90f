"""Sampling parameters and request outputs: the engine's public plain-data types."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

# Re-exported: the engine's callers import it from here, beside the parameters it checks.
from minimill.errors import InvalidRequestError as InvalidRequestError
from minimill.models.grammar import GuidedDecoding


class EngineError(Exception):
    """The engine failed (its process died, it was closed): not the request's fault. A bad
    request raises InvalidRequestError (minimill/errors.py), which the API answers with 400."""


class EngineDied(EngineError):
    """The engine cannot step any more (a pipeline stage's process ended): its front end
    stops it rather than failing requests one by one, and the work resumes elsewhere."""


class FinishReason(str, Enum):  # noqa: UP042 (str() of members is relied on as is)
    """Why a request stopped; values are the OpenAI finish_reason strings."""

    STOP = "stop"  # an eos token or a stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. Sampling at output position i depends only on (seed, i, logits)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    seed: int | None = None  # None: the engine draws one at admission and reports it
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # how many alternatives per position (0..20)
    # OpenAI's penalties: each output token so far lowers its logit by frequency_penalty per
    # occurrence, and by presence_penalty once.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100) added to the logit
    # What the output may be (a JSON schema, tool calls): tokens outside it are never sampled.
    guided: GuidedDecoding | None = None
    # Mixed into the hash of its first KV block (block_manager.prefix_root): cached prefixes
    # serve only requests with the same salt (the control plane gives each tenant its own;
    # None: shared with every request without one).
    cache_salt: str | None = None
    # An embedding request: prefill only, its output is the final normed hidden state of the
    # last prompt token, L2-normalised (TokenDelta.embedding); no token is sampled.
    embed: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be at least 1, got {self.top_k}")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequestError(f"logit_bias has a negative token id {token}")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def uses_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob) of the most likely alternatives, best first; empty unless asked.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """The whole result of one request (offline API), or the state so far (async API)."""

    request_id: str
    prompt_token_ids: list[int]
    # All generated tokens, including any that a resumed request was given as its checkpoint.
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    seed: int
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or a KV tier
    embedding: list[float] | None = None  # an embedding request's vector (params.embed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class TokenDelta:
    """What the async engine yields per request per step: new tokens and text since last time."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    # Set on the last delta of a request.
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    seed: int = 0
    # Prompt tokens whose KV came from the prefix cache or a KV tier, not computed.
    num_cached_tokens: int = 0
    # An embedding request's vector (float32 values), on its only (last) delta.
    embedding: list[float] | None = None
