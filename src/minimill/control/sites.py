"""The site registry: sites, their tokens, health counters, outages; and the `sites` CLI."""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, case, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from minimill.control import metering
from minimill.control.errors import ConflictError, ControlError, InvalidRequestError, NotFoundError
from minimill.control.keys import hash_secret
from minimill.control.records import RequestStatus, Site, new_id
from minimill.control.store import Store, StoreError, open_store
from minimill.control.tables import outages, requests, sites

TOKEN_PREFIX = "mms-"
# A site unheard of for longer than this is shown offline (a few lease TTLs).
OFFLINE_AFTER_S = 90.0


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
    if price_per_hour < 0:
        raise InvalidRequestError("price_per_hour must be >= 0", param="price_per_hour")
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
               tokens_per_s: float | None = None, **more: Any) -> None:
    """Record contact from a site: last seen, observed up time, measured throughput, plus any
    `more` column values (counters). Callers touch the site row after the request rows, so
    every transaction locks rows in one order (batches, requests, sites): no deadlocks."""
    gap = now - sites.c.last_seen_at
    values: dict[str, Any] = {
        "last_seen_at": now,
        "first_seen_at": func.coalesce(sites.c.first_seen_at, now),
        "up_s": sites.c.up_s + case(
            ((sites.c.last_seen_at.is_not(None)) & (gap > 0) & (gap <= up_grace_s), gap),
            else_=0.0),
    }
    if tokens_per_s is not None and math.isfinite(tokens_per_s) and tokens_per_s >= 0:
        values["tokens_per_s"] = tokens_per_s
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


def add_outage(store: Store, site_name: str, start_at: float, end_at: float) -> None:
    """Announce a planned or forecast outage; placement drains the site ahead of it."""
    if end_at <= start_at:
        raise InvalidRequestError("an outage must end after it starts", param="end")
    with store.write() as conn:
        site_id = conn.execute(select(sites.c.id).where(sites.c.name == site_name)).scalar()
        if site_id is None:
            raise NotFoundError(f"no site named {site_name!r}", param="site")
        conn.execute(insert(outages).values(site_id=site_id, start_at=start_at, end_at=end_at,
                                            created_at=time.time()))


@dataclass(frozen=True, slots=True)
class SiteStatus:
    """A site as operators see it (`minimill sites list`, and the API's JSON)."""

    name: str
    status: str  # online | offline | new | outage
    chip: str
    price_per_hour: float
    tokens_per_s: float | None
    uptime: float | None  # observed fraction of time up since first contact
    usd_per_mtok: float
    in_flight: int
    leases_granted: int
    leases_expired: int
    completions: int
    stale_completions: int
    wasted_tokens: int
    tokens_generated: int
    last_seen_at: float | None
    outages: list[dict[str, float]]


def list_sites(store: Store, now: float) -> list[SiteStatus]:
    with store.read() as conn:
        rows = conn.execute(select(sites).order_by(sites.c.name)).all()
        held: dict[str, int] = dict(conn.execute(
            select(requests.c.site_id, func.count()).where(
                requests.c.status == RequestStatus.LEASED).group_by(requests.c.site_id)).all())
        windows = conn.execute(select(outages).where(outages.c.end_at > now)
                               .order_by(outages.c.start_at)).all()
    out = []
    for row in rows:
        mine = [{"start_at": o.start_at, "end_at": o.end_at} for o in windows
                if o.site_id == row.id]
        if any(o["start_at"] <= now for o in mine):
            status = "outage"
        elif row.last_seen_at is None:
            status = "new"
        else:
            status = "online" if now - row.last_seen_at <= OFFLINE_AFTER_S else "offline"
        span = now - row.first_seen_at if row.first_seen_at is not None else 0.0
        uptime = min(1.0, row.up_s / span) if span > 0 else None
        out.append(SiteStatus(
            name=row.name, status=status, chip=row.chip, price_per_hour=row.price_per_hour,
            tokens_per_s=row.tokens_per_s, uptime=uptime,
            usd_per_mtok=metering.usd_per_mtok(row.price_per_hour, row.tokens_per_s),
            in_flight=int(held.get(row.id, 0)), leases_granted=row.leases_granted,
            leases_expired=row.leases_expired, completions=row.completions,
            stale_completions=row.stale_completions, wasted_tokens=row.wasted_tokens,
            tokens_generated=row.tokens_generated, last_seen_at=row.last_seen_at,
            outages=mine))
    return out


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
                   "in flight", "leases", "expired", "stale", "wasted tok"):
        table.add_column(column, no_wrap=True, justify="left" if column in (
            "site", "status", "chip") else "right")
    for s in statuses:
        table.add_row(
            s.name, s.status, s.chip, f"{s.price_per_hour:.4f}",
            "-" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}",
            "-" if s.uptime is None else f"{s.uptime:.1%}", f"{s.usd_per_mtok:.4f}",
            str(s.in_flight), str(s.leases_granted), str(s.leases_expired),
            str(s.stale_completions), str(s.wasted_tokens))
    # Piped output is not cut to 80 columns: every site's row stays on one line.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def add_outage_cli(site: str, start: str, end: str, db: str | None) -> None:
    """`minimill sites outage add SITE --from T --to T`."""
    store = _cli_store(db)
    try:
        add_outage(store, site, parse_time(start, "from"), parse_time(end, "to"))
    except ControlError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    finally:
        store.close()
    print(f"outage of {site} from {start} to {end} recorded")
