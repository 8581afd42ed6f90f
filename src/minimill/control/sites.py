"""The site registry: sites, their tokens, health counters, held time and cost, outages.

Writes live here (registration, contact from workers, outages); the read side (placement's
SiteState snapshot, the operators' SiteStatus list) is site_view.py, the definitions of uptime,
expected loss and effective cost are site_health.py.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from minimill.control import metering
from minimill.control.errors import ConflictError, InvalidRequestError, NotFoundError
from minimill.control.keys import hash_secret
from minimill.control.price_schedule import PriceSchedule
from minimill.control.price_schedule import parse as parse_schedule
from minimill.control.records import ALL_SITE_SCOPES, Site, SiteScope, new_id
from minimill.control.site_contact import contact_params, contact_update
from minimill.control.store import Store
from minimill.control.tables import outages, sites
from minimill.transport.protocol import MAX_PRICE_PER_HOUR

TOKEN_PREFIX = "mms-"
# What a site serves unless its operator says more: tokens only. Boxes run tenants' code and
# agents' harnesses hold tenants' credentials, so a site takes them only when it is named for
# them.
DEFAULT_SCOPES = frozenset({SiteScope.TOKENS})


def parse_scopes(text: str) -> frozenset[SiteScope]:
    """`tokens,boxes` -> its scopes; InvalidRequestError naming what is unknown or missing."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = ", ".join(s.value for s in SiteScope)
    unknown = [n for n in names if n not in {s.value for s in SiteScope}]
    if unknown or not names:
        raise InvalidRequestError(f"serves: a comma-separated list of {known}"
                                  + (f"; unknown: {', '.join(unknown)}" if unknown else ""),
                                  param="serves")
    return frozenset(SiteScope(n) for n in names)


def scopes_text(scopes: frozenset[SiteScope]) -> str:
    """The column's spelling, in a fixed order."""
    return ",".join(s.value for s in SiteScope if s in scopes)


def _site(row: Any) -> Site:
    return Site(id=row.id, name=row.name, chip=row.chip, price_per_hour=row.price_per_hour,
                tokens_per_s=row.tokens_per_s, created_at=row.created_at,
                last_seen_at=row.last_seen_at,
                serves=parse_scopes(row.serves) if row.serves else ALL_SITE_SCOPES)


def create_site(store: Store, name: str, price_per_hour: float, chip: str = "cpu", *,
                replace: bool = False, serves: frozenset[SiteScope] = DEFAULT_SCOPES) -> str:
    """Register a site for the parts of the worker protocol it `serves` and return its token
    (shown once). With `replace`, an existing site of that name gets a new token (the old one
    stops working) and the given price, chip and scopes."""
    if not serves:
        raise InvalidRequestError("a site must serve tokens, boxes or agents", param="serves")
    name = name.strip()
    if not name or len(name) > 200:
        raise InvalidRequestError("a site name must have 1 to 200 characters", param="name")
    if not 0 <= price_per_hour <= MAX_PRICE_PER_HOUR:
        raise InvalidRequestError(f"price_per_hour must be in [0, {MAX_PRICE_PER_HOUR:g}]",
                                  param="price_per_hour")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with store.write() as conn:
        existing = conn.execute(select(sites.c.id).where(sites.c.name == name)).first()
        if existing is not None:
            if not replace:
                raise ConflictError(f"site {name!r} already exists", param="name")
            conn.execute(update(sites).where(sites.c.id == existing.id).values(
                token_hash=hash_secret(token), price_per_hour=price_per_hour, chip=chip,
                serves=scopes_text(serves)))
            return token
        try:
            conn.execute(insert(sites).values(
                id=new_id("site_"), name=name, token_hash=hash_secret(token), chip=chip,
                serves=scopes_text(serves), price_per_hour=price_per_hour,
                created_at=time.time()))
        except IntegrityError:
            raise ConflictError(f"site {name!r} already exists", param="name") from None
    return token


# Built once: every fleet call authenticates, and building the statement each time was half
# of the ~145 us of CPU that took on SQLite.
_SITE_BY_TOKEN_HASH = select(sites).where(sites.c.token_hash == bindparam("token_hash"))


def authenticate_site(store: Store, token: str) -> Site | None:
    if not token.startswith(TOKEN_PREFIX):
        return None
    with store.read() as conn:
        row = conn.execute(_SITE_BY_TOKEN_HASH, {"token_hash": hash_secret(token)}).first()
    return _site(row) if row else None


