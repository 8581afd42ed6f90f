"""Wire messages between a worker (fleet/) and the control plane (api/ serves, control/ decides).

Workers pull: they ask for leases with their free capacity, heartbeat (extending leases and
carrying checkpoints), and complete with the lease's fencing epoch. A lease a worker will not
finish (it is stopping, or the heartbeat answer lists it in `handback` ahead of an announced
outage of its site) is released with its last checkpoint: the request is queued again at once
and resumes elsewhere from there. A site needs no inbound connectivity. All routes are under
`/v1/fleet/` and authenticated with the site token as a Bearer key. Times are Unix seconds
(float) from the control plane's clock.

Checkpoints are incremental: a heartbeat carries, per choice, only what is new since the
control plane's last accepted checkpoint (`CheckpointDelta`), with the lengths it extends. A
delta whose base lengths differ from what the control plane holds (a lost answer, say) is not
applied and the lease is listed in `resync`: the worker then sends its whole progress once as
`checkpoint`. A lease's own checkpoint (what it resumes from) is the base of its first delta; a
release carries the whole progress.

`complete` is idempotent: resending an accepted result (same request, epoch and site) answers
`accepted` again. A lease revoked by expiry that nobody else took is still the current epoch:
its finished result is accepted.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

# The tool-call syntaxes a site may say its text is written in.
from minimill.models.tool_calls import ToolFormatName

FLEET_PREFIX = "/v1/fleet"
# A worker waits this long for a lease call's answer, longer than for its other calls: at a
# loaded control plane a lease call waits its turn, and a worker that gave up and asked again
# went to the back of the line, while what the call it left was granted waited for a retry to
# get through (LeaseRequest.ask_id).
LEASE_CALL_TIMEOUT_S = 30.0
# The control plane's side of it: a lease call waits at most this long for its turn before it
# is answered with nothing (the worker asks again), so that its answer, transaction included,
# arrives well inside the worker's timeout. At a thousand sites calls waited up to 30 s and
# timed out, and what their transactions had just granted expired unread.
LEASE_QUEUE_S = LEASE_CALL_TIMEOUT_S / 3
# A request id a site names: the control plane's ids are short and printable, and a NUL byte
# reached PostgreSQL's text comparison as an error (a 500), not as an id that names nothing.
SiteRequestId = Annotated[str, Field(max_length=200, pattern=r"^[^\x00]*$")]
# Longest chip name a worker may declare (the site registry's column holds this many).
MAX_CHIP_CHARS = 100
# A site price above this is a typo, and would make $/Mtok overflow to infinity.
MAX_PRICE_PER_HOUR = 1e6
# Most session tags a worker reports as held (its most recent sessions).
MAX_HELD_SESSIONS = 256
# Longest embedding a worker may return (the widest open models' hidden size is 16,384).
MAX_EMBEDDING_DIM = 65_536


def session_tag(session_key: str) -> str:
    """A short, fixed-size stand-in for a session key: what workers report they hold."""
    return hashlib.blake2b(session_key.encode(), digest_size=6).hexdigest()


class ChoiceProgress(BaseModel):
    """Generated-so-far state of one choice (of `n`) of a request."""

    index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    # Set once this choice has finished ("stop" | "length").
    finish_reason: str | None = None
    # Logprob per generated token, when the request asked for logprobs.
    logprobs: list[dict[str, Any]] | None = None
    # A request with tools: the syntax of the tool calls in `text` (the control plane parses
    # them out of it).
    tool_format: ToolFormatName | None = None
    # An embedding request's vector for input `index` (float32 values; no tokens, no text).
    embedding: list[Annotated[float, Field(allow_inf_nan=False)]] | None = Field(
        default=None, max_length=MAX_EMBEDDING_DIM)


class Checkpoint(BaseModel):
    """Tokens generated so far, per choice; a resumed request continues from here."""

    choices: list[ChoiceProgress] = Field(default_factory=list)
    num_prompt_tokens: int = 0


class ChoiceDelta(BaseModel):
    """What one choice generated since the control plane's last accepted checkpoint."""

    index: int = Field(default=0, ge=0, le=2**31 - 1)
    # What this delta extends: the token ids, text characters (Unicode code points) and
    # logprobs the control plane holds for this choice. A delta whose base differs from what
    # it holds is refused (the lease is listed in `resync`).
    base_tokens: int = Field(default=0, ge=0)
    base_chars: int = Field(default=0, ge=0)
    base_logprobs: int = Field(default=0, ge=0)
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    # None: no logprobs in this delta (the request did not ask, or none are new).
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    tool_format: ToolFormatName | None = None


