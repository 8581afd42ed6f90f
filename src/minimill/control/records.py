"""Typed records and status enums of the control plane (what domain operations return)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal


def new_id(prefix: str) -> str:
    """A random id with OpenAI-like prefix, e.g. `file-…`, `batch_…`; 96 random bits."""
    return prefix + secrets.token_hex(12)


class RequestStatus(StrEnum):
    QUEUED = "queued"  # waiting for a lease (fresh, or returned by an expired lease)
    LEASED = "leased"  # a worker holds it at the row's current epoch
    SUCCEEDED = "succeeded"  # a valid completion arrived; result and usage are set
    FAILED = "failed"  # bad batch line, or the worker reported a request-level error
    CANCELLED = "cancelled"  # its batch was cancelled, or a realtime client went away
    EXPIRED = "expired"  # its deadline (batch window, realtime timeout) passed unfinished


ACTIVE_REQUEST_STATUSES = (RequestStatus.QUEUED, RequestStatus.LEASED)
TERMINAL_REQUEST_STATUSES = (RequestStatus.SUCCEEDED, RequestStatus.FAILED,
                             RequestStatus.CANCELLED, RequestStatus.EXPIRED)


class BatchStatus(StrEnum):
    VALIDATING = "validating"  # input file being read and its lines queued, in short steps
    FAILED = "failed"  # the input file was unusable; `errors` says which line and why
    IN_PROGRESS = "in_progress"  # rows are being served
    FINALIZING = "finalizing"  # every row is terminal; output and error files being written
    COMPLETED = "completed"  # files written, window not exceeded
    EXPIRED = "expired"  # the window passed; unfinished rows are in the error file
    CANCELLING = "cancelling"  # cancel requested; unfinished rows are being cancelled
    CANCELLED = "cancelled"  # files written after a cancel; finished results kept


class Tier(StrEnum):
    REALTIME = "realtime"  # someone waits on it: leased before any background work
    BACKGROUND = "background"  # batch lines and service_tier "flex": fills free capacity


class Kind(StrEnum):
    CHAT = "chat"  # /v1/chat/completions
    COMPLETION = "completion"  # /v1/completions
    # /v1/responses: workers run it as a chat over the whole conversation (its body holds the
    # chat messages), so leases hand it out as "chat" (wire_kind) and no worker changes.
    RESPONSE = "response"
    # /v1/embeddings: one pooled vector per input, nothing generated (billed for its prompt).
    EMBEDDING = "embedding"

    @property
    def wire_kind(self) -> Literal["chat", "completion", "embedding"]:
        """The kind a worker is told in its lease: the engine path that runs it."""
        if self == Kind.EMBEDDING:
            return "embedding"
        return "completion" if self == Kind.COMPLETION else "chat"


ENDPOINT_KINDS = {"/v1/chat/completions": Kind.CHAT, "/v1/completions": Kind.COMPLETION,
                  "/v1/responses": Kind.RESPONSE, "/v1/embeddings": Kind.EMBEDDING}


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class Operator:
    """The holder of an operator key: reaches the fleet (sites, outages, prices, keys)."""

    key_id: str


class SiteScope(StrEnum):
    """A part of the worker protocol a site is registered for (`sites create --serves`)."""

    TOKENS = "tokens"  # leases, heartbeats, completions and releases of requests
    BOXES = "boxes"  # the box host protocol: holds tenants' boxes (runs their code)
    AGENTS = "agents"  # the runner protocol: runs tenants' harnesses with their credentials


ALL_SITE_SCOPES = frozenset(SiteScope)


@dataclass(frozen=True, slots=True)
class Site:
    id: str
    name: str
    chip: str
    price_per_hour: float
    tokens_per_s: float | None  # busy rate its worker reports (placement's prior, not cost)
    created_at: float
    last_seen_at: float | None
    # What its token reaches (a site registered before scopes existed: everything).
    serves: frozenset[SiteScope] = ALL_SITE_SCOPES


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    tenant_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    expires_at: float | None  # when the janitor deletes it; None: kept until deleted


@dataclass(frozen=True, slots=True)
class RequestCounts:
    total: int
    completed: int  # succeeded
    failed: int  # failed, cancelled or expired


@dataclass(frozen=True, slots=True)
class UsageTotals:
    prompt_tokens: int
    completion_tokens: int
    billed_usd: float  # what the tenant is billed (the price list), never the factory's cost


@dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str
    tenant_id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: float
    expires_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    expired_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    output_file_id: str | None
    error_file_id: str | None
    errors: list[dict[str, Any]] | None  # validation errors of an unusable file
    metadata: dict[str, str] | None
    counts: RequestCounts
    usage: UsageTotals


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One realtime request or batch line, as far as readers of its progress need it."""

    id: str
    tenant_id: str
    batch_id: str | None
    kind: Kind | None  # None only for batch lines that failed validation
    tier: Tier
    model: str | None
    body: dict[str, Any] | None
    status: RequestStatus
    epoch: int
    version: int  # bumped on every checkpoint and state change; watchers compare it
    # Lengths of the stored checkpoint per choice (checkpoints.Progress); None once terminal.
    progress: dict[str, Any] | None
    result: dict[str, Any] | None  # {"choices": [ChoiceProgress...]} once succeeded
    error: dict[str, Any] | None  # {"code", "message", "param"} once failed
    prompt_tokens: int
    completion_tokens: int
    billed_usd: float  # what the tenant is billed for it (prices.billed_usd at completion)
    created_at: float
    finished_at: float | None
    session_key: str | None = None  # the conversation it belongs to (requests.session_key)
    cached_tokens: int = 0  # of prompt_tokens, those served from the engine's KV cache
    # The stored checkpoint, assembled (a Checkpoint as JSON), for readers that ask for it (a
    # response's text so far); None otherwise, and once terminal.
    checkpoint: dict[str, Any] | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_REQUEST_STATUSES