def touch_site(conn: Connection, site_id: str, now: float, up_grace_s: float,
               tokens_per_s: float | None = None, *, busy: bool = True, accepted_tokens: int = 0,
               added: Mapping[str, float] | None = None, **more: Any) -> None:
    """Record contact from a site: last seen, observed up time, held time and its cost, the
    throughput the control plane measures, the rate the worker reports, plus any `more` column
    values and `added` counter increments (site_contact.py builds the statement). Callers
    touch the site row after the request rows, so every transaction
    locks rows in one order (batches, requests, sites): no deadlocks.

    `busy` says the site held at least one lease since its last contact (leases are granted
    only in its own calls, so one it holds now, it held since then). That time, if the gap is
    short enough to count as up, is held time (`busy_s`), costs its price per hour
    (`cost_usd`), and joins the throughput window with the `accepted_tokens` of this call: the
    measured rate is window_tokens / window_busy_s (metering), each new held second weighing
    older ones down by METER_WINDOW_S / (METER_WINDOW_S + gap), about exp(-gap / window).
    Nothing in it comes from what the worker says.

    `tokens_per_s` is what the worker measured over its recent past; the registry keeps the
    site's *busy* throughput, since an idle or half-empty site measures its load, not what it
    can do (and pricing it by that would starve it of the work that would show its speed):
    - the first measurement is taken as it is;
    - later ones count only when the site holds work (`busy`): while its worker said it was
      full (no free capacity at its last lease call), the stored rate moves half way to the
      measurement, so it can go down as well as up; while it had room, a measurement only
      raises the stored rate (a half-empty site is at least that fast).
    Measurements below metering.MIN_TOKENS_PER_S are noise and ignored.
    """
    rate = (tokens_per_s if tokens_per_s is not None and math.isfinite(tokens_per_s)
            and tokens_per_s >= metering.MIN_TOKENS_PER_S else None)
    price = _scheduled_price(conn, site_id, now) if busy else None
    counters = dict(added or {})
    statement = contact_update(busy, price is not None, rate is not None, bool(accepted_tokens),
                               tuple(more), tuple(counters))
    conn.execute(statement, contact_params(site_id, now, up_grace_s, price, accepted_tokens,
                                           rate, more, counters))


_SCHEDULE = select(sites.c.price_schedule).where(sites.c.id == bindparam("site_id"))


def _scheduled_price(conn: Connection, site_id: str, now: float) -> float | None:
    """The site's $/h now from its price schedule, for the cost of its held time (None: it
    has none, and its price_per_hour column counts)."""
    schedule = conn.execute(_SCHEDULE, {"site_id": site_id}).scalar()
    if schedule is not None:
        try:
            return parse_schedule(schedule, 0.0).price_at(now)
        except ValueError:
            return None
    return None


def parse_time(text: str, param: str) -> float:
    """ISO 8601 -> Unix seconds; a time without a zone is UTC."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidRequestError(f"{param}: not an ISO 8601 time: {text!r}",
                                  param=param) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def add_outage(store: Store, site_name: str, start_at: float, end_at: float) -> int:
    """Announce a planned or forecast outage; placement drains the site ahead of it, and the
    site hands back what it holds before it starts (handback.py). Returns the outage's id."""
    if not (math.isfinite(start_at) and math.isfinite(end_at)):
        raise InvalidRequestError("an outage's start and end must be finite times",
                                  param="start_at")
    if end_at <= start_at:
        raise InvalidRequestError("an outage must end after it starts", param="end")
    with store.write() as conn:
        site_id = conn.execute(select(sites.c.id).where(sites.c.name == site_name)).scalar()
        if site_id is None:
            raise NotFoundError(f"no site named {site_name!r}", param="site")
        outage_id = conn.execute(insert(outages).values(
            site_id=site_id, start_at=start_at, end_at=end_at, created_at=time.time())
        ).inserted_primary_key
    return int(outage_id[0]) if outage_id else 0


@dataclass(frozen=True, slots=True)
class OutageRecord:
    """An announced outage, as operators see it."""

    id: int
    site: str
    start_at: float
    end_at: float
    created_at: float


def list_outages(store: Store, now: float, site_name: str | None = None, *,
                 include_past: bool = False) -> list[OutageRecord]:
    """Announced outages by start time: those not over yet (every one with `include_past`),
    of one site or of all."""
    query = (select(outages.c.id, sites.c.name, outages.c.start_at, outages.c.end_at,
                    outages.c.created_at)
             .join(sites, sites.c.id == outages.c.site_id)
             .order_by(outages.c.start_at, outages.c.id))
    if site_name is not None:
        query = query.where(sites.c.name == site_name)
    if not include_past:
        query = query.where(outages.c.end_at > now)
    with store.read() as conn:
        if site_name is not None and conn.execute(
                select(sites.c.id).where(sites.c.name == site_name)).first() is None:
            raise NotFoundError(f"no site named {site_name!r}", param="site")
        rows = conn.execute(query).all()
    return [OutageRecord(id=int(r.id), site=r.name, start_at=r.start_at, end_at=r.end_at,
                         created_at=r.created_at) for r in rows]


def remove_outage(store: Store, outage_id: int, site_name: str | None = None) -> OutageRecord:
    """Withdraw an announced outage (of `site_name` only, when given): placement and handback
    stop counting it at once. NotFoundError if there is no such outage (of that site)."""
    with store.write() as conn:
        query = (select(outages.c.id, sites.c.name, outages.c.start_at, outages.c.end_at,
                        outages.c.created_at)
                 .join(sites, sites.c.id == outages.c.site_id)
                 .where(outages.c.id == outage_id))
        if site_name is not None:
            query = query.where(sites.c.name == site_name)
        row = conn.execute(query).first() if 0 <= outage_id < 2**63 else None
        if row is None:
            raise NotFoundError(f"no outage with id {outage_id}", param="outage_id")
        conn.execute(delete(outages).where(outages.c.id == outage_id))
    return OutageRecord(id=int(row.id), site=row.name, start_at=row.start_at,
                        end_at=row.end_at, created_at=row.created_at)


def set_price_schedule(store: Store, site_name: str,
                       schedule: PriceSchedule | None) -> PriceSchedule | None:
    """Make a site's price follow `schedule` (None: its flat price_per_hour again). Placement
    ranks the site at its price now and defers background work to its cheaper hours."""
    with store.write() as conn:
        hit = conn.execute(update(sites).where(sites.c.name == site_name).values(
            price_schedule=None if schedule is None else schedule.to_json())).rowcount
    if not hit:
        raise NotFoundError(f"no site named {site_name!r}", param="site")
    return schedule