class CheckpointDelta(BaseModel):
    """New progress of a lease since its last accepted checkpoint (choices without news are
    left out)."""

    choices: list[ChoiceDelta] = Field(default_factory=list)
    num_prompt_tokens: int = 0


class LeaseRequest(BaseModel):
    capacity: int = Field(ge=0, description="How many more requests this worker can take now.")
    models: list[str] = Field(description="Model names this worker's engine serves.")
    # Output tokens/s the worker measured recently; the control plane keeps it per site.
    tokens_per_s: float | None = None
    # The site's price and chip as its worker declares them (`minimill worker --price-per-hour
    # --chip`); when given they replace what the site was registered with, so the site's cost
    # (metering) and placement use them; never a tenant's bill. None: keep the registered
    # values.
    price_per_hour: float | None = Field(default=None, ge=0, le=MAX_PRICE_PER_HOUR,
                                          allow_inf_nan=False)
    chip: str | None = Field(default=None, min_length=1, max_length=MAX_CHIP_CHARS,
                             pattern=r"\S")  # not blank
    # session_tag()s of the sessions whose KV this worker's engine last held (most recent
    # last), so that placement can send a session's next turn back here. None: unchanged
    # since the last call that sent them.
    held_sessions: list[Annotated[str, Field(max_length=16)]] | None = Field(
        default=None, max_length=MAX_HELD_SESSIONS)
    # The worker's first call after a start, when its engine's KV survives a restart (a flash
    # tier): the leases its site still holds (its previous run's, killed) come back in this
    # answer at a new epoch, before any new work, so that they resume here from the KV on
    # flash instead of being recomputed elsewhere. They count towards `capacity`.
    adopt_held: bool = False
    # With nothing to hand out, the control plane holds the call open up to this long (at most
    # a third of the lease TTL) and answers as soon as work arrives: a worker waits there
    # instead of asking again and again.
    wait_s: float = Field(default=0.0, ge=0.0, le=60.0, allow_inf_nan=False)
    # The worker's slots in all. A held call offers, at each look, these slots less the leases
    # the site still holds (its requests finish while the call waits); without it, `capacity`.
    slots: int | None = Field(default=None, ge=0, le=2**31 - 1)
    # The worker's name for this ask, kept when the call fails (a timeout, a lost answer) and
    # sent again with the next call: the leases granted under it that the site still holds
    # come back first in that answer, at their epoch, instead of waiting out their TTL unread
    # (at a thousand sites, answers granted just as the worker gave up were lost that way).
    # They count towards `capacity`. None: every call is new.
    ask_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{8,32}$")


class Lease(BaseModel):
    request_id: str
    lease_id: str
    epoch: int = Field(description="Fencing epoch; completions and heartbeats must carry it.")
    expires_at: float
    kind: Literal["chat", "completion", "embedding"]
    model: str
    # The OpenAI request body as the client sent it (already validated by the control plane).
    body: dict[str, Any]
    # Seed to sample with when the body has none, so a resumed request samples the same.
    seed: int
    checkpoint: Checkpoint | None = None
    # Realtime streaming requests want fresh checkpoints often; others every checkpoint_interval_s.
    stream: bool = False
    # Background work (a batch line, a flex or background request): nobody waits on its
    # result as it finishes, so the worker may hold it a moment to share a completion call.
    background: bool = False
    checkpoint_interval_s: float = 2.0
    # The conversation the request belongs to (a Responses chain's root id, or the client's
    # prompt_cache_key): requests sharing it share a prompt prefix. None: no session.
    session_key: str | None = None
    # Mixed into the KV prefix cache's block hashes (SamplingParams.cache_salt): the request's
    # tenant's own, unless it shares its prefixes with other tenants (None).
    cache_salt: str | None = None


