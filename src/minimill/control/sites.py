"""The site registry: sites, their tokens, health counters, outages; and the `sites` CLI.

Writes live here (registration, contact from workers, outages); the read side (placement's
SiteState snapshot, the operators' SiteStatus list) is site_view.py, the definitions of uptime,
expected loss and effective cost are site_health.py.
"""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, case, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from minimill.control import metering
from minimill.control.errors import ConflictError, ControlError, InvalidRequestError, NotFoundError
from minimill.control.keys import hash_secret
from minimill.control.records import Site, new_id
from minimill.control.site_view import SiteStatus, list_sites
from minimill.control.store import Store, StoreError, open_store
from minimill.control.tables import outages, sites
from minimill.protocol import MAX_PRICE_PER_HOUR

TOKEN_PREFIX = "mms-"
# A full site's stored throughput moves this fraction of the way to each new measurement.
RATE_SMOOTHING = 0.5


def _site(row: Any) -> Site:
    return Site(id=row.id, name=row.name, chip=row.chip, price_per_hour=row.price_per_hour,
                tokens_per_s=row.tokens_per_s, created_at=row.created_at,
                last_seen_at=row.last_seen_at)


def create_site(store: Store, name: str, price_per_hour: float, chip: str = "cpu", *,
                replace: bool = False) -> str:
    """Register a site and return its token (shown once). With `replace`, an existing site of
    that name gets a new token (the old one stops working) and the given price and chip."""
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
                token_hash=hash_secret(token), price_per_hour=price_per_hour, chip=chip))
            return token
        try:
            conn.execute(insert(sites).values(
                id=new_id("site_"), name=name, token_hash=hash_secret(token), chip=chip,
                price_per_hour=price_per_hour, created_at=time.time()))
        except IntegrityError:
            raise ConflictError(f"site {name!r} already exists", param="name") from None
    return token


def authenticate_site(store: Store, token: str) -> Site | None:
    if not token.startswith(TOKEN_PREFIX):
        return None
    with store.read() as conn:
        row = conn.execute(select(sites).where(
            sites.c.token_hash == hash_secret(token))).first()
    return _site(row) if row else None


def touch_site(conn: Connection, site_id: str, now: float, up_grace_s: float,
               tokens_per_s: float | None = None, *, busy: bool = True, **more: Any) -> None:
    """Record contact from a site: last seen, observed up time, measured throughput, plus any
    `more` column values (counters). Callers touch the site row after the request rows, so
    every transaction locks rows in one order (batches, requests, sites): no deadlocks.

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
    gap = now - sites.c.last_seen_at
    values: dict[str, Any] = {
        "last_seen_at": now,
        "first_seen_at": func.coalesce(sites.c.first_seen_at, now),
        "up_s": sites.c.up_s + case(
            ((sites.c.last_seen_at.is_not(None)) & (gap > 0) & (gap <= up_grace_s), gap),
            else_=0.0),
    }
    if (tokens_per_s is not None and math.isfinite(tokens_per_s)
            and tokens_per_s >= metering.MIN_TOKENS_PER_S):
        old = sites.c.tokens_per_s
        if busy:
            values["tokens_per_s"] = case(
                (old.is_(None), tokens_per_s),
                (sites.c.free_capacity <= 0, old + RATE_SMOOTHING * (tokens_per_s - old)),
                (old < tokens_per_s, tokens_per_s),
                else_=old)
        else:
            values["tokens_per_s"] = func.coalesce(old, tokens_per_s)
    values.update(more)
    conn.execute(update(sites).where(sites.c.id == site_id).values(**values))


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


def _cli_store(db: str | None) -> Store:
    try:
        return open_store(db)
    except StoreError as exc:
        raise SystemExit(f"error: {exc}") from None


def create_site_cli(name: str, price_per_hour: float, chip: str, db: str | None) -> str:
    """`minimill sites create NAME`: registers the site and returns its token."""
    store = _cli_store(db)
    try:
        return create_site(store, name, price_per_hour, chip)
    except ControlError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    finally:
        store.close()


def list_sites_cli(db: str | None, json_out: bool) -> None:
    """`minimill sites list`: a table (or JSON) of every site."""
    store = _cli_store(db)
    try:
        statuses = list_sites(store, time.time())
    finally:
        store.close()
    if json_out:
        print(json.dumps([asdict(s) for s in statuses], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="minimill sites")
    for column in ("site", "status", "chip", "$/hour", "tokens/s", "uptime", "$/Mtok",
                   "eff $/Mtok", "in flight", "free", "leases", "expired", "stale",
                   "wasted tok", "next outage (UTC)"):
        table.add_column(column, no_wrap=True, justify="left" if column in (
            "site", "status", "chip", "next outage (UTC)") else "right")
    for s in statuses:
        table.add_row(
            s.name, s.status, s.chip, f"{s.price_per_hour:.4f}",
            "-" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}",
            "-" if s.uptime is None else f"{s.uptime:.1%}", f"{s.usd_per_mtok:.4f}",
            f"{s.effective_usd_per_mtok:.4f}", str(s.in_flight), str(s.free_capacity),
            str(s.leases_granted), str(s.leases_expired), str(s.stale_completions),
            str(s.wasted_tokens), _next_outage(s))
    # Piped output is not cut to 80 columns: every site's row stays on one line.
    Console(width=None if sys.stdout.isatty() else 240).print(table)


def _next_outage(status: SiteStatus) -> str:
    if not status.outages:
        return "-"
    first = min(status.outages, key=lambda o: o["start_at"])

    def moment(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M")

    return f"{moment(first['start_at'])} to {moment(first['end_at'])}"


def add_outage_cli(site: str, start: str, end: str, db: str | None) -> None:
    """`minimill sites outage add SITE --from T --to T`."""
    store = _cli_store(db)
    try:
        outage_id = add_outage(store, site, parse_time(start, "from"), parse_time(end, "to"))
    except ControlError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    finally:
        store.close()
    print(f"outage {outage_id} of {site} from {start} to {end} recorded")


def list_outages_cli(site: str | None, include_past: bool, json_out: bool,
                     db: str | None) -> None:
    """`minimill sites outage list [SITE]`: one line (or JSON object) per outage."""
    store = _cli_store(db)
    try:
        records = list_outages(store, time.time(), site, include_past=include_past)
    except ControlError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    finally:
        store.close()
    if json_out:
        print(json.dumps([asdict(r) for r in records], indent=2))
        return
    if not records:
        print("no outages announced" + (f" for {site}" if site else ""))
    for r in records:
        print(f"{r.id:>6}  {r.site}  {_moment(r.start_at)} to {_moment(r.end_at)} UTC")


def remove_outage_cli(outage_id: int, db: str | None) -> None:
    """`minimill sites outage remove ID`."""
    store = _cli_store(db)
    try:
        record = remove_outage(store, outage_id)
    except ControlError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    finally:
        store.close()
    print(f"outage {record.id} of {record.site} ({_moment(record.start_at)} to "
          f"{_moment(record.end_at)} UTC) removed")


def _moment(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")
