"""Per-tenant rate limits: requests and tokens per minute, as token buckets in the store.

Each tenant has one row (tables.rate_buckets) holding how much of each limit it has used; use
drains at the limit per minute, so a tenant that used all of it has it all back a minute later,
and a steady client is limited to the rate without a cliff at a window's edge. A request takes
one request and its tokens (the prompt as counted at admission plus max_tokens, as OpenAI
counts) inside the write transaction that queues it, so several control-plane processes sharing
PostgreSQL limit a tenant together (the row is locked for the read-modify-write; SQLite has one
writer). A request over either limit is refused whole (429 rate_limit_exceeded), and takes
nothing. The answer's `x-ratelimit-*` headers say, as OpenAI's do, the limits, what remains,
and how long until the bucket is full again ("1s", "6m0s", "20ms").

Realtime requests queued or leased at once are counted from the requests themselves, in the
same transaction (429 too: the neighbour's capacity is what it protects).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import Connection, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from minimill.control.errors import ControlError
from minimill.control.records import ACTIVE_REQUEST_STATUSES, Tier
from minimill.control.tables import rate_buckets, requests
from minimill.control.tenant_limits import TenantLimits

WINDOW_S = 60.0


class RateLimitError(ControlError):
    """Over a rate limit (429): OpenAI's `type` names the limit (requests or tokens)."""

    status_code = 429

    def __init__(self, message: str, *, limit_type: str, headers: dict[str, str]) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.error_type = limit_type
        self.headers = headers


@dataclass(frozen=True, slots=True)
class Bucket:
    limit: int
    used: float  # after this request (or before it, when it was refused)

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.limit - self.used))

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return self.used * WINDOW_S / self.limit if self.limit > 0 else 0.0

    def wait_s(self, need: float) -> float:
        """Seconds until `need` fits (inf: it never does)."""
        if need > self.limit:
            return math.inf
        return max(0.0, (self.used + need - self.limit) * WINDOW_S / self.limit)


@dataclass(frozen=True, slots=True)
class RateState:
    """What the answer's x-ratelimit-* headers report (None: that limit is not set)."""

    requests: Bucket | None
    tokens: Bucket | None

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
                out[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining)
                out[f"x-ratelimit-reset-{name}"] = duration(bucket.reset_s)
        return out


def duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds * 1000) / 1000
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if minutes or hours:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


def _drained(used: float, limit: int, elapsed_s: float) -> float:
    return max(0.0, used - max(0.0, elapsed_s) * limit / WINDOW_S)


def _ensure_row(conn: Connection, tenant_id: str, now: float) -> None:
    values = {"tenant_id": tenant_id, "requests_used": 0.0, "tokens_used": 0.0,
              "updated_at": now}
    stmt = (postgresql.insert(rate_buckets) if conn.dialect.name == "postgresql"
            else sqlite.insert(rate_buckets))
    conn.execute(stmt.values(**values).on_conflict_do_nothing(index_elements=["tenant_id"]))


def take(conn: Connection, tenant_id: str, tokens: int, now: float,
         limits: TenantLimits) -> RateState | None:
    """Take one request and `tokens` from the tenant's buckets, inside the caller's write
    transaction; raises RateLimitError (taking nothing) when either would overflow. None when
    the tenant has no rate limit."""
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    if rpm is None and tpm is None:
        return None
    _ensure_row(conn, tenant_id, now)
    row = conn.execute(select(rate_buckets).where(rate_buckets.c.tenant_id == tenant_id)
                       .with_for_update()).one()
    elapsed = now - row.updated_at
    req = None if rpm is None else Bucket(rpm, _drained(row.requests_used, rpm, elapsed))
    tok = None if tpm is None else Bucket(tpm, _drained(row.tokens_used, tpm, elapsed))
    before = RateState(req, tok)
    if req is not None and req.used + 1 > req.limit:
        raise _refusal("requests", "requests per min (RPM)", req, 1, before)
    if tok is not None and tok.used + tokens > tok.limit:
        raise _refusal("tokens", "tokens per min (TPM)", tok, tokens, before)
    after = RateState(None if req is None else Bucket(req.limit, req.used + 1),
                      None if tok is None else Bucket(tok.limit, tok.used + tokens))
    conn.execute(update(rate_buckets).where(rate_buckets.c.tenant_id == tenant_id).values(
        requests_used=after.requests.used if after.requests else 0.0,
        tokens_used=after.tokens.used if after.tokens else 0.0, updated_at=now))
    return after


def _refusal(kind: str, what: str, bucket: Bucket, need: float,
             state: RateState) -> RateLimitError:
    wait = bucket.wait_s(need)
    headers = state.headers()
    if math.isinf(wait):
        message = (f"Request too large on {what}: Limit {bucket.limit}, Requested "
                   f"{int(need)}. Send a smaller request (fewer prompt tokens or a lower "
                   "max_tokens), or ask the operator to raise the limit.")
        headers["x-should-retry"] = "false"
    else:
        message = (f"Rate limit reached on {what}: Limit {bucket.limit}, Used "
                   f"{math.ceil(bucket.used)}, Requested {int(need)}. Please try again in "
                   f"{duration(wait)}.")
        headers["retry-after"] = str(max(1, math.ceil(wait)))
        headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
    return RateLimitError(message, limit_type=kind, headers=headers)


def check_concurrent(conn: Connection, tenant_id: str, limits: TenantLimits) -> None:
    """429 when the tenant already has its most realtime requests queued or leased."""
    cap = limits.max_concurrent_realtime
    if cap is None:
        return
    active = conn.execute(
        select(func.count()).select_from(requests)
        .where(requests.c.tenant_id == tenant_id, requests.c.tier == Tier.REALTIME.value,
               requests.c.batch_id.is_(None),
               requests.c.status.in_([s.value for s in ACTIVE_REQUEST_STATUSES]))).scalar()
    if int(active or 0) >= cap:
        raise RateLimitError(
            f"Too many concurrent requests: Limit {cap} realtime requests in progress at once. "
            "Please try again when one of them has finished.", limit_type="requests",
            headers={"retry-after": "1"})


def admit(conn: Connection, tenant_id: str, tokens: int, now: float,
          limits: TenantLimits, realtime: bool) -> RateState | None:
    """Every rate check of one request, in the transaction that queues it."""
    if realtime:
        check_concurrent(conn, tenant_id, limits)
    return take(conn, tenant_id, tokens, now, limits)