class LeaseResponse(BaseModel):
    leases: list[Lease]
    # Seconds a lease lives without a heartbeat.
    lease_ttl_s: float


class HeartbeatItem(BaseModel):
    request_id: SiteRequestId
    epoch: int
    # The whole progress: replaces what the control plane holds. Sent after a `resync`.
    checkpoint: Checkpoint | None = None
    # Progress since the last accepted checkpoint; ignored when `checkpoint` is set.
    delta: CheckpointDelta | None = None


class HeartbeatRequest(BaseModel):
    leases: list[HeartbeatItem]
    tokens_per_s: float | None = None


class HeartbeatResponse(BaseModel):
    # request_id -> new expiry, for leases still held at the sent epoch.
    extended: dict[str, float]
    # Leases the worker no longer holds (stale epoch, expired, cancelled): abort them, but
    # still deliver a result already finished (its epoch may still be current).
    revoked: list[str]
    # Extended leases whose delta did not extend the stored checkpoint: send `checkpoint`.
    resync: list[str] = Field(default_factory=list)
    # Leases of this site to give back now, before an announced outage of the site: stop
    # them, and release each with its checkpoint (POST /release). Any lease the site holds may
    # be named, not only those of this heartbeat.
    handback: list[str] = Field(default_factory=list)


class ReleaseItem(BaseModel):
    request_id: SiteRequestId
    epoch: int
    # Progress so far; None keeps the checkpoint the control plane has.
    checkpoint: Checkpoint | None = None


class ReleaseRequest(BaseModel):
    """Leases the worker gives back unfinished; it has stopped generating for them."""

    leases: list[ReleaseItem] = Field(default_factory=list)
    # Also every lease the site holds at its current epoch, with the stored checkpoints: a
    # worker starting for its site says so, since a site runs one worker and whatever the
    # site still holds was its previous run's (killed, not drained) and would otherwise wait
    # for its leases to expire.
    all_held: bool = False


class ReleaseResponse(BaseModel):
    # Queued again with the sent checkpoint (or already queued after an expiry, nobody having
    # leased them since: the checkpoint is kept all the same).
    released: list[str]
    # Not this site's at that epoch any more (finished, cancelled, taken over): nothing done.
    rejected: list[str]


class Usage(BaseModel):
    """What the worker counted. The control plane bills its own counts (the prompt counted at
    admission, the tokens of the choices returned) and rejects a completion whose report
    disagrees with them."""

    prompt_tokens: int
    completion_tokens: int
    # Of the prompt tokens, those whose KV the engine reused (prefix cache, KV tiers) instead
    # of computing: billed at the cached-input price.
    cached_tokens: int = Field(default=0, ge=0)


class ErrorInfo(BaseModel):
    # OpenAI error code, e.g. "context_length_exceeded", "invalid_request_error".
    code: str
    message: str
    param: str | None = None


class CompletionItem(BaseModel):
    request_id: SiteRequestId
    epoch: int
    outcome: Literal["succeeded", "failed"]
    # On success: every choice, finished.
    choices: list[ChoiceProgress] = Field(default_factory=list)
    usage: Usage | None = None
    error: ErrorInfo | None = None


class CompleteRequest(BaseModel):
    results: list[CompletionItem]


class RejectedCompletion(BaseModel):
    request_id: str
    # usage_mismatch: the usage reported disagrees with the choices returned (more choices
    # than asked for, more tokens than they hold): a protocol error, counted against the site;
    # the request goes back to the queue.
    reason: Literal["stale_epoch", "unknown_request", "already_completed", "usage_mismatch"]
    message: str | None = None


class CompleteResponse(BaseModel):
    # Results now stored, and resent results that had been stored already.
    accepted: list[str]
    rejected: list[RejectedCompletion]
